"""kiln.serving: the engine (scheduler, KV block manager, runner), tokenizer, HTTP server and the `kiln` CLI.

The top of the stack: it may import kiln.compile (to plan and load artifacts), kiln.targets and kiln.models; nothing
imports it. cli.py is the table of commands; each command lives with the package it drives.

`kiln.serving.LLM`, `AsyncLLM`, `build_engine` (from llm.py), `SamplingParams` and `StructuredOutputsParams`
(params.py) are imported lazily.
"""


def __getattr__(name: str):
    if name in ("LLM", "AsyncLLM", "build_engine"):
        from kiln.serving import llm

        return getattr(llm, name)
    if name in ("SamplingParams", "RequestOutput", "StructuredOutputsParams"):
        from kiln.serving import params

        return getattr(params, name)
    raise AttributeError(f"module 'kiln.serving' has no attribute {name!r}")

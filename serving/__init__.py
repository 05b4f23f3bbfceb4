"""kiln.serving: the engine (scheduler, KV block manager, runner), tokenizer, HTTP server and CLI.

`kiln.serving.LLM`, `AsyncLLM` and `build_engine` are imported lazily (they pull in JAX), from kiln.serving.llm.
"""


def __getattr__(name: str):
    if name in ("LLM", "AsyncLLM", "build_engine"):
        from kiln.serving import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'kiln.serving' has no attribute {name!r}")

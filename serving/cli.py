"""The `kiln` command: one console script with sub-commands.

Each sub-command lives in its own module with `add_arguments(parser)` and `run(args) -> int`; COMMANDS maps the
name to that module. A KilnError (a problem the user can fix) is printed as one sentence with exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kiln.models.errors import KilnError

# JAX's GPU allocator takes 75% of device memory by default; kiln sizes weights + KV + workspace to the target's
# memory fraction (0.9 on cuda/rocm), so the allocator's pool must be larger. Set before any command imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

COMMANDS = {
    # name: (module, one-line help)
    "bench": ("kiln.serving.bench_cmd", "Load-test any OpenAI-compatible server and report latency and throughput."),
    "compile": ("kiln.compile.compile_cmd", "Compile a model ahead of time for a hardware target into an artifact."),
    "targets": ("kiln.targets.targets_cmd", "List the hardware targets kiln compiles for and what each needs."),
    "inspect": ("kiln.serving.inspect_cmd", "Load a model's config, weights and tokenizer and print a summary."),
    "serve": ("kiln.serving.serve_cmd", "Serve a model over the OpenAI-compatible HTTP API."),
    "chat": ("kiln.serving.chat_cmd", "Chat in the terminal with a running kiln (or any OpenAI-compatible) server."),
    "generate": ("kiln.serving.generate_cmd", "Generate text for one prompt in this process, streamed to stdout."),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Compile LLMs ahead of time per target and serve them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

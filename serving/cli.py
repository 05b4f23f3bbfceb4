"""The `kiln` command: one console script with sub-commands.

Each sub-command lives in its own module with `add_arguments(parser)` and `run(args) -> int`; COMMANDS maps the
name to that module. A KilnError (a problem the user can fix) is printed as one sentence with exit code 1.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import threading

from kiln.models.errors import KilnError

# JAX's GPU allocator takes 75% of device memory by default; kiln sizes weights + KV + workspace to the target's
# memory fraction (0.9 on cuda/rocm), so the allocator's pool must be larger. Set before any command imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# ... and grows it as the weights, the KV cache and the programs' buffers arrive instead of reserving all of it at the
# client's start: on an H200 a fresh process with the 95% reserved (134 GB) started its client in 3.0 s and uploaded
# its first 16 GB at 4.4 GB/s (the reserved memory's first use), without the reservation 0.97 s and 11.3 GB/s
# (benchmarks/h2d_first_touch.py; BENCHMARKS.md, issue 15, round 8). The allocator is the same (BFC), and its limit.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

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


GC_OFF_S = 20.0  # the longest a `kiln serve ARTIFACT` start runs without Python's cyclic GC (readahead_artifact)


def readahead_artifact(argv: list[str]):
    """`kiln serve ARTIFACT` (and plain `kiln serve`, whose artifact under artifacts/ is found without jax:
    kiln.compile.checks.serve_artifact): start the checks of the artifact's files now, before jax is imported
    (kiln.compile.checks.Prefetch; it also starts reading an accelerator's uncached weights.bin into the page cache
    where jax's libraries are cached, so that the disk works from the start's first second). Returns that Prefetch,
    or None. Python's cyclic GC is off until the server is ready (kiln.serving.serve_cmd), at most GC_OFF_S seconds:
    the start allocates ~200k objects (jax's above all) that live as long as the process, and collecting them as they
    came cost a SmolLM2 CPU start ~0.2 s (some 300 collections, two of them full: 20-70 ms each)."""
    if not argv or argv[0] != "serve":
        return None
    from kiln.compile.checks import Prefetch, serve_artifact, start_early_cpu

    folder = serve_artifact(argv)  # the folder given, or plain `kiln serve`'s artifact under artifacts/ (a guess)
    if folder is None or not os.path.isfile(os.path.join(folder, "weights", "weights.bin")):
        return None
    gc.disable()
    back = threading.Timer(GC_OFF_S, gc.enable)  # a load that compiles (another jaxlib) gets its GC back
    back.daemon = True
    back.start()

    prefetch = Prefetch(folder)
    start_early_cpu(prefetch)  # a CPU artifact's first programs deserialize beside jax's import
    return prefetch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prefetch = readahead_artifact(argv)
    parser = argparse.ArgumentParser(prog="kiln", description="Compile LLMs ahead of time per target and serve them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # only the command being run is imported (its module's imports are part of its start-up time); `kiln --help` and
    # an unknown command get every command's parser
    chosen = [argv[0]] if argv and argv[0] in COMMANDS else list(COMMANDS)
    from kiln.compile.checks import plugin_scan_by_name

    with plugin_scan_by_name():  # the commands' modules import jax, which reads every installed package's metadata
        for name, (module_name, help_text) in COMMANDS.items():
            if name not in chosen:
                sub.add_parser(name, help=help_text, description=help_text)
                continue
            module = importlib.import_module(module_name)
            module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    args.prefetch = prefetch  # kiln serve ARTIFACT's checks, started before the parser imported jax
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

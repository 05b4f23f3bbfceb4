"""`kiln compile`: a checkpoint and a target in, an artifact folder out (see kiln.compile.build)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from kiln.targets.target import KV_DTYPES, WEIGHT_FORMATS


def buckets_arg(text: str) -> tuple[int, ...]:
    """argparse type of --buckets: comma-separated positive token counts."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive token counts")
    return values


def add_plan_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The flags of kiln.compile.plan.Options, for every command that plans a model (compile, serve, generate)."""
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence in tokens")
    p.add_argument("--kv-tokens", type=int, default=None, help="tokens of KV cache to allocate")
    p.add_argument(
        "--kv-memory-fraction", type=float, default=None, help="fraction of device memory for weights, KV, workspace"
    )
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel devices (default: all the heads allow)")
    p.add_argument(
        "--attention", default=None, help="attention implementation (default: the target's; reference to debug)"
    )
    p.add_argument("--buckets", type=buckets_arg, default=None, help="token buckets, e.g. 16,64,256")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (the largest bucket)")
    p.add_argument("--dtype", default=None, help="compute and KV dtype (float32, bfloat16)")
    p.add_argument(
        "--kv-dtype", default=None, choices=KV_DTYPES,
        help="the KV cache's dtype when not --dtype's: fp8 (float8_e4m3fn) halves its bytes (cuda/rocm, or reference)",
    )  # fmt: skip
    p.add_argument(
        "--quantize", default=None, choices=WEIGHT_FORMATS,
        help="weight format: int8 stores linear layers, embedding and LM head as int8 with per-channel scales; int4 "
        "as int4 with scales per channel and group of 32-128 inputs, weight-only (for GPU and TPU: slow on the CPU); "
        "fp8 as float8_e4m3fn with per-channel scales (Hopper and newer GPUs)",
    )  # fmt: skip
    p.add_argument(
        "--decode-steps", type=int, default=None, help="decode tokens per dispatch when all sequences decode (1: off)"
    )
    p.add_argument(
        "--expert-parallel", action="store_true", default=None,
        help="a mixture of experts: whole experts per --tp device (expert parallelism) instead of every expert's width "
        "split over them",
    )  # fmt: skip


def plan_options(args: argparse.Namespace) -> dict:
    """The Options that add_plan_arguments' flags set (unset ones left to the plan's defaults)."""
    from kiln.compile.plan import Options  # imports jax: not while the CLI builds its parser

    names = [f.name for f in dataclasses.fields(Options)]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--target", default="auto", help="hardware target (see `kiln targets`; default: auto)")
    p.add_argument("--out", default=None, help="artifact folder (default: artifacts/<model>.<target>)")
    add_plan_arguments(p)


def run(args: argparse.Namespace) -> int:
    from kiln.compile.build import compile_artifact

    log = logging.getLogger("kiln")
    if not log.handlers:
        # a terminal shows tqdm's progress bar; elsewhere (Docker builds, CI) a log line per program and weight step
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.WARNING if sys.stderr.isatty() else logging.INFO)
    path = compile_artifact(args.model, args.target, out=args.out, **plan_options(args))
    from kiln.compile.artifact import read_manifest
    from kiln.compile.roofline import format_line

    m = read_manifest(path)
    g = m["geometry"]
    kinds = "exported + compiled" if m["runtime"] else "exported only (compiles once at first start on the target)"
    print(
        f"{path}: {m['model']['name']} for {m['target']['name']}, tp={g['tp']}, buckets {g['buckets']}, "
        f"decode steps {g['decode_steps']}, weights {g['weight_format']}, "
        f"{g['num_pages']} KV pages of {g['page_size']} tokens, max_model_len {g['max_model_len']}; programs "
        f"{kinds}; {m['build']['total_seconds']:.1f} s."
    )
    for name, prog in m["programs"].items():  # the static roofline of each step and decode program
        if prog.get("roofline"):
            print("  " + format_line(name, prog["roofline"]))
    return 0

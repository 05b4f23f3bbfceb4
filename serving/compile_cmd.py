"""`kiln compile`: a checkpoint and a target in, an artifact folder out (see kiln.compile.build)."""

from __future__ import annotations

import argparse
import logging
import sys

from kiln.models.errors import KilnError
from kiln.targets.target import KV_DTYPES, WEIGHT_FORMATS


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive token counts")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--target", default="auto", help="hardware target (see `kiln targets`; default: auto)")
    p.add_argument("--out", default=None, help="artifact folder (default: artifacts/<model>.<target>)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence in tokens")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-tokens", type=int, default=None, help="tokens of KV cache to allocate")
    kv.add_argument(
        "--kv-memory-fraction", type=float, default=None, help="fraction of device memory for weights, KV, workspace"
    )
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel devices (default: all the heads allow)")
    p.add_argument("--attention", default=None, help="force an attention implementation (debugging): reference, ...")
    p.add_argument("--buckets", type=_buckets, default=None, help="token buckets, e.g. 16,64,256")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    p.add_argument("--dtype", default=None, help="compute and KV dtype (float32, bfloat16)")
    p.add_argument(
        "--kv-dtype", default=None, choices=KV_DTYPES,
        help="the KV cache's dtype when not --dtype's: fp8 (float8_e4m3fn) halves its bytes (cuda/rocm, or reference)",
    )  # fmt: skip
    p.add_argument(
        "--quantize", default=None, choices=WEIGHT_FORMATS,
        help="weight format: int8 stores linear layers, embedding and LM head as int8 with per-channel scales; int4 "
        "as int4 with scales per channel and group of 32-128 inputs, weight-only (for GPU and TPU: slow on the CPU)",
    )  # fmt: skip
    p.add_argument(
        "--decode-steps", type=int, default=None, help="decode tokens per dispatch when all sequences decode (1: off)"
    )


def run(args: argparse.Namespace) -> int:
    from kiln.compile.build import compile_artifact

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    for name in ("max_model_len", "kv_tokens", "tp", "max_num_seqs", "decode_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise KilnError(f"--{name.replace('_', '-')} must be positive, not {value}.")
    path = compile_artifact(
        args.model,
        args.target,
        out=args.out,
        max_model_len=args.max_model_len,
        kv_tokens=args.kv_tokens,
        kv_memory_fraction=args.kv_memory_fraction,
        tp=args.tp,
        attention=args.attention,
        buckets=args.buckets,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        decode_steps=args.decode_steps,
        quantize=args.quantize,
    )
    from kiln.compile.artifact import read_manifest

    m = read_manifest(path)
    g = m["geometry"]
    kinds = "exported + compiled" if m["runtime"] else "exported only (compiles once at first start on the target)"
    print(
        f"{path}: {m['model']['name']} for {m['target']['name']}, tp={g['tp']}, buckets {g['buckets']}, "
        f"decode steps {g['decode_steps']}, weights {g['weight_format']}, "
        f"{g['num_pages']} KV pages of {g['page_size']} tokens, max_model_len {g['max_model_len']}; programs "
        f"{kinds}; {m['build']['total_seconds']:.1f} s."
    )
    return 0

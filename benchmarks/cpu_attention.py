"""Whole SmolLM2 steps on the CPU with the reference attention against xla_cpu (the cpu target's): fresh prefills,
mixed decode + prefill steps and decodes, each jitted step timed as the median of several runs, the two
implementations alternating.

    python benchmarks/cpu_attention.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from kiln.models.batch import KVCache, SeqChunk, make_batch
from kiln.models.checkpoint import load_checkpoint
from kiln.models.sampling import SamplingBatch
from kiln.models.step import jit_step

PAGE, PER_SEQ = 16, 16  # pages per sequence: room for 256 tokens


def seqs(specs: list[tuple[int, int]]) -> list[SeqChunk]:
    """(new tokens, cached tokens) per sequence, each on its own pages."""
    pages = lambda i: list(range(i * PER_SEQ, (i + 1) * PER_SEQ))  # noqa: E731
    return [SeqChunk(list(range(7, 7 + n)), c, pages(i)) for i, (n, c) in enumerate(specs)]


CASES = {
    "fresh prefill, 2 prompts x 128 (T=256)": (seqs([(128, 0)] * 2), 256, 16),
    "mixed T=256: 8 decodes at 150 + a fresh 128 + a 120-token chunk over 64": (
        seqs([(1, 150)] * 8 + [(128, 0), (120, 64)]), 256, 16),
    "mixed T=64: 15 decodes at 150 + a 49-token chunk over 64": (seqs([(1, 150)] * 15 + [(49, 64)]), 64, 16),
    "decode T=1 at 150": (seqs([(1, 150)]), 1, 1),
    "decode T=16, 16 sequences at 150": (seqs([(1, 150)] * 16), 16, 16),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    cfg, weights = load_checkpoint(None)
    weights = jax.device_put(weights)
    print("| step | reference ms | xla_cpu ms | speed-up |\n|---|---:|---:|---:|")
    for name, (chunks, tokens, num_seqs) in CASES.items():
        batch = jax.device_put(make_batch(chunks, PAGE, tokens, num_seqs, PER_SEQ))
        sampling = jax.device_put(SamplingBatch.neutral(num_seqs, vocab_size=cfg.vocab_size))
        best = {}
        for attention in ("reference", "xla_cpu", "reference", "xla_cpu"):
            step, kv = jit_step(cfg, attention), KVCache.create(cfg, PER_SEQ * 17, PAGE)
            for _ in range(2):
                out, kv = step(weights, kv, batch, sampling)
            jax.block_until_ready(out)
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                out, kv = step(weights, kv, batch, sampling)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
            best[attention] = min(best.get(attention, float("inf")), 1e3 * statistics.median(times))
        print(f"| {name} | {best['reference']:.1f} | {best['xla_cpu']:.1f} | "
              f"{best['reference'] / best['xla_cpu']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

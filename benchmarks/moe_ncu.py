"""One Qwen3-30B-A3B layer's single-token MoE kernels (router_add_norm, gate_up, down, the o-proj as gemv_partials'
split-K rows) and a 1-row q|k|v GEMM on random bf16 inputs, each kernel once per variant: a small program for Nsight
Compute, which reads the kernels' hardware counters (DRAM throughput, stall reasons, occupancy) that the variants'
timings in moe_gpu.py could not explain (gate_up at 2.9-3.2 TB/s of ~4.25). On the H200 (Firecracker, ncu seen
working there; no memory reservation, so that ncu's replays save and restore only the arrays):

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:'gate_up|down_kernel|gemv|gemm|nvjet' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section LaunchStats --csv --page details python3 benchmarks/moe_ncu.py [--experts base,g4_k128 --oproj ...]

--experts: experts_single keyword sets as moe_gpu.kernel_options' suffixes joined by "_" ("base": the defaults);
--oproj: gemv_partials' (moe_gpu.oproj_options, "base": its defaults). `--summary NCU.csv` (anywhere, no GPU) prints
a row per kernel of that CSV: duration, DRAM bytes and rates, the busiest and mean SM's active share of the elapsed
cycles, the time no SM ran the kernel, the DRAM rate over the busiest SM's active time, and the main stall reasons
(BENCHMARKS.md, session 13).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from kiln.models.kernels import pallas_gpu_moe as kernels  # noqa: E402


def _options(name: str, keys: dict) -> dict:
    return {} if name == "base" else {keys[part[0]]: int(part[1:]) for part in name.split("_")}


EXPERT_KEYS = {"n": "block_n", "w": "num_warps", "g": "num_stages", "k": "block_k", "d": "down_block_n",
               "e": "down_block_k"}  # fmt: skip
OPROJ_KEYS = {"s": "splits", "k": "block_k", "n": "block_n", "w": "num_warps", "g": "num_stages"}


STALLS = ("long_scoreboard", "wait", "short_scoreboard", "barrier")


def summary(path: str) -> None:
    """The table of an `ncu --csv --page raw` file (one row per profiled kernel)."""
    rows = list(csv.reader(open(path)))
    start = next(n for n, r in enumerate(rows) if r and r[0] == "ID")
    head, data = rows[start], [r for r in rows[start + 2 :] if len(r) == len(rows[start])]
    col = {h: n for n, h in enumerate(head)}

    def num(r, key):
        return float(r[col[key]].replace(",", ""))

    print("| kernel | grid | us | DRAM MB | DRAM TB/s | DRAM busy % | busiest / mean SM active % | us no SM active | "
          "TB/s while active | stalls: " + " / ".join(STALLS) + " |")  # fmt: skip
    for r in data:
        grid, us = num(r, "launch__grid_size"), num(r, "gpu__time_duration.sum") / 1e3
        hz = num(r, "gpc__cycles_elapsed.avg.per_second")
        elapsed, busiest = num(r, "gpc__cycles_elapsed.max"), num(r, "sm__cycles_active.max")
        mean = num(r, "sm__cycles_active.sum") / min(grid, num(r, "device__attribute_multiprocessor_count"))
        rate = num(r, "dram__bytes.sum.per_second")
        mb = rate * us / 1e12
        stalls = " / ".join(f"{num(r, f'smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio'):.1f}"
                            for s in STALLS)  # fmt: skip
        print(f"| {r[col['Kernel Name']][:40]} | {grid:.0f} | {us:.2f} | {mb:.1f} | {rate / 1e12:.2f} | "
              f"{num(r, 'dram__cycles_active.avg.pct_of_peak_sustained_elapsed'):.0f} | "
              f"{busiest / elapsed * 100:.0f} / {mean / elapsed * 100:.0f} | {(elapsed - busiest) / hz * 1e6:.1f} | "
              f"{mb / (busiest / hz) / 1e6:.2f} | {stalls} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", default=None, help="print the table of an ncu --csv --page raw file, and exit")
    ap.add_argument("--experts", default="base", help="experts_single variants, comma-separated")
    ap.add_argument("--oproj", default="base", help="gemv_partials variants, comma-separated")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    if args.summary:
        summary(args.summary)
        return
    hidden, num_experts, width, top_k, kv_heads, group, head_dim = 2048, 128, 768, 8, 4, 8, 128
    keys = iter(jax.random.split(jax.random.key(0), 16))

    def rand(shape, scale=1.0):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(jnp.bfloat16)

    x, norm_w = rand((1, hidden)), rand((hidden,))
    attn, wo = rand((1, 4096)), rand((4096, hidden), 4096**-0.5)  # the o-proj's input and weight
    wqkv = rand((hidden, kv_heads * (group + 2) * head_dim), hidden**-0.5)
    router = rand((hidden, num_experts), hidden**-0.5)
    gate, up = rand((num_experts, hidden, width), hidden**-0.5), rand((num_experts, hidden, width), hidden**-0.5)
    down = rand((num_experts, width, hidden), width**-0.5)
    live = jnp.ones((1,), bool)
    outs = []
    for name in args.oproj.split(","):
        opts = _options(name, OPROJ_KEYS)

        @jax.jit
        def oproj(x, attn, wo, norm_w, router, opts=opts):
            parts = kernels.gemv_partials(attn, wo, **opts)  # moe.GPU_OPROJ_KERNEL: added inside router_add_norm
            return kernels.router_add_norm(x, parts, norm_w, router, 1e-6, partials=True)

        for _ in range(args.runs):
            outs.append(oproj(x, attn, wo, norm_w, router))
    _, h, logits = outs[-1]
    for name in args.experts.split(","):
        opts = {"block_k": 256, "down_block_k": 128} | _options(name, EXPERT_KEYS)  # the H200's defaults first

        @jax.jit
        def experts(h, logits, gate, up, down, opts=opts):
            return kernels.experts_single(h, logits, live, gate, up, down, top_k, True, jax.nn.silu,
                                          partial_logits=True, combine=False, **opts)  # fmt: skip

        for _ in range(args.runs):
            outs.append(experts(h, logits, gate, up, down))
    qkv = jax.jit(lambda x, w: x @ w)  # the q|k|v's 1-row GEMM as XLA runs it (cuBLAS on the H200)
    for _ in range(args.runs):
        outs.append(qkv(x, wqkv))
    jax.block_until_ready(outs)
    print("rows", outs[-2].shape, "finite", bool(jnp.all(jnp.isfinite(outs[-2]))), "kernels run:",
          len(args.oproj.split(",")), "o-proj,", len(args.experts.split(",")), "experts")  # fmt: skip


if __name__ == "__main__":
    main()

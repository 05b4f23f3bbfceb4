"""One Qwen3-30B-A3B layer's single-token MoE kernels (router_add_norm, gate_up, down) and the q/k norm + RoPE kernel
on random bf16 inputs, run a few times: a small program for Nsight Compute, which reads the kernels' hardware counters
(DRAM throughput, stall reasons, occupancy) that the variants' timings in moe_gpu.py could not explain (gate_up at
2.9 TB/s of ~4.2). On the H200 (Firecracker, ncu seen working there):

    ncu --clock-control none -k regex:'gate_up|down_kernel|router_add|qk_norm|gemv' -c 8 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
        python3 benchmarks/moe_ncu.py [--block-k 256]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from kiln.models.kernels import pallas_gpu_moe as kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    hidden, num_experts, width, top_k, kv_heads, group, head_dim = 2048, 128, 768, 8, 4, 8, 128
    keys = iter(jax.random.split(jax.random.key(0), 16))

    def rand(shape, scale=1.0):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(jnp.bfloat16)

    x, o, norm_w = rand((1, hidden)), rand((2, hidden)), rand((hidden,))
    attn, wo = rand((1, 4096)), rand((4096, hidden), 4096**-0.5)  # the o-proj's input and weight
    router = rand((hidden, num_experts), hidden**-0.5)
    gate, up = rand((num_experts, hidden, width), hidden**-0.5), rand((num_experts, hidden, width), hidden**-0.5)
    down = rand((num_experts, width, hidden), width**-0.5)
    qkv = rand((1, kv_heads * (group + 2) * head_dim))
    q_norm, k_norm = rand((head_dim,)), rand((head_dim,))
    cos, sin = rand((1, 1, head_dim // 2)), rand((1, 1, head_dim // 2))
    live = jnp.ones((1,), bool)

    @jax.jit
    def layer(x, o, norm_w, router, gate, up, down, qkv, q_norm, k_norm, cos, sin, attn, wo):
        parts = kernels.gemv_partials(attn, wo)  # the o-proj as split-K rows (moe.GPU_OPROJ_KERNEL), added inside
        x2 = kernels.router_add_norm(x, parts, norm_w, router, 1e-6, partials=True)[0]
        x, h, logits = kernels.router_add_norm(x, o, norm_w, router, 1e-6)
        y = kernels.experts_single(h, logits, live, gate, up, down, top_k, True, jax.nn.silu, partial_logits=True,
                                   combine=False, block_k=args.block_k, down_block_k=128)  # fmt: skip
        q = kernels.qk_norm_rope(qkv, q_norm, k_norm, cos, sin, 1e-6, kv_heads=kv_heads, head_dim=head_dim)
        return x, y, q, x2

    for _ in range(args.runs):
        out = layer(x, o, norm_w, router, gate, up, down, qkv, q_norm, k_norm, cos, sin, attn, wo)
    jax.block_until_ready(out)
    print("rows", out[1].shape, "finite", bool(jnp.all(jnp.isfinite(out[1]))), "qkv", out[2].shape)


if __name__ == "__main__":
    main()

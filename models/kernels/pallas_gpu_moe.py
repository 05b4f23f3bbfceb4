"""The experts of a mixture-of-experts layer as two grouped Pallas kernels for GPUs (Triton lowering): every touched
expert's weights are read once, untouched experts cost nothing, nothing is gathered or widened in memory.

The T * k (token, expert) pairs are sorted by expert in XLA (a few small ops); then

* gate_up: grid (G groups = the distinct experts, at most min(T * k, X), F / block_f). Program (g, j) runs the
  pairs of group g's expert, block_m at a time (one chunk when the
  expert has at most block_m pairs, as every expert has at decode sizes), over the hidden axis block_k at a time:
  act = act_fn(x @ gate[g][:, j]) * (x @ up[g][:, j]), the rows of x gathered by token.
* down: grid (X, E / block_e). y = act @ down[g][:, j], scaled by each pair's routing weight.

and XLA adds each token's k rows of y. Values as kiln.models.moe.experts_dense (float32 accumulation, the weights'
dtype into the dots). Measured against the XLA dispatches by benchmarks/moe_gpu.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _pairs(start_ref, size_ref, g, c, block_m):
    """Rows of the sorted pairs in chunk c of group g, and which of them are the group's."""
    r = c * block_m + jnp.arange(block_m, dtype=jnp.int32)
    return start_ref[g] + r, r < size_ref[g]


def _gate_up_kernel(
    exp_ref, start_ref, size_ref, tok_ref, h_ref, wg_ref, wu_ref, out_ref, *, block_m, block_k, block_f, act
):
    g, j = pl.program_id(0), pl.program_id(1)
    e = exp_ref[g]
    hidden = h_ref.shape[1]
    fcols = j * block_f + jnp.arange(block_f, dtype=jnp.int32)

    def chunk(c, carry):
        rows, ok = _pairs(start_ref, size_ref, g, c, block_m)
        tok = plgpu.load(tok_ref.at[rows], mask=ok, other=0)  # (M,)

        def kstep(i, acc):
            kcols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
            x = plgpu.load(h_ref.at[tok[:, None], kcols[None, :]], mask=ok[:, None], other=0)  # (M, K)
            wg = plgpu.load(wg_ref.at[e, pl.ds(i * block_k, block_k), pl.ds(j * block_f, block_f)])  # (K, F)
            wu = plgpu.load(wu_ref.at[e, pl.ds(i * block_k, block_k), pl.ds(j * block_f, block_f)])
            return acc[0] + plgpu.dot(x, wg), acc[1] + plgpu.dot(x, wu)

        zero = jnp.zeros((block_m, block_f), jnp.float32)
        gate, up = lax.fori_loop(0, hidden // block_k, kstep, (zero, zero))
        y = (act(gate) * up).astype(out_ref.dtype)
        plgpu.store(out_ref.at[rows[:, None], fcols[None, :]], y, mask=ok[:, None])
        return carry

    lax.fori_loop(0, pl.cdiv(size_ref[g], block_m), chunk, jnp.int32(0))


def _down_kernel(exp_ref, start_ref, size_ref, w_ref, a_ref, wd_ref, out_ref, *, block_m, block_k, block_e):
    g, j = pl.program_id(0), pl.program_id(1)
    e = exp_ref[g]
    width = a_ref.shape[1]
    ecols = j * block_e + jnp.arange(block_e, dtype=jnp.int32)

    def chunk(c, carry):
        rows, ok = _pairs(start_ref, size_ref, g, c, block_m)

        def kstep(i, acc):
            kcols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
            a = plgpu.load(a_ref.at[rows[:, None], kcols[None, :]], mask=ok[:, None], other=0)  # (M, K)
            wd = plgpu.load(wd_ref.at[e, pl.ds(i * block_k, block_k), pl.ds(j * block_e, block_e)])  # (K, E)
            return acc + plgpu.dot(a, wd)

        y = lax.fori_loop(0, width // block_k, kstep, jnp.zeros((block_m, block_e), jnp.float32))
        w = plgpu.load(w_ref.at[rows], mask=ok, other=0.0)  # (M,) routing weights
        plgpu.store(out_ref.at[rows[:, None], ecols[None, :]], y * w[:, None], mask=ok[:, None])
        return carry

    lax.fori_loop(0, pl.cdiv(size_ref[g], block_m), chunk, jnp.int32(0))


def _block(dim: int, want: int) -> int:
    b = min(want, dim)
    if dim % b:
        raise ValueError(f"MoE kernel: dimension {dim} is not a multiple of the block {b}")
    return b


def experts_grouped(
    h, w_gate, w_up, w_down, weights, experts, act, *, interpret=False, block_m=16, block_n=64, num_warps=4
):
    """Every token through its k experts: (T, E). h (T, E); w_gate, w_up (X, E, F); w_down (X, F, E); weights,
    experts (T, k), as kiln.models.moe.experts_dense."""
    t, k = experts.shape
    num_experts, hidden, width = w_gate.shape
    pairs = t * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # (P,) pair indices sorted by expert
    # Groups: the distinct experts in sorted order, at most min(P, X) of them (a decode's grid covers only those).
    groups = min(pairs, num_experts)
    e_sorted = flat[order]
    first = jnp.concatenate([jnp.ones((1,), bool), e_sorted[1:] != e_sorted[:-1]])  # (P,) a group's first pair
    gid = jnp.cumsum(first.astype(jnp.int32)) - 1  # (P,) each sorted pair's group
    at = jnp.where(first, gid, groups)  # the other pairs fall outside and are dropped
    g_expert = jnp.zeros((groups,), jnp.int32).at[at].set(e_sorted, mode="drop")
    g_start = jnp.zeros((groups,), jnp.int32).at[at].set(jnp.arange(pairs, dtype=jnp.int32), mode="drop")
    g_size = jnp.zeros((groups,), jnp.int32).at[gid].add(1)  # 0 for the groups past the last expert
    pad = block_m  # a chunk's rows past the last pair stay inside the buffers (masked on the GPU, the interpreter
    #                writes back what is there)
    token = jnp.pad(order // k, (0, pad))  # (P + pad,)
    pair_w = jnp.pad(weights.reshape(-1)[order].astype(jnp.float32), (0, pad))
    tables = (g_expert, g_start, g_size)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=3)
    bk, bf = _block(hidden, 128), _block(width, block_n)
    act_rows = pl.pallas_call(
        functools.partial(_gate_up_kernel, block_m=block_m, block_k=bk, block_f=bf, act=act),
        out_shape=jax.ShapeDtypeStruct((pairs + pad, width), h.dtype),
        grid=(groups, width // bf),
        interpret=interpret,
        compiler_params=params,
    )(*tables, token, h, w_gate, w_up)
    bk, be = _block(width, 128), _block(hidden, block_n)
    y = pl.pallas_call(
        functools.partial(_down_kernel, block_m=block_m, block_k=bk, block_e=be),
        out_shape=jax.ShapeDtypeStruct((pairs + pad, hidden), jnp.float32),
        grid=(groups, hidden // be),
        interpret=interpret,
        compiler_params=params,
    )(*tables, pair_w, act_rows, w_down)
    return jnp.zeros((t, hidden), jnp.float32).at[token[:pairs]].add(y[:pairs]).astype(h.dtype)

"""fp8 weight-only matmul for GPUs as a Pallas kernel (Triton lowering, CUDA on Hopper and newer): x (M, K) in the
compute dtype against a float8_e4m3fn weight w (N, K) with one scale per output channel (N,), the weight read once as
fp8 and widened in registers. For the decode buckets (M <= 128 rows), where XLA's weight-only GEMM (the convert fused
into its Triton GEMM) reads fp8 at 2.2-3.2 TB/s on an H200.

* grid (N / block_n, split_k). Program (j, s) owns output columns j * block_n ... and the s-th of split_k equal runs
  of K; it loops over its run block_k at a time: the x tile (M, block_k) and the weight tile (block_n, block_k) (fp8,
  K-contiguous rows, loaded with evict_first: read once), the tile widened to x's dtype, one tl.dot with float32
  accumulation: x @ w.T (M, block_n), or with `swap` w @ x.T (block_n, M), transposed before the store (the weight
  as the first operand: the wgmma M side, which Triton can feed from registers, so the widened tile need not go
  through shared memory; small-M fp8 GEMMs elsewhere swap the operands for that reason).
* split_k = 1: the program scales its (M, block_n) sums by the channels' scales and writes them in x's dtype.
  split_k > 1 (narrow N, or long K: too few programs to fill the GPU otherwise): float32 partials (split_k, M, N),
  summed and scaled by a small XLA fusion.

M is padded to a power of two >= 16 (tl.dot's smallest tile) when it is not one. Same values as
reference `matmul_reference` (the dequantized weight's matmul, float32 accumulation) up to the summation order.
Per-shape configs: `choose(m, n, k)`, from benchmarks/gpu_fp8.py's sweep on an H200.

Measured (session 9, H200, the Llama-3-8B fp8 decode program at c = 1, BENCHMARKS.md issue 16): the x-first form
took 12.1 / 9.2 us a layer for q|k|v / o (block_n 32, split 2 / 4) against XLA's 10.5 / 7.3, so quant leaves it off
(FP8_PALLAS_MAX_ROWS = 0). The swapped form (session 11, H200, jax 0.11.2, benchmarks/gpu_fp8.py --pallas by device
kernel time, split-K sums included) lost too, by 1.5-1.8x: best config against XLA's weight-only dot, us a weight,
16 / 64 rows: q|k|v 15.8 vs 10.5 / 28.5 vs 15.9, o 13.2 vs 7.7 / 19.6 vs 11.8, gate|up 57.1 vs 37.6 / 75.9 vs 46.7
(best: block_n 64, block_k 128, 4 warps, 4-5 stages; 3-6 configs each within a 30 s budget; down and the LM head not
reached). So it stays off; a faster small-M fp8 GEMM needs another form than Triton's dot on a widened tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Config:
    block_n: int = 64  # output channels per program
    block_k: int = 256  # input features per inner step
    split_k: int = 1  # programs along K (float32 partials summed in XLA when > 1)
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # the weight tile as the dot's first operand: (bn, bk) @ x.T -> (bn, M), transposed at the end

    def fits(self, n: int, k: int) -> bool:
        return n % self.block_n == 0 and k % (self.block_k * self.split_k) == 0


# Measured per (rows bucket, N, K) on an H200 (benchmarks/gpu_fp8.py --pallas); other shapes take `default_config`.
CONFIGS: dict[tuple[int, int, int], Config | None] = {}
SMS = 132  # an H200's (and H100 SXM's) streaming multiprocessors: the default config aims at >= 2 programs each


def default_config(m: int, n: int, k: int) -> Config:
    """64 output channels a program and K split until there are >= 2 programs per SM (block_k 256)."""
    block_n = 64 if n % 64 == 0 else 32 if n % 32 == 0 else 16
    split = 1
    while (n // block_n) * split < 2 * SMS and k % (256 * split * 2) == 0 and k // (split * 2) >= 1024:
        split *= 2
    return Config(block_n=block_n, block_k=256, split_k=split)


def padded_rows(m: int) -> int:
    """The rows the kernel runs for m: a power of two, >= 16 (tl.dot's smallest tile)."""
    return max(16, 1 << (m - 1).bit_length())


def choose(m: int, n: int, k: int) -> Config | None:
    """The config for x (m, K) against w (N, K), or None where XLA's weight-only dot measured faster (a CONFIGS entry
    of None) or the shape does not tile."""
    key = (padded_rows(m), n, k)
    cfg = CONFIGS[key] if key in CONFIGS else default_config(*key)
    return cfg if cfg is not None and cfg.fits(n, k) else None


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_n: int, block_k: int, steps: int, split: int, swap: bool):
    j, s = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[0]
    n0 = j * block_n
    k0 = s * (steps * block_k)
    cols = pl.ds(n0, block_n)
    contract_k = (((1,), (1,)), ((), ()))

    def kstep(i, acc):
        k = pl.ds(k0 + i * block_k, block_k)
        x = plgpu.load(x_ref.at[:, k])  # (M, bk)
        w = plgpu.load(w_ref.at[cols, k], eviction_policy="evict_first").astype(x.dtype)  # (bn, bk)
        if swap:
            return acc + lax.dot_general(w, x, contract_k, preferred_element_type=jnp.float32)  # (bn, M)
        return acc + lax.dot_general(x, w, contract_k, preferred_element_type=jnp.float32)  # (M, bn)

    acc_shape = (block_n, rows) if swap else (rows, block_n)
    acc = lax.fori_loop(0, steps, kstep, jnp.zeros(acc_shape, jnp.float32))
    acc = acc.T if swap else acc  # (M, bn)
    if split == 1:
        scale = plgpu.load(s_ref.at[cols]).astype(jnp.float32)  # (bn,)
        plgpu.store(o_ref.at[:, cols], (acc * scale[None, :]).astype(o_ref.dtype))
    else:
        plgpu.store(o_ref.at[s, :, cols], acc)


def fp8_matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    cfg: Config | None = None,
    *,
    interpret: bool = False,
    name: str = "fp8_matmul",
) -> jax.Array:
    """x (M, K) @ (w * scale[:, None]).T: (M, N) in x's dtype; w (N, K) float8_e4m3fn, scale (N,). name: the
    kernel's (what a profile shows)."""
    m, k = x.shape
    n = w.shape[0]
    mp = padded_rows(m)
    cfg = cfg or choose(m, n, k)
    if cfg is None or not cfg.fits(n, k):
        raise ValueError(f"fp8 matmul: {cfg} does not divide the weight ({n}, {k})")
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x  # (Mp, K)
    split = cfg.split_k
    steps = k // (cfg.block_k * split)
    out_shape = (mp, n) if split == 1 else (split, mp, n)
    out = pl.pallas_call(
        functools.partial(_kernel, block_n=cfg.block_n, block_k=cfg.block_k, steps=steps, split=split, swap=cfg.swap),
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype if split == 1 else jnp.float32),
        grid=(n // cfg.block_n, split),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name=name,
    )(xp, w, scale)
    if split > 1:
        out = (out.sum(axis=0) * scale.astype(jnp.float32)).astype(x.dtype)  # (Mp, N)
    return out[:m] if mp != m else out


def matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """The kernel's values: x against the dequantized weight, float32 accumulation, in x's dtype."""
    wd = w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]  # (N, K)
    return jnp.dot(x.astype(jnp.float32), wd.T, precision=lax.Precision.HIGHEST).astype(x.dtype)  # (M, N)

"""Weight-only matmul of narrow weights for GPUs as a Pallas kernel (Triton lowering, CUDA): x (M, K) in the compute
dtype against a weight w (N, K) stored narrow, read once and widened in registers. Two formats (kiln.models.quant):

* fp8: float8_e4m3fn with one scale per output channel (N,), applied to the sums at the end (Hopper and newer).
* int4: jnp.int4 with one scale per output channel and group of g consecutive inputs (N, K // g); each group's
  partial sums are scaled as they are added (float32), so the weight is never scaled tile by tile.

* grid (M / block_m, N / block_n, split_k), or (N / block_n, split_k) with one row block (block_m 0: all rows, the
  decode case). Row blocks (prefill chunks) do not pay on an H200: 0.91-1.24x XLA's int4 dot at 256 rows, 0.47-0.60x at
  2048 (session 22), so quant uses the kernel up to 128 rows. Program (r, j, s) owns rows r * block_m ..., output
  columns j * block_n ... and the s-th of split_k equal runs of K; it loops over its run block_k at a time. A weight
  tile's row blocks are neighbouring programs, so it is read from HBM about once. The weight is viewed as (N, K / unit,
  unit) (unit = block_k, or the int4 group when block_k spans several: a reshape that splits the minor dimension, no
  copy), so that each tile's load has a static start in its last dimension: Pallas then reads int4 as bytes (two values
  each) rather than a byte a value. Tiles are loaded (evict_first where one program reads them), widened to x's dtype,
  one tl.dot each with float32 accumulation: x @ w.T (block_m, block_n), or with `swap` w @ x.T (block_n, block_m),
  transposed before the store (the weight as the first operand: the wgmma M side, which Triton can feed from registers).
* split_k = 1: the program writes its (block_m, block_n) sums (fp8: scaled by the channels' scales) in x's dtype.
  split_k > 1 (narrow N, or long K: too few programs to fill the GPU otherwise): float32 partials (split_k, M, N),
  summed (and fp8's scaled) by a small XLA fusion.

M is padded to a power of two >= 16 (tl.dot's smallest tile) when it is not one. Same values as `matmul_reference`
(the dequantized weight's matmul, float32 accumulation) up to the summation order. Per-shape configs: `choose(m, w,
scale)`, from benchmarks/gpu_fp8.py's sweep on an H200 (CONFIGS).

Measured, fp8 (session 9, H200, the Llama-3-8B fp8 decode program at c = 1, BENCHMARKS.md issue 16): the x-first
form took 12.1 / 9.2 us a layer for q|k|v / o (block_n 32, split 2 / 4) against XLA's weight-only GEMM's 10.5 / 7.3,
so quant leaves it off for fp8 (PALLAS_MAX_ROWS["fp8"] = 0). The swapped form (session 11, benchmarks/gpu_fp8.py
--pallas by device kernel time, split-K sums included) lost too, by 1.5-1.8x: 16 / 64 rows: q|k|v 15.8 vs 10.5 /
28.5 vs 15.9 us, gate|up 57.1 vs 37.6 / 75.9 vs 46.7. int4 has no XLA GEMM that reads it: see quant._int4_dot.
`fp8_x` (session 27, H100) drops the widening: fp8 rows against the fp8 weight, the wgmma's native form. With the rows
quantized by XLA outside the kernel it matched XLA's weight-only GEMM per weight (0.97-1.18x; down and the LM head
1.09-1.18x) and beat every widening config (1.01-1.54x), but the quantize fusions cost the c = 1 program more than it
saved (4.10 against 3.91 ms a token); each x tile is now quantized inside the kernel, per row and block_k inputs
(not measured yet). One fp8 term per row costs SmolLM2 1-4 points of logit error and, in two of four block sizes, the
28-of-32 greedy agreement; `fp8_x=2` adds a second term for what the first leaves (a second fp8 x fp8 dot against the
same weight tile) and keeps weight-only's accuracy (benchmarks/fp8_accuracy.py, session 28), but ran 1.06-1.39x XLA's
weight-only GEMM's time at 16 rows and 2.6-4.0x at 64 (H100, session 28): off.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kiln.models.quant import quantize_fp8_terms


@dataclasses.dataclass(frozen=True)
class Config:
    block_n: int = 64  # output channels per program
    block_k: int = 256  # input features per inner step (int4: a multiple of the group, or a divisor of it)
    split_k: int = 1  # programs along K (float32 partials summed in XLA when > 1)
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # the weight tile as the dot's first operand: (bn, bk) @ x.T -> (bn, M), transposed at the end
    bits: bool = False  # int4 into bfloat16 by integer arithmetic (the bits of 136 + q, less 136), not a conversion
    block_m: int = 0  # rows per program (a power of two >= 16: tl.dot's smallest tile); 0: all of them in one
    fp8_x: int = 0  # fp8 weights: each x tile as this many float8_e4m3fn terms per row (quant.quantize_fp8_terms),
    # quantized in the kernel, one fp8 x fp8 dot each (2: bf16's accuracy; 1: 1-4 points more logit error); 0: widen w

    def rows_per_program(self, rows: int) -> int:
        return min(rows, self.block_m or rows)

    def smem_bytes(self, rows: int, fmt: str) -> int:
        """Shared memory of the pipelined tiles: num_stages of the x tile (rows per program, block_k) in bfloat16 and
        the weight tile (block_n, block_k) in fmt (Triton's requests on an H200 were within 4% of this)."""
        w_bits = 4 if fmt == "int4" else 8
        x_bytes = self.rows_per_program(rows) * self.block_k * 2
        return self.num_stages * (x_bytes + self.block_n * self.block_k * w_bits // 8)

    def fits(self, n: int, k: int, group: int | None = None) -> bool:
        """Whether this config tiles w (n, k); group: int4's scale group (None: one scale per channel)."""
        tiles = n % self.block_n == 0 and k % (self.block_k * self.split_k) == 0
        return tiles and (group is None or self.block_k % group == 0 or group % self.block_k == 0)


# Measured per (format, rows bucket, N, K) on an H200 (benchmarks/gpu_fp8.py --pallas --format int4 --rows 16,64
# and 32,128, sessions 20 and 21, BENCHMARKS.md issue 16): the Llama-3-8B weights (q|k|v, o, gate|up, down, LM head),
# int4 group 128. Others take `default_config`; an entry of None means XLA's dot measured faster.
CONFIGS: dict[tuple[str, int, int, int], Config | None] = {
    ("int4", 32, 6144, 4096): Config(block_n=64, block_k=128, split_k=4, num_stages=5, swap=True, bits=True),
    ("int4", 32, 4096, 4096): Config(
        block_n=128, block_k=256, split_k=8, num_warps=8, num_stages=3, swap=True, bits=True
    ),
    ("int4", 32, 28672, 4096): Config(block_n=64, block_k=128, num_stages=5, swap=True, bits=True),
    ("int4", 32, 4096, 14336): Config(block_n=64, block_k=128, split_k=8, num_stages=5, swap=True, bits=True),
    ("int4", 32, 128256, 4096): Config(block_n=64, block_k=64, swap=True, bits=True),
    ("int4", 128, 6144, 4096): Config(block_n=64, block_k=64, split_k=4, swap=True),
    ("int4", 128, 4096, 4096): Config(block_n=64, block_k=64, split_k=8, swap=True, bits=True),
    ("int4", 128, 28672, 4096): Config(block_n=64, block_k=64, swap=True, bits=True),
    ("int4", 128, 4096, 14336): Config(block_n=64, block_k=64, split_k=8, swap=True),
    ("int4", 128, 128256, 4096): Config(block_n=64, block_k=64, swap=True, bits=True),
    ("int4", 16, 6144, 4096): Config(block_n=32, block_k=512, split_k=2, num_stages=3, bits=True),
    ("int4", 64, 6144, 4096): Config(block_n=64, block_k=128, split_k=4, swap=True),
    ("int4", 16, 4096, 4096): Config(block_n=64, block_k=128, split_k=8, num_stages=5, swap=True, bits=True),
    ("int4", 64, 4096, 4096): Config(block_n=64, block_k=256, split_k=4, num_stages=3, swap=True, bits=True),
    ("int4", 16, 28672, 4096): Config(block_n=32, block_k=512, num_stages=3, bits=True),
    ("int4", 64, 28672, 4096): Config(block_n=64, block_k=128, swap=True, bits=True),
    ("int4", 16, 4096, 14336): Config(block_n=32, block_k=512, split_k=4, num_stages=3, bits=True),
    ("int4", 64, 4096, 14336): Config(block_n=64, block_k=256, split_k=4, num_stages=3, swap=True, bits=True),
    ("int4", 16, 128256, 4096): Config(block_n=128, block_k=256, num_warps=8, num_stages=3, bits=True),
    ("int4", 64, 128256, 4096): Config(block_n=64, block_k=128, swap=True, bits=True),
}
SMS = 132  # an H200's (and H100 SXM's) streaming multiprocessors: the default config aims at >= 2 programs each
# Shared memory a config may plan for (an H200 SM has 227 KiB; Triton adds scratch: at 256 rows every swept config
# asked 274-811 KiB and failed to compile, session 21).
SMEM_BYTES = 200 * 1024


def default_config(fmt: str, m: int, n: int, k: int) -> Config:
    """64 output channels and up to 128 rows a program, block_k the largest of 256, 128, 64, 32 that divides K and
    keeps 4 stages (else 2) within SMEM_BYTES, and K split until there are >= 2 programs per SM; int4 widened by
    integer arithmetic (`widen`: it won 17 of the 20 sweeps)."""
    block_n = 64 if n % 64 == 0 else 32 if n % 32 == 0 else 16
    block_m = 128 if m > 128 else 0
    dividing = [b for b in (256, 128, 64, 32) if k % b == 0] or [32]
    tiles = [Config(block_n=block_n, block_k=b, num_stages=st, block_m=block_m) for st in (4, 2) for b in dividing]
    cfg = next((c for c in tiles if c.smem_bytes(m, fmt) <= SMEM_BYTES), tiles[-1])
    programs, split = (n // block_n) * (m // cfg.rows_per_program(m)), 1
    while programs * split < 2 * SMS and k % (cfg.block_k * split * 2) == 0 and k // (split * 2) >= 1024:
        split *= 2
    return dataclasses.replace(cfg, split_k=split, bits=fmt == "int4")


def format_of(w: jax.Array) -> str:
    """The CONFIGS key's format of a narrow weight: "int4" or "fp8"."""
    return "int4" if w.dtype == jnp.int4 else "fp8"


def padded_rows(m: int) -> int:
    """The rows the kernel runs for m: a power of two, >= 16 (tl.dot's smallest tile)."""
    return max(16, 1 << (m - 1).bit_length())


def group_of(w: jax.Array, scale: jax.Array) -> int | None:
    """The scale group along K of w (N, K) with scale (N,) (None: one per channel) or (N, K // g) (g)."""
    return w.shape[1] // scale.shape[1] if scale.ndim == 2 else None


def choose(m: int, w: jax.Array, scale: jax.Array) -> Config | None:
    """The config for x (m, K) against w (N, K), or None where XLA's dot measured faster (a CONFIGS entry of None) or
    the shape does not tile."""
    (n, k) = w.shape
    key = (format_of(w), padded_rows(m), n, k)
    cfg = CONFIGS[key] if key in CONFIGS else default_config(*key)
    return cfg if cfg is not None and cfg.fits(n, k, group_of(w, scale)) else None


def widen(w: jax.Array, dtype, bits: bool) -> jax.Array:
    """A narrow weight tile in the compute dtype. bits (int4 into bfloat16): 0x4308 + q (sign-extended) are the bits
    of the bfloat16 136 + q (128 + the nibble q + 8 in the 7-bit mantissa), from which 136 is taken exactly: integer
    adds where the conversion instruction runs at a quarter of their rate."""
    if not bits or w.dtype != jnp.int4 or dtype != jnp.bfloat16:
        return w.astype(dtype)
    return lax.bitcast_convert_type(w.astype(jnp.int16) + 0x4308, jnp.bfloat16) - 136


def _dot(w, x, swap: bool) -> jax.Array:
    """The tile's float32 sums: w (bn, unit) @ x.T -> (bn, M) with swap (the weight on the wgmma's M side), else x @
    w.T -> (M, bn)."""
    contract = (((1,), (1,)), ((), ()))
    if swap:
        return lax.dot_general(w, x, contract, preferred_element_type=jnp.float32)
    return lax.dot_general(x, w, contract, preferred_element_type=jnp.float32)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_n, block_k, block_m, unit, group, steps, split, swap, bits, fp8_x):
    once = x_ref.shape[0] == block_m  # one row block (decode): each weight tile is read by one program
    r, j, s = (0, pl.program_id(0), pl.program_id(1)) if once else (pl.program_id(i) for i in range(3))
    rows = pl.ds(r * block_m, block_m)
    cols = pl.ds(j * block_n, block_n)
    subs = block_k // unit  # weight loads a step

    def kstep(i, acc):
        for u in range(subs):
            piece = (s * steps + i) * subs + u  # the piece of the weight's (N, K / unit, unit) view
            x = plgpu.load(x_ref.at[rows, pl.ds(piece * unit, unit)])  # (block_m, unit)
            w = plgpu.load(w_ref.at[cols, piece, :], eviction_policy="evict_first" if once else None)  # (bn, unit)
            if fp8_x:  # the tile's rows as fp8 terms with a scale per row each: fp8 x fp8 dots, nothing widened
                part = 0.0
                for xq, xs in quantize_fp8_terms(x, fp8_x):  # (block_m, unit), (block_m, 1)
                    part = part + _dot(w, xq, swap) * (xs.T if swap else xs)
            else:
                part = _dot(widen(w, x.dtype, bits), x, swap)
            if group is not None:  # int4: this piece's group scale, per channel
                scale = plgpu.load(s_ref.at[cols, (piece * unit) // group]).astype(jnp.float32)  # (bn,)
                part = part * (scale[:, None] if swap else scale[None, :])
            acc = acc + part
        return acc

    acc = lax.fori_loop(0, steps, kstep, jnp.zeros((block_n, block_m) if swap else (block_m, block_n), jnp.float32))
    acc = acc.T if swap else acc  # (block_m, bn)
    if split > 1:
        plgpu.store(o_ref.at[s, rows, cols], acc)
        return
    if group is None:  # fp8: the channels' scales
        acc = acc * plgpu.load(s_ref.at[cols]).astype(jnp.float32)[None, :]
    plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype))


def narrow_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, cfg: Config | None = None, *,
                  interpret: bool = False) -> jax.Array:  # fmt: skip
    """x (M, K) @ the weight (K, N) that w (N, K) with scale stands for: (M, N) in x's dtype. w float8_e4m3fn with
    scale (N,), or int4 with scale (N, K // g). The kernel is named after the format (what a profile shows)."""
    m, k = x.shape
    n = w.shape[0]
    group = group_of(w, scale)
    mp = padded_rows(m)
    cfg = cfg or choose(m, w, scale)
    block_m = cfg.rows_per_program(mp) if cfg is not None else 0
    if cfg is None or not cfg.fits(n, k, group) or mp % block_m or block_m < 16:
        raise ValueError(f"narrow matmul: {cfg} does not tile the weight ({n}, {k}) with group {group} or {mp} rows")
    unit = cfg.block_k if group is None else min(cfg.block_k, group)
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x  # (Mp, K)
    if cfg.fp8_x and group is not None:
        raise ValueError("narrow matmul: fp8 rows (fp8_x) need fp8 weights")
    split = cfg.split_k
    steps = k // (cfg.block_k * split)
    kernel = functools.partial(_kernel, block_n=cfg.block_n, block_k=cfg.block_k, block_m=block_m, unit=unit,
                               group=group, steps=steps, split=split, swap=cfg.swap, bits=cfg.bits,
                               fp8_x=cfg.fp8_x)  # fmt: skip
    shape, dtype = ((mp, n), x.dtype) if split == 1 else ((split, mp, n), jnp.float32)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(shape, dtype),
        grid=(n // cfg.block_n, split) if block_m == mp else (mp // block_m, n // cfg.block_n, split),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name=f"{jnp.dtype(w.dtype).name}_matmul",
    )(xp, w.reshape(n, k // unit, unit), scale)
    if split > 1:
        out = out.sum(axis=0)  # (Mp, N)
        out = (out if group is not None else out * scale.astype(jnp.float32)).astype(x.dtype)
    return out[:m] if mp != m else out


def dequantize(w: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 (N, K) weight that w with scale stands for."""
    group = group_of(w, scale)
    if group is None:
        return w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    wg = w.astype(jnp.float32).reshape(w.shape[0], -1, group) * scale.astype(jnp.float32)[..., None]
    return wg.reshape(w.shape)


def matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array, fp8_block: int = 0, fp8_terms: int = 1) -> jax.Array:
    """The kernel's values: x against the dequantized weight, float32 accumulation, in x's dtype. fp8_block
    (Config.fp8_x's block_k): x rounded as the kernel does, each block of that many inputs per row to fp8_terms
    float8_e4m3fn terms (Config.fp8_x)."""
    if fp8_block:
        m, k = x.shape
        terms = quantize_fp8_terms(x.reshape(m * k // fp8_block, fp8_block), fp8_terms)
        x32 = sum(xq.astype(jnp.float32) * xs for xq, xs in terms).reshape(m, k)
        return jnp.dot(x32, dequantize(w, scale).T, precision=lax.Precision.HIGHEST).astype(x.dtype)
    return jnp.dot(x.astype(jnp.float32), dequantize(w, scale).T, precision=lax.Precision.HIGHEST).astype(x.dtype)

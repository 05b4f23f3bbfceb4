"""Weight formats: how a linear layer's weight is stored, multiplied and converted from float, in one place.

"float" keeps every tensor in the compute dtype, linear layers as (in, out), and a matmul is `x @ w`. A narrow format
stores the linear layers, the embedding and the LM head as a `QuantArray`: the narrow tensor `q` (out, in) (the
embedding (V, E), which is the tied LM head's (out, in)) and its float `scale`, w.T ~ q * scale. A QuantArray is a
pytree (leaves q, scale) that takes the float weight's place in `Weights`, so the model graph calls `dot(x, w)`
whatever the format, and the artifact stores it under the flat names `<name>` and `<name>_qscale`.

* "int8" (`--quantize int8`): symmetric int8, one scale per output channel (out,); the dot quantizes its input per row
  on the fly into two int8 terms (the activations add almost no error to the weights') and runs int8 x int8 -> int32
  (XLA's CPU int8 kernel; the (out, in) layout runs 1.5-2x faster there than (in, out)). No float copy of a weight is
  ever materialised.
* "int4" (`--quantize int4`, weight-only, like llama.cpp's Q4_0 or GPTQ): symmetric jnp.int4 in -7..7 with one scale
  per output channel and group of g consecutive input features, (out, in // g) in the compute dtype, g =
  `group_size(in)`. The activations stay in the compute dtype and the weight is widened inside the graph per call
  (`_int4_dot`; on CUDA up to PALLAS_MAX_ROWS["int4"] rows kiln's Pallas kernel, which reads the int4 bytes once).
  XLA's CPU has no int4 kernel and widens whole weights (slow: the format is for accelerators).
* "fp8" (`--quantize fp8`, Hopper and newer): float8_e4m3fn with one scale per output channel (out,) = max |w| / 448.
  Up to FP8_WEIGHT_ONLY_MAX_ROWS rows (decode buckets) the weight is widened to the compute dtype inside the dot
  (weight-only: XLA fuses the convert into the GEMM, so only fp8 bytes are read; on CUDA up to PALLAS_MAX_ROWS["fp8"]
  rows kiln's Pallas kernel instead, kiln.models.kernels.pallas_gpu_narrow, off until it measures faster); above, the
  rows are quantized per token to float8_e4m3fn too (up to FP8_TWO_TERM_MAX_ROWS rows as two fp8 terms) and the dot
  runs fp8 x fp8 -> float32 (cuBLASLt's fp8 GEMM on Hopper), scaled by both.

* GGUF block formats "q8_0", "q4_0", "q4_1" (and "gguf" = a GGUF source's own, the cpu target's default): the
  blocks of llama.cpp's formats kept bit for bit, per tensor (a format string like "q4_1,embed=q8_0"), multiplied by a
  C++ kernel on the CPU; kiln.models.gguf_quant.

The embedding lookup of every narrow format widens only the gathered rows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models import gguf_quant
from kiln.models.gguf_quant import GGUF_KINDS

WEIGHT_FORMATS = ("float", "int8", "int4", "fp8", "gguf", *GGUF_KINDS)  # what --quantize accepts
NARROW_DTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}  # each narrow format's q dtype
QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the LayerWeights a narrow format stores quantized
GROUP_SIZES = (128, 64, 32)  # int4 scale groups, largest first
GROUPED_DOT_MAX_ROWS = 32  # int4 dots of at most this many rows run batched over the scale groups (see _int4_dot)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_WEIGHT_ONLY_MAX_ROWS = 128  # fp8 dots of at most this many rows widen the weight; more rows run fp8 x fp8
# fp8 x fp8 dots of at most this many rows quantize their rows as two fp8 terms (quantize_fp8_terms: bf16's accuracy,
# where one term's costs SmolLM2 the 28-of-32 greedy agreement in some settings); more rows (prefill) one term. No dot
# takes it while FP8_WEIGHT_ONLY_MAX_ROWS is as large. Measured on an H100 (issue 16, session 28): two terms cost
# 10-40% more than one per weight, and the c = 64 program with them in its 64-row bucket ran 8.8 against 7.8 ms a
# token weight-only.
FP8_TWO_TERM_MAX_ROWS = 128
# The result dtype of the one-term fp8 x fp8 dots (prefill), None: x's dtype. cuBLASLt accumulates in float32 either
# way and writes this, which a fusion then scales (float32) and converts to x's dtype. Measured on an H100 (issue 16,
# session 36, Llama-3-8B shape, fp8, gpu_profile.py --prefill 2048: the step on two fresh 1024-token prompts): bf16
# results 30.98 ms a step (kernels 30.39) against float32's 33.95 / 33.83 (33.31 / 33.37): the float32 results were
# written and read back by the scaling fusions (the SiLU-and-mul's 3.62 -> 2.01 ms).
FP8_DOT_OUT = None
# On CUDA (one device, or no "tp" mesh axis), weight-only dots of at most this many rows run kiln's Pallas kernel
# (pallas_gpu_narrow) where a config is chosen for their shape, per format. 0: off. fp8, session 9 (H200, Llama-3-8B
# fp8 decode program at c = 1): the x-first kernel took 12.1 / 9.2 us for q|k|v / o (XLA's weight-only GEMM 10.5 /
# 7.3, plus the split-K sums), 3.55 ms/token against 3.31. int4: see _int4_dot.
PALLAS_MAX_ROWS = {"fp8": 0, "int4": 128}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantArray:
    """A weight in a narrow format: q (N, K) int8 / int4 / float8_e4m3fn and scale (N,) or, with int4, (N, K // g);
    it stands for the float (K, N) weight (q * scale).T (the embedding: the (V, E) table q * scale itself). A GGUF
    block format sets `kind` (static: part of the pytree's structure) and holds its blocks (kiln.models.gguf_quant)."""

    q: jax.Array  # (N, K); q4_0/q4_1: (N, K // 2) uint8
    scale: jax.Array  # (N,) or (N, K // g); GGUF: (N, K // 32) or (N, K // 32, 2) float16
    kind: str = dataclasses.field(default="", metadata=dict(static=True))  # a GGUF kind, "" for the others

    @property
    def format(self) -> str:
        return self.kind or next(f for f, d in NARROW_DTYPES.items() if jnp.dtype(self.q.dtype) == jnp.dtype(d))

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The (N, K) of the weight it stands for."""
        return (self.q.shape[0], gguf_quant.in_features(self.q, self.kind)) if self.kind else self.q.shape

    @property
    def sharding(self):
        return self.q.sharding


def format_of(w) -> str:
    """The weight format of one stored weight: "float" for a plain array."""
    return w.format if isinstance(w, QuantArray) else "float"


def group_size(in_features: int) -> int:
    """The int4 format's scale group along the input features: the largest of 128, 64, 32 that divides them (SmolLM2's
    576 -> 64, Llama-3-8B's 4096 and 14336 -> 128); all of them (one group per row) when none does."""
    return next((g for g in GROUP_SIZES if in_features % g == 0), in_features)


def is_weight_format(weight_format: str) -> bool:
    """Whether a string names a weight format: one of WEIGHT_FORMATS or a GGUF per-tensor one ("q4_1,embed=q8_0")."""
    return weight_format in WEIGHT_FORMATS or gguf_quant.parse_format(weight_format) is not None


def tensor_format(weight_format: str, name: str) -> str:
    """The format of the quantizable weight `name` ("embed", "lm_head", "layers.3.wq") in a model's weight format."""
    return gguf_quant.tensor_kind(weight_format, name) or weight_format


def weights_format(weights) -> str:
    """The weight format string of a Weights (what Weights.abstract needs to rebuild its structure)."""
    if not isinstance(weights.embed, QuantArray) or not weights.embed.kind:
        return format_of(weights.embed)
    kinds = {"embed": weights.embed.kind}
    if weights.lm_head is not None:
        kinds["lm_head"] = weights.lm_head.kind
    for i, lw in enumerate(weights.layers):
        kinds.update({f"layers.{i}.{n}": getattr(lw, n).kind for n in QUANTIZED if getattr(lw, n) is not None})
    return gguf_quant.format_string(kinds)


def abstract(out_in: tuple[int, int], weight_format: str, dtype) -> QuantArray:
    """The QuantArray of jax.ShapeDtypeStruct leaves of a stored (out, in) weight; dtype: the compute dtype (scales);
    weight_format: this tensor's (tensor_format)."""
    if weight_format in GGUF_KINDS:
        return QuantArray(*gguf_quant.abstract(out_in, weight_format), kind=weight_format)
    out, k = out_in
    scale = (out, k // group_size(k)) if weight_format == "int4" else (out,)
    return QuantArray(jax.ShapeDtypeStruct(out_in, NARROW_DTYPES[weight_format]), jax.ShapeDtypeStruct(scale, dtype))


# ---- the dot ----------------------------------------------------------------------------------------------------


def dot(x: jax.Array, w: jax.Array | QuantArray) -> jax.Array:
    """x (T, K) @ the weight (K, N) that w stands for: (T, N) in x's dtype."""
    return linears(x, w)[0]


def linears(x: jax.Array, *ws: jax.Array | QuantArray) -> list[jax.Array]:
    """x (T, K) @ each weight of ws: a float w (K, N) is a plain matmul; an int8 one quantizes x per row into two int8
    terms (once for all ws) and runs int8 x int8 -> int32 before the scales; int4 and fp8 ones see _int4_dot and
    _fp8_dot."""
    rows = None
    out = []
    for w in ws:
        fmt = format_of(w)
        if fmt == "float":
            out.append(_float_dot(x, w))  # (T, N)
        elif fmt in GGUF_KINDS:
            out.append(gguf_quant.dot(x, w.q, w.scale, fmt))
        elif fmt == "int4":
            out.append(_int4_dot(x, w.q, w.scale))
        elif fmt == "fp8":
            out.append(_fp8_dot(x, w.q, w.scale))
        else:
            rows = _quantize_rows(x) if rows is None else rows
            out.append(_int8_dot(*rows, w.q, w.scale, x.dtype))
    return out


def _float_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (T, K) @ w (K, N). One row runs as two on GPUs where (1 + N) K < 10M: there XLA's GPU compiler turns a (1, K)
    x (K, N) dot into a multiply that writes the whole (K, N) product and a reduction over it (an H200, Qwen3-30B-A3B's
    (4096, 2048) o-proj at batch 1: 11 + 17.5 us; as a 2-row GEMM 10); two rows stay a GEMM. Larger ones keep their
    1-row GEMM (cuBLAS's q|k|v there: 8 us, 10 as a 2-row Triton GEMM)."""
    if x.shape[0] != 1 or (1 + w.shape[1]) * w.shape[0] >= 10_000_000:
        return x @ w

    def two_rows(x, w):
        return (jnp.broadcast_to(x, (2, x.shape[1])) @ w)[:1]

    return jax.lax.platform_dependent(x, w, cuda=two_rows, rocm=two_rows, default=jnp.matmul)


def dequantize_int4(w: jax.Array, qscale: jax.Array, dtype) -> jax.Array:
    """The int4 weight w (N, K) with grouped scales qscale (N, K // g) as (N, K) in dtype: each group of g input
    features widened and multiplied by its scale, in the compute dtype."""
    groups = qscale.shape[-1]
    wg = w.astype(dtype).reshape(*w.shape[:-1], groups, w.shape[-1] // groups)  # (N, K // g, g)
    return (wg * qscale.astype(dtype)[..., None]).reshape(w.shape)  # (N, K)


def _int4_dot(x: jax.Array, w: jax.Array, qscale: jax.Array) -> jax.Array:
    """x (T, K) in the compute dtype against the int4 weight w (N, K) with grouped scales qscale (N, K // g): (T, N).

    On CUDA up to PALLAS_MAX_ROWS["int4"] rows (decode buckets) kiln's Pallas kernel, which reads the int4 bytes once
    and widens them in registers: the Llama-3-8B decode program on an H200 ran 4.21 / 7.91 ms a token at c = 1 / 64
    with it against 5.11 / 16.57 through XLA (BENCHMARKS.md, issue 16; at 128 rows it is 1.7-2.3x XLA's dot). More
    rows (prefill chunks), and every other platform, take `_int4_xla_dot`: the kernel's row-blocked form measured
    0.91-1.24x XLA's dot at 256 rows and 0.47-0.60x at 2048 (session 22)."""
    return _on_cuda_pallas("int4", _int4_xla_dot, x, w, qscale)


def _int4_xla_dot(x: jax.Array, w: jax.Array, qscale: jax.Array) -> jax.Array:
    """_int4_dot through XLA: two formulations, chosen by the static row count T. Up to GROUPED_DOT_MAX_ROWS rows
    (decode): one dot batched over the G = K // g groups, (T, g) x (N, g) -> float32 partial sums (G, T, N), then
    scaled per output and group and summed over G; XLA's GPU compiler fuses the int4 -> compute dtype convert into
    that batched GEMM, so only the int4 bytes are read. More rows (prefill): the weight dequantized to (N, K) and one
    dot over K; XLA materialises that (N, K) copy as a temporary of the call (it does not fuse the grouped scales'
    multiply into its GEMM), which many rows amortise, while the partial sums would grow with T. One (14336, 4096)
    layer on an H200 (jax 0.11.2, 16 layers in one jit): at T = 1 / 16 / 32 / 33 / 256 / 2048 rows, 35 / 52 / 72 /
    136 / 142 / 439 us against 43 / 55 / 47 / 55 / 64 / 355 us with bf16 weights (dequantise-then-dot at T <= 32:
    129-132 us)."""
    t, k = x.shape
    if t > GROUPED_DOT_MAX_ROWS:
        return jax.lax.dot_general(x, dequantize_int4(w, qscale, x.dtype), (((1,), (1,)), ((), ())))  # (T, N)
    groups = qscale.shape[-1]
    xg = x.reshape(t, groups, k // groups)  # (T, G, g)
    wg = w.astype(x.dtype).reshape(w.shape[0], groups, k // groups)  # (N, G, g)
    dims = (((2,), (2,)), ((1,), (1,)))  # contract g, batch over G
    part = jax.lax.dot_general(xg, wg, dims, preferred_element_type=jnp.float32)  # (G, T, N)
    return jnp.einsum("gtn,ng->tn", part, qscale.astype(jnp.float32)).astype(x.dtype)  # (T, N)


def _on_cuda_pallas(fmt: str, fallback, x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """fallback(x, w, scale), or on CUDA kiln's Pallas kernel (pallas_gpu_narrow) where x has at most
    PALLAS_MAX_ROWS[fmt] rows, a config tiles w and no "tp" mesh axis splits the weight (the kernel is one device's)."""
    from kiln.models.kernels import TP_AXIS, pallas_gpu_narrow  # here: jax's Triton dialect costs a CPU start 0.2 s

    mesh = jax.sharding.get_abstract_mesh()
    split = not mesh.empty and dict(mesh.shape).get(TP_AXIS, 1) > 1
    cfg = None if split or x.shape[0] > PALLAS_MAX_ROWS[fmt] else pallas_gpu_narrow.choose(x.shape[0], w, scale)
    if cfg is None:
        return fallback(x, w, scale)
    pallas = functools.partial(pallas_gpu_narrow.narrow_matmul, cfg=cfg)
    return jax.lax.platform_dependent(x, w, scale, cuda=pallas, default=fallback)


def _row_terms(x: jax.Array, terms: int, qmax: float, cast) -> list[tuple[jax.Array, jax.Array]]:
    """x (T, K) as a sum of `terms` quantized terms with a float32 scale per row each, x ~ sum cast(v) * xs with xs =
    max |r| / qmax per row of what the terms before leave (r, the first: x). cast rounds v = r / xs to the format."""
    r = x.astype(jnp.float32)
    out = []
    for t in range(terms):
        xs = jnp.maximum(jnp.max(jnp.abs(r), axis=1, keepdims=True), 1e-30) / qmax  # (T, 1)
        xq = cast(r / xs)  # (T, K)
        out.append((xq, xs))
        if t + 1 < terms:
            r = r - xq.astype(jnp.float32) * xs  # what this term leaves, |.| <= xs / 2 for int8
    return out


def _quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x (T, K) as two int8 terms per row, x ~ xq[:T] * xs[:T] + xq[T:] * xs[T:]: the second term quantizes what the
    first leaves (one int8 term per row costs SmolLM2 3x the logit error of the int8 weights alone). Returns xq
    (2T, K) int8 and xs (2T, 1) float32. A single row's second term also keeps the dot at two rows, which XLA's CPU
    runs in its int8 kernel (one row it rewrites into a matvec that widens the whole weight to int32)."""
    (hi, hs), (lo, ls) = _row_terms(x, 2, 127.0, lambda v: jnp.round(v).astype(jnp.int8))
    return jnp.concatenate([hi, lo]), jnp.concatenate([hs, ls])


def _int8_dot(xq: jax.Array, xs: jax.Array, w: jax.Array, qscale: jax.Array, dtype) -> jax.Array:
    """Two-term quantized rows (xq, xs) against the int8 weight w (N, K) with per-row scales qscale (N,): (T, N)."""
    rows = xq.shape[0] // 2
    acc = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)  # (2T, N)
    acc = acc.astype(jnp.float32) * xs  # (2T, N)
    return ((acc[:rows] + acc[rows:]) * qscale.astype(jnp.float32)).astype(dtype)  # (T, N)


def quantize_fp8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x (T, K) per row (token) as float8_e4m3fn: xq (T, K) and xs (T, 1) float32 with x ~ xq * xs, xs = max |x| /
    448 (each value rounded to 3 mantissa bits, relative error <= 2^-4)."""
    return quantize_fp8_terms(x, 1)[0]


def quantize_fp8_terms(x: jax.Array, terms: int) -> list[tuple[jax.Array, jax.Array]]:
    """x (T, K) as a sum of `terms` float8_e4m3fn terms with a scale per row each, x ~ sum xq * xs: the first is
    quantize_fp8_rows(x), each next one quantizes what the ones before leave (as _quantize_rows does for int8). Two
    terms keep about bf16's 8 significant bits: SmolLM2's decode dots with two-term fp8 rows match weight-only's
    logit error and argmax agreement, one term costs 1-4 points of error (benchmarks/fp8_accuracy.py, session 28)."""
    return _row_terms(x, terms, FP8_MAX, lambda v: v.astype(jnp.float8_e4m3fn))


def _fp8_dot(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x (T, K) against the float8_e4m3fn weight w (N, K) with per-output-channel scales (N,): (T, N) in x's dtype.

    Up to FP8_WEIGHT_ONLY_MAX_ROWS rows: weight-only, w widened to x's dtype inside the dot (XLA fuses the convert into
    its GEMM: fp8 bytes read, compute-dtype math), float32 accumulation, then the scales. More rows: x quantized per
    row to float8_e4m3fn (quantize_fp8_rows; up to FP8_TWO_TERM_MAX_ROWS rows as two terms stacked as rows, one dot)
    and an fp8 x fp8 dot, which XLA's GPU compiler hands to cuBLASLt's fp8 GEMM (both operands K-contiguous, as that
    GEMM wants; one term: its result in x's dtype, FP8_DOT_OUT), then both scales. (Either dot written weight first,
    (w . x.T).T, compiles to the same GEMM: session 27.)"""
    dims = (((1,), (1,)), ((), ()))  # contract K
    if x.shape[0] <= FP8_WEIGHT_ONLY_MAX_ROWS:

        def weight_only(x, w, scale):
            acc = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)  # (T, N)
            return (acc * scale.astype(jnp.float32)).astype(x.dtype)

        return _on_cuda_pallas("fp8", weight_only, x, w, scale)
    if x.shape[0] > FP8_TWO_TERM_MAX_ROWS:
        xq, xs = quantize_fp8_rows(x)  # (T, K), (T, 1)
        acc = jax.lax.dot_general(xq, w, dims, preferred_element_type=FP8_DOT_OUT or x.dtype)  # (T, N)
        return (acc.astype(jnp.float32) * xs * scale.astype(jnp.float32)).astype(x.dtype)
    (hi, hs), (lo, ls) = quantize_fp8_terms(x, 2)
    acc = jax.lax.dot_general(jnp.concatenate([hi, lo]), w, dims, preferred_element_type=jnp.float32)  # (2T, N)
    acc = acc[: x.shape[0]] * hs + acc[x.shape[0] :] * ls  # (T, N)
    return (acc * scale.astype(jnp.float32)).astype(x.dtype)


def embed_rows(table: jax.Array | QuantArray, token_ids: jax.Array, dtype) -> jax.Array:
    """The rows (T, E) of the embedding table (V, E) for token_ids (T,), in dtype; a narrow table widens only the
    gathered rows."""
    if not isinstance(table, QuantArray):
        return table[token_ids]  # (T, E)
    if table.kind:
        return gguf_quant.embed_rows(table.q, table.scale, table.kind, token_ids, dtype)
    x = table.q[token_ids]  # (T, E)
    scale = table.scale[token_ids]  # (T,), or (T, E // g) with int4
    if table.format == "int4":
        return dequantize_int4(x, scale, dtype)
    return x.astype(dtype) * scale[:, None].astype(dtype)


# ---- conversion from float (host, numpy) --------------------------------------------------------------------------


def quantize_int8(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one scale per slice across `axis` (the reduced one): w ~ q * scale; axis=1 of an (out, in)
    weight gives one scale per output channel (out,)."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=axis) / 127.0  # (N,) or (V,)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, axis)), -127, 127).astype(np.int8)
    return q, scale


def quantize_int4(w: np.ndarray, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 of an (out, in) weight with one scale per output channel and group of `group` consecutive input
    features (default `group_size(in)`): w ~ q * scale per group, q in -7..7 (jnp.int4 (N, K)), scale (N, K // g) =
    the group's max |w| / 7 in w's float dtype (float32 for anything else: the dtype the artifact stores them in), so
    that |w - q * scale| <= scale / 2 and the group's largest weight is exact (up to the scale's rounding).

    Measured on SmolLM2 (logit error against float32): max / 7.5 (a 7% smaller step, same bound) gives 56% instead of
    52%, and a per-group MSE-optimal scale over -8..7 55%: keeping the largest weight exact matters more."""
    w = np.asarray(w)
    scale_dtype = w.dtype if np.issubdtype(w.dtype, np.floating) or w.dtype == jnp.bfloat16 else np.dtype(np.float32)
    w = w.astype(np.float32)
    n, k = w.shape
    g = group or group_size(k)
    if k % g:
        raise ValueError(f"int4 group {g} does not divide {k} input features")
    wg = w.reshape(n, k // g, g)  # (N, K // g, g)
    amax = np.abs(wg).max(axis=2)  # (N, K // g)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(scale_dtype)
    q = np.clip(np.rint(wg / scale.astype(np.float32)[..., None]), -7, 7).astype(np.int8)  # (N, K // g, g)
    return q.reshape(n, k).astype(jnp.int4), scale


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn of an (out, in) weight with one float32 scale per output channel (N,) = max |w| / 448: w ~ q *
    scale, each weight rounded to nearest at 3 mantissa bits (relative error <= 2^-4; the channel's max is exact).
    Runs as one jitted program on the default device (numpy's float8 cast would take minutes for an 8B model)."""
    q, scale = _quantize_fp8(jnp.asarray(w))
    return np.asarray(q), np.asarray(scale)


@jax.jit
def _quantize_fp8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    w = w.astype(jnp.float32)  # (N, K)
    amax = jnp.max(jnp.abs(w), axis=1)  # (N,)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(w / scale[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), scale


def quantize(w: np.ndarray, weight_format: str) -> QuantArray:
    """One (out, in) host weight in a narrow format."""
    if weight_format in GGUF_KINDS:
        return QuantArray(*gguf_quant.quantize(w, weight_format), kind=weight_format)
    if weight_format == "int4":
        return QuantArray(*quantize_int4(w))
    if weight_format == "fp8":
        return QuantArray(*quantize_fp8(w))
    return QuantArray(*quantize_int8(w, axis=1))


def quantize_weights(weights, weight_format: str, source=None):
    """Host (numpy) float Weights in `weight_format`: "float" returns them as they are; a narrow format stores every
    linear layer and an untied LM head transposed to (out, in), and the embedding (V, E), as QuantArrays; "gguf" keeps
    the blocks of `source` (the checkpoint path) when it is a GGUF file (kiln.models.gguf_quant.keep_gguf), else
    returns the float weights. weights_format(result) is the format the result is in."""
    from kiln.models.errors import KilnError

    if not is_weight_format(weight_format):
        raise KilnError(f"Unknown weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}.")
    if weight_format == "float" or weights_format(weights) == weight_format:  # already in it
        return weights
    if weight_format == "gguf":
        if source is None or not str(source).endswith(".gguf"):
            return weights
        return gguf_quant.keep_gguf(weights, source, QUANTIZED)

    def narrow(i, lw):  # (in, out) -> (out, in); a mixture-of-experts layer's router and experts stay float
        present = [n for n in QUANTIZED if getattr(lw, n) is not None]
        fmt = {n: tensor_format(weight_format, f"layers.{i}.{n}") for n in present}
        return dataclasses.replace(lw, **{n: quantize(np.asarray(getattr(lw, n)).T, fmt[n]) for n in present})

    # Layers in parallel: numpy's passes release the GIL (an (14336, 4096) int4 layer weight takes ~0.4 s in one
    # thread; four took 1.53 s in one thread and 0.96 s in two on a 2-core machine). Up to 8 layers at a time: each
    # holds a few float32 copies of its largest weight (~1.2 GB for an 8B model's).
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        layers = list(pool.map(narrow, range(len(weights.layers)), weights.layers))
    lm_head = None
    if weights.lm_head is not None:
        lm_head = quantize(np.asarray(weights.lm_head).T, tensor_format(weight_format, "lm_head"))
    embed = quantize(np.asarray(weights.embed), tensor_format(weight_format, "embed"))
    return dataclasses.replace(weights, layers=layers, embed=embed, lm_head=lm_head)


# ---- sharding -------------------------------------------------------------------------------------------------------


def stored_split_dim(field: str, dim: int, scale_ndim: int | None) -> int | None:
    """Which dimension of a narrow weight's stored tensor a tensor-parallel split over `dim` of the float weight lands
    on: the q (out, in) of a linear (float (in, out)) swaps them, the embedding (V, E) keeps them; scale_ndim: the
    scale's instead (1: (out,), split only with the output channels; 2: int4's (out, in // g), like q)."""
    if field != "embed":
        dim = 1 - dim
    if scale_ndim == 1:
        return 0 if dim == 0 else None
    return dim

"""The decoder-only transformer of every supported family (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3) as pure JAX
functions over a weights pytree. Families differ only by ModelConfig flags.

Weights are stored in the layout the graph uses: linear layers as (in, out), norm weights already holding Gemma's
(1 + w), so the graph has no per-family branches beyond optional tensors.

Weight formats: "float" keeps every tensor in the compute dtype. "int8" (`kiln compile --quantize int8`) stores the
linear layers, the embedding and the LM head as symmetric int8 with one float scale per output channel (`<name>_qscale`;
per vocabulary row for the embedding, which is the tied LM head's output channel), each linear transposed to (out, in)
like the embedding (XLA's CPU int8 kernel runs that layout 1.5-2x faster); the matmuls quantize their input per row on
the fly (two int8 terms, so the activations add almost no error to the weights') and run int8 x int8 -> int32 dots, so
no float copy of a weight is ever materialised.

"int4" (`--quantize int4`, weight-only, like llama.cpp's Q4_0 or GPTQ) stores the same tensors in the same (out, in)
layout as symmetric jnp.int4 in -7..7 with one scale per output channel and group of g consecutive input features
(`<name>_qscale` shaped (out, in // g), g = `group_size(in)`), the scales in the compute dtype. The activations stay in
the compute dtype and the int4 weight is widened inside the jitted graph, per call (`_int4_dot`): with few rows
(decode) in a dot batched over the scale groups, into which XLA's GPU compiler fuses the widening (only int4 bytes are
read), with many rows (prefill) dequantised to a temporary right before the dot. Nothing wider than int4 is stored or
kept between calls. XLA's CPU has no int4 kernel and widens whole weights (slow: the format is for accelerators). The
embedding lookup widens only the gathered rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.batch import Batch, KVCache
from kiln.models.config import ModelConfig
from kiln.models.kernels.reference import paged_attention as reference_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: jax.Array  # (E,)
    wq: jax.Array  # (E, H*D)
    wk: jax.Array  # (E, KVH*D)
    wv: jax.Array  # (E, KVH*D)
    wo: jax.Array  # (H*D, E)
    mlp_norm: jax.Array  # (E,)
    w_gate: jax.Array  # (E, F)
    w_up: jax.Array  # (E, F)
    w_down: jax.Array  # (F, E)
    bq: jax.Array | None = None  # (H*D,)
    bk: jax.Array | None = None  # (KVH*D,)
    bv: jax.Array | None = None  # (KVH*D,)
    bo: jax.Array | None = None  # (E,)
    q_norm: jax.Array | None = None  # (D,)
    k_norm: jax.Array | None = None  # (D,)
    post_attn_norm: jax.Array | None = None  # (E,)
    post_mlp_norm: jax.Array | None = None  # (E,)
    # scales of a narrow weight format: (out,) with int8, e.g. (H*D,) here; (out, in // g) with int4, e.g. (H*D, E // g)
    wq_qscale: jax.Array | None = None  # (H*D,)
    wk_qscale: jax.Array | None = None  # (KVH*D,)
    wv_qscale: jax.Array | None = None  # (KVH*D,)
    wo_qscale: jax.Array | None = None  # (E,)
    w_gate_qscale: jax.Array | None = None  # (F,)
    w_up_qscale: jax.Array | None = None  # (F,)
    w_down_qscale: jax.Array | None = None  # (E,)


WEIGHT_FORMATS = ("float", "int8", "int4")
NARROW_DTYPES = {"int8": jnp.int8, "int4": jnp.int4}  # the dtype of each narrow weight format's quantized tensors
QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the LayerWeights a narrow format stores quantized
GROUP_SIZES = (128, 64, 32)  # int4 scale groups, largest first
GROUPED_DOT_MAX_ROWS = 32  # int4 dots of at most this many rows run batched over the scale groups (see _int4_dot)


def group_size(in_features: int) -> int:
    """The int4 format's scale group along the input features: the largest of 128, 64, 32 that divides them (SmolLM2's
    576 -> 64, Llama-3-8B's 4096 and 14336 -> 128); all of them (one group per row) when none does."""
    return next((g for g in GROUP_SIZES if in_features % g == 0), in_features)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # (V, E)
    final_norm: jax.Array  # (E,)
    layers: list[LayerWeights]
    lm_head: jax.Array | None = None  # (E, V); None when tied to embed
    embed_qscale: jax.Array | None = None  # (V,) with int8: one scale per vocabulary row; (V, E // g) with int4
    lm_head_qscale: jax.Array | None = None  # likewise, with an untied LM head

    @staticmethod
    def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Shape of every tensor of one layer (key: LayerWeights field) and of the top-level tensors."""
        e, h, kv, d, f, v = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.vocab_size,
        )
        return {
            "embed": (v, e), "final_norm": (e,), "lm_head": (e, v),
            "attn_norm": (e,), "wq": (e, h * d), "wk": (e, kv * d), "wv": (e, kv * d), "wo": (h * d, e),
            "mlp_norm": (e,), "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e),
            "bq": (h * d,), "bk": (kv * d,), "bv": (kv * d,), "bo": (e,), "q_norm": (d,), "k_norm": (d,),
            "post_attn_norm": (e,), "post_mlp_norm": (e,),
            "wq_qscale": (h * d,), "wk_qscale": (kv * d,), "wv_qscale": (kv * d,), "wo_qscale": (e,),
            "w_gate_qscale": (f,), "w_up_qscale": (f,), "w_down_qscale": (e,), "embed_qscale": (v,),
            "lm_head_qscale": (v,),
        }  # fmt: skip

    @staticmethod
    def layer_fields(cfg: ModelConfig, weight_format: str = "float") -> list[str]:
        """The LayerWeights fields this config uses in this weight format."""
        names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
        if weight_format in NARROW_DTYPES:
            names += [f"{n}_qscale" for n in QUANTIZED]
        if cfg.qkv_bias:
            names += ["bq", "bk", "bv"]
        if cfg.o_bias:
            names += ["bo"]
        if cfg.qk_norm:
            names += ["q_norm", "k_norm"]
        if cfg.sandwich_norms:
            names += ["post_attn_norm", "post_mlp_norm"]
        return names

    @staticmethod
    def abstract(cfg: ModelConfig, dtype=jnp.float32, weight_format: str = "float") -> Weights:
        """A Weights of jax.ShapeDtypeStruct leaves, for ahead-of-time lowering. dtype: the compute dtype (norms,
        biases, scales, and with weight format "float" every tensor); weight_format: see the module docstring."""
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weight_format!r}")
        shapes = Weights.shapes(cfg)
        narrow = set(QUANTIZED) | {"embed", "lm_head"} if weight_format in NARROW_DTYPES else set()

        def stored(name):  # a narrow tensor's (out, in)
            return shapes[name] if name == "embed" else shapes[name][::-1]

        def spec(name):
            if weight_format == "int4" and name.endswith("_qscale"):
                out, k = stored(name.removesuffix("_qscale"))
                return jax.ShapeDtypeStruct((out, k // group_size(k)), dtype)
            if name not in narrow:
                return jax.ShapeDtypeStruct(shapes[name], dtype)
            return jax.ShapeDtypeStruct(stored(name), NARROW_DTYPES[weight_format])

        fields = Weights.layer_fields(cfg, weight_format)
        layers = [LayerWeights(**{n: spec(n) for n in fields}) for _ in range(cfg.num_layers)]
        top = ["embed", "final_norm"] + ([] if cfg.tie_word_embeddings else ["lm_head"])
        if weight_format in NARROW_DTYPES:
            top += [f"{n}_qscale" for n in top if n != "final_norm"]
        return Weights(layers=layers, **{n: spec(n) for n in top})

    @property
    def weight_format(self) -> str:
        if self.embed_qscale is None:
            return "float"
        return "int4" if self.embed.dtype == jnp.int4 else "int8"


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * w


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, HF's rotate-half convention. x: (T, N, D), positions: (T,)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # (T, D/2)
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]  # (T, 1, D/2)
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)  # (T, N, D/2) each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def linears(x: jax.Array, *ws: tuple[jax.Array, jax.Array | None]) -> list[jax.Array]:
    """x (T, K) @ w for each (w, qscale) of ws: a float w (K, N); an int8 w (N, K) with qscale (N,) (w.T ~ w_int8 *
    qscale), for which x is quantized per row into two int8 terms (once for all ws) and the dot runs int8 x int8 ->
    int32 (XLA's CPU hands it to its YNNPACK kernel) before the scales are applied; or an int4 w (N, K) with grouped
    scales qscale (N, K // g), widened to x's dtype inside the graph right before the dot (`dequantize_int4`)."""
    rows = None
    out = []
    for w, qscale in ws:
        if qscale is None:
            out.append(x @ w)  # (T, N)
        elif w.dtype == jnp.int4:
            out.append(_int4_dot(x, w, qscale))
        else:
            rows = _quantize_rows(x) if rows is None else rows
            out.append(_int8_dot(*rows, w, qscale, x.dtype))
    return out


def dequantize_int4(w: jax.Array, qscale: jax.Array, dtype) -> jax.Array:
    """The int4 weight w (N, K) with grouped scales qscale (N, K // g) as (N, K) in dtype: each group of g input
    features widened and multiplied by its scale, in the compute dtype."""
    groups = qscale.shape[-1]
    wg = w.astype(dtype).reshape(*w.shape[:-1], groups, w.shape[-1] // groups)  # (N, K // g, g)
    return (wg * qscale.astype(dtype)[..., None]).reshape(w.shape)  # (N, K)


def _int4_dot(x: jax.Array, w: jax.Array, qscale: jax.Array) -> jax.Array:
    """x (T, K) in the compute dtype against the int4 weight w (N, K) with grouped scales qscale (N, K // g): (T, N).

    Two formulations, chosen by the static row count T. Up to GROUPED_DOT_MAX_ROWS rows (decode): one dot batched over
    the G = K // g groups, (T, g) x (N, g) -> float32 partial sums (G, T, N), then scaled per output and group and
    summed over G; XLA's GPU compiler fuses the int4 -> compute dtype convert into that batched GEMM, so only the int4
    bytes are read. More rows (prefill): the weight dequantized to (N, K) and one dot over K; XLA materialises that
    (N, K) copy as a temporary of the call (it does not fuse the grouped scales' multiply into its GEMM), which many
    rows amortise, while the partial sums would grow with T. One (14336, 4096) layer on an H200 (jax 0.11.2, 16 layers
    in one jit): at T = 1 / 16 / 32 / 33 / 256 / 2048 rows, 35 / 52 / 72 / 136 / 142 / 439 us against 43 / 55 / 47 / 55
    / 64 / 355 us with bf16 weights (dequantise-then-dot at T <= 32: 129-132 us)."""
    t, k = x.shape
    if t > GROUPED_DOT_MAX_ROWS:
        return jax.lax.dot_general(x, dequantize_int4(w, qscale, x.dtype), (((1,), (1,)), ((), ())))  # (T, N)
    groups = qscale.shape[-1]
    xg = x.reshape(t, groups, k // groups)  # (T, G, g)
    wg = w.astype(x.dtype).reshape(w.shape[0], groups, k // groups)  # (N, G, g)
    dims = (((2,), (2,)), ((1,), (1,)))  # contract g, batch over G
    part = jax.lax.dot_general(xg, wg, dims, preferred_element_type=jnp.float32)  # (G, T, N)
    return jnp.einsum("gtn,ng->tn", part, qscale.astype(jnp.float32)).astype(x.dtype)  # (T, N)


def _quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x (T, K) as two int8 terms per row, x ~ xq[:T] * xs[:T] + xq[T:] * xs[T:]: the second term quantizes what the
    first leaves (one int8 term per row costs SmolLM2 3x the logit error of the int8 weights alone). Returns xq
    (2T, K) int8 and xs (2T, 1) float32. A single row's second term also keeps the dot at two rows, which XLA's CPU
    runs in its int8 kernel (one row it rewrites into a matvec that widens the whole weight to int32)."""
    x32 = x.astype(jnp.float32)
    terms, scales = [], []
    for _ in range(2):
        xs = jnp.maximum(jnp.max(jnp.abs(x32), axis=1, keepdims=True), 1e-30) / 127.0  # (T, 1)
        xq = jnp.round(x32 / xs)  # (T, K), integers in [-127, 127]
        terms.append(xq.astype(jnp.int8))
        scales.append(xs)
        x32 = x32 - xq * xs  # what this term leaves, |.| <= xs / 2
    return jnp.concatenate(terms), jnp.concatenate(scales)


def _int8_dot(xq: jax.Array, xs: jax.Array, w: jax.Array, qscale: jax.Array, dtype) -> jax.Array:
    """Two-term quantized rows (xq, xs) against the int8 weight w (N, K) with per-row scales qscale (N,): (T, N)."""
    rows = xq.shape[0] // 2
    acc = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)  # (2T, N)
    acc = acc.astype(jnp.float32) * xs  # (2T, N)
    return ((acc[:rows] + acc[rows:]) * qscale.astype(jnp.float32)).astype(dtype)  # (T, N)


def embed(weights: Weights, token_ids: jax.Array) -> jax.Array:
    """The embedding rows (T, E) of token_ids (T,), widened from int8 or int4 when the weights are narrow (only the
    gathered rows)."""
    x = weights.embed[token_ids]  # (T, E)
    if weights.embed_qscale is None:
        return x
    dtype = weights.final_norm.dtype
    scale = weights.embed_qscale[token_ids]  # (T,) with int8, (T, E // g) with int4
    if x.dtype == jnp.int4:
        return dequantize_int4(x, scale, dtype)
    return x.astype(dtype) * scale[:, None].astype(dtype)


def _act(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return jax.nn.silu(x) if cfg.hidden_act == "silu" else jax.nn.gelu(x, approximate=True)


def forward(
    cfg: ModelConfig,
    weights: Weights,
    kv: KVCache,
    batch: Batch,
    attention: Callable = reference_attention,
) -> tuple[jax.Array, KVCache]:
    """Run the ragged batch through every layer. Returns the final-normed hidden states (T, E) and the new cache."""
    x = embed(weights, batch.token_ids)  # (T, E)
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    num_tokens = x.shape[0]
    new_k, new_v = [], []
    for i, lw in enumerate(weights.layers):
        h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)  # (T, E)
        # q (T, H*D), k and v (T, KVH*D)
        q, k, v = linears(h, (lw.wq, lw.wq_qscale), (lw.wk, lw.wk_qscale), (lw.wv, lw.wv_qscale))
        if lw.bq is not None:
            q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)  # (T, H, D)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # (T, KVH, D)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if lw.q_norm is not None:
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        inv_freq = cfg.layer_rope(i).inv_freq(cfg.head_dim)
        q = rope(q, batch.positions, inv_freq)
        k = rope(k, batch.positions, inv_freq)
        o, k_pages, v_pages = attention(
            q, k, v, kv.k[i], kv.v[i], batch,
            scale=cfg.scale, sliding_window=cfg.window(i), soft_cap=cfg.attn_logit_softcap,
        )  # fmt: skip
        new_k.append(k_pages)
        new_v.append(v_pages)
        (o,) = linears(o.reshape(num_tokens, cfg.num_heads * cfg.head_dim), (lw.wo, lw.wo_qscale))  # (T, E)
        if lw.bo is not None:
            o = o + lw.bo
        if lw.post_attn_norm is not None:
            o = rms_norm(o, lw.post_attn_norm, cfg.rms_norm_eps)
        x = x + o
        h = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
        gate, up = linears(h, (lw.w_gate, lw.w_gate_qscale), (lw.w_up, lw.w_up_qscale))  # (T, F) each
        (h,) = linears(_act(cfg, gate) * up, (lw.w_down, lw.w_down_qscale))  # (T, E)
        if lw.post_mlp_norm is not None:
            h = rms_norm(h, lw.post_mlp_norm, cfg.rms_norm_eps)
        x = x + h
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), KVCache(k=new_k, v=new_v)


def logits(cfg: ModelConfig, weights: Weights, hidden: jax.Array) -> jax.Array:
    """Float32 logits (N, V) of hidden states (N, E)."""
    if weights.lm_head is not None:
        (out,) = linears(hidden, (weights.lm_head, weights.lm_head_qscale))  # (N, V)
    elif weights.embed_qscale is not None:  # a narrow embedding (V, E) is the tied head's (out, in) weight
        (out,) = linears(hidden, (weights.embed, weights.embed_qscale))  # (N, V)
    else:
        out = hidden @ weights.embed.T  # (N, V)
    out = out.astype(jnp.float32)
    if cfg.final_logit_softcap:
        out = cfg.final_logit_softcap * jnp.tanh(out / cfg.final_logit_softcap)
    return out

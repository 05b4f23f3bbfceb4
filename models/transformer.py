"""The decoder-only transformer of every supported family (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3, and the
mixtures of experts Qwen3-MoE and Mixtral) as pure JAX functions over a weights pytree. Families differ only by
ModelConfig flags; a mixture-of-experts layer has a router and stacked experts instead of w_gate/w_up/w_down, and its
MLP is kiln.models.moe.

Weights are stored in the layout the graph uses: linear layers as (in, out), norm weights already holding Gemma's
(1 + w), so the graph has no per-family branches beyond optional tensors. In a narrow weight format (int8, int4, fp8)
the linear layers, the embedding and the LM head are kiln.models.quant.QuantArrays instead, and every matmul goes
through quant.linears: the formats, their dots and their conversion from float live there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.batch import Batch, KVCache
from kiln.models.config import ModelConfig
from kiln.models.kernels.reference import paged_attention as reference_attention
from kiln.models.moe import add_norm_mlp, gpu_qk_norm_rope, gpu_rows, moe_mlp, qk_norm_rope
from kiln.models.quant import (
    QUANTIZED,
    QuantArray,
    embed_rows,
    is_weight_format,
    linears,
    tensor_format,
    weights_format,
)
from kiln.models.quant import abstract as quant_abstract

Linear = jax.Array | QuantArray  # a linear layer's weight: float (in, out), or narrow (out, in) (kiln.models.quant)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    attn_norm: jax.Array  # (E,)
    wo: Linear  # (H*D, E)
    mlp_norm: jax.Array  # (E,)
    wq: Linear | None = None  # (E, H*D); None in the fused layout (wqkv)
    wk: Linear | None = None  # (E, KVH*D)
    wv: Linear | None = None  # (E, KVH*D)
    wqkv: Linear | None = None  # (E, (H + 2*KVH)*D): the fused layout's q|k|v, grouped by KV head (fuse_linears)
    bqkv: jax.Array | None = None  # ((H + 2*KVH)*D,)
    w_gate_up: Linear | None = None  # (E, 2F): the fused layout's gate|up, in gate_up_groups(cfg) groups (fuse_linears)
    w_gate: Linear | None = None  # (E, F); None in a mixture-of-experts layer and in the fused layout
    w_up: Linear | None = None  # (E, F)
    w_down: Linear | None = None  # (F, E)
    bq: jax.Array | None = None  # (H*D,)
    bk: jax.Array | None = None  # (KVH*D,)
    bv: jax.Array | None = None  # (KVH*D,)
    bo: jax.Array | None = None  # (E,)
    q_norm: jax.Array | None = None  # (D,)
    k_norm: jax.Array | None = None  # (D,)
    post_attn_norm: jax.Array | None = None  # (E,)
    post_mlp_norm: jax.Array | None = None  # (E,)
    router: jax.Array | None = None  # (E, X): a mixture-of-experts layer (kiln.models.moe), always float
    experts_gate: jax.Array | None = None  # (X, E, Fx)
    experts_up: jax.Array | None = None  # (X, E, Fx)
    experts_down: jax.Array | None = None  # (X, Fx, E)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: Linear  # (V, E)
    final_norm: jax.Array  # (E,)
    layers: list[LayerWeights]
    lm_head: Linear | None = None  # (E, V); None when tied to embed

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
        x, fx = cfg.num_experts, cfg.moe_intermediate_size
        return {
            "embed": (v, e), "final_norm": (e,), "lm_head": (e, v),
            "attn_norm": (e,), "wq": (e, h * d), "wk": (e, kv * d), "wv": (e, kv * d), "wo": (h * d, e),
            "wqkv": (e, (h + 2 * kv) * d), "bqkv": ((h + 2 * kv) * d,), "w_gate_up": (e, 2 * f),
            "mlp_norm": (e,), "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e),
            "bq": (h * d,), "bk": (kv * d,), "bv": (kv * d,), "bo": (e,), "q_norm": (d,), "k_norm": (d,),
            "post_attn_norm": (e,), "post_mlp_norm": (e,),
            "router": (e, x), "experts_gate": (x, e, fx), "experts_up": (x, e, fx), "experts_down": (x, fx, e),
        }  # fmt: skip

    @staticmethod
    def layer_fields(cfg: ModelConfig, weight_format: str = "float", layer: int = 0, fused: bool = False) -> list[str]:
        """The LayerWeights fields this config uses in this weight format in this layer; fused: the fused layout
        (fuse_linears), where the format allows it (fusable)."""
        fused = fused and fusable(weight_format)
        names = ["attn_norm", *(["wqkv"] if fused else ["wq", "wk", "wv"]), "wo", "mlp_norm"]
        if cfg.is_moe(layer):
            names += ["router", "experts_gate", "experts_up", "experts_down"]
        else:
            names += ["w_gate_up", "w_down"] if fused else ["w_gate", "w_up", "w_down"]
        if cfg.qkv_bias:
            names += ["bqkv"] if fused else ["bq", "bk", "bv"]
        if cfg.o_bias:
            names += ["bo"]
        if cfg.qk_norm:
            names += ["q_norm", "k_norm"]
        if cfg.sandwich_norms:
            names += ["post_attn_norm", "post_mlp_norm"]
        return names

    @staticmethod
    def abstract(cfg: ModelConfig, dtype=jnp.float32, weight_format: str = "float", fused: bool = False) -> Weights:
        """A Weights of jax.ShapeDtypeStruct leaves, for ahead-of-time lowering. dtype: the compute dtype (norms,
        biases, scales, and with weight format "float" every tensor); weight_format: see the module docstring; fused:
        the fused layout of fuse_linears (where the format allows it)."""
        if not is_weight_format(weight_format):
            raise ValueError(f"unknown weight format {weight_format!r}")
        shapes = Weights.shapes(cfg)
        narrow = set(QUANTIZED) | set(FUSED) | {"embed", "lm_head"} if weight_format not in ("float", "gguf") else set()

        def spec(name, flat_name=None):
            if name not in narrow:
                return jax.ShapeDtypeStruct(shapes[name], dtype)
            stored = shapes[name] if name == "embed" else shapes[name][::-1]  # (out, in)
            return quant_abstract(stored, tensor_format(weight_format, flat_name or name), dtype)

        layers = [
            LayerWeights(**{n: spec(n, f"layers.{i}.{n}") for n in Weights.layer_fields(cfg, weight_format, i, fused)})
            for i in range(cfg.num_layers)
        ]
        top = ["embed", "final_norm"] + ([] if cfg.tie_word_embeddings else ["lm_head"])
        return Weights(layers=layers, **{n: spec(n) for n in top})

    @property
    def weight_format(self) -> str:
        return weights_format(self)


# ---- the fused layout ------------------------------------------------------------------------------------------
#
# q|k|v as one weight wqkv and gate|up as one w_gate_up, so that a step reads each as one GEMM instead of XLA's
# DotMerger concatenating the separate weights inside the GEMM every step (BENCHMARKS.md, issue 16). The columns
# (a narrow format's rows: every format here is per output channel) are grouped so that a tensor-parallel split in
# contiguous pieces gives every device whole heads and matching gate/up columns, for any tp that divides the KV heads:
# wqkv holds, for each KV head g, the G = H / KVH query heads that attend to it, then k head g, then v head g; w_gate_up
# holds gate_up_groups(cfg) groups of [gate columns | up columns] (F / groups each). A GGUF block format keeps the
# separate weights (its tensors may differ in kind).

FUSED = ("wqkv", "w_gate_up")  # the fused layout's linear layers


def fusable(weight_format: str) -> bool:
    """Whether a weight format has a fused layout: float and the whole-model narrow formats, not GGUF blocks."""
    return weight_format in ("float", "int8", "int4", "fp8")


def gate_up_groups(cfg: ModelConfig) -> int:
    """Groups of w_gate_up: the KV heads (every tp divides them) where they divide the MLP width, else 1."""
    return cfg.num_kv_heads if cfg.intermediate_size % cfg.num_kv_heads == 0 else 1


def _interleave(parts: list, groups: int, axis: int):
    """Concatenate arrays along `axis`, each split into `groups` equal pieces there and the pieces taken group by group:
    [a0 | b0 | c0 | a1 | b1 | c1 | ...]. numpy or jax arrays."""
    xp = jnp if any(isinstance(p, jax.Array) for p in parts) else np
    axis = axis % parts[0].ndim
    split = [p.reshape(*p.shape[:axis], groups, p.shape[axis] // groups, *p.shape[axis + 1 :]) for p in parts]
    out = xp.concatenate(split, axis=axis + 1)  # (..., groups, sum of pieces, ...)
    return out.reshape(*out.shape[:axis], -1, *out.shape[axis + 2 :])


def _fuse(ws: list, groups: int):
    """One linear weight of the separate ones ws, grouped (_interleave) along the output features: a float (in, out)
    along its columns, a QuantArray along the rows of q (out, in) and of its scale (out,) or (out, in // g)."""
    if not isinstance(ws[0], QuantArray):
        return _interleave(ws, groups, axis=1)
    return QuantArray(_interleave([w.q for w in ws], groups, 0), _interleave([w.scale for w in ws], groups, 0))


def fuse_linears(cfg: ModelConfig, weights: Weights) -> Weights:
    """The same weights in the fused layout (wqkv, bqkv, w_gate_up; see above), where their format allows it
    (fusable); numpy or jax leaves. forward gives the same results with either layout."""
    if not fusable(weights.weight_format) or weights.layers[0].wqkv is not None:
        return weights
    kv, gu = cfg.num_kv_heads, gate_up_groups(cfg)
    layers = []
    for lw in weights.layers:
        fields = dict(wq=None, wk=None, wv=None, wqkv=_fuse([lw.wq, lw.wk, lw.wv], kv))
        if lw.bq is not None:
            fields.update(bq=None, bk=None, bv=None, bqkv=_interleave([lw.bq, lw.bk, lw.bv], kv, axis=0))
        if lw.w_gate is not None:
            fields.update(w_gate=None, w_up=None, w_gate_up=_fuse([lw.w_gate, lw.w_up], gu))
        layers.append(dataclasses.replace(lw, **fields))
    return dataclasses.replace(weights, layers=layers)


def _split_qkv(cfg: ModelConfig, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q (T, H, D), k and v (T, KVH, D) of the fused projection qkv (T, (H + 2*KVH)*D)."""
    g = cfg.num_heads // cfg.num_kv_heads
    qkv = qkv.reshape(qkv.shape[0], cfg.num_kv_heads, g + 2, cfg.head_dim)  # (T, KVH, G + 2, D)
    q = qkv[:, :, :g].reshape(qkv.shape[0], cfg.num_heads, cfg.head_dim)  # (T, H, D), head h = kv head h // G
    return q, qkv[:, :, g], qkv[:, :, g + 1]


def _split_gate_up(cfg: ModelConfig, gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    """gate and up (T, F) of the fused projection gate_up (T, 2F)."""
    t, groups = gate_up.shape[0], gate_up_groups(cfg)
    gate_up = gate_up.reshape(t, groups, 2, -1)  # (T, groups, 2, F / groups)
    return gate_up[:, :, 0].reshape(t, -1), gate_up[:, :, 1].reshape(t, -1)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * w


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin (T, 1, D/2) in dtype of the rotary angles of positions (T,): position-only work, computed once per
    step for every layer that shares inv_freq rather than once per layer."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # (T, D/2)
    return jnp.cos(angles).astype(dtype)[:, None, :], jnp.sin(angles).astype(dtype)[:, None, :]


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, HF's rotate-half convention. x: (T, N, D), cos and sin: (T, 1, D/2) (rope_tables)."""
    x1, x2 = jnp.split(x, 2, axis=-1)  # (T, N, D/2) each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_slots(x: jax.Array, cos: jax.Array, sin: jax.Array, n: int) -> jax.Array:
    """rope of the first n of the S rows of each KV head of x (T, KVH, S, D) (a fused qkv: its q and k), the others
    as they are; cos and sin: (T, 1, D/2) (rope_tables)."""
    t, kvh, slots, d = x.shape
    rotated = rope(x.reshape(t, kvh * slots, d), cos, sin).reshape(x.shape)
    return jnp.where((jnp.arange(slots) < n)[None, None, :, None], rotated, x)


def embed(weights: Weights, token_ids: jax.Array) -> jax.Array:
    """The embedding rows (T, E) of token_ids (T,), widened from a narrow format (only the gathered rows).

    On TPU a tied bf16 table is read by columns (pallas_tpu.embed_columns): the LM head gives it the transposed
    layout, which XLA's gather copied back whole every step. Only while the column blocks read (T * 128 columns) are
    at most twice the table, what XLA's copy and gather count."""
    table = weights.embed
    if _tied_tpu_table(weights) and token_ids.shape[0] * 128 <= 2 * table.shape[0]:
        from kiln.models.kernels.pallas_tpu import embed_columns

        return jax.lax.platform_dependent(
            table, token_ids, tpu=lambda t, ids: embed_columns(t.T, ids), default=lambda t, ids: t[ids]
        )
    return embed_rows(table, token_ids, weights.final_norm.dtype)


def _tied_tpu_table(weights: Weights) -> bool:
    """Whether pallas_tpu.embed_columns applies: a bf16 table tied to the LM head, V a multiple of 128, one device's
    whole table (tp = 1)."""
    table = weights.embed
    mesh = jax.sharding.get_abstract_mesh()
    whole = mesh.empty or dict(mesh.shape).get("tp", 1) == 1
    tied = weights.lm_head is None and not isinstance(table, QuantArray) and table.dtype == jnp.bfloat16
    return tied and whole and table.shape[0] % 128 == 0


def _act(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return jax.nn.silu(x) if cfg.hidden_act == "silu" else jax.nn.gelu(x, approximate=True)


def forward(
    cfg: ModelConfig,
    weights: Weights,
    kv: KVCache,
    batch: Batch,
    attention: Callable = reference_attention,
    attention_qkv: Callable | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run the ragged batch through every layer. Returns the final-normed hidden states (T, E) and the new cache.
    attention_qkv: the attention's entry point for a fused qkv (kiln.models.kernels.get_attention_qkv), which the
    fused layout's layers without q/k norms use: q, k and v stay one array, RoPE'd in one pass."""
    x = embed(weights, batch.token_ids)  # (T, E)
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    num_tokens = x.shape[0]
    new_k, new_v = [], []
    tables = {}  # inv_freq bytes -> (cos, sin): one set per distinct RoPE of the model (Gemma 3 has two)
    # A mixture of experts' float32 expert rows summed by the residual add + RMSNorm kernel, where the attention offers
    # one (pallas_gpu.add_rms_norm; moe.add_norm_mlp's rows): `pending` holds them until the next norm (the next
    # layer's, or the final one) adds them to x.
    add_norm, pending = getattr(attention_qkv, "add_norm", None), None
    for i, lw in enumerate(weights.layers):
        if pending is None:
            h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)  # (T, E)
        else:
            x, h = add_norm(x, pending, lw.attn_norm, cfg.rms_norm_eps)
            pending = None
        qkv = None  # (T, KVH, G + 2, D) when the attention reads q, k and v out of one array
        # Qwen3's q/k norms and RoPE as one GPU kernel writing the fused qkv the attention reads (moe.qk_norm_rope)
        qk_kernel = lw.q_norm is not None and lw.wqkv is not None and getattr(attention_qkv, "takes_rope", False)
        qk_kernel = qk_kernel and gpu_qk_norm_rope(num_tokens, cfg.head_dim)
        if lw.wqkv is not None:  # the fused layout
            (qkv,) = linears(h, lw.wqkv)  # (T, (H + 2*KVH)*D)
            qkv = qkv if lw.bqkv is None else qkv + lw.bqkv
            if attention_qkv is None or (lw.q_norm is not None and not qk_kernel):
                q, k, v = _split_qkv(cfg, qkv)  # (T, H, D), (T, KVH, D) x 2
                qkv = None
            else:
                qkv = qkv.reshape(num_tokens, cfg.num_kv_heads, -1, cfg.head_dim)  # (T, KVH, G + 2, D)
        else:
            # q (T, H*D), k and v (T, KVH*D)
            q, k, v = linears(h, lw.wq, lw.wk, lw.wv)
            if lw.bq is not None:
                q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)  # (T, H, D)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # (T, KVH, D)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if lw.q_norm is not None and not qk_kernel:
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        inv_freq = cfg.layer_rope(i).inv_freq(cfg.head_dim)
        key = np.asarray(inv_freq).tobytes()
        if key not in tables:
            tables[key] = rope_tables(batch.positions, inv_freq, x.dtype)
        opts = dict(scale=cfg.scale, sliding_window=cfg.window(i), soft_cap=cfg.attn_logit_softcap)
        if qk_kernel:
            qkv = qk_norm_rope(qkv.reshape(num_tokens, -1), lw.q_norm, lw.k_norm, *tables[key], cfg.rms_norm_eps,
                               kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)  # fmt: skip
            o, k_pages, v_pages = attention_qkv(qkv, kv.k[i], kv.v[i], batch, **opts)
        elif qkv is not None and getattr(attention_qkv, "takes_rope", False):  # RoPE'd by the attention (a kernel)
            o, k_pages, v_pages = attention_qkv(qkv, kv.k[i], kv.v[i], batch, rope=tables[key], **opts)
        elif qkv is not None:
            qkv = _rope_slots(qkv, *tables[key], qkv.shape[2] - 1)  # q and k rotated, v as it is
            o, k_pages, v_pages = attention_qkv(qkv, kv.k[i], kv.v[i], batch, **opts)
        else:
            q = rope(q, *tables[key])  # (T, H, D)
            k = rope(k, *tables[key])  # (T, KVH, D)
            o, k_pages, v_pages = attention(q, k, v, kv.k[i], kv.v[i], batch, **opts)
        new_k.append(k_pages)
        new_v.append(v_pages)
        o = o.reshape(num_tokens, cfg.num_heads * cfg.head_dim)
        # a mixture of experts adds the o-proj and norms itself (one token on GPUs: in its kernels, moe.add_norm_mlp)
        moe_add_norm = lw.router is not None and lw.bo is None and lw.post_attn_norm is None
        if not moe_add_norm:
            (o,) = linears(o, lw.wo)  # (T, E)
            if lw.bo is not None:
                o = o + lw.bo
            if lw.post_attn_norm is not None:
                o = rms_norm(o, lw.post_attn_norm, cfg.rms_norm_eps)
            x = x + o
            h = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
        if lw.router is not None:  # mixture of experts
            experts = (lw.router, lw.experts_gate, lw.experts_up, lw.experts_down)
            routing = (cfg.num_experts_per_tok, cfg.norm_topk_prob, partial(_act, cfg))
            moe_kw = dict(live=batch.slot_mapping >= 0, dispatch=cfg.moe_dispatch)
            if moe_add_norm:
                rows = add_norm is not None and lw.post_mlp_norm is None
                rows = rows and gpu_rows(num_tokens, x.shape[1], cfg.num_experts_per_tok)
                x, h = add_norm_mlp(x, o, lw.wo, lw.mlp_norm, cfg.rms_norm_eps, *experts, *routing, **moe_kw, rows=rows)
                if rows:  # the experts' float32 rows (k, T, E), added to x by the next norm (add_norm)
                    pending = h
                    continue
            else:
                h = moe_mlp(h, *experts, *routing, **moe_kw)
        else:
            if lw.w_gate_up is not None:  # the fused layout
                gate, up = _split_gate_up(cfg, *linears(h, lw.w_gate_up))  # (T, F) each
            else:
                gate, up = linears(h, lw.w_gate, lw.w_up)  # (T, F) each
            (h,) = linears(_act(cfg, gate) * up, lw.w_down)  # (T, E)
        if lw.post_mlp_norm is not None:
            h = rms_norm(h, lw.post_mlp_norm, cfg.rms_norm_eps)
        x = x + h
    if pending is not None:
        return add_norm(x, pending, weights.final_norm, cfg.rms_norm_eps)[1], KVCache(k=new_k, v=new_v)
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), KVCache(k=new_k, v=new_v)


def logits(cfg: ModelConfig, weights: Weights, hidden: jax.Array) -> jax.Array:
    """Float32 logits (N, V) of hidden states (N, E)."""
    if weights.lm_head is not None:
        (out,) = linears(hidden, weights.lm_head)  # (N, V)
    elif isinstance(weights.embed, QuantArray):  # a narrow embedding (V, E) is the tied head's (out, in) weight
        (out,) = linears(hidden, weights.embed)  # (N, V)
    else:
        out = hidden @ weights.embed.T  # (N, V)
    out = out.astype(jnp.float32)
    if cfg.final_logit_softcap:
        out = cfg.final_logit_softcap * jnp.tanh(out / cfg.final_logit_softcap)
    return out

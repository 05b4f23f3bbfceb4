"""The decoder-only transformer of every supported family (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3) as pure JAX
functions over a weights pytree. Families differ only by ModelConfig flags.

Weights are stored in the layout the graph uses: linear layers as (in, out), norm weights already holding Gemma's
(1 + w), so the graph has no per-family branches beyond optional tensors.
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # (V, E)
    final_norm: jax.Array  # (E,)
    layers: list[LayerWeights]
    lm_head: jax.Array | None = None  # (E, V); None when tied to embed

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
        }  # fmt: skip

    @staticmethod
    def layer_fields(cfg: ModelConfig) -> list[str]:
        """The LayerWeights fields this config uses."""
        names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
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
    def abstract(cfg: ModelConfig, dtype=jnp.float32) -> Weights:
        """A Weights of jax.ShapeDtypeStruct leaves, for ahead-of-time lowering."""
        shapes = Weights.shapes(cfg)

        def spec(name):
            return jax.ShapeDtypeStruct(shapes[name], dtype)

        layers = [LayerWeights(**{n: spec(n) for n in Weights.layer_fields(cfg)}) for _ in range(cfg.num_layers)]
        lm_head = None if cfg.tie_word_embeddings else spec("lm_head")
        return Weights(embed=spec("embed"), final_norm=spec("final_norm"), layers=layers, lm_head=lm_head)


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
    x = weights.embed[batch.token_ids]  # (T, E)
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    num_tokens = x.shape[0]
    new_k, new_v = [], []
    for i, lw in enumerate(weights.layers):
        h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)  # (T, E)
        q = h @ lw.wq  # (T, H*D)
        k = h @ lw.wk  # (T, KVH*D)
        v = h @ lw.wv
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
        o = o.reshape(num_tokens, cfg.num_heads * cfg.head_dim) @ lw.wo  # (T, E)
        if lw.bo is not None:
            o = o + lw.bo
        if lw.post_attn_norm is not None:
            o = rms_norm(o, lw.post_attn_norm, cfg.rms_norm_eps)
        x = x + o
        h = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
        h = (_act(cfg, h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down  # (T, E)
        if lw.post_mlp_norm is not None:
            h = rms_norm(h, lw.post_mlp_norm, cfg.rms_norm_eps)
        x = x + h
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), KVCache(k=new_k, v=new_v)


def logits(cfg: ModelConfig, weights: Weights, hidden: jax.Array) -> jax.Array:
    """Float32 logits (N, V) of hidden states (N, E)."""
    head = weights.embed.T if weights.lm_head is None else weights.lm_head  # (E, V)
    out = (hidden @ head).astype(jnp.float32)  # (N, V)
    if cfg.final_logit_softcap:
        out = cfg.final_logit_softcap * jnp.tanh(out / cfg.final_logit_softcap)
    return out

"""Reference ragged paged attention in plain jax.numpy: runs anywhere, and is the oracle the Pallas kernels are
tested against.

Every implementation (kiln.models.kernels.IMPLEMENTATIONS: reference, xla_cpu, pallas_tpu, pallas_gpu) has the
signature of `paged_attention` below: it writes the new tokens' K/V into their pages, then computes causal (optionally
sliding-window, soft-capped) grouped-query attention of each query token over its own sequence's pages, and returns
(out, k_pages, v_pages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.models.batch import Batch

NEG_INF = -1e30


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V (T, KVH, D) into pages (KVH, P, page_size, D) at slot_mapping (T,); slot -1 is dropped."""
    _, num_pages, page_size, _ = k_pages.shape
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # (T,) out of range -> dropped
    off = slot_mapping % page_size  # (T,)
    k_pages = k_pages.at[:, page, off].set(k.transpose(1, 0, 2).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[:, page, off].set(v.transpose(1, 0, 2).astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


def token_metadata(batch: Batch, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each query token: its sequence index (T,), its position (T,), and its KV length (T,; 0 for padding)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)  # (T,)
    num_seqs = batch.seq_lens.shape[0]
    seq = jnp.searchsorted(batch.query_start[1:], t, side="right").astype(jnp.int32)  # (T,)
    valid = t < batch.query_start[batch.num_seqs[0]]
    seq = jnp.minimum(seq, num_seqs - 1)
    q_len = batch.query_start[seq + 1] - batch.query_start[seq]  # (T,)
    kv_len = jnp.where(valid, batch.seq_lens[seq], 0)  # (T,)
    q_pos = kv_len - q_len + (t - batch.query_start[seq])  # (T,)
    return seq, q_pos, kv_len


def piece_tokens(batch: Batch, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """For each query token: its sequence index (T,), and whether it belongs to a prefill piece (T,): a live
    sequence with more than one new token in this step."""
    seq, _, kv_len = token_metadata(batch, num_tokens)
    q_len = batch.query_start[seq + 1] - batch.query_start[seq]
    return seq, (kv_len > 0) & (q_len > 1)


def piece_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, batch: Batch, *, scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal attention of each prefill piece's tokens over the piece's own new keys alone (not the cached ones):
    q (T, H, D), k and v (T, KVH, D). Returns out (T, H, D) float32, the softmax's natural log-sum-exp (T, H) and
    which tokens are pieces' (T,); the other tokens' values are unspecified. The in-step half of a step's attention,
    merged with the cached half by the log-sum-exp (pallas_gpu.paged_attention's pieces); the oracle of
    cudnn_gpu.piece_attention."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    seq, covered = piece_tokens(batch, num_tokens)
    t = jnp.arange(num_tokens)
    mask = (seq[:, None] == seq[None, :]) & (t[None, :] <= t[:, None]) & covered[:, None] & covered[None, :]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
    s = jnp.einsum("tkgd,ukd->tkgu", qg, k.astype(jnp.float32), precision="highest")  # (T, KVH, G, T)
    s = jnp.where(mask[:, None, None, :], s, NEG_INF)
    lse = jax.nn.logsumexp(s, axis=-1)  # (T, KVH, G)
    p = jnp.exp(s - lse[..., None]) * mask[:, None, None, :]
    out = jnp.einsum("tkgu,ukd->tkgd", p, v.astype(jnp.float32), precision="highest")
    return out.reshape(num_tokens, num_heads, head_dim), lse.reshape(num_tokens, num_heads), covered


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    batch: Batch,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_block: int = 256,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Ragged paged attention.

    q: (T, H, D) queries; k, v: (T, KVH, D) the new tokens' keys and values; k_pages, v_pages:
    (KVH, P, page_size, D). Query token t of sequence s sits at position seq_lens[s] - q_len[s] + i and attends
    to the keys at positions p <= its own (and p > pos - sliding_window when a window is given).
    Returns out (T, H, D) in q's dtype (zeros for padding tokens) and the updated pages.
    """
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    seq, q_pos, kv_len = token_metadata(batch, num_tokens)
    tables = batch.block_tables[seq]  # (T, max_pages)
    max_pages = tables.shape[1]
    pages_per_block = max(1, min(max_pages, kv_block // page_size))
    block_len = pages_per_block * page_size
    num_blocks = (jnp.max(kv_len) + block_len - 1) // block_len  # dynamic trip count

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale  # (T, KVH, G, D)

    def body(b, carry):
        m, l, acc = carry  # (T, KVH, G), (T, KVH, G), (T, KVH, G, D)
        idx = b * pages_per_block + jnp.arange(pages_per_block)  # (C,)
        pages = jnp.take(tables, jnp.minimum(idx, max_pages - 1), axis=1)  # (T, C)
        kb = k_pages[:, pages].astype(jnp.float32)  # (KVH, T, C, ps, D)
        vb = v_pages[:, pages].astype(jnp.float32)  # (KVH, T, C, ps, D)
        kb = kb.reshape(num_kv_heads, num_tokens, block_len, head_dim)  # (KVH, T, L, D)
        vb = vb.reshape(num_kv_heads, num_tokens, block_len, head_dim)
        s = jnp.einsum("tkgd,ktld->tkgl", qg, kb)  # (T, KVH, G, L)
        if soft_cap:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = b * block_len + jnp.arange(block_len)  # (L,)
        mask = (k_pos[None, :] < kv_len[:, None]) & (k_pos[None, :] <= q_pos[:, None])  # (T, L)
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))  # (T, KVH, G)
        p = jnp.exp(s - m_new[..., None]) * mask[:, None, None, :]  # (T, KVH, G, L)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgl,ktld->tkgd", p, vb)
        return m_new, l, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), NEG_INF, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (T, KVH, G, D)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype), k_pages, v_pages


def paged_attention_qkv(
    qkv: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: Batch, **kwargs
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """paged_attention of a fused qkv (T, KVH, G + 2, D): each KV head's G query heads, then its key, then its value
    (kiln.models.transformer.fuse_linears's layout). The oracle of the kernels' fused-qkv entry points."""
    num_tokens, num_kv_heads, slots, head_dim = qkv.shape
    g = slots - 2
    q = qkv[:, :, :g].reshape(num_tokens, num_kv_heads * g, head_dim)  # (T, H, D)
    return paged_attention(q, qkv[:, :, g], qkv[:, :, g + 1], k_pages, v_pages, batch, **kwargs)

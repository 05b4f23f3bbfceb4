"""Ragged paged attention in plain jax.numpy, arranged for XLA's CPU backend (the `cpu` target's implementation).

Same contract as reference.paged_attention. The reference gathers, for every query token, whole blocks of its
sequence's pages, the step's own tokens included, so a 256-token prefill copies 256 blocks of K and V per layer; on
the CPU that gather and the many small batched dots over it took ~40% of a prefill step (measured on SmolLM2). Here
attention is split in two parts merged by their softmax statistics:

* the step's new tokens attend each other straight from k and v (rounded to the pages' dtype, as the pages store
  them): one (T, T) score matrix per head, masked to the same sequence, causally and by the window, computed by
  plain dense matmuls;
* only keys cached before this step are read from the pages, block by block as in the reference, and the loop runs
  for no block at all when the step is fresh prompts.

Where kiln's C++ kernel is built and the pages are float32, every step instead calls it
(kiln.models.kernels.cpu_quant.paged_attention, the XLA FFI custom call "kiln_paged_attention"): each token reads
exactly its own keys, [0, its position], from the pages after the step's K/V are written, no block gathered and
copied. On SmolLM2 gguf (BENCHMARKS.md, issue 20, 2026-12-01 session 9) the XLA ops' gathers and transposes were ~40%
of a 16-sequence decode step and ~45% of a 64-token prompt chunk over 64 cached tokens. The XLA ops remain the path
for narrow pages, for a kiln built without a C++ compiler, and with KILN_CPU_ATTENTION=xla.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from kiln.models.batch import Batch
from kiln.models.kernels import cpu_quant
from kiln.models.kernels.reference import NEG_INF, token_metadata, write_kv

KERNEL = os.environ.get("KILN_CPU_ATTENTION", "kernel") != "xla"  # "xla": the XLA ops below (A/B runs)


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
    """q (T, H, D); k, v (T, KVH, D); k_pages, v_pages (KVH, P, page_size, D). Returns out (T, H, D) in q's dtype
    (zeros for padding tokens) and the pages with the new K/V written."""
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
    seq, q_pos, kv_len = token_metadata(batch, q.shape[0])  # (T,) each; kv_len 0 for padding tokens
    live = kv_len > 0
    if kernel_applies(k_pages):
        # kiln's C++ kernel: each token reads its keys [0, position] straight from the pages
        lens = jnp.where(live, q_pos + 1, 0)
        tables = batch.block_tables[seq]

        def kernel(q, k_pages, v_pages, tables, lens):
            out = cpu_quant.paged_attention(q.astype(jnp.float32), k_pages, v_pages, tables, lens, scale=scale,
                                            soft_cap=soft_cap, window=sliding_window)  # fmt: skip
            return out.astype(q.dtype)

        def xla(q, k_pages, v_pages, tables, lens):
            return _attend(q, k, v, k_pages, v_pages, batch, seq, q_pos, kv_len, scale, sliding_window, soft_cap,
                           kv_block)  # fmt: skip

        out = jax.lax.platform_dependent(q, k_pages, v_pages, tables, lens, cpu=kernel, default=xla)
        return out, k_pages, v_pages
    out = _attend(q, k, v, k_pages, v_pages, batch, seq, q_pos, kv_len, scale, sliding_window, soft_cap, kv_block)
    return out, k_pages, v_pages


def kernel_applies(k_pages: jax.Array) -> bool:
    """Whether the step takes the C++ kernel (kiln.models.kernels.cpu_quant.paged_attention): float32 pages, the
    kernel built, KILN_CPU_ATTENTION not "xla"."""
    return KERNEL and k_pages.dtype == jnp.float32 and cpu_quant.attention_available()


def _attend(q, k, v, k_pages, v_pages, batch, seq, q_pos, kv_len, scale, sliding_window, soft_cap, kv_block):
    """The attention in XLA ops, the step's K/V already in the pages: (T, H, D) in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_heads // num_kv_heads
    live = kv_len > 0
    cached = jnp.where(live, q_pos - (jnp.arange(num_tokens) - batch.query_start[seq]), 0)  # (T,) keys before step
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale  # (T, KVH, G, D)

    def scores(s, mask):
        if soft_cap:
            s = soft_cap * jnp.tanh(s / soft_cap)
        return jnp.where(mask, s, NEG_INF)

    # The step's own tokens: key u is visible to query t when both are live, of one sequence, u's position <= t's.
    kn = k.astype(k_pages.dtype).astype(jnp.float32)  # (T, KVH, D), as the pages hold them
    vn = v.astype(v_pages.dtype).astype(jnp.float32)
    mask = live[:, None] & live[None, :] & (seq[:, None] == seq[None, :]) & (q_pos[None, :] <= q_pos[:, None])
    if sliding_window is not None:
        mask &= q_pos[None, :] > q_pos[:, None] - sliding_window
    mask = mask[:, None, None, :]  # (T, 1, 1, U)
    s = scores(jnp.einsum("tkgd,ukd->tkgu", qg, kn), mask)  # (T, KVH, G, U)
    m = s.max(-1)  # (T, KVH, G)
    p = jnp.exp(s - m[..., None]) * mask
    l = p.sum(-1)
    acc = jnp.einsum("tkgu,ukd->tkgd", p, vn)  # (T, KVH, G, D)

    # Keys cached before this step, from the pages, a block at a time; merged with the new keys' statistics.
    cached_part = _cached_by_query_block if num_tokens > batch.seq_lens.shape[0] else _cached_by_token
    m2, l2, acc2 = cached_part(qg, q_pos, seq, cached, k_pages, v_pages, batch, scores, sliding_window, kv_block)
    m_all = jnp.maximum(m, m2)
    a1, a2 = jnp.exp(m - m_all), jnp.exp(m2 - m_all)
    l = l * a1 + l2 * a2
    acc = acc * a1[..., None] + acc2 * a2[..., None]
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (T, KVH, G, D)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _online_softmax_block(m, l, acc, s, mask, vb, spec: str):
    """One key block of the online softmax: scores s (..., L) under mask, values vb contracted by `spec`."""
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None]) * mask
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + jnp.einsum(spec, p, vb)


def _block_pages(tables: jax.Array, b, pages_per_block: int) -> jax.Array:
    """The pages of key block b for each row of tables (R, max_pages): (R, C)."""
    max_pages = tables.shape[1]
    idx = b * pages_per_block + jnp.arange(pages_per_block)  # (C,)
    return jnp.take(tables, jnp.minimum(idx, max_pages - 1), axis=1)


def _cached_by_token(qg, q_pos, seq, cached, k_pages, v_pages, batch, scores, window, kv_block):
    """Decode-sized steps (T <= S): every token gathers its own sequence's cached keys, block by block."""
    num_tokens, num_kv_heads, group, head_dim = qg.shape
    page_size = k_pages.shape[2]
    tables = batch.block_tables[seq]  # (T, max_pages)
    pages_per_block = max(1, min(tables.shape[1], kv_block // page_size))
    block_len = pages_per_block * page_size
    shape = (num_tokens, num_kv_heads, group)

    def body(b, carry):
        pages = _block_pages(tables, b, pages_per_block)  # (T, C)
        kb = k_pages[:, pages].astype(jnp.float32).reshape(num_kv_heads, num_tokens, block_len, head_dim)
        vb = v_pages[:, pages].astype(jnp.float32).reshape(num_kv_heads, num_tokens, block_len, head_dim)
        k_pos = b * block_len + jnp.arange(block_len)  # (L,)
        mask = k_pos[None, :] < cached[:, None]  # (T, L)
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        mask = mask[:, None, None, :]
        s = scores(jnp.einsum("tkgd,ktld->tkgl", qg, kb), mask)  # (T, KVH, G, L)
        return _online_softmax_block(*carry, s, mask, vb, "tkgl,ktld->tkgd")

    init = (jnp.full(shape, NEG_INF), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
    num_blocks = (jnp.max(cached) + block_len - 1) // block_len
    return jax.lax.fori_loop(0, num_blocks, body, init)


def _cached_by_query_block(qg, q_pos, seq, cached, k_pages, v_pages, batch, scores, window, kv_block, bq: int = 4):
    """Prefill-sized steps: the tokens go in blocks of bq consecutive tokens of one sequence (at most T / bq + S
    blocks), and each block gathers its sequence's cached keys once for all its tokens (a token-by-token gather
    copies them bq times)."""
    num_tokens, num_kv_heads, group, head_dim = qg.shape
    num_seqs = batch.seq_lens.shape[0]
    page_size = k_pages.shape[2]
    qs, ns = batch.query_start, batch.num_seqs[0]
    # Work item w is block j of sequence s, where the blocks of s start at item qs[s] // bq + s (increasing in s).
    w = jnp.arange(-(-num_tokens // bq) + num_seqs)  # (W,)
    later = jnp.arange(1, num_seqs + 1)  # (S,)
    starts = qs[later] // bq + later
    s_item = jnp.sum((later[None, :] <= ns) & (starts[None, :] <= w[:, None]), axis=1)  # (W,) in [0, ns]
    s_c = jnp.minimum(s_item, num_seqs - 1)
    t0 = qs[s_c] + (w - (qs[s_c] // bq + s_c)) * bq  # (W,) the block's first token
    rows = t0[:, None] + jnp.arange(bq)[None, :]  # (W, bq)
    row_ok = (s_item < ns)[:, None] & (rows < qs[s_c + 1][:, None])
    rows = jnp.where(row_ok, rows, 0)
    item_cached = jnp.where(s_item < ns, cached[rows[:, 0]], 0)  # (W,) every token of a sequence has the same
    qi = qg[rows]  # (W, bq, KVH, G, D)
    pos = q_pos[rows]  # (W, bq)
    tables = batch.block_tables[s_c]  # (W, max_pages)
    pages_per_block = max(1, min(tables.shape[1], kv_block // page_size))
    block_len = pages_per_block * page_size
    num_items = w.shape[0]
    shape = (num_items, bq, num_kv_heads, group)

    def body(b, carry):
        pages = _block_pages(tables, b, pages_per_block)  # (W, C)
        kb = k_pages[:, pages].astype(jnp.float32).reshape(num_kv_heads, num_items, block_len, head_dim)
        vb = v_pages[:, pages].astype(jnp.float32).reshape(num_kv_heads, num_items, block_len, head_dim)
        k_pos = b * block_len + jnp.arange(block_len)  # (L,)
        mask = (k_pos[None, None, :] < item_cached[:, None, None]) & row_ok[:, :, None]  # (W, bq, L)
        if window is not None:
            mask &= k_pos[None, None, :] > pos[:, :, None] - window
        mask = mask[:, :, None, None, :]
        s = scores(jnp.einsum("wqkgd,kwld->wqkgl", qi, kb), mask)  # (W, bq, KVH, G, L)
        return _online_softmax_block(*carry, s, mask, vb, "wqkgl,kwld->wqkgd")

    init = (jnp.full(shape, NEG_INF), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
    num_blocks = (jnp.max(cached) + block_len - 1) // block_len
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    dest = jnp.where(row_ok, rows, num_tokens).reshape(-1)  # each token's one row; the rest dropped
    tshape = (num_tokens, num_kv_heads, group)
    m = jnp.full(tshape, NEG_INF).at[dest].set(m.reshape(-1, num_kv_heads, group), mode="drop")
    l = jnp.zeros(tshape).at[dest].set(l.reshape(-1, num_kv_heads, group), mode="drop")
    acc = jnp.zeros((*tshape, head_dim)).at[dest].set(acc.reshape(-1, num_kv_heads, group, head_dim), mode="drop")
    return m, l, acc

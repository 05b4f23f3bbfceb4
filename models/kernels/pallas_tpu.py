"""Ragged paged attention for TPU in Pallas (Mosaic), with the signature of reference.paged_attention.

Design
* K/V write: the new tokens' K/V are scattered into their pages by XLA just before the kernel (reference.write_kv,
  in place because the cache is donated). That is T * KVH * D elements, tiny next to the pages the kernel reads, and
  it guarantees every write has landed before any page DMA of the kernel starts; writing inside the kernel would
  need single-row DMAs into tiled pages and an ordering between the writes and the prefetches of other grid steps.
* Work items: the ragged queries are cut per sequence into blocks of `q_block` tokens; work item w is (sequence,
  first token, token count). There are at most W = min(T, T // q_block + S) of them, a static bound, so the grid is
  (KVH, W); items past the live count are skipped, and their BlockSpec index is clamped so nothing is re-fetched.
  XLA gathers the queries into a padded (KVH, W, q_block * G, D) array (the G query heads of one KV head side by
  side, rows token-major) so each item's queries are one aligned block that BlockSpec pipelines, and gathers the
  outputs back the same way. Padding tokens come out zero.
* KV: the pages stay in HBM (memory_space ANY). Each item walks its sequence's KV in blocks of `pages_per_block`
  pages, from the first page its sliding window can see up to the page of its last query (causal), copying only
  the pages it needs, page by page, into a double buffer (2, pages_per_block, page_size, D) per K and V. The next
  block is prefetched while the current one is computed, and the last block of an item prefetches the first block
  of the next item, so one sequence's decode does not wait on a DMA at its start. Every page is read once per KV
  head and query block: the G query heads that share it are processed together as rows of one matrix.
* Math: online softmax in float32 (m, l, acc in VMEM scratch), logits scaled, optionally soft-capped, then masked
  (causal, window, beyond the item's last query); probabilities of masked keys are exactly zero.
* Block tables, lengths, query starts and the work list are scalar-prefetched into SMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.models.batch import Batch
from kiln.models.kernels.reference import NEG_INF, token_metadata, write_kv

KV_BLOCK_BYTES = 1 << 20  # target size of one K (or V) block in VMEM; two buffers each for K and V


def _sublanes(dtype) -> int:
    """Rows of one (sublane, lane) tile for dtype: 8 for 32-bit, 16 for 16-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def default_q_block(num_tokens: int, num_seqs: int, group: int, dtype) -> int:
    """Query tokens per work item: about 128 rows (tokens x G) when the bucket holds prefill chunks, the smallest
    aligned block when it cannot (T <= S: at most one token per sequence on average, decode)."""
    rows = 128 if num_tokens > num_seqs else _sublanes(dtype)
    q_block = max(1, rows // group)
    while (q_block * group) % _sublanes(dtype):
        q_block += 1
    return q_block


def default_pages_per_block(page_size: int, head_dim: int, dtype, max_pages: int) -> int:
    """Pages per KV block: up to 512 tokens and KV_BLOCK_BYTES per K block."""
    tokens = min(512, KV_BLOCK_BYTES // (head_dim * jnp.dtype(dtype).itemsize))
    return max(1, min(max_pages, tokens // page_size))


def _work_items(batch: Batch, num_tokens: int, q_block: int, num_items: int):
    """The work list: per item w, its sequence (W,), first query token (W,) and token count (W,; 0 = no item);
    the number of items (1,); and per token t, its item (T,) and row in the item (T,)."""
    num_seqs = batch.seq_lens.shape[0]
    s = jnp.arange(num_seqs, dtype=jnp.int32)  # (S,)
    q_len = jnp.where(s < batch.num_seqs[0], batch.query_start[1:] - batch.query_start[:-1], 0)  # (S,)
    blocks = (q_len + q_block - 1) // q_block  # (S,)
    ends = jnp.cumsum(blocks).astype(jnp.int32)  # (S,) first item of the next sequence
    w = jnp.arange(num_items, dtype=jnp.int32)  # (W,)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right").astype(jnp.int32), num_seqs - 1)  # (W,)
    j = w - (ends[seq] - blocks[seq])  # (W,) block of the item within its sequence
    first = batch.query_start[seq] + j * q_block  # (W,)
    count = jnp.clip(q_len[seq] - j * q_block, 0, q_block)  # (W,)
    count = jnp.where(w < ends[-1], count, 0)
    num_work = ends[-1:]  # (1,)

    t = jnp.arange(num_tokens, dtype=jnp.int32)  # (T,)
    tok_seq, _, kv_len = token_metadata(batch, num_tokens)  # (T,), (T,)
    rel = t - batch.query_start[tok_seq]  # (T,) index within the sequence's queries
    tok_item = jnp.clip(ends[tok_seq] - blocks[tok_seq] + rel // q_block, 0, num_items - 1)  # (T,)
    tok_row = rel % q_block  # (T,)
    tok_valid = kv_len > 0  # (T,)
    return seq, first, count, num_work, tok_item, tok_row, tok_valid


def _kernel(
    # scalar prefetch (SMEM)
    tables_ref,  # (S * max_pages,) block tables, flattened
    seq_lens_ref,  # (S,)
    query_start_ref,  # (S + 1,)
    item_seq_ref,  # (W,)
    item_first_ref,  # (W,)
    item_count_ref,  # (W,)
    num_work_ref,  # (1,)
    # inputs
    q_ref,  # (R, D) block of item (h, w): R = q_block * G rows, token-major
    k_hbm,  # (KVH, P, page_size, D) in HBM
    v_hbm,  # (KVH, P, page_size, D) in HBM
    # output
    o_ref,  # (R, D)
    # scratch
    k_buf,  # (2, pages_per_block, page_size, D)
    v_buf,  # (2, pages_per_block, page_size, D)
    sems,  # DMA semaphores (2, 2): [K/V, slot]
    slot_ref,  # SMEM (1,) buffer slot holding the current item's first block
    m_ref,  # (R, 128) running max, broadcast along lanes
    l_ref,  # (R, 128) running denominator
    acc_ref,  # (R, D) running numerator
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    max_pages: int,
):
    h, w = pl.program_id(0), pl.program_id(1)
    num_work = num_work_ref[0]
    _, pages_per_block, page_size, head_dim = k_buf.shape
    block_len = pages_per_block * page_size
    rows = q_ref.shape[0]

    def item_range(i):
        """Sequence, first and last query position, and the KV blocks [lo, hi) of item i."""
        seq = item_seq_ref[i]
        q_len = query_start_ref[seq + 1] - query_start_ref[seq]
        first = seq_lens_ref[seq] - q_len + (item_first_ref[i] - query_start_ref[seq])
        last = first + item_count_ref[i] - 1
        lo = 0 if sliding_window is None else jnp.maximum(first - sliding_window + 1, 0) // block_len
        hi = last // block_len + 1
        return seq, first, last, lo, hi

    def copies(seq, last, b, slot):
        """(condition, K copy, V copy) per page of KV block b of sequence seq into buffer slot."""
        out = []
        for j in range(pages_per_block):
            idx = b * pages_per_block + j
            page = tables_ref[seq * max_pages + jnp.minimum(idx, max_pages - 1)]
            ck = pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, j], sems.at[0, slot])
            cv = pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, j], sems.at[1, slot])
            out.append((idx * page_size <= last, ck, cv))
        return out

    def start(seq, last, b, slot):
        for cond, ck, cv in copies(seq, last, b, slot):

            @pl.when(cond)
            def _(ck=ck, cv=cv):
                ck.start()
                cv.start()

    def wait(seq, last, b, slot):
        for cond, ck, cv in copies(seq, last, b, slot):

            @pl.when(cond)
            def _(ck=ck, cv=cv):
                ck.wait()
                cv.wait()

    @pl.when(w < num_work)
    def _():
        seq, first, last, lo, hi = item_range(w)

        @pl.when(w == 0)
        def _():
            slot_ref[0] = 0
            start(seq, last, lo, 0)

        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        q = q_ref[...]  # (R, D)
        row_pos = first + jax.lax.broadcasted_iota(jnp.int32, (rows, block_len), 0) // group  # (R, L)
        row_pos = jnp.minimum(row_pos, last)  # rows past the item's queries see what its last query sees
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

        def body(b, slot):
            nxt = 1 - slot

            @pl.when(b + 1 < hi)
            def _():
                start(seq, last, b + 1, nxt)

            @pl.when((b + 1 == hi) & (w + 1 < num_work))
            def _():
                nseq, _, nlast, nlo, _ = item_range(w + 1)
                start(nseq, nlast, nlo, nxt)
                slot_ref[0] = nxt

            wait(seq, last, b, slot)
            k = k_buf[slot].reshape(block_len, head_dim)  # (L, D)
            v = v_buf[slot].reshape(block_len, head_dim)  # (L, D)
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # (R, L)
            s = s * scale
            if soft_cap:
                s = soft_cap * jnp.tanh(s / soft_cap)
            col_pos = b * block_len + jax.lax.broadcasted_iota(jnp.int32, (rows, block_len), 1)  # (R, L)
            mask = col_pos <= row_pos
            if sliding_window is not None:
                mask &= col_pos > row_pos - sliding_window
            s = jnp.where(mask, s, NEG_INF)
            # pages past the last query were not copied: zero V there so stale buffer contents cannot reach acc
            v_pos = b * block_len + jax.lax.broadcasted_iota(jnp.int32, (block_len, head_dim), 0)  # (L, D)
            v = jnp.where(v_pos <= last, v, jnp.zeros_like(v))

            m_prev = m_ref[...]  # (R, 128)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # (R, 128)
            p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)  # (R, L)
            alpha = jnp.exp(m_prev - m_next)  # (R, 128)
            l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
            m_ref[...] = m_next
            pv = jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # (R, D)
            acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv
            return nxt

        jax.lax.fori_loop(lo, hi, body, slot_ref[0])
        l = l_ref[...][:, :1]  # (R, 1)
        o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


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
    q_block: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Ragged paged attention on TPU; same arguments and results as reference.paged_attention.

    q: (T, H, D); k, v: (T, KVH, D) the new tokens' K/V; k_pages, v_pages: (KVH, P, page_size, D).
    Returns out (T, H, D) in q's dtype (zeros for padding tokens) and the pages with the new K/V written.
    q_block (query tokens per work item) and pages_per_block (pages per KV block) default to a heuristic;
    interpret=True runs the kernel in Pallas's TPU interpret mode (on the CPU).
    """
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    num_seqs, max_pages = batch.block_tables.shape
    q_block = q_block or default_q_block(num_tokens, num_seqs, group, q.dtype)
    pages_per_block = pages_per_block or default_pages_per_block(page_size, head_dim, k_pages.dtype, max_pages)
    num_items = min(num_tokens, num_tokens // q_block + num_seqs)
    rows = q_block * group
    if rows % _sublanes(q.dtype):
        raise ValueError(f"q_block * group = {rows} must be a multiple of {_sublanes(q.dtype)} for {q.dtype}")

    item_seq, item_first, item_count, num_work, tok_item, tok_row, tok_valid = _work_items(
        batch, num_tokens, q_block, num_items
    )
    # queries of item w, row i * G + g = token item_first[w] + i, head g of KV head h
    tok = jnp.minimum(item_first[:, None] + jnp.arange(q_block, dtype=jnp.int32), num_tokens - 1)  # (W, q_block)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)[tok]  # (W, q_block, KVH, G, D)
    q_items = qg.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, num_items, rows, head_dim)  # (KVH, W, R, D)

    def item_map(h, w, *refs):
        num_work_ref = refs[-1]
        return h, jnp.minimum(w, jnp.maximum(num_work_ref[0] - 1, 0)), 0, 0

    block = pl.BlockSpec((pl.squeezed, pl.squeezed, rows, head_dim), item_map)
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    kernel = functools.partial(
        _kernel,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        group=group,
        max_pages=max_pages,
    )
    out_items = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(num_kv_heads, num_items),
            in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=block,
            scratch_shapes=[
                buf,
                buf,
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.SMEM((1,), jnp.int32),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_items, rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kiln_ragged_paged_attention",
    )(
        batch.block_tables.reshape(-1),
        batch.seq_lens,
        batch.query_start,
        item_seq,
        item_first,
        item_count,
        num_work,
        q_items,
        k_pages,
        v_pages,
    )
    out = out_items.reshape(num_kv_heads, num_items, q_block, group, head_dim)[:, tok_item, tok_row]  # (KVH, T, G, D)
    out = jnp.where(tok_valid[None, :, None, None], out, jnp.zeros_like(out))
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim), k_pages, v_pages

"""Ragged paged attention for TPU in Pallas (Mosaic), with the signature of reference.paged_attention.

Design
* K/V write: the new tokens' K/V are scattered into their pages by XLA just before the kernel (write_pages, in
  place because the cache is donated; one (D,) row per token and KV head, the form XLA on TPU updates in place).
  That is T * KVH * D elements, tiny next to the pages the kernel reads, and it guarantees every write has landed
  before any page DMA of the kernel starts. Writing inside the kernel would need single-row DMAs into tiled pages,
  issued one by one (T * KVH of them), and an ordering against the cross-step prefetches.
* Grid (KVH, T / q_block): step (h, b) owns query tokens [b * q_block, (b + 1) * q_block) for KV head h. q and the
  output move by BlockSpec (pipelined) as lane-dense (q_block, G * D) blocks of q viewed as (KVH, T, G * D) (XLA
  only moves the KV-head axis); the kernel stacks the G heads' lane slices into (G * q_block, D) rows (head-major), so
  each KV page read serves all G heads.
* Work items: a q block may hold the tails and heads of several sequences (ragged batch). Item i is one (q block,
  sequence) pair; XLA builds the list (at most T / q_block + S items) and the kernel loops over its block's items.
  Rows of other sequences are masked out of an item, so the block's online-softmax state simply accumulates item
  after item, and rows no item touches (padding tokens) come out zero.
* KV: pages stay in HBM (memory_space ANY). An item walks its sequence's KV in blocks of `pages_per_block` pages,
  from the first page its sliding window can see to the page of its last query (causal), copying only the pages it
  needs into a double buffer (2, pages_per_block, page_size, D) per K and V. The next block is prefetched while
  the current one is computed, and an item's last block prefetches the first block of the next item (across grid
  steps too), so a decode's first DMA is already in flight when its turn comes.
* Math: float32 online softmax (m, l, acc in VMEM scratch); logits scaled, optionally soft-capped, then masked
  (own sequence, causal, window); probabilities of masked keys are exactly zero.
* Scalar prefetch (SMEM): KV lengths, query starts and the work list. The block tables stay in HBM (S * max_pages
  entries outgrow SMEM at long contexts); each item DMAs its sequence's row into a two-row SMEM buffer while the
  previous item computes, and waits for it before the first page DMA that needs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.models.batch import Batch
from kiln.models.kernels.reference import NEG_INF

KV_BLOCK_BYTES = 1 << 20  # target size of one K (or V) block in VMEM; two buffers each for K and V
TABLE_ALIGN = 128  # block-table rows are padded to this many entries: DMAs to SMEM move whole 512-byte words


def _sublanes(dtype) -> int:
    """Rows of one (sublane, lane) tile for dtype: 8 for 32-bit, 16 for 16-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def default_q_block(num_tokens: int, num_seqs: int, group: int, dtype) -> int:
    """Query tokens per grid step: about 128 rows (tokens x G) when the bucket holds prefill chunks, the smallest
    aligned block when it cannot (T <= S: at most one token per sequence on average, decode); never much more
    than the bucket."""
    unit = _sublanes(dtype)  # each query head's rows of a block are aligned (the kernel stacks them head-major)
    rows = 128 if num_tokens > num_seqs else 0
    q_block = max(unit, rows // group // unit * unit)
    return min(q_block, -(-num_tokens // unit) * unit)


def default_pages_per_block(page_size: int, head_dim: int, dtype, max_pages: int) -> int:
    """Pages per KV block: up to 512 tokens and KV_BLOCK_BYTES per K block."""
    tokens = min(512, KV_BLOCK_BYTES // (head_dim * jnp.dtype(dtype).itemsize))
    return max(1, min(max_pages, tokens // page_size))


def write_pages(
    k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """reference.write_kv as a scatter of single rows into pages viewed as (KVH * P * page_size, D): XLA on TPU
    updates that in place, where the (KVH, page, offset) form makes it relayout the whole cache at large T."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    slots = num_pages * page_size
    row = jnp.arange(num_kv_heads, dtype=jnp.int32)[:, None] * slots + slot_mapping[None, :]  # (KVH, T)
    row = jnp.where(slot_mapping[None, :] < 0, num_kv_heads * slots, row).reshape(-1)  # (KVH * T,) -1 -> dropped

    def write(pages, new):  # (KVH, P, ps, D), (T, KVH, D)
        rows = new.transpose(1, 0, 2).reshape(-1, head_dim).astype(pages.dtype)  # (KVH * T, D)
        flat = pages.reshape(num_kv_heads * slots, head_dim).at[row].set(rows, mode="drop")
        return flat.reshape(pages.shape)

    return write(k_pages, k), write(v_pages, v)


def cost_estimate(q: jax.Array, k_pages: jax.Array, block_tables: jax.Array) -> pl.CostEstimate:
    """What the kernel moves and computes at most, for XLA's cost analysis (without it a Mosaic call counts as zero
    bytes and zero flops): q and out, the block tables, and K and V of every page the S sequences can reach
    (min(P, S * max_pages), each read once per sequence: the worst case, every sequence at full length); QK^T and PV
    of every token over a full context."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, max_pages = block_tables.shape
    pages = min(num_pages, num_seqs * max_pages)
    kv = 2 * pages * num_kv_heads * page_size * head_dim * k_pages.dtype.itemsize
    context = min(num_pages, max_pages) * page_size
    return pl.CostEstimate(
        flops=4 * num_tokens * num_heads * head_dim * context,
        transcendentals=num_tokens * num_heads * context,
        bytes_accessed=2 * q.size * q.dtype.itemsize + kv + block_tables.size * 4,
    )


def _work_items(batch: Batch, num_blocks: int, q_block: int):
    """The work list, one item per (q block, sequence) pair with tokens in both, in order: per block its first item
    (NB + 1,) (cumulative); per item its sequence (W,) and token range [lo, hi) (W,), W = NB + S."""
    num_seqs = batch.seq_lens.shape[0]
    qs = batch.query_start  # (S + 1,)
    live = qs[batch.num_seqs[0]]  # tokens of live sequences
    start = jnp.arange(num_blocks, dtype=jnp.int32) * q_block  # (NB,)
    end = jnp.minimum(start + q_block, live)  # (NB,)
    seq_of = lambda t: jnp.minimum(jnp.searchsorted(qs[1:], t, side="right"), num_seqs - 1).astype(jnp.int32)
    first_seq, last_seq = seq_of(start), seq_of(end - 1)  # (NB,)
    count = jnp.where(end > start, last_seq - first_seq + 1, 0)  # (NB,)
    block_items = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(count).astype(jnp.int32)])  # (NB + 1,)
    num_items = num_blocks + num_seqs
    i = jnp.arange(num_items, dtype=jnp.int32)  # (W,)
    blk = jnp.minimum(jnp.searchsorted(block_items[1:], i, side="right"), num_blocks - 1).astype(jnp.int32)  # (W,)
    seq = jnp.minimum(first_seq[blk] + i - block_items[blk], num_seqs - 1)  # (W,)
    tok_lo = jnp.maximum(qs[seq], start[blk])  # (W,)
    tok_hi = jnp.minimum(qs[seq + 1], end[blk])  # (W,)
    return block_items, seq, tok_lo, tok_hi


def _kernel(
    # scalar prefetch (SMEM)
    seq_lens_ref,  # (S,)
    query_start_ref,  # (S + 1,)
    block_items_ref,  # (NB + 1,) first item of each q block
    item_seq_ref,  # (W,)
    item_lo_ref,  # (W,) first token of the item
    item_hi_ref,  # (W,) one past its last token
    # inputs
    tables_hbm,  # (S * table_width,) block tables, rows padded to TABLE_ALIGN, flattened, in HBM
    q_ref,  # (q_block, G * D) q block b of KV head h: a token's G query heads side by side in lanes
    k_hbm,  # (KVH, P, page_size, D) in HBM
    v_hbm,  # (KVH, P, page_size, D) in HBM
    # output
    o_ref,  # (q_block, G * D), like q_ref
    # scratch
    k_buf,  # (2, pages_per_block, page_size, D)
    v_buf,  # (2, pages_per_block, page_size, D)
    sems,  # DMA semaphores (2, 2): [K/V, slot]
    table_buf,  # SMEM (2 * table_width,) the block tables of the current and the next item
    table_sems,  # DMA semaphores (2,)
    slot_ref,  # SMEM (1,) buffer slot holding the next item's first KV block
    m_ref,  # (R, 128) running max, broadcast along lanes; R = G * q_block rows, head-major (head * q_block + token)
    l_ref,  # (R, 128) running denominator
    acc_ref,  # (R, D) running numerator
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    q_block: int,
    table_width: int,
):
    h, b = pl.program_id(0), pl.program_id(1)
    num_work = block_items_ref[pl.num_programs(1)]
    _, pages_per_block, page_size, head_dim = k_buf.shape
    block_len = pages_per_block * page_size
    rows = group * q_block

    def item_range(i):
        """Sequence, position offset (token -> position), last query position and KV blocks [lo, hi) of item i."""
        seq = item_seq_ref[i]
        offset = seq_lens_ref[seq] - query_start_ref[seq + 1]  # position = token index + offset
        first = item_lo_ref[i] + offset
        last = item_hi_ref[i] - 1 + offset
        lo = 0 if sliding_window is None else jnp.maximum(first - sliding_window + 1, 0) // block_len
        hi = jnp.maximum(last // block_len + 1, lo + 1)
        return seq, offset, last, lo, hi

    def table_copy(i):
        """DMA of item i's block table row into table_buf half i % 2."""
        src = tables_hbm.at[pl.ds(pl.multiple_of(item_seq_ref[i] * table_width, TABLE_ALIGN), table_width)]
        dst = table_buf.at[pl.ds(pl.multiple_of((i % 2) * table_width, TABLE_ALIGN), table_width)]
        return pltpu.make_async_copy(src, dst, table_sems.at[i % 2])

    def page_copies(i, kv_block, j, slot):
        """K and V copies of page j of KV block kv_block of item i into buffer slot."""
        idx = jnp.minimum(kv_block * pages_per_block + j, table_width - 1)
        page = table_buf[(i % 2) * table_width + idx]
        ck = pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, j], sems.at[0, slot])
        cv = pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, j], sems.at[1, slot])
        return ck, cv

    def for_pages(i, last, kv_block, slot, fn):
        """fn(copy) for the K and V copy of each page of the block that holds a position <= last."""
        num = jnp.clip(last // page_size + 1 - kv_block * pages_per_block, 0, pages_per_block)

        def body(j, carry):
            for copy in page_copies(i, kv_block, j, slot):
                fn(copy)
            return carry

        jax.lax.fori_loop(0, num, body, 0)

    def start(i, last, kv_block, slot):
        for_pages(i, last, kv_block, slot, lambda copy: copy.start())

    def wait(i, last, kv_block, slot):
        for_pages(i, last, kv_block, slot, lambda copy: copy.wait())

    @pl.when((b == 0) & (num_work > 0))
    def _():
        _, _, last, lo, _ = item_range(0)
        first_table = table_copy(0)
        first_table.start()
        first_table.wait()
        slot_ref[0] = 0
        start(0, last, lo, 0)

    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    q = jnp.concatenate([q_ref[:, g * head_dim : (g + 1) * head_dim] for g in range(group)], axis=0)  # (R, D)
    row_tok = b * q_block + jax.lax.broadcasted_iota(jnp.int32, (rows, block_len), 0) % q_block  # (R, L)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def item_body(i, slot):
        _, offset, last, lo, hi = item_range(i)

        @pl.when(i + 1 < num_work)
        def _():
            table_copy(i + 1).start()

        in_item = (row_tok >= item_lo_ref[i]) & (row_tok < item_hi_ref[i])  # (R, L)
        row_pos = row_tok + offset  # (R, L)

        def kv_body(kv_block, slot):
            nxt = 1 - slot

            @pl.when(kv_block + 1 < hi)
            def _():
                start(i, last, kv_block + 1, nxt)

            @pl.when((kv_block + 1 == hi) & (i + 1 < num_work))
            def _():
                table_copy(i + 1).wait()
                _, _, nlast, nlo, _ = item_range(i + 1)
                start(i + 1, nlast, nlo, nxt)

            wait(i, last, kv_block, slot)
            k = k_buf[slot].reshape(block_len, head_dim)  # (L, D)
            v = v_buf[slot].reshape(block_len, head_dim)  # (L, D)
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # (R, L)
            s = s * scale
            if soft_cap:
                s = soft_cap * jnp.tanh(s / soft_cap)
            col_pos = kv_block * block_len + jax.lax.broadcasted_iota(jnp.int32, (rows, block_len), 1)  # (R, L)
            mask = in_item & (col_pos <= row_pos)
            if sliding_window is not None:
                mask &= col_pos > row_pos - sliding_window
            s = jnp.where(mask, s, NEG_INF)
            # pages past the last query were not copied: zero V there so stale buffer contents cannot reach acc
            v_pos = kv_block * block_len + jax.lax.broadcasted_iota(jnp.int32, (block_len, head_dim), 0)  # (L, D)
            v = jnp.where(v_pos <= last, v, jnp.zeros_like(v))

            m_prev = m_ref[...]  # (R, 128)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # (R, 128)
            p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)  # (R, L)
            alpha = jnp.exp(m_prev - m_next)  # (R, 128); 1 on rows this item does not touch
            l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
            m_ref[...] = m_next
            pv = jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )  # (R, D)
            acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv
            return nxt

        return jax.lax.fori_loop(lo, hi, kv_body, slot)

    slot_ref[0] = jax.lax.fori_loop(block_items_ref[b], block_items_ref[b + 1], item_body, slot_ref[0])
    l = l_ref[...][:, :1]  # (R, 1)
    out = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)  # (R, D)
    for g in range(group):
        o_ref[:, g * head_dim : (g + 1) * head_dim] = out[g * q_block : (g + 1) * q_block]


@functools.partial(
    jax.jit,
    static_argnames=("scale", "sliding_window", "soft_cap", "group", "q_block", "table_width", "pages_per_block",
                     "cost", "interpret"),
)  # fmt: skip
def _call(
    seq_lens, query_start, block_items, item_seq, item_lo, item_hi, tables, qg, k_pages, v_pages, *, scale,
    sliding_window, soft_cap, group, q_block, table_width, pages_per_block, cost, interpret=False,
):  # fmt: skip
    """The pallas_call of paged_attention on its prepared operands; cost = (flops, transcendentals, bytes)."""
    num_kv_heads, _, page_size, head_dim = k_pages.shape
    rows = q_block * group
    block = pl.BlockSpec((pl.squeezed, q_block, group * head_dim), lambda h, b, *_: (h, b, 0))
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    kernel = functools.partial(
        _kernel,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        group=group,
        q_block=q_block,
        table_width=table_width,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_kv_heads, block_items.shape[0] - 1),
            in_specs=[any_space, block, any_space, any_space],
            out_specs=block,
            scratch_shapes=[
                buf,
                buf,
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.SMEM((2 * table_width,), jnp.int32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret
        if isinstance(interpret, pltpu.InterpretParams)
        else pltpu.InterpretParams()
        if interpret
        else False,
        name="kiln_ragged_paged_attention",
        cost_estimate=pl.CostEstimate(flops=cost[0], transcendentals=cost[1], bytes_accessed=cost[2]),
    )(seq_lens, query_start, block_items, item_seq, item_lo, item_hi, tables, qg, k_pages, v_pages)


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
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Ragged paged attention on TPU; same arguments and results as reference.paged_attention.

    q: (T, H, D); k, v: (T, KVH, D) the new tokens' K/V; k_pages, v_pages: (KVH, P, page_size, D).
    Returns out (T, H, D) in q's dtype (zeros for padding tokens) and the pages with the new K/V written.
    q_block (query tokens per grid step) and pages_per_block (pages per KV block) default to a heuristic;
    interpret=True runs the kernel in Pallas's TPU interpret mode (on the CPU); InterpretParams picks its options.
    """
    k_pages, v_pages = write_pages(k_pages, v_pages, k, v, batch.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    num_seqs, max_pages = batch.block_tables.shape
    q_block = q_block or default_q_block(num_tokens, num_seqs, group, q.dtype)
    pages_per_block = pages_per_block or default_pages_per_block(page_size, head_dim, k_pages.dtype, max_pages)
    if q_block % _sublanes(q.dtype):
        raise ValueError(f"q_block = {q_block} must be a multiple of {_sublanes(q.dtype)} for {q.dtype}")
    num_blocks = -(-num_tokens // q_block)
    padded = num_blocks * q_block

    block_items, item_seq, item_lo, item_hi = _work_items(batch, num_blocks, q_block)
    # (KVH, NB * q_block, G * D): lane-dense (a (.., G, D) array of head_dim 64 is tiled 8 x 128 on its last two
    # axes, 2-5x its size, and XLA-TPU relayouts it on the way in and out: ~40 MB a layer at T = 2048)
    qg = q.reshape(num_tokens, num_kv_heads, group * head_dim).transpose(1, 0, 2)  # (KVH, T, G * D)
    qg = jnp.pad(qg, ((0, 0), (0, padded - num_tokens), (0, 0)))

    table_width = -(-max_pages // TABLE_ALIGN) * TABLE_ALIGN
    tables = jnp.pad(batch.block_tables, ((0, 0), (0, table_width - max_pages))).reshape(-1)  # (S * width,)
    est = cost_estimate(q, k_pages, batch.block_tables)
    statics = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, group=group, q_block=q_block,
                   table_width=table_width, pages_per_block=pages_per_block,
                   cost=(est.flops, est.transcendentals, est.bytes_accessed))  # fmt: skip
    args = (batch.seq_lens, batch.query_start, block_items, item_seq, item_lo, item_hi, tables, qg, k_pages, v_pages)
    if interpret:
        out = _call.__wrapped__(*args, **statics, interpret=interpret)
    else:  # jitted: a model's layers share one trace and one Mosaic lowering (30 of each cost SmolLM2's export ~8 s)
        out = _call(*args, **statics)
    out = out[:, :num_tokens].transpose(1, 0, 2)  # (T, KVH, G * D)
    return out.reshape(num_tokens, num_heads, head_dim), k_pages, v_pages


EMBED_ROWS = 8  # tokens per grid step of embed_columns: one (8, E) output block, 8 column-block DMAs in flight


def _embed_kernel(ids_ref, table_hbm, out_ref, buf, sems):
    """Grid step b: tokens [b * 8, b * 8 + 8). Each token's 128-lane column block of the (E, V) table is copied into
    VMEM and its column taken out by a one-hot product (exact: one nonzero term)."""
    b = pl.program_id(0)

    def copy(j):
        start = pl.multiple_of(ids_ref[b * EMBED_ROWS + j] // 128 * 128, 128)
        return pltpu.make_async_copy(table_hbm.at[:, pl.ds(start, 128)], buf.at[j], sems.at[j])

    for j in range(EMBED_ROWS):
        copy(j).start()
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, 128), 1)
    rows = []
    for j in range(EMBED_ROWS):
        copy(j).wait()
        onehot = (lane == ids_ref[b * EMBED_ROWS + j] % 128).astype(buf.dtype)  # (1, 128)
        precision = jax.lax.Precision.HIGHEST if buf.dtype == jnp.float32 else None  # exact for float32 tables too
        dims = (((1,), (1,)), ((), ()))
        rows.append(jax.lax.dot_general(onehot, buf[j], dims, precision=precision, preferred_element_type=jnp.float32))
    out_ref[...] = jnp.concatenate(rows, axis=0).astype(out_ref.dtype)


def embed_columns(table_t: jax.Array, token_ids: jax.Array, interpret: bool = False) -> jax.Array:
    """The embedding rows (T, E) of token_ids (T,) read out of the transposed table table_t (E, V): the layout XLA
    gives a tied embedding for its LM head's matmul. XLA's own gather needs the table row-major, so on TPU it copied
    the whole table (56.6 MB for SmolLM2) to another layout every step and counted a gather of 16 rows as reading the
    table twice; here each token DMAs only its (E, 128) column block (T * E * 256 bytes in bf16). Needs V % 128 == 0;
    ids index as jnp does (negative from the end, then clamped to [0, V))."""
    num_embed, vocab = table_t.shape
    num_tokens = token_ids.shape[0]
    padded = -(-num_tokens // EMBED_ROWS) * EMBED_ROWS
    ids = token_ids.astype(jnp.int32)
    ids = jnp.clip(jnp.where(ids < 0, ids + vocab, ids), 0, vocab - 1)  # as jnp indexing: negative from the end
    ids = jnp.pad(ids, (0, padded - num_tokens))
    itemsize = table_t.dtype.itemsize
    out = pl.pallas_call(
        _embed_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // EMBED_ROWS,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((EMBED_ROWS, num_embed), lambda b, ids: (b, 0)),
            scratch_shapes=[
                pltpu.VMEM((EMBED_ROWS, num_embed, 128), table_t.dtype),
                pltpu.SemaphoreType.DMA((EMBED_ROWS,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((padded, num_embed), table_t.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kiln_embed_columns",
        cost_estimate=pl.CostEstimate(
            flops=2 * padded * 128 * num_embed,
            transcendentals=0,
            bytes_accessed=padded * num_embed * (128 + 1) * itemsize + padded * 4,
        ),
    )(ids, table_t)
    return out[:num_tokens]


def jax_ragged_paged_attention(
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
    pages_per_block: int | None = None,
    queries_per_block: int | None = None,
    jax_reference: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The peer: JAX's shipped ragged paged attention (jax.experimental.pallas.ops.tpu.ragged_paged_attention) on
    kiln's inputs, for benchmarks/tpu_kernels.py and the equality test. It reads one combined cache
    (P, page_size, 2 * KVH, D) with K and V interleaved by head and writes nothing, so the new K/V go in with kiln's
    write_pages and the pages are interleaved here: a copy of the whole cache that a server using it would avoid by
    keeping that layout. Same results as paged_attention (zeros for padding tokens). Block sizes default to JAX's
    tuned table on a TPU (deviceless included) and to kiln's heuristic elsewhere (the table asks for the TPU).
    jax_reference: call the kernel's own jnp oracle (ref_ragged_paged_attention; not jittable, it loops over the live
    sequences in Python) instead: under jax 0.10.2 neither Pallas interpret mode runs JAX's kernel on a CPU (the TPU
    interpreter: "'ReshapeTransform' object has no attribute 'indices'"; the generic one: "'TypedInt' object has no
    attribute 'shape'")."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ragged_paged_attention,
        ref_ragged_paged_attention,
    )

    k_pages, v_pages = write_pages(k_pages, v_pages, k, v, batch.slot_mapping)
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    blocks = {}
    if not jax_reference and (pages_per_block or queries_per_block or jax.devices()[0].platform != "tpu"):
        max_pages = batch.block_tables.shape[1]
        blocks = dict(
            num_kv_pages_per_block=pages_per_block
            or default_pages_per_block(page_size, head_dim, k_pages.dtype, max_pages),
            num_queries_per_block=queries_per_block or max(8, min(128, q.shape[0])),
        )
    combined = jnp.stack([k_pages, v_pages], axis=1)  # (KVH, 2, P, ps, D)
    combined = combined.transpose(2, 3, 0, 1, 4).reshape(num_pages, page_size, 2 * num_kv_heads, head_dim)
    out = (ref_ragged_paged_attention if jax_reference else ragged_paged_attention)(
        q,
        combined,
        batch.seq_lens,
        batch.block_tables,
        batch.query_start,
        batch.num_seqs,
        sm_scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        **blocks,
    )  # (T, H, D)
    out = jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))  # the oracle returns live tokens only
    live = jnp.arange(q.shape[0]) < batch.query_start[batch.num_seqs[0]]
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype), k_pages, v_pages

"""Ragged paged attention as a Pallas kernel for GPUs (Triton lowering: CUDA and ROCm).

Same signature and values as reference.paged_attention. One launch covers a whole ragged batch:

* grid (work blocks, KV heads, KV splits). Work block b is a run of up to `block_q` query tokens of one sequence;
  sequence s owns blocks query_start[s] // block_q + s ... (an upper bound on its cdiv(q_len, block_q) blocks, so
  the grid size cdiv(T, block_q) + S is static); the program finds its sequence with one vector load of
  query_start. Blocks after the last live sequence zero the padding tokens.
* A program takes the query heads of one KV head together: its tile is (tokens x group) rows, so each KV row it
  loads serves every query head of the group. Blocks with few tokens (decodes) run a 16-row tile, longer prefill
  blocks a 64-row tile (a cond per program, so a mixed batch is one launch).
* Keys come from two places: the cached prefix (positions < seq_len - q_len) is gathered from the pages through the
  block table; the new tokens' keys are read straight from k/v, with the causal mask. The new K/V rows are then
  stored into their pages by the same program (write_kv_in="kernel"; the pages are aliased in and out), which no
  other program reads, so there is no race; write_kv_in="xla" scatters them before the kernel instead.
* Flash-decoding: the cached range of each sequence is split among `num_splits` programs, each writes an
  unnormalised partial (acc, max, sum) and a small XLA combine merges them; with one split the kernel writes the
  final output directly.

Assumes slot_mapping agrees with block_tables (slot of position p = block_tables[s, p // page_size] * page_size +
p % page_size), as models.batch.make_batch builds it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kiln.models.batch import Batch
from kiln.models.kernels import DECODE_BATCH
from kiln.models.kernels.reference import write_kv

NEG = -1e30
LOG2E = math.log2(math.e)
# Whether the decode kernel applies RoPE to q and k itself when the caller passes the tables (paged_attention's rope);
# read when a program traces (benchmarks/gpu_profile.py's ;rope=kernel / ;rope=xla). Off: measured on an H200 with
# the Llama-3-8B shapes (session 11, gpu_attn_sweep and gpu_profile), the kernel with RoPE took 8.98 us a layer
# against 8.92 at c = 1, but the program kept a fusion in the RoPE's place there (XLA splits the q|k|v GEMM's K in 4 at
# 16 rows and sums the partials in the fusion that also did the RoPE), and at c = 64 the kernel took 93 us against 74
# (attention 3.16 against 2.51 ms a token: the halves' two K = 64 dots and loads).
ROPE_IN_KERNEL = False
# Keys a step of the decode kernel for batches of up to DECODE_SMALL_SEQS sequences. On an H200 (gpu_attn_sweep,
# Llama-3-8B, 1152 keys, the S = 16 bucket) 128-key blocks took 11.17 / 14.82 / 29.66 us a layer against 12.39 / 15.59
# / 30.84 with 64 at 1 / 4 / 16 live sequences (session 11, 19:55 UTC), but 87 against 74 us at c = 64 (one split,
# 512 programs: a 128-key stage is 64 KB of K + V, so one program per SM where 64 keys fit two).
DECODE_SMALL_SEQS, DECODE_SMALL_BLOCK_K = 16, 128
# An fp8 KV cache (kiln compile --kv-dtype fp8, float8_e4m3fn pages): the dots' input dtype (each fp8 tile widened to
# it in registers; None = q's) and the decode kernel's keys a step. float16 holds every float8_e4m3fn value exactly and
# is one conversion instruction from it (bfloat16 is several); q is clipped to its range and rounded to it. Measured on
# an H200 (issue 16, session 23, gpu_attn_sweep --kv-dtype fp8, Llama-3-8B, 1152 keys, us a layer with the combine):
# the decode kernel took 63.1 / 234.4 us at c = 64 / 256 with float16 dots and 128-key blocks, against 88.6 / 340.5
# with bfloat16 dots and 64-key blocks (the default before) and 73.1 / 274.4 for bf16 pages (128 fp8 keys are the
# bytes of 64 bf16 ones); 10.6 against 12.2 us at c = 1 (7.9 / 9.5 us of kernel); relative error against the float32
# reference 2.1e-3 against 2.5e-3. The prefill kernel (--prefill 16): 189.7 against 214.5 us (bf16 pages 139.6).
# Served (bf16 weights, 1024 in / 256 out) an fp8 cache then ran 4,679 / 5,823 tok/s at c = 64 / 256 against bf16
# pages' 4,698 / 5,790: the decode steps gain what the prefill steps lose. The kernel is bound by the widening
# (~2.4 G values a ms), not by its bytes.
FP8_CACHE_DOT = jnp.float16
FP8_CACHE_DECODE_BLOCK_K = 128
# XLA compile options of the decode program of each bucket T (compiler_options("decode", T, format): read by
# kiln.compile.lower.decode_program, so an artifact's compile only; the jitted path compiles every bucket of a
# program with one set of options). T = 64 (17-64 live sequences) takes cuBLAS for its GEMMs instead of XLA's Triton
# GEMMs: measured on an H200 (issue 16, Llama-3-8B shape, bf16), its kernels took 6.84 ms a token against 7.26 in
# gpu_profile's 8-step program (session 12: the residual adds go into cuBLAS's epilogue), and served (kiln serve +
# kiln bench, 1024 in / 256 out, session 13, the same artifact with decode_t64 swapped by gpu_swap_program.py) the
# decode-bound c = 64 runs had TPOT p50 6.99 / 7.00 ms against 7.19 / 7.21 / 7.23 with Triton; the prefill-bound
# first runs 4238 / 4282 tok/s against 4008 / 4312 (within their spread). T = 16 keeps Triton: cuBLAS took 4.69 ms a
# token of kernels against 4.48 there (every GEMM slower at 16 rows, plus its split-K reduce kernels), and XLA's
# exhaustive tiling search (`xla_gpu_exhaustive_tiling_search`) picked other tilings for all five GEMMs but served c = 1
# at the same TPOT, 4.48 ms (208.3 against 208.2 tok/s) for 81 s of compile (session 13).
DECODE_XLA_OPTIONS: dict[int, dict[str, bool | int | str]] = {64: {"xla_gpu_enable_triton_gemm": False}}
# The same for the step program of each bucket T (compiler_options("step", T, format), read by lower.step_program).
# T = 2048 (the prefill chunks) takes cuBLAS too: at 2048 rows XLA already sent q|k|v, gate|up and the LM head to
# cuBLASLt and kept o and down as Triton GEMMs (128 x 256 tiles) with the residual adds apart; with Triton off those go
# to cuBLASLt as well, the adds into its epilogue. Measured on an H200 (issue 16, session 14, Llama-3-8B shape, bf16,
# benchmarks/gpu_prefill.py: the served step on a batch recorded from a c = 64 run, 2048 tokens in 34 chunks): kernels
# 47.87 ms against 48.81 (GEMMs 38.72 against 38.32, the other fusions 2.71 against 4.12), 49.79 ms pipelined against
# 50.13; a c = 64 run through the engine (1024 in / 256 out, fresh prompts, alternated) 4509 / 4556 / 4558 tok/s
# against 4483 / 4510 / 4546; served (kiln serve + kiln bench, fresh seeds, alternated) 4296 / 4351 against
# 4146 / 4251. T = 1024 (a 1024-token prompt in one step) the same (session 22, gpu_prefill.py at c = 1, alternated:
# step_t1024's device ms 21.6 / 22.2 / 22.2 against 21.8 / 22.6 / 22.3 with XLA's choice).
STEP_XLA_OPTIONS: dict[int, dict[str, bool | int | str]] = {
    t: {"xla_gpu_enable_triton_gemm": False} for t in (1024, 2048)
}
# The weight formats (kiln.models.quant) whose programs take those options. They turn XLA's Triton GEMMs off, which is
# what fuses a narrow weight's widening into its dot (quant's weight-only dots): without it XLA widens every weight
# into a copy first. Measured on an H200 (issue 16, session 19, Llama-3-8B shape, gpu_profile, the c = 64 decode
# program, ms a token of kernels with / without them): fp8 16.46 / 6.26 (8.4 ms of `wrapped_convert` copies with them;
# bf16 6.84 with them), int8 6.93 / 7.91 (its int8 x int8 dots go to cuBLAS), int4 16.38 / 16.61 (widened into copies
# either way). So fp8 and int4 keep XLA's defaults in the decode programs. int4's step programs of 1024 and 2048 tokens
# (more rows than pallas_gpu_narrow serves: quant dequantizes the weights, then one dot) take them: their dots then
# run as the dequantized copy and a cuBLAS GEMM, no slower than XLA's Triton GEMM fed the int4 weight (issue 16,
# session 22, gpu_prefill.py on the int4 artifact, device ms a step, alternated: step_t1024 at c = 1 29.9 / 31.2
# against 31.2 / 31.5; step_t2048 at c = 64 55.8 / 55.9 against 56.7 / 56.7, the run 4,210 / 4,243 tok/s against
# 4,195 / 4,204).
XLA_OPTIONS_FORMATS = {"decode": ("float", "int8"), "step": ("float", "int8", "int4")}
# Decode options of a weight format's own (instead of DECODE_XLA_OPTIONS), per bucket T. fp8's 16-token program with
# XLA's exhaustive GEMM tiling search: measured on an H100 (issue 16, session 28, Llama-3-8B shape, gpu_profile's c = 1
# 8-step program, each run a process of its own, alternated): kernels 3.79 / 3.80 / 3.78 ms a token against 3.88 /
# 3.89 / 3.87 with XLA's default search, wall 3.95 / 3.95 / 3.79 against 4.04 / 4.07 / 4.08; its compile 49-52 s
# against 9 s. (bf16's gained nothing served at 16 rows, session 13.) Its 64-token program keeps the default search:
# on an H200 (session 30, h200_decode.sh exhaustive64, alternated) the search took kernels 6.16 / 6.18 ms a token
# against 6.27 / 6.27 (1.6%) for a compile of 146-148 s against 13-15 s.
FORMAT_DECODE_XLA_OPTIONS: dict[str, dict[int, dict[str, bool | int | str]]] = {
    "fp8": {16: {"xla_gpu_exhaustive_tiling_search": True}}
}
# Steps of at least this many tokens (the prefill chunks' bucket) on CUDA take cuDNN's flash attention for the prefill
# pieces' own keys (paged_attention's pieces; cudnn_gpu). None: the kernel does every key. Off: measured on an H200
# (issue 16, session 17, Llama-3-8B shape, bf16, gpu_attn_sweep --prefill, a layer's attention with every kernel it
# launches) the split took 323 us against the kernel's 162 at step 0 of a c = 64 run (two fresh 1024-token prompts) and
# 380 against 184 at step 16 (pieces (798, 226), (0, 1024), (0, 767) + 31 decodes): cuDNN's packed call 86-94 us (54 on
# the same FLOPs unpacked), its zero fill of the (S, H, T) statistics 80 us (S = 256 segments), the kernel's cached
# half 25 / 90 us (one program a block and head walks all of a decode's keys), the merge and its copies ~125 us; the
# served step_t2048 took 54.2 against 51.1 ms and a c = 64 run through the engine 4,396-4,651 against 4,753-4,760 tok/s.
PIECES_CUDNN_MIN_TOKENS: int | None = None
# New keys (this step's own) a step of the prefill tile (paged_attention's block_k_new). Measured on an H200 (issue 16,
# session 17, Llama-3-8B shape, bf16, gpu_attn_sweep --prefill, us a layer): 64 keys took 125.9 / 151.6 us against
# 162.8 / 184.4 with the tile's 16 tokens (the default before), 133.0 / 156.9 with 32 and 189.9 / 235.0 with 128, at
# steps 0 / 16 of a c = 64 run (8 warps, or 32-token tiles, slower still); in the served step program on a batch
# recorded from a c = 64 run the kernel took 4.78-4.95 against 6.09-6.23 ms a step (32 layers); a c = 64 run through
# the engine (1024 in / 256 out, fresh prompts, alternated x4) 4,790-4,832 tok/s against 4,756-4,768 with 16.
PREFILL_BLOCK_K_NEW = 64


def compiler_options(kind: str, num_tokens: int, weight_format: str) -> dict[str, bool | int | str] | None:
    """The XLA compile options of the program of that kind ("decode": DECODE_XLA_OPTIONS, "step": STEP_XLA_OPTIONS)
    and bucket num_tokens, or None; only for the weight formats in XLA_OPTIONS_FORMATS[kind], and a decode program's
    of a format in FORMAT_DECODE_XLA_OPTIONS from there."""
    if kind == "decode" and weight_format in FORMAT_DECODE_XLA_OPTIONS:
        options = FORMAT_DECODE_XLA_OPTIONS[weight_format].get(num_tokens)
    elif weight_format not in XLA_OPTIONS_FORMATS[kind]:
        return None
    else:
        options = {"decode": DECODE_XLA_OPTIONS, "step": STEP_XLA_OPTIONS}[kind].get(num_tokens)
    return dict(options) if options else None


@dataclasses.dataclass(frozen=True)
class _Config:
    block_q: int  # query tokens per work block (the prefill tile)
    block_q_small: int  # query tokens of the decode tile
    block_k: int  # cached keys per inner step
    block_k_new: int  # new keys per inner step (prefill tile)
    num_splits: int
    group: int  # query heads per KV head
    group_pad: int  # group rounded up to a power of two
    page_size: int
    pages_total: int  # rows of one KV head in the flattened pages = num_pages * page_size
    max_pages: int
    num_seqs_pad: int  # S + 1 rounded up to a power of two
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    write_kv: bool
    precision: lax.Precision | None
    kv_stride: int = 1  # rows of k/v per (token, KV head): 1 for separate k and v, G + 2 in a fused qkv
    pieces_apart: bool = False  # the new keys of sequences with more than one new token are `pieces`' (partials out)
    k_slot: int = 0  # the row of k among them (G in a fused qkv)
    v_slot: int = 0  # the row of v (G + 1)


def _dot_dtype(q_dtype, kv_dtype):
    """The kernels' dot input dtype: the cache's when q has it too; with a float8 cache (widened per tile in registers,
    so it reads half the bytes of a bf16 one) FP8_CACHE_DOT under a 16-bit q, else q's; else float32."""
    if jnp.dtype(kv_dtype).itemsize == 1:
        return FP8_CACHE_DOT if FP8_CACHE_DOT is not None and jnp.dtype(q_dtype).itemsize == 2 else q_dtype
    return kv_dtype if q_dtype == kv_dtype else jnp.float32


def _dot_input(x, cd):
    """x in the dots' input dtype cd; into float16 (an fp8 cache's, FP8_CACHE_DOT) clipped to its range first (in
    float32: bfloat16 has no 65504, its nearest is 65536)."""
    if cd == jnp.float16 and x.dtype != jnp.float16:
        x = jnp.clip(x.astype(jnp.float32), -65504.0, 65504.0)
    return x.astype(cd)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a, b):
    return (a + b - 1) // b


def _kernel(qs_ref, lens_ref, nseq_ref, bt_ref, slot_ref, q_ref, k_ref, v_ref, kc_ref, vc_ref, *outs, c: _Config):
    """One program: work block b of KV head h, KV split sp. Ref shapes: qs (S+1,), lens (S,), nseq (1,),
    bt (S * max_pages,), slot (T,), q (T, KVH, Gp, D), k/v (T * KVH, D), kc/vc (KVH * P * ps, D); with a fused qkv
    (paged_attention_qkv) q is the qkv (T, KVH, G + 2, D) itself and k/v its rows (T * KVH * (G + 2), D)."""
    if c.write_kv:
        *outs, kc_out, vc_out = outs
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tokens = slot_ref.shape[0]
    _, num_kv_heads, _, head_dim = q_ref.shape
    num_seqs = lens_ref.shape[0]
    ns = nseq_ref[0]

    # Which sequence owns block b: blockstart(s) = query_start[s] // block_q + s is strictly increasing.
    idx = jnp.arange(c.num_seqs_pad, dtype=jnp.int32)  # (Sp,)
    qs_all = qs_ref[jnp.minimum(idx, num_seqs)]  # (Sp,)
    owns = (idx >= 1) & (idx <= ns) & (qs_all // c.block_q + idx <= b)
    s = jnp.sum(owns.astype(jnp.int32))  # in [0, ns]; ns = the padding tokens
    live = s < ns
    q_begin = qs_ref[s]
    q_end = jnp.where(live, qs_ref[jnp.minimum(s + 1, num_seqs)], num_tokens)
    kv_len = jnp.where(live, lens_ref[jnp.minimum(s, num_seqs - 1)], 0)
    j = b - (q_begin // c.block_q + s)  # block index within the sequence
    t0 = q_begin + j * c.block_q  # first token of the block
    n_q = jnp.clip(q_end - t0, 0, c.block_q)  # tokens in the block
    n_new = jnp.where(live, q_end - q_begin, 0)  # new tokens of the sequence
    cached = jnp.maximum(kv_len - n_new, 0)  # keys already in the pages
    u0 = j * c.block_q  # index of the block's first token among the new ones
    pos0 = cached + u0  # its position
    cols = jnp.arange(head_dim, dtype=jnp.int32)  # (D,)
    cd = _dot_dtype(q_ref.dtype, kc_ref.dtype)
    win = c.sliding_window

    def attend(bq: int, bkn: int):
        rows = bq * c.group_pad
        r_tok = jnp.arange(rows, dtype=jnp.int32) // c.group_pad  # (M,) token of each row
        row_pos = pos0 + r_tok  # (M,)
        tok_ok = jnp.arange(bq, dtype=jnp.int32) < n_q  # (bq,)
        tile_mask = jnp.broadcast_to(tok_ok[:, None, None], (bq, c.group_pad, head_dim))
        head_ok = jnp.arange(c.group_pad, dtype=jnp.int32) < c.group  # (Gp,) a fused qkv has k and v after q
        q_mask = tile_mask & head_ok[None, :, None]
        qt = plgpu.load(q_ref.at[pl.ds(t0, bq), h, pl.ds(0, c.group_pad)], mask=q_mask, other=0)  # (bq, Gp, D)
        qt = _dot_input(qt.reshape(rows, head_dim), cd)  # (M, D)

        def update(carry, kt, vt, mask):
            m, l, acc = carry  # (M,), (M,), (M, D)
            sc = plgpu.dot(qt, kt, trans_b=True, precision=c.precision) * c.scale  # (M, L) f32
            if c.soft_cap:
                sc = c.soft_cap * jnp.tanh(sc / c.soft_cap)
            sc = jnp.where(mask, sc * LOG2E, NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))  # (M,)
            p = jnp.where(mask, jnp.exp2(sc - m_new[:, None]), 0.0)  # (M, L)
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(cd), vt, precision=c.precision)
            return m_new, l, acc

        carry = (
            jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )

        # Cached keys [lo, cached) from the pages, this split's share of the blocks.
        bk = c.block_k
        lo = 0 if win is None else jnp.maximum(pos0 - win + 1, 0)
        blk_lo = lo // bk
        n_blk = jnp.maximum(_cdiv(cached, bk) - blk_lo, 0)
        per = _cdiv(n_blk, c.num_splits)
        i_lo = blk_lo + sp * per
        i_hi = jnp.minimum(blk_lo + n_blk, i_lo + per)
        head_row = h * c.pages_total
        seq_row = jnp.minimum(s, num_seqs - 1) * c.max_pages

        def cached_step(i, carry):
            pos = i * bk + jnp.arange(bk, dtype=jnp.int32)  # (L,)
            valid = pos < cached
            page = plgpu.load(bt_ref.at[seq_row + pos // c.page_size], mask=valid, other=0)  # (L,)
            row = head_row + page * c.page_size + pos % c.page_size  # (L,)
            kv_mask = jnp.broadcast_to(valid[:, None], (bk, head_dim))  # a float fill: Triton casts it to fp8 pages
            kt = plgpu.load(kc_ref.at[row[:, None], cols[None, :]], mask=kv_mask, other=0.0).astype(cd)  # (L, D)
            vt = plgpu.load(vc_ref.at[row[:, None], cols[None, :]], mask=kv_mask, other=0.0).astype(cd)  # (L, D)
            mask = valid[None, :]
            if win is not None:
                mask = mask & (pos[None, :] > row_pos[:, None] - win)
            return update(carry, kt, vt, mask)

        carry = lax.fori_loop(i_lo, i_hi, cached_step, carry)

        # New keys (this step's tokens) straight from k/v, causal; done by the last split (pieces_apart: decodes only).
        mine = live & (sp == c.num_splits - 1)
        if c.pieces_apart:
            mine = mine & (n_new == 1)
        u_hi = jnp.where(mine, u0 + n_q, 0)
        u_lo = 0 if win is None else jnp.maximum(u0 - win + 1, 0)

        def new_step(i, carry):
            u = i * bkn + jnp.arange(bkn, dtype=jnp.int32)  # (Ln,)
            valid = u < u_hi
            row = ((q_begin + u) * num_kv_heads + h) * c.kv_stride
            kv_mask = jnp.broadcast_to(valid[:, None], (bkn, head_dim))
            kt = plgpu.load(k_ref.at[(row + c.k_slot)[:, None], cols[None, :]], mask=kv_mask, other=0)  # (Ln, D)
            kt = kt.astype(kc_ref.dtype).astype(cd)  # rounded as the pages store it
            vt = plgpu.load(v_ref.at[(row + c.v_slot)[:, None], cols[None, :]], mask=kv_mask, other=0)  # (Ln, D)
            vt = vt.astype(vc_ref.dtype).astype(cd)  # rounded as the pages store it
            mask = valid[None, :] & (u[None, :] <= (u0 + r_tok)[:, None])
            if win is not None:
                mask = mask & (u[None, :] > (u0 + r_tok)[:, None] - win)
            return update(carry, kt, vt, mask)

        m, l, acc = lax.fori_loop(u_lo // bkn, _cdiv(u_hi, bkn), new_step, carry)

        if c.write_kv:

            @pl.when(sp == c.num_splits - 1)
            def _():
                tok = t0 + jnp.arange(bq, dtype=jnp.int32)  # (bq,)
                slot = plgpu.load(slot_ref.at[tok], mask=tok_ok, other=-1)
                ok = jnp.broadcast_to((tok_ok & (slot >= 0))[:, None], (bq, head_dim))
                src = (tok * num_kv_heads + h) * c.kv_stride
                dst = head_row + slot
                kn = plgpu.load(k_ref.at[(src + c.k_slot)[:, None], cols[None, :]], mask=ok, other=0)
                vn = plgpu.load(v_ref.at[(src + c.v_slot)[:, None], cols[None, :]], mask=ok, other=0)
                plgpu.store(kc_out.at[dst[:, None], cols[None, :]], kn.astype(kc_out.dtype), mask=ok)
                plgpu.store(vc_out.at[dst[:, None], cols[None, :]], vn.astype(vc_out.dtype), mask=ok)

        shape3 = (bq, c.group_pad, head_dim)
        if c.num_splits == 1 and not c.pieces_apart:
            (out_ref,) = outs
            o = acc / jnp.where(l > 0, l, 1.0)[:, None]
            plgpu.store(out_ref.at[pl.ds(t0, bq), h], o.reshape(shape3).astype(out_ref.dtype), mask=tile_mask)
        else:
            o_ref, m_ref, l_ref = outs
            plgpu.store(o_ref.at[sp, pl.ds(t0, bq), h], acc.reshape(shape3), mask=tile_mask)
            mask2 = jnp.broadcast_to(tok_ok[:, None], (bq, c.group_pad))
            plgpu.store(m_ref.at[sp, pl.ds(t0, bq), h], m.reshape(bq, c.group_pad), mask=mask2)
            plgpu.store(l_ref.at[sp, pl.ds(t0, bq), h], l.reshape(bq, c.group_pad), mask=mask2)

    @pl.when(n_q > 0)
    def _():
        if c.block_q_small == c.block_q:
            attend(c.block_q, c.block_k_new)
        else:
            lax.cond(
                n_q <= c.block_q_small,
                lambda: attend(c.block_q_small, max(16, c.block_q_small)),
                lambda: attend(c.block_q, c.block_k_new),
            )


@dataclasses.dataclass(frozen=True)
class _DecodeConfig:
    rows: int  # tile rows: the group padded to a power of two, at least 16 (Triton's dot)
    block_k: int
    num_splits: int  # static upper bound; a program takes split sp < live_splits(num_seqs)
    split_target: int  # programs with keys wanted per launch (live_splits)
    group: int
    q_stride: int  # rows of q per (token, KV head): G, or G + 2 in a fused qkv
    kv_stride: int
    k_slot: int
    v_slot: int
    num_kv_heads: int
    page_size: int
    pages_total: int
    max_pages: int
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    write_kv: bool
    precision: lax.Precision | None
    interpret: bool
    rope: bool = False  # q and k arrive un-rotated: the kernel applies RoPE (cos/sin tables as two more inputs)


def live_splits(num_seqs: jax.Array, num_kv_heads: int, num_splits: int, split_target: int) -> jax.Array:
    """KV splits per live sequence in the decode kernel: enough programs for split_target among the live sequences'
    (KV head, split) pairs, at most the launch's num_splits. The kernel and its XLA combine both use it."""
    work = jnp.maximum(num_seqs, 1) * num_kv_heads
    return jnp.clip((split_target + work - 1) // work, 1, num_splits).astype(jnp.int32)


def _decode_kernel(lens_ref, nseq_ref, bt_ref, slot_ref, q_ref, k_ref, v_ref, kc_ref, vc_ref, *outs, c: _DecodeConfig):
    """A decode batch (query token s is sequence s's only one): program (split sp, KV head h, sequence s). No search
    for the sequence, no prefill tile: programs of padding sequences and of splits past live_splits only store an
    empty partial (zeros with one split).
    Refs are flat: q (T * KVH * q_stride, D), k/v (T * KVH * kv_stride, D), kc/vc (KVH * P * ps, D); with c.rope
    two more inputs, cos and sin (T * D/2,); outputs (S * KVH * G, D), or partials (NS * S * KVH * G, D) and
    (NS * S * KVH * G,) x 2."""
    cos_ref = sin_ref = None
    if c.rope:
        cos_ref, sin_ref, *outs = outs
    if c.write_kv:
        *outs, kc_out, vc_out = outs
    sp, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_seqs = lens_ref.shape[0]
    head_dim = kc_ref.shape[1]
    ns = nseq_ref[0]
    splits = live_splits(ns, c.num_kv_heads, c.num_splits, c.split_target)
    cols = jnp.arange(head_dim, dtype=jnp.int32)  # (D,)
    r = jnp.arange(c.rows, dtype=jnp.int32)  # (M,) query head of the group
    head_ok = r < c.group
    q_mask = jnp.broadcast_to(head_ok[:, None], (c.rows, head_dim))
    # This program's rows of the (NS *) S * KVH * G outputs. A masked row (past the group) writes nothing on a GPU;
    # Pallas's interpreter stores every row (a masked one as the value it read), so there each masked row points at
    # a spare row of its own at the end.
    total = c.num_splits * num_seqs * c.num_kv_heads * c.group
    part = (sp * num_seqs + s) * c.num_kv_heads * c.group + h * c.group + r
    part = jnp.where(head_ok, part, total + r if c.interpret else 0)

    def store(m, l, acc):
        if c.num_splits == 1:
            (out_ref,) = outs
            o = acc / jnp.where(l > 0, l, 1.0)[:, None]
            plgpu.store(out_ref.at[part[:, None], cols[None, :]], o.astype(out_ref.dtype), mask=q_mask)
        else:
            o_ref, m_ref, l_ref = outs
            plgpu.store(o_ref.at[part[:, None], cols[None, :]], acc, mask=q_mask)
            plgpu.store(m_ref.at[part], m, mask=head_ok)
            plgpu.store(l_ref.at[part], l, mask=head_ok)

    live = (s < ns) & (sp < splits)

    @pl.when(~live)
    def _():  # a padding sequence, or a split it does not use: no keys (the combine then gives zeros / ignores it)
        store(jnp.full((c.rows,), NEG, jnp.float32), jnp.zeros((c.rows,), jnp.float32),
              jnp.zeros((c.rows, head_dim), jnp.float32))  # fmt: skip

    @pl.when(live)
    def _():
        kv_len = lens_ref[s]
        cached = kv_len - 1  # keys in the pages before this step; the new one is at position `cached`
        cd = _dot_dtype(q_ref.dtype, kc_ref.dtype)
        win = c.sliding_window
        tok_row = s * c.num_kv_heads + h
        q_rows = jnp.where(head_ok, tok_row * c.q_stride + r, 0)
        last = sp == splits - 1
        one = jnp.zeros((1,), jnp.int32)
        kv_row = tok_row * c.kv_stride + one  # (1,)

        def ld(ref, rows, pc, mask=None):
            """ref's rows x columns pc."""
            masked = {} if mask is None else {"mask": mask, "other": 0}
            return plgpu.load(ref.at[rows[:, None], pc[None, :]], **masked)

        vn = ld(v_ref, kv_row + c.v_slot, cols)  # (1, D) the new value
        if c.rope:
            # RoPE (HF's rotate-half, as transformer.rope), q and k taken as their two halves (contiguous loads): the
            # rotated halves x1 * cos - x2 * sin and x2 * cos + x1 * sin, rounded to x's dtype as rope() rounds them;
            # the scores are the two halves' dots summed, the cached keys loaded by halves too
            half = head_dim // 2
            lo_cols = jnp.arange(half, dtype=jnp.int32)
            parts = [lo_cols, lo_cols + half]  # the columns of each part
            cos = plgpu.load(cos_ref.at[s * half + lo_cols])[None, :]  # (1, D/2)
            sin = plgpu.load(sin_ref.at[s * half + lo_cols])[None, :]

            def rot(ref, rows, mask):
                x1, x2 = (ld(ref, rows, pc, mask) for pc in parts)
                cs, sn = cos.astype(x1.dtype), sin.astype(x1.dtype)
                return [x1 * cs - x2 * sn, x2 * cs + x1 * sn]

            q_half = jnp.broadcast_to(head_ok[:, None], (c.rows, half))
            qts = [_dot_input(x, cd) for x in rot(q_ref, q_rows, q_half)]  # (M, D/2) x 2
            kns = rot(k_ref, kv_row + c.k_slot, None)  # (1, D/2) x 2: the new key, rotated
        else:
            parts = [cols]
            qts = [_dot_input(ld(q_ref, q_rows, cols, q_mask), cd)]  # (M, D)
            kns = [ld(k_ref, kv_row + c.k_slot, cols)]  # (1, D) the new key

        def add_all(xs):
            total = xs[0]
            for x in xs[1:]:
                total = total + x
            return total

        def scores(sc):
            if c.soft_cap:
                sc = c.soft_cap * jnp.tanh(sc / c.soft_cap)
            return sc * LOG2E

        def update(carry, kts, vt, mask):
            m, l, acc = carry  # (M,), (M,), (M, D)
            dots = [plgpu.dot(qt, kt, trans_b=True, precision=c.precision) for qt, kt in zip(qts, kts, strict=True)]
            sc = scores(add_all(dots) * c.scale)  # (M, L) f32
            sc = jnp.where(mask, sc, NEG)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            p = jnp.where(mask, jnp.exp2(sc - m_new[:, None]), 0.0)
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(cd), vt, precision=c.precision)
            return m_new, l, acc

        # The new key first, by the last live split: one row, so a product and a row sum rather than a dot.
        kfs = [kn.astype(kc_ref.dtype).astype(cd).astype(jnp.float32) for kn in kns]  # rounded as the pages store it
        vf = vn.astype(vc_ref.dtype).astype(cd).astype(jnp.float32)
        sc_new = add_all([jnp.sum(qt.astype(jnp.float32) * kf, axis=1) for qt, kf in zip(qts, kfs, strict=True)])
        sc_new = scores(sc_new * c.scale)  # (M,)
        on = last.astype(jnp.float32)  # 1 in the last live split, else 0 (no keys yet)
        m = jnp.where(jnp.broadcast_to(last, (c.rows,)), sc_new, jnp.full((c.rows,), NEG, jnp.float32))
        l = jnp.full((c.rows,), 1.0, jnp.float32) * on
        acc = jnp.broadcast_to(vf, (c.rows, head_dim)) * on  # p = exp2(0) = 1

        # This split's share of the cached keys [lo, cached).
        bk = c.block_k
        lo = 0 if win is None else jnp.maximum(cached - win + 1, 0)
        blk_lo = lo // bk
        n_blk = jnp.maximum(_cdiv(cached, bk) - blk_lo, 0)
        per = _cdiv(n_blk, splits)
        i_lo = blk_lo + sp * per
        i_hi = jnp.minimum(blk_lo + n_blk, i_lo + per)
        head_row = h * c.pages_total
        seq_row = s * c.max_pages

        def cached_step(i, carry):
            pos = i * bk + jnp.arange(bk, dtype=jnp.int32)  # (L,)
            valid = (pos < cached) & (pos >= lo)
            page = plgpu.load(bt_ref.at[seq_row + jnp.where(valid, pos, 0) // c.page_size], mask=valid, other=0)
            row = head_row + page * c.page_size + pos % c.page_size  # (L,)
            kts = [
                plgpu.load(
                    kc_ref.at[row[:, None], pc[None, :]], mask=jnp.broadcast_to(valid[:, None], (bk, pc.shape[0])),
                    other=0.0,
                ).astype(cd)
                for pc in parts
            ]  # fmt: skip
            kv_mask = jnp.broadcast_to(valid[:, None], (bk, head_dim))
            vt = plgpu.load(vc_ref.at[row[:, None], cols[None, :]], mask=kv_mask, other=0.0).astype(cd)
            return update(carry, kts, vt, jnp.broadcast_to(valid[None, :], (c.rows, bk)))

        m, l, acc = lax.fori_loop(i_lo, i_hi, cached_step, (m, l, acc))

        if c.write_kv:

            @pl.when(last)
            def _():
                slot = slot_ref[s]
                dst = (head_row + jnp.maximum(slot, 0) + one)[:, None]
                for pc, kn in zip(parts, kns, strict=True):
                    ok = jnp.broadcast_to(slot >= 0, (1, pc.shape[0]))
                    plgpu.store(kc_out.at[dst, pc[None, :]], kn.astype(kc_out.dtype), mask=ok)
                ok = jnp.broadcast_to(slot >= 0, (1, head_dim))
                plgpu.store(vc_out.at[dst, cols[None, :]], vn.astype(vc_out.dtype), mask=ok)

        store(m, l, acc)


def _decode_attention(q, k, v, k_pages, v_pages, batch, *, fused, group, scale, sliding_window, soft_cap, interpret,
                      num_splits, block_k, num_warps, num_stages, precision, rope=None):  # fmt: skip
    """paged_attention of a decode batch through _decode_kernel (the K/V written in the kernel); rope: (cos, sin)
    tables (T, 1, D/2) that the kernel applies to q and k (un-rotated in q / k)."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    num_tokens = q.shape[0]
    out_dtype = q.dtype
    num_seqs, max_pages = batch.block_tables.shape
    if num_tokens < num_seqs:
        raise ValueError(f"a decode batch has a token per sequence slot, got T={num_tokens} < S={num_seqs}")
    cores = getattr(jax.devices()[0], "core_count", None) or 132
    c = _DecodeConfig(
        rows=max(16, _next_pow2(group)),
        block_k=block_k,
        num_splits=num_splits,
        split_target=4 * cores,
        group=group,
        q_stride=group + 2 if fused else group,
        kv_stride=group + 2 if fused else 1,
        k_slot=group if fused else 0,
        v_slot=group + 1 if fused else 0,
        num_kv_heads=num_kv_heads,
        page_size=page_size,
        pages_total=num_pages * page_size,
        max_pages=max_pages,
        scale=float(scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        write_kv=True,
        precision=precision,
        interpret=interpret,
        rope=rope is not None,
    )
    kc = k_pages.reshape(num_kv_heads * num_pages * page_size, head_dim)
    vc = v_pages.reshape(num_kv_heads * num_pages * page_size, head_dim)
    flat = q.reshape(-1, head_dim)
    args = (
        batch.seq_lens.astype(jnp.int32),
        batch.num_seqs.astype(jnp.int32),
        batch.block_tables.reshape(-1).astype(jnp.int32),
        batch.slot_mapping.astype(jnp.int32),
        flat,
        flat if fused else k.reshape(-1, head_dim),
        flat if fused else v.reshape(-1, head_dim),
        kc,
        vc,
    )
    if rope is not None:  # (T, 1, D/2) each, flat; in q's dtype, as transformer.rope multiplies them
        args += tuple(t.reshape(-1).astype(out_dtype) for t in rope)
    rows = num_splits * num_seqs * num_kv_heads * group + (c.rows if interpret else 0)  # + the spare rows
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, head_dim), out_dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ]
    aliases = {7: len(out_shape), 8: len(out_shape) + 1}
    out_shape += [jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype)]
    *outs, kc, vc = pl.pallas_call(
        functools.partial(_decode_kernel, c=c),
        grid=(num_splits, num_kv_heads, num_seqs),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"kiln_decode_attention_k{block_k}_s{num_splits}{'_rope' if rope is not None else ''}",
    )(*args)
    tile = (num_splits, num_seqs, num_kv_heads, group)
    if interpret:  # the spare rows dropped
        outs = [x[: math.prod(tile)] for x in outs]
    outs = [x.reshape(*tile, *x.shape[1:]) for x in outs]
    if num_splits == 1:
        out = outs[0][0]  # padding sequences' rows are zeros
    else:  # every program wrote its partial (m = NEG, l = 0, acc = 0 without keys): the general kernel's combine
        o, m, l = outs  # (NS, S, KVH, G, D), (NS, S, KVH, G) x2; m in log2 units
        w = jnp.exp2(m - jnp.max(m, axis=0))
        den = jnp.sum(w * l, axis=0)
        out = jnp.sum(w[..., None] * o, axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
        out = out.astype(out_dtype)
    out = out.reshape(num_seqs, num_kv_heads * group, head_dim)
    if num_tokens > num_seqs:
        out = jnp.pad(out, ((0, num_tokens - num_seqs), (0, 0), (0, 0)))
    return out, kc.reshape(k_pages.shape), vc.reshape(v_pages.shape)


def default_decode_splits(num_seqs: int, max_kv: int, num_kv_heads: int, block_k: int) -> int:
    """The decode kernel's static split bound: what default_splits gives a batch of S sequences (live_splits then
    gives fewer live sequences more splits, up to this bound)."""
    return default_splits(num_seqs, num_seqs, max_kv, num_kv_heads, 1, block_k)


def default_splits(num_tokens: int, num_seqs: int, max_kv: int, num_kv_heads: int, block_q: int, block_k: int) -> int:
    """KV splits per sequence so that a batch of few sequences still fills the GPU (about 4 programs per SM)."""
    cores = getattr(jax.devices()[0], "core_count", None) or 132
    blocks = min(num_seqs, num_tokens) + _cdiv(max(num_tokens - num_seqs, 0), block_q)  # q blocks, at most
    work = blocks * num_kv_heads
    if work >= 2 * cores:
        return 1
    return max(1, min(_cdiv(4 * cores, work), _cdiv(max_kv, block_k), 128))


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
    interpret: bool = False,
    num_splits: int | None = None,
    block_k: int | None = None,
    block_k_new: int | None = None,
    rows_small: int = 16,
    rows_big: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    write_kv_in: str = "kernel",
    decode: bool | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
    pieces: Callable | None | str = "default",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Ragged paged attention (see reference.paged_attention for the contract).

    q: (T, H, D); k, v: (T, KVH, D); k_pages, v_pages: (KVH, P, page_size, D). Returns out (T, H, D) in q's dtype
    (zeros for padding tokens) and the pages with the new K/V written. `interpret` runs Pallas's interpreter (CPU).
    The tuning knobs (splits, tile sizes, warps, stages, where the K/V write happens) are static. k = v = None: q is
    a fused qkv (T, KVH, G + 2, D) (paged_attention_qkv). decode: the batch is a decode batch (query token s is
    sequence s's only one), run by the decode-only kernel (_decode_kernel); None: while tracing inside
    kiln.models.kernels.decode_batch() (the multi-step decode programs), with the K/V written in the kernel.
    rope: (cos, sin) tables (T, 1, D/2) (transformer.rope_tables) when q and k arrive un-rotated: the decode kernel
    rotates them as it loads them (while ROPE_IN_KERNEL; one XLA fusion a layer fewer), the other paths in XLA first
    (transformer.rope's values either way). pieces: the attention of each prefill piece (a sequence's new tokens when
    it has more than one) over its own new tokens, as reference.piece_attention computes it (cudnn_gpu's on CUDA); the
    kernel then does the cached keys and the decodes' own key, and the two halves are merged by their log-sum-exp.
    None: the kernel does it all; "default": default_pieces(T).
    """
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if decode is None:
        decode = DECODE_BATCH.get() and write_kv_in == "kernel"
    fused = k is None
    if fused:  # each KV head's G query heads, then its k, then its v (kiln.models.transformer.fuse_linears)
        num_tokens, _, slots, head_dim = q.shape
        group = slots - 2
        num_heads = group * num_kv_heads
    else:
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // num_kv_heads
    num_seqs, max_pages = batch.block_tables.shape
    if num_heads % num_kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"pallas_gpu needs H % KVH == 0 and a power-of-two head_dim >= 16, got {q.shape=}")
    if block_k is None:
        # 64 keys a step. Measured on an H200 (Triton 3.6): a 64-key block with 64-token pages asked for 276 KB of
        # shared memory once sequences reach 128 pages, so 64-token pages take 128-key blocks (they compile and run).
        block_k = 128 if page_size == 64 else 64
        if decode and num_seqs <= DECODE_SMALL_SEQS and head_dim <= 128:  # D = 256 tiles: 64 (shared memory)
            block_k = max(block_k, DECODE_SMALL_BLOCK_K)
        if decode and jnp.dtype(k_pages.dtype).itemsize == 1 and head_dim <= 128:
            block_k = max(block_k, FP8_CACHE_DECODE_BLOCK_K)
    precision = lax.Precision.HIGHEST if jnp.float32 in (q.dtype, k_pages.dtype) else None
    if rope is not None and not (decode and ROPE_IN_KERNEL and head_dim >= 32):  # halves >= 16 (tl.dot)
        if fused:
            q = _rope_slots(q, *rope, group + 1)
        else:
            q, k = _rope(q, *rope), _rope(k, *rope)
        rope = None
    if decode:
        if num_splits is None:
            num_splits = default_decode_splits(num_seqs, max_pages * page_size, num_kv_heads, block_k)
        return _decode_attention(
            q, k, v, k_pages, v_pages, batch, fused=fused, group=group, scale=scale, sliding_window=sliding_window,
            soft_cap=soft_cap, interpret=interpret, num_splits=num_splits, block_k=block_k, num_warps=num_warps,
            num_stages=num_stages, precision=precision, rope=rope,
        )  # fmt: skip
    if pieces == "default":
        pieces = None if interpret or soft_cap or sliding_window else default_pieces(num_tokens)
    if pieces is not None and (soft_cap or sliding_window):
        raise ValueError("pallas_gpu: pieces (the prompts' own keys apart) takes no sliding window or soft cap")
    gp = _next_pow2(group)
    block_q_small = max(1, rows_small // gp)
    block_q = max(block_q_small, rows_big // gp)
    if num_splits is None:
        num_splits = default_splits(num_tokens, num_seqs, max_pages * page_size, num_kv_heads, block_q, block_k)
    if fused and (write_kv_in != "kernel" or gp > group + 2):  # no room for the padded q tile: the separate path
        return paged_attention(
            q[:, :, :group].reshape(num_tokens, num_heads, head_dim), q[:, :, group], q[:, :, group + 1], k_pages,
            v_pages, batch, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret,
            num_splits=num_splits, block_k=block_k, block_k_new=block_k_new, rows_small=rows_small,
            rows_big=rows_big, num_warps=num_warps, num_stages=num_stages, write_kv_in=write_kv_in, pieces=pieces,
        )  # fmt: skip
    in_kernel = write_kv_in == "kernel"
    if not in_kernel:
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
    c = _Config(
        block_q=block_q,
        block_q_small=block_q_small,
        block_k=block_k,
        block_k_new=block_k_new or PREFILL_BLOCK_K_NEW,
        num_splits=num_splits,
        group=group,
        group_pad=gp,
        page_size=page_size,
        pages_total=num_pages * page_size,
        max_pages=max_pages,
        num_seqs_pad=_next_pow2(num_seqs + 1),
        scale=float(scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        write_kv=in_kernel,
        precision=precision,
        kv_stride=group + 2 if fused else 1,
        k_slot=group if fused else 0,
        v_slot=group + 1 if fused else 0,
        pieces_apart=pieces is not None,
    )
    partials = num_splits > 1 or pieces is not None

    if fused:
        qg = q  # (T, KVH, G + 2, D): the kernel reads the first Gp of each KV head's rows, masked to G
        k = v = q.reshape(num_tokens * num_kv_heads * (group + 2), head_dim)  # k / v: rows G / G + 1 of each head
    else:
        qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # (T, KVH, G, D)
        if gp != group:
            qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))  # (T, KVH, Gp, D)
    rows_out = num_tokens
    if interpret:  # the interpreter shifts a dynamic slice that overhangs the end: give every tile room
        rows_out = num_tokens + block_q
        qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, 0), (0, 0)))  # (T + block_q, KVH, Gp, D)
    kc = k_pages.reshape(num_kv_heads * num_pages * page_size, head_dim)  # (KVH * P * ps, D)
    vc = v_pages.reshape(num_kv_heads * num_pages * page_size, head_dim)
    args = (
        batch.query_start.astype(jnp.int32),
        batch.seq_lens.astype(jnp.int32),
        batch.num_seqs.astype(jnp.int32),
        batch.block_tables.reshape(-1).astype(jnp.int32),
        batch.slot_mapping.astype(jnp.int32),
        qg,
        k.reshape(-1, head_dim),
        v.reshape(-1, head_dim),
        kc,
        vc,
    )
    tile = (rows_out, num_kv_heads, gp)
    if not partials:
        out_shape = [jax.ShapeDtypeStruct((*tile, head_dim), q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, *tile, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, *tile), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, *tile), jnp.float32),
        ]
    aliases = {}
    if in_kernel:
        aliases = {8: len(out_shape), 9: len(out_shape) + 1}
        out_shape += [jax.ShapeDtypeStruct(kc.shape, kc.dtype), jax.ShapeDtypeStruct(vc.shape, vc.dtype)]
    grid = (_cdiv(num_tokens, block_q) + num_seqs, num_kv_heads, num_splits)
    outs = pl.pallas_call(
        functools.partial(_kernel, c=c),
        grid=grid,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"kiln_paged_attention_q{block_q}_k{block_k}_s{num_splits}",
    )(*args)
    if in_kernel:
        *outs, kc, vc = outs
        k_pages = kc.reshape(k_pages.shape)
        v_pages = vc.reshape(v_pages.shape)
    if not partials:
        return outs[0][:num_tokens, :, :group].reshape(num_tokens, num_heads, head_dim), k_pages, v_pages
    o, m, l = (x[:, :num_tokens, :, :group] for x in outs)  # (NS, T, KVH, G, D), (NS, T, KVH, G) x2; m in log2 units
    if pieces is not None:  # the pieces' own keys as one more split: acc = their output, l = 1, m = the lse in log2
        if fused:
            q, k, v = q[:, :, :group].reshape(num_tokens, num_heads, head_dim), q[:, :, group], q[:, :, group + 1]
        k, v = k.astype(k_pages.dtype).astype(q.dtype), v.astype(v_pages.dtype).astype(q.dtype)  # as the pages hold
        po, lse, covered = pieces(q, k, v, batch, scale=scale)  # (T, H, D), (T, H), (T,)
        split = (num_tokens, num_kv_heads, group)
        o = jnp.concatenate([o, jnp.where(covered[:, None, None], po, 0).reshape(1, *split, head_dim)])
        m = jnp.concatenate([m, jnp.where(covered[:, None], lse * LOG2E, NEG).reshape(1, *split)])
        l = jnp.concatenate([l, jnp.broadcast_to(covered[:, None, None], split).astype(jnp.float32)[None]])
    m_max = jnp.max(m, axis=0)  # (T, KVH, G)
    w = jnp.exp2(m - m_max)  # (NS, T, KVH, G)
    den = jnp.sum(w * l, axis=0)
    out = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
    return out.astype(q.dtype).reshape(num_tokens, num_heads, head_dim), k_pages, v_pages


def default_pieces(num_tokens: int) -> Callable | None:
    """The pieces attention a step of num_tokens tokens takes by default: cudnn_gpu.piece_attention for buckets of
    at least PIECES_CUDNN_MIN_TOKENS on a CUDA GPU with cuDNN's packed flash attention (Hopper and newer), else None
    (the kernel does all of it)."""
    if PIECES_CUDNN_MIN_TOKENS is None or num_tokens < PIECES_CUDNN_MIN_TOKENS:
        return None
    from kiln.models.kernels import cudnn_gpu

    return cudnn_gpu.piece_attention if cudnn_gpu.available() else None


def paged_attention_qkv(
    qkv: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: Batch, **kwargs
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """paged_attention of a fused qkv (T, KVH, G + 2, D) (each KV head's G query heads, then its key, then its value:
    kiln.models.transformer.fuse_linears's layout, after RoPE, or before it with rope=(cos, sin)): the kernel reads
    q, k and v out of it, so XLA need not cut it into three arrays first (three kernels a layer at decode sizes).
    Same values as reference.paged_attention_qkv (of the rotated qkv)."""
    return paged_attention(qkv, None, None, k_pages, v_pages, batch, **kwargs)


paged_attention_qkv.takes_rope = True  # transformer.forward passes the un-rotated qkv and the RoPE tables


def _rope(x, cos, sin):
    """transformer.rope: x (T, N, D), cos and sin (T, 1, D/2)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_slots(x, cos, sin, n: int):
    """transformer._rope_slots: _rope of the first n of the S rows of each KV head of x (T, KVH, S, D)."""
    t, kvh, slots, d = x.shape
    rotated = _rope(x.reshape(t, kvh * slots, d), cos, sin).reshape(x.shape)
    return jnp.where((jnp.arange(slots) < n)[None, None, :, None], rotated, x)


# ---- the residual add and RMSNorm of a decode step, fed by float32 partials -------------------------------------
#
# transformer.forward hands the next norm float32 rows to add (a mixture of experts' k weighted expert rows at one
# token, kiln.models.moe.add_norm_mlp) where the attention offers add_norm: add_rms_norm sums them, adds the residual
# and normalises in one kernel. (Dense layers' o and down GEMMs as 8 K-piece partials summed here, and the q|k|v GEMM's
# 4 summed by the decode kernel, ADD_NORM_PIECES / QKV_PIECES of session 11, were removed in session 12: on an H200
# the 8-step decode program at c = 1 took 4.52 ms a token of kernels with them against 4.47 without in session 11,
# 4.47 against 4.49 in session 12, the wall time following the variants' order (the first ran slower either way);
# this kernel took 4.1 us a call there against 3.8 for XLA's add and RMSNorm fusions together: 16 programs, a row each.)


def _add_norm_kernel(x_ref, p_ref, w_ref, xo_ref, h_ref, *, eps: float):
    x = x_ref[...]  # (E,)
    o = jnp.sum(p_ref[...], axis=0).astype(x.dtype)  # (E,) the GEMM's output, rounded as its dot's would be
    xn = x + o
    x32 = xn.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32) + eps)
    xo_ref[...] = xn
    h_ref[...] = y.astype(xn.dtype) * w_ref[...]


def add_rms_norm(
    x: jax.Array, parts: jax.Array, w: jax.Array, eps: float, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """x + sum(parts) and its RMSNorm (transformer.rms_norm) in one kernel, one program a row: x (T, E), parts
    float32 rows (P, T, E) whose sum, rounded to x's dtype, is added; w (E,). Returns (x', norm(x'))."""
    num_tokens, hidden = x.shape
    pieces = parts.shape[0]
    row = pl.BlockSpec((None, hidden), lambda t: (t, 0))
    return pl.pallas_call(
        functools.partial(_add_norm_kernel, eps=float(eps)),
        grid=(num_tokens,),
        in_specs=[
            row,
            pl.BlockSpec((pieces, None, hidden), lambda t: (0, t, 0)),
            pl.BlockSpec((hidden,), lambda t: (0,)),
        ],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
        interpret=interpret,
        # a row's P x E float32 partials (128 KB for 8 x 4096) in registers at once: 8 warps, 128 values a thread
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        name=f"kiln_add_rms_norm_p{pieces}",
    )(x, parts, w.astype(x.dtype))


# transformer.forward's hook into the decode programs (see above): read off the fused-qkv entry point it is given
paged_attention_qkv.add_norm = add_rms_norm

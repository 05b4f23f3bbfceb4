"""The TPU paged-attention kernel (Pallas/Mosaic), run in Pallas's TPU interpret mode on the CPU, against the
reference implementation on fresh random inputs.

Each case is small (interpret mode is slow) and the cases together cover every value of every axis: head_dim 64,
128, 256; GQA ratio 1, 4, 8; page size 16, 32, 64; decode-only, prefill-only and mixed batches; sequences ending
mid-page; padding sequences and padding tokens; sliding window; soft cap; q blocks holding several sequences and
sequences spanning several q blocks and KV blocks (so the double buffer and the prefetch across items and grid steps
run), and an all-padding batch.
Tolerance: float32 relative error ||out - ref|| / ||ref|| < 1e-5 (bf16: 1e-2); pages must match exactly.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.models.batch import SeqChunk, make_batch
from kiln.models.kernels import get_attention, pallas_tpu, reference

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # interpret mode: many small compiles


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    group: int  # query heads per KV head
    page_size: int
    chunks: tuple[tuple[int, int], ...]  # per live sequence: (KV length before the step, new tokens)
    num_tokens: int  # T bucket (>= total new tokens; the rest is padding)
    num_seqs: int  # S bucket (>= live sequences; the rest is padding)
    num_kv_heads: int = 2
    sliding_window: int | None = None
    soft_cap: float | None = None
    q_block: int | None = None
    pages_per_block: int | None = None
    dtype: str = "float32"
    empty_too: bool = False  # also run an all-padding batch of the same shapes through the same executable


CASES = [
    # prefill continuing at mid-page, a decode, a fresh prompt ending mid-page, all in one q block; a padding
    # sequence, padding tokens
    # and then an all-padding step of the same bucket: nothing live, output zeros, pages untouched
    Case("mixed-d64-g1-ps16", 64, 1, 16, ((5, 20), (40, 1), (0, 9)), num_tokens=40, num_seqs=4, empty_too=True),
    # decode only (T <= S: the decode block size, two sequences per q block), lengths ending mid-page and on a page
    # boundary; soft cap
    Case("decode-d128-g4-ps32", 128, 4, 32, ((70, 1), (31, 1), (63, 1)), 4, 4, soft_cap=20.0),
    # prefill only, several KV blocks per item and query blocks per sequence; the window skips whole blocks
    Case(
        "prefill-d256-g8-ps64-window",
        256,
        8,
        64,
        ((0, 150), (100, 30)),
        192,
        2,
        num_kv_heads=1,
        sliding_window=48,
        q_block=32,
        pages_per_block=1,
    ),
    # mixed with many items per KV head (cross-item prefetch), window and soft cap together, 2-page KV blocks
    Case(
        "mixed-d128-g8-ps16-window-cap",
        128,
        8,
        16,
        ((0, 37), (50, 1), (17, 1), (90, 12)),
        64,
        6,
        sliding_window=40,
        soft_cap=30.0,
        q_block=8,
        pages_per_block=2,
    ),
    # bf16 mixed batch with the default block sizes
    Case("mixed-bf16-d128-g4-ps16", 128, 4, 16, ((3, 29), (60, 1), (0, 1)), 40, 4, dtype="bfloat16"),
]


def make_inputs(case: Case, seed: int, empty: bool = False):
    """Random q/k/v and page contents; each sequence gets random distinct pages, so its pages are scattered."""
    rng = np.random.default_rng(seed)
    ps, kvh, d = case.page_size, case.num_kv_heads, case.head_dim
    pages_needed = [-(-(start + n) // ps) for start, n in case.chunks]
    max_pages = max(pages_needed, default=1) + 1
    num_pages = sum(pages_needed) + 3
    order = rng.permutation(num_pages)
    chunks, used = [], 0
    for (start, n), p in zip(case.chunks, pages_needed, strict=True):
        tokens = rng.integers(0, 100, n).tolist()
        chunks.append(SeqChunk(tokens=tokens, start=start, pages=order[used : used + p].tolist()))
        used += p
    chunks = [] if empty else chunks
    batch = jax.tree.map(jnp.asarray, make_batch(chunks, ps, case.num_tokens, case.num_seqs, max_pages))
    dt = jnp.dtype(case.dtype)
    t, h = case.num_tokens, kvh * case.group

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), dt)

    return (
        rand(t, h, d),
        rand(t, kvh, d),
        rand(t, kvh, d),
        rand(kvh, num_pages, ps, d),
        rand(kvh, num_pages, ps, d),
        batch,
    )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case: Case):
    opts = dict(scale=case.head_dim**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    ref = jax.jit(lambda *a: reference.paged_attention(*a, **opts))
    kernel = jax.jit(
        lambda *a: pallas_tpu.paged_attention(
            *a, **opts, q_block=case.q_block, pages_per_block=case.pages_per_block, interpret=True
        )
    )
    for empty in [False, True] if case.empty_too else [False]:
        inputs = make_inputs(case, seed=zlib.crc32(case.name.encode()), empty=empty)
        check(case, kernel(*inputs), ref(*inputs), inputs[-1])


def check(case: Case, got, want, batch) -> None:
    """Pages equal, padding tokens zero, live tokens within the relative tolerance."""
    (out, out_k, out_v), (ref_out, ref_k, ref_v) = got, want
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    np.testing.assert_array_equal(np.asarray(out_k), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(out_v), np.asarray(ref_v))
    live = int(batch.query_start[int(batch.num_seqs[0])])
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert np.all(out32[live:] == 0), "padding tokens must come out zero"
    if live == 0:
        return
    assert np.all(np.isfinite(out32))
    tol = 1e-5 if case.dtype == "float32" else 1e-2
    err = np.linalg.norm(out32 - ref32) / np.linalg.norm(ref32)
    assert err < tol, f"relative error {err:.2e} >= {tol}"


def test_selected_by_name():
    assert get_attention("pallas_tpu") is pallas_tpu.paged_attention


PEER_CASES = [c for c in CASES if c.name == "mixed-d128-g8-ps16-window-cap"]  # window, soft cap, GQA 8, 4 items


@pytest.mark.parametrize("case", PEER_CASES, ids=[c.name for c in PEER_CASES])
def test_kernel_matches_jax_ragged_paged_attention(case: Case):
    """The same inputs through JAX's shipped ragged paged attention's own oracle (ref_ragged_paged_attention, on its
    combined K/V layout): the same outputs and pages. JAX's kernel itself runs in neither Pallas interpret mode on a
    CPU under jax 0.10.2 (see pallas_tpu.jax_ragged_paged_attention); it is compiled deviceless in
    benchmarks/tpu_kernels.py. Only shapes JAX's kernel takes: head_dim a multiple of 128 and 2 * KVH heads that XLA
    tiles fully (SmolLM2's head_dim 64 and 3 KV heads are refused); one case (interpret mode takes ~15 s a case)."""
    opts = dict(scale=case.head_dim**-0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    inputs = make_inputs(case, seed=zlib.crc32(case.name.encode()))
    ours = jax.jit(lambda *a: pallas_tpu.paged_attention(*a, **opts, interpret=True))(*inputs)
    peer = pallas_tpu.jax_ragged_paged_attention(*inputs, **opts, jax_reference=True)
    check(case, ours, peer, inputs[-1])

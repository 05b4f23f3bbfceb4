"""The GPU Pallas kernel (models/kernels/pallas_gpu.py) against the reference, in Pallas interpret mode on the CPU.

Fresh random inputs per case: decode-only, prefill-only and mixed ragged batches, sequences ending mid-page,
padding tokens and padding sequences, GQA 1/4/8 (and an odd group), one and several KV splits, the in-kernel and
the XLA K/V write, a sliding window and a logit soft cap. The same checks at real sizes run on the H200 through
benchmarks/attention_check.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.models.batch import SeqChunk, make_batch
from kiln.models.kernels import get_attention, reference

PAGE = 8


def random_case(rng, lens, *, heads, kv_heads, head_dim=32, num_tokens=None, num_seqs=None, dtype=jnp.float32):
    """lens: list of (cached, new) per sequence. Returns (q, k, v, k_pages, v_pages, batch) with pages shuffled,
    T and S padded beyond what the sequences use."""
    max_kv = max(c + n for c, n in lens)
    max_pages = -(-max_kv // PAGE) + 1
    need = sum(-(-(c + n) // PAGE) for c, n in lens)
    num_pages = need + 3
    perm = rng.permutation(num_pages)
    chunks, used = [], 0
    for cached, new in lens:
        n_pages = -(-(cached + new) // PAGE)
        pages = perm[used : used + n_pages]
        used += n_pages
        chunks.append(SeqChunk(tokens=[1] * new, start=cached, pages=list(pages)))
    n_tok = sum(n for _, n in lens)
    num_tokens = num_tokens or n_tok + 3
    num_seqs = num_seqs or len(lens) + 2
    batch = make_batch(chunks, PAGE, num_tokens, num_seqs, max_pages)
    batch = jax.tree.map(jnp.asarray, batch)
    shape_pages = (kv_heads, num_pages, PAGE, head_dim)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    return (
        f(num_tokens, heads, head_dim),
        f(num_tokens, kv_heads, head_dim),
        f(num_tokens, kv_heads, head_dim),
        f(*shape_pages),
        f(*shape_pages),
        batch,
    )


def check(case, tol=2e-5, **kw):
    q, k, v, kp, vp, batch = case
    scale = q.shape[-1] ** -0.5
    opts = {key: kw.pop(key) for key in ("sliding_window", "soft_cap") if key in kw}
    want, wk, wv = reference.paged_attention(q, k, v, kp, vp, batch, scale=scale, **opts)
    got, gk, gv = get_attention("pallas_gpu")(q, k, v, kp, vp, batch, scale=scale, interpret=True, **opts, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(jnp.all(jnp.isfinite(got)))
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert err < tol, err
    n_live = int(batch.query_start[int(batch.num_seqs[0])])
    assert bool(jnp.all(got[n_live:] == 0)), "padding tokens must be zero"
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wk))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(wv))


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode(rng, group):
    lens = [(int(c), 1) for c in rng.integers(0, 70, size=5)]
    check(random_case(rng, lens, heads=2 * group, kv_heads=2))


def test_decode_split_kv(rng):
    lens = [(77, 1), (5, 1), (0, 1)]
    check(random_case(rng, lens, heads=8, kv_heads=2), num_splits=3, block_k=16)


def test_kv_block_within_a_page(rng):
    lens = [(37, 1), (12, 9)]
    check(random_case(rng, lens, heads=4, kv_heads=2), block_k=PAGE)


def test_prefill(rng):
    lens = [(0, 37), (0, 9)]
    check(random_case(rng, lens, heads=8, kv_heads=2))


def test_mixed_chunked_prefill_and_decodes(rng):
    lens = [(13, 1), (21, 30), (0, 5), (40, 1), (3, 17)]
    check(random_case(rng, lens, heads=8, kv_heads=2, num_tokens=64, num_seqs=8), num_splits=2, block_k=16)


def test_xla_write_and_odd_group(rng):
    lens = [(11, 1), (6, 19), (30, 2)]
    check(random_case(rng, lens, heads=6, kv_heads=2), write_kv_in="xla")


def test_sliding_window_soft_cap(rng):
    lens = [(45, 1), (20, 25), (0, 12)]
    check(random_case(rng, lens, heads=8, kv_heads=2), sliding_window=10, soft_cap=5.0, block_k=16)


def test_bf16(rng):
    lens = [(30, 1), (9, 14)]
    check(random_case(rng, lens, heads=8, kv_heads=1, dtype=jnp.bfloat16), tol=1e-2)

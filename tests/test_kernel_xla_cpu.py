"""The CPU target's attention (models/kernels/xla_cpu.py: kiln's C++ kernel on float32 pages where it is built, XLA
ops otherwise) against the reference on fresh random inputs: decodes,
fresh prompts, chunked prefills over cached pages and padding in one ragged batch, GQA 1/4 and an odd group of 3,
a sliding window and a logit soft cap, KV blocks that end mid-sequence, and bf16 / fp8 pages."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernel_gpu import MIXED, PAGE, jitted, random_case

from kiln.models.batch import SeqChunk, make_batch
from kiln.models.kernels import get_attention

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # small attention programs: compiling costs more than running

LONG = [(70, 1), (0, 23), (45, 12), (3, 1)]  # cached context spanning several 16-key blocks, a fresh prompt


def check(case, *, tol=2e-5, **kw):
    q, k, v, kp, vp, batch = case
    want, wk, wv = jitted("reference", **kw)(q, k, v, kp, vp, batch)
    got, gk, gv = jitted("xla_cpu", **kw)(q, k, v, kp, vp, batch)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert err < tol, err
    n_live = int(batch.query_start[int(batch.num_seqs[0])])
    assert bool(jnp.all(got[n_live:] == 0)), "padding tokens must be zero"
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wk))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(wv))


def decode_case(rng, contexts, *, heads=8, kv_heads=2, num_tokens=8, d=16):
    """A decode-sized step (T = S, one token per sequence, the rest padding): the token-by-token path."""
    chunks, first = [], 0
    for c in contexts:
        n = -(-(c + 1) // PAGE)
        chunks.append(SeqChunk([1], c, list(range(first, first + n))[::-1]))  # pages out of order
        first += n
    max_pages = max(12, -(-(max(contexts) + 1) // PAGE))
    batch = jax.tree.map(jnp.asarray, make_batch(chunks, PAGE, num_tokens, num_tokens, max_pages))
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    pages = (kv_heads, first + 2, PAGE, d)
    return f(num_tokens, heads, d), f(num_tokens, kv_heads, d), f(num_tokens, kv_heads, d), f(*pages), f(*pages), batch


def test_decode_step_token_by_token(rng):
    check(decode_case(rng, [0, 7, 40, 95, 16, 63]), kv_block=2 * PAGE)
    check(decode_case(rng, [90, 3]), sliding_window=20, soft_cap=5.0, kv_block=2 * PAGE)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize(
    "lens",
    [[(int(c), 1) for c in (0, 7, 8, 33, 70, 94)], [(0, 37), (0, 9), (0, 1)], MIXED, LONG],
    ids=["decode", "prefill", "mixed", "long"],
)
def test_gqa4(rng, lens):
    check(random_case(rng, lens, heads=8, kv_heads=2), kv_block=2 * PAGE)


def test_gqa1_and_group3(rng):
    check(random_case(rng, LONG, heads=4, kv_heads=4), kv_block=2 * PAGE)
    check(random_case(rng, MIXED, heads=6, kv_heads=2), kv_block=PAGE)


def test_window_soft_cap(rng):
    check(random_case(rng, LONG, heads=8, kv_heads=2), sliding_window=10, soft_cap=5.0, kv_block=2 * PAGE)


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_narrow_pages(rng, kv_dtype):
    check(random_case(rng, LONG, heads=8, kv_heads=2, kv_dtype=kv_dtype), kv_block=2 * PAGE)


def test_xla_ops_path(rng, monkeypatch):
    """The XLA ops that float32 pages take without the C++ kernel (no compiler at install, KILN_CPU_ATTENTION=xla):
    the other tests run the kernel there."""
    from kiln.models.kernels import xla_cpu

    monkeypatch.setattr(xla_cpu, "KERNEL", False)
    check(random_case(rng, MIXED, heads=6, kv_heads=2), sliding_window=10, soft_cap=5.0, kv_block=PAGE)
    check(decode_case(rng, [0, 7, 40, 95]), kv_block=2 * PAGE)


def test_decode_kernel(rng, monkeypatch):
    """Steps on float32 pages run kiln's C++ paged attention (cpu_quant.cc) where it is built: decode steps against
    the reference on fresh random pages, head dims 64 (SmolLM2's) and 20 (a remainder), groups of 1 / 3 / 4, contexts
    past 256 keys, a sliding window with a soft cap, padding tokens (the other tests: prefill and mixed steps)."""
    from kiln.models.kernels import cpu_quant, xla_cpu

    if not cpu_quant.attention_available():
        pytest.skip("kiln's CPU kernels are not built")
    cases = [
        (dict(heads=9, kv_heads=3, d=64), [0, 15, 16, 100, 270], {}),
        (dict(heads=8, kv_heads=2, d=20, num_tokens=4), [33, 1, 64], dict(sliding_window=20, soft_cap=5.0)),
        (dict(heads=4, kv_heads=4, d=64, num_tokens=2), [260], dict(sliding_window=7)),
    ]
    for shape, contexts, kw in cases:
        case = decode_case(rng, contexts, **shape)
        q, k, v, kp, vp, batch = case
        fn = jax.jit(lambda *a, kw=kw, s=shape: get_attention("xla_cpu")(*a, scale=s["d"] ** -0.5, **kw))
        assert "kiln_paged_attention" in fn.lower(*case).as_text()
        got = fn(*case)[0]
        want = jax.jit(lambda *a, kw=kw, s=shape: get_attention("reference")(*a, scale=s["d"] ** -0.5, **kw))(*case)[0]
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        assert err < 2e-6, (shape, err)
        assert bool(jnp.all(got[len(contexts) :] == 0)), "padding tokens must be zero"
    monkeypatch.setattr(xla_cpu, "KERNEL", False)  # KILN_CPU_ATTENTION=xla: the XLA ops (the other tests' path)
    xla = jax.jit(lambda *a: get_attention("xla_cpu")(*a, scale=0.125))
    assert "kiln_paged_attention" not in xla.lower(*case).as_text()

"""The GPU Pallas kernels (models/kernels/pallas_gpu.py; pallas_gpu_narrow.py's fp8 and int4 weight-only matmul) against
the reference, in Pallas interpret mode on the CPU.

Fresh random inputs per case: decode-only, prefill-only and mixed ragged batches, sequences ending mid-page,
padding tokens and padding sequences, GQA 1/4/8 and an odd group of 3, one and several KV splits, the in-kernel and
the XLA K/V write, a KV block inside one page, a sliding window and a logit soft cap, float32 and bf16. Shapes are
fixed per kernel configuration so each compiles once. The same checks at real sizes run on the H200 through
benchmarks/attention_check.py.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiln.models import kernels, quant
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.kernels import get_attention, pallas_gpu, pallas_gpu_narrow, reference
from kiln.models.quant import FP8_MAX, QuantArray, quantize_int4

PAGE = 8
NUM_PAGES = 40
MAX_PAGES = 12
T, S, D = 64, 8, 16
pytestmark = pytest.mark.usefixtures("cheap_compiles")  # interpret mode: ~180 small compiles


def random_case(rng, lens, *, heads, kv_heads, dtype=jnp.float32, kv_dtype=None, head_dim=D):
    """lens: (cached, new) per sequence, on shuffled pages; T and S padded beyond what the sequences use."""
    perm = rng.permutation(NUM_PAGES)
    chunks, used = [], 0
    for cached, new in lens:
        n_pages = -(-(cached + new) // PAGE)
        chunks.append(SeqChunk(tokens=[1] * new, start=cached, pages=list(perm[used : used + n_pages])))
        used += n_pages
    assert used <= NUM_PAGES and sum(n for _, n in lens) < T and len(lens) < S
    batch = jax.tree.map(jnp.asarray, make_batch(chunks, PAGE, T, S, MAX_PAGES))
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    pages = (kv_heads, NUM_PAGES, PAGE, head_dim)
    kp, vp = f(*pages).astype(kv_dtype or dtype), f(*pages).astype(kv_dtype or dtype)
    return f(T, heads, head_dim), f(T, kv_heads, head_dim), f(T, kv_heads, head_dim), kp, vp, batch


@functools.cache
def jitted(name: str, **kw):
    return jax.jit(functools.partial(get_attention(name), scale=D**-0.5, **kw))


def check(case, tol=2e-5, **kw):
    q, k, v, kp, vp, batch = case
    opts = {key: kw[key] for key in ("sliding_window", "soft_cap") if key in kw}
    want, wk, wv = jitted("reference", **opts)(q, k, v, kp, vp, batch)
    got, gk, gv = jitted("pallas_gpu", interpret=True, **kw)(q, k, v, kp, vp, batch)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(jnp.all(jnp.isfinite(got)))
    assert int(batch.query_start[int(batch.num_seqs[0])]) < T
    assert_matches((got, gk, gv), (want, wk, wv), batch, tol)


def assert_matches(out, ref, batch, tol, label=None):
    """The kernel's (o, k pages, v pages) against the reference's: o within tol (relative), zero on padding tokens,
    the pages equal bit for bit."""
    (got, gk, gv), (want, wk, wv) = out, ref
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert err < tol, (label, err)
    n_live = int(batch.query_start[int(batch.num_seqs[0])])
    assert bool(jnp.all(got[n_live:] == 0)), "padding tokens must be zero"
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wk))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(wv))


MIXED = [(13, 1), (21, 30), (0, 5), (40, 1), (3, 17)]  # decodes, a chunked prefill, fresh prompts, mid-page ends


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize(
    "lens",
    [
        [(int(c), 1) for c in (0, 7, 8, 33, 70, 94)],  # decode only
        [(0, 37), (0, 9), (0, 1)],  # prefill only
        MIXED,
    ],
    ids=["decode", "prefill", "mixed"],
)
def test_gqa4(rng, lens):
    check(random_case(rng, lens, heads=8, kv_heads=2))


def test_split_kv(rng):
    check(random_case(rng, MIXED, heads=8, kv_heads=2), num_splits=3, block_k=16, block_k_new=32)


def test_gqa1_xla_write(rng):
    check(random_case(rng, MIXED, heads=4, kv_heads=4), write_kv_in="xla")


def test_gqa8_window_soft_cap_block_in_page(rng):
    check(random_case(rng, MIXED, heads=16, kv_heads=2), sliding_window=10, soft_cap=5.0, block_k=PAGE)


def test_bf16_group3(rng):
    check(random_case(rng, MIXED, heads=6, kv_heads=2, dtype=jnp.bfloat16), tol=1e-2)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 1e-2)], ids=["f32", "bf16"])
def test_fp8_pages(rng, dtype, tol):
    """An fp8 (float8_e4m3fn) cache: the kernel rounds the new K/V into the pages exactly as the reference's scatter
    does (pages equal bit for bit), and attends over the same fp8 values widened to the dots' dtype (float16 under a
    bf16 q: pallas_gpu.FP8_CACHE_DOT; float32 q keeps float32)."""
    case = random_case(rng, MIXED, heads=8, kv_heads=2, dtype=dtype, kv_dtype=jnp.float8_e4m3fn)
    check(case, tol=tol, num_splits=2)


@pytest.mark.parametrize("decode", [False, True], ids=["general", "decode"])
def test_fp8_pages_float16_dots_clip_q(rng, decode):
    """With an fp8 cache the dots run in float16, whose range ends at 65504: a bf16 q beyond it is clipped, not made
    inf (inf x a key's mixed signs would be NaN)."""
    q, k, v, kp, vp, batch = random_case(rng, DECODE if decode else MIXED, heads=8, kv_heads=2, dtype=jnp.bfloat16,
                                         kv_dtype=jnp.float8_e4m3fn)  # fmt: skip
    assert pallas_gpu.FP8_CACHE_DOT == jnp.float16
    q = q * 1e5  # about half the entries past float16's range
    got = jitted("pallas_gpu", interpret=True, decode=decode)(q, k, v, kp, vp, batch)[0]
    assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))


@pytest.mark.parametrize("heads, kv_heads, splits", [(8, 2, 1), (6, 2, 3), (4, 4, 2)], ids=["gqa4", "group3", "gqa1"])
def test_fused_qkv(rng, heads, kv_heads, splits):
    """paged_attention_qkv reads q, k and v out of one (T, KVH, G + 2, D) array (the fused weight layout's) and
    gives the reference's values and pages."""
    q, k, v, kp, vp, batch = random_case(rng, MIXED, heads=heads, kv_heads=kv_heads)
    group = heads // kv_heads
    qkv = jnp.concatenate([q.reshape(T, kv_heads, group, D), k[:, :, None], v[:, :, None]], axis=2)
    want, wk, wv = jax.jit(functools.partial(reference.paged_attention_qkv, scale=D**-0.5))(qkv, kp, vp, batch)
    fn = functools.partial(pallas_gpu.paged_attention_qkv, scale=D**-0.5, interpret=True, num_splits=splits)
    got, gk, gv = jax.jit(fn)(qkv, kp, vp, batch)
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert err < 2e-5, err
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wk))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(wv))


@pytest.mark.parametrize(
    "heads, kv_heads, dtype, kv_dtype, fused, splits, tol",
    [(8, 2, jnp.float32, None, False, 1, 2e-5), (6, 2, jnp.bfloat16, jnp.float8_e4m3fn, True, 3, 1e-2)],
    ids=["gqa4", "fused_group3_bf16_fp8_split3"],
)
def test_pieces_apart(rng, heads, kv_heads, dtype, kv_dtype, fused, splits, tol):
    """The prefill pieces' own keys by another function (pieces=reference.piece_attention: cudnn_gpu's oracle, which
    the H200 runs through cuDNN): the kernel does the cached keys and the decodes' own, the halves merged by their
    log-sum-exp give the reference's values; the pages as the reference writes them."""
    q, k, v, kp, vp, batch = random_case(rng, MIXED, heads=heads, kv_heads=kv_heads, dtype=dtype, kv_dtype=kv_dtype)
    kw = dict(scale=D**-0.5, interpret=True, num_splits=splits, pieces=reference.piece_attention)
    if fused:
        group = heads // kv_heads
        qkv = jnp.concatenate([q.reshape(T, kv_heads, group, D), k[:, :, None], v[:, :, None]], axis=2)
        want = jax.jit(functools.partial(reference.paged_attention_qkv, scale=D**-0.5))(qkv, kp, vp, batch)
        got = jax.jit(functools.partial(pallas_gpu.paged_attention_qkv, **kw))(qkv, kp, vp, batch)
    else:
        want = jitted("reference")(q, k, v, kp, vp, batch)
        got = jax.jit(functools.partial(pallas_gpu.paged_attention, **kw))(q, k, v, kp, vp, batch)
    assert_matches(got, want, batch, tol)


def test_piece_attention(rng):
    """reference.piece_attention (the in-step half): on fresh prompts (no cached keys) its output is the whole
    attention's and its log-sum-exp the scores' over each token's causal keys; decodes and padding are not pieces;
    on a CPU no cuDNN is offered (default_pieces)."""
    lens = [(0, 9), (4, 1), (0, 17), (0, 2)]
    q, k, v, kp, vp, batch = random_case(rng, lens, heads=8, kv_heads=2)
    out, lse, covered = jax.jit(functools.partial(reference.piece_attention, scale=D**-0.5))(q, k, v, batch)
    want = jitted("reference")(q, k, v, kp, vp, batch)[0]
    expect = np.zeros(T, bool)
    expect[[*range(9), *range(10, 27), 27, 28]] = True
    np.testing.assert_array_equal(np.asarray(covered), expect)
    np.testing.assert_allclose(np.asarray(out)[expect], np.asarray(want)[expect], rtol=1e-5, atol=1e-5)
    qs, t = 10, 14  # the second piece (tokens 10..26), its fifth token: keys 10..14
    kk = np.repeat(np.asarray(k)[qs : t + 1], 4, axis=1)  # (5, H, D): each query head's KV head
    scores = np.einsum("hd,khd->hk", np.asarray(q)[t], kk) * D**-0.5
    np.testing.assert_allclose(np.asarray(lse)[t], np.log(np.exp(scores).sum(-1)), rtol=1e-5)
    assert pallas_gpu.default_pieces(2048) is None


DECODE = [(int(c), 1) for c in (0, 7, 8, 33, 70, 94)]  # cached keys before the one new token, mid-page ends


@pytest.mark.parametrize(
    "heads, kv_heads, kw",
    [
        (8, 2, dict(num_splits=4, block_k=16)),  # live_splits gives 6 sequences x 2 heads all 4
        (6, 2, dict(num_splits=1, block_k=PAGE, sliding_window=10, soft_cap=5.0)),  # group 3, a block in a page
    ],
    ids=["gqa4_split4", "group3_window_cap"],
)
def test_decode_kernel(rng, heads, kv_heads, kw):
    """The decode-only kernel (decode=True: query token s is sequence s's only one) on a ragged decode batch with
    padding sequences and tokens: the reference's values and pages."""
    check(random_case(rng, DECODE, heads=heads, kv_heads=kv_heads), decode=True, **kw)


def test_decode_kernel_fused_fp8_bf16(rng, splits=5):
    """The decode kernel on a fused bf16 qkv with an fp8 cache (the served combination), entered as the multi-step
    decode program enters it: under kernels.decode_batch(), one live sequence, so live_splits gives it every split."""
    lens = [(int(rng.integers(20, 90)), 1)]
    q, k, v, kp, vp, batch = random_case(rng, lens, heads=8, kv_heads=2, dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn)
    qkv = jnp.concatenate([q.reshape(T, 2, 4, D), k[:, :, None], v[:, :, None]], axis=2)
    want, wk, wv = jax.jit(functools.partial(reference.paged_attention_qkv, scale=D**-0.5))(qkv, kp, vp, batch)
    fn = functools.partial(pallas_gpu.paged_attention_qkv, scale=D**-0.5, interpret=True, num_splits=splits)
    with kernels.decode_batch():
        got, gk, gv = jax.jit(fn)(qkv, kp, vp, batch)
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert err < 1e-2, err
    assert bool(jnp.all(got[1:] == 0)), "padding tokens must be zero"
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wk))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(wv))


@pytest.mark.parametrize(
    "dtype, kv_dtype, splits, tol",
    [(jnp.float32, None, 3, 2e-5), (jnp.bfloat16, jnp.float8_e4m3fn, 5, 1e-2)],
    ids=["f32_split3", "bf16_fp8_split5"],
)
def test_decode_kernel_rope(rng, dtype, kv_dtype, splits, tol):
    """The decode kernel given the un-rotated fused qkv and the RoPE tables (rope=(cos, sin)) rotates q and k as it
    loads them (by halves: head_dim 32 for halves of 16, tl.dot's least): the reference's values on
    transformer._rope_slots's qkv, the same pages bit for bit, padding zero; and with ROPE_IN_KERNEL off (the rotation
    in XLA first) the same."""
    from kiln.models.transformer import _rope_slots, rope_tables

    d = 32
    q, k, v, kp, vp, batch = random_case(rng, DECODE, heads=8, kv_heads=2, dtype=dtype, kv_dtype=kv_dtype, head_dim=d)
    qkv = jnp.concatenate([q.reshape(T, 2, 4, d), k[:, :, None], v[:, :, None]], axis=2)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    tables = rope_tables(batch.positions, inv_freq, dtype)
    ref = functools.partial(reference.paged_attention_qkv, scale=d**-0.5)
    want, wk, wv = jax.jit(lambda x, *a: ref(_rope_slots(x, *tables, 5), *a))(qkv, kp, vp, batch)
    fn = functools.partial(pallas_gpu.paged_attention_qkv, scale=d**-0.5, interpret=True, num_splits=splits)
    saved = pallas_gpu.ROPE_IN_KERNEL
    for in_kernel in (True, False):
        pallas_gpu.ROPE_IN_KERNEL = in_kernel
        try:
            with kernels.decode_batch():
                got, gk, gv = jax.jit(lambda x, *a: fn(x, *a, rope=tables))(qkv, kp, vp, batch)
        finally:
            pallas_gpu.ROPE_IN_KERNEL = saved
        assert_matches((got, gk, gv), (want, wk, wv), batch, tol, in_kernel)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"])
def test_add_rms_norm(rng, dtype, tol):
    """pallas_gpu.add_rms_norm (what transformer.forward's `pending` rows of a mixture of experts go through): x plus
    the float32 rows' sum rounded to x's dtype, and its RMSNorm, as transformer.rms_norm gives them (interpreter,
    fresh random inputs, 3 rows of 8 parts)."""
    from kiln.models.transformer import rms_norm

    x = jnp.asarray(rng.standard_normal((3, 64)), dtype)
    parts = jnp.asarray(rng.standard_normal((8, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(64), dtype)
    got_x, got_h = pallas_gpu.add_rms_norm(x, parts, w, 1e-6, interpret=True)
    want_x = x + jnp.sum(parts, axis=0).astype(dtype)
    assert got_x.dtype == got_h.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32))
    want_h = rms_norm(want_x, w, 1e-6)
    np.testing.assert_allclose(np.asarray(got_h, np.float32), np.asarray(want_h, np.float32), rtol=tol, atol=tol)


def test_decode_compiler_options(monkeypatch):
    """pallas_gpu.DECODE_XLA_OPTIONS (STEP_XLA_OPTIONS) are the XLA options of the cuda decode (step) program of their
    bucket (lower.decode_program's, step_program's) for float and int8 weights, none for fp8 and int4 decode programs
    (their weight-only dots need XLA's Triton GEMMs to fuse the widening; fp8's take FORMAT_DECODE_XLA_OPTIONS) nor
    fp8 step programs (int4's take them),
    and compile_exported hands a Program's options to XLA (an unknown one is refused)."""
    import types

    from kiln.compile import executable, lower

    monkeypatch.setattr(pallas_gpu, "DECODE_XLA_OPTIONS", {16: {"xla_gpu_enable_triton_gemm": False}})
    monkeypatch.setattr(pallas_gpu, "STEP_XLA_OPTIONS", {256: {"xla_gpu_autotune_level": 0}})
    gpu = types.SimpleNamespace(attention="pallas_gpu", weight_format="float")
    cpu = types.SimpleNamespace(attention="xla_cpu", weight_format="float")
    assert lower._xla_options(gpu, 16) == {"xla_gpu_enable_triton_gemm": False}
    fp8, int4 = (types.SimpleNamespace(attention="pallas_gpu", weight_format=fmt) for fmt in ("fp8", "int4"))
    assert lower._xla_options(fp8, 16) == {"xla_gpu_exhaustive_tiling_search": True}  # FORMAT_DECODE_XLA_OPTIONS
    assert lower._xla_options(fp8, 64) is None and lower._xla_options(fp8, 256, "step") is None
    assert lower._xla_options(int4, 16) is None
    assert lower._xla_options(int4, 256, "step") == {"xla_gpu_autotune_level": 0}
    int8 = types.SimpleNamespace(attention="pallas_gpu", weight_format="int8")
    assert lower._xla_options(int8, 16) == {"xla_gpu_enable_triton_gemm": False}
    assert lower._xla_options(gpu, 64) is None and lower._xla_options(cpu, 16) is None
    assert lower._xla_options(gpu, 256, "step") == {"xla_gpu_autotune_level": 0}
    assert lower._xla_options(gpu, 16, "step") is None and lower._xla_options(cpu, 256, "step") is None
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("tp",)), jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=sharding)
    prog = executable.Program(name="p", fn=lambda a: a @ a.T, args=(x,), out=jax.ShapeDtypeStruct((4, 4), x.dtype,
                              sharding=sharding), compiler_options=lower._xla_options(gpu, 16))  # fmt: skip
    exported = executable.export(prog, "cpu")
    a = jnp.ones((4, 8))
    np.testing.assert_allclose(executable.compile_exported(exported, prog)(a)[0], a @ a.T)
    prog.compiler_options = lower._xla_options(fp8, 16)  # an option XLA knows by that name
    np.testing.assert_allclose(executable.compile_exported(exported, prog)(a)[0], a @ a.T)
    prog.compiler_options = {"xla_gpu_no_such_option": True}
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        executable.compile_exported(exported, prog)


Narrow = pallas_gpu_narrow.Config


@pytest.mark.parametrize(
    "fmt, rows, n, k, cfg",
    [
        ("fp8", 3, 64, 512, Narrow(block_n=32, block_k=128, split_k=2)),
        ("fp8", 16, 128, 512, None),
        ("fp8", 20, 128, 512, Narrow(block_n=64, block_k=128, split_k=2, swap=True)),
        ("fp8", 5, 128, 512, Narrow(block_n=64, block_k=128, swap=True, fp8_x=1)),  # fp8 x fp8, one K run
        ("fp8", 16, 64, 1024, Narrow(block_n=64, block_k=256, split_k=2, swap=True, fp8_x=1)),
        ("fp8", 16, 128, 512, Narrow(block_n=64, block_k=128, swap=True, fp8_x=2)),  # two fp8 terms a row
        ("fp8", 3, 64, 512, Narrow(block_n=32, block_k=256, split_k=2, fp8_x=2)),  # x first
        ("int4", 1, 64, 512, None),  # group 128, block_k 256: two groups a step; int4 widened by integer adds
        ("int4", 20, 128, 512, Narrow(block_n=64, block_k=256, split_k=2, swap=True)),
        ("int4", 5, 64, 192, Narrow(block_n=32, block_k=32, bits=True)),  # group 64: two steps a group
        ("int4", 40, 64, 256, Narrow(block_n=32, block_k=128, block_m=16)),  # 4 row blocks (64 padded rows)
        ("int4", 20, 128, 512, Narrow(block_n=64, block_k=128, split_k=2, swap=True, bits=True, block_m=16)),
    ],
)
def test_narrow_matmul(fmt, rows, n, k, cfg, monkeypatch):
    """The weight-only kernel (split K and not, rows padded to 16, the weight-first dot, row blocks; int4's group
    scales spanning a step or several) against the dequantized matmul on fresh random inputs, and its cuda lowering
    behind quant's decode-size dot."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    if fmt == "fp8":
        w = jnp.asarray(rng.standard_normal((n, k)) * 64, jnp.float32).astype(jnp.float8_e4m3fn)
        scale = jnp.asarray(rng.uniform(0.5, 2.0, n) / FP8_MAX, jnp.bfloat16)
    else:
        w, scale = quantize_int4(rng.standard_normal((n, k)).astype(np.float32))
        w, scale = jnp.asarray(w), jnp.asarray(scale, jnp.bfloat16)
        assert scale.shape == (n, k // quant.group_size(k))
    got = pallas_gpu_narrow.narrow_matmul(x, w, scale, cfg, interpret=True)
    fp8_x = cfg.fp8_x if cfg is not None else 0
    want = pallas_gpu_narrow.matmul_reference(x, w, scale, cfg.block_k if fp8_x else 0, fp8_x)
    assert got.shape == (rows, n) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    monkeypatch.setitem(quant.PALLAS_MAX_ROWS, fmt, 64)
    lowered = jax.jit(quant.dot).trace(x, QuantArray(w, scale)).lower(lowering_platforms=("cuda",)).as_text()
    assert f"{jnp.dtype(w.dtype).name}_matmul" in lowered and "stablehlo.dot_general" not in lowered


def test_int4_widened_by_bits_is_exact():
    """widen's integer route (the bits of 136 + q, less 136) gives every int4 value exactly, as the conversion does."""
    q = jnp.arange(-8, 8, dtype=jnp.int32).astype(jnp.int4)
    got = pallas_gpu_narrow.widen(q, jnp.bfloat16, bits=True)
    assert got.dtype == jnp.bfloat16 and got.tolist() == list(range(-8, 8))


@pytest.mark.parametrize("rows", [16, 32, 64, 128, 256, 2048])
def test_narrow_default_config_fits_shared_memory(rows):
    """The default config of every row bucket keeps its pipelined tiles within the kernel's shared memory budget (at
    256 rows the first configs asked 274-811 KiB of an H200's 227 and failed to compile), as the measured ones do."""
    for fmt in ("int4", "fp8"):
        for n, k in [(6144, 4096), (4096, 14336), (128256, 4096), (576, 1536)]:
            cfg = pallas_gpu_narrow.default_config(fmt, rows, n, k)
            assert cfg.fits(n, k, 128 if fmt == "int4" else None)
            assert cfg.smem_bytes(rows, fmt) <= pallas_gpu_narrow.SMEM_BYTES
    for (fmt, m, _, _), cfg in pallas_gpu_narrow.CONFIGS.items():
        assert cfg is None or cfg.smem_bytes(m, fmt) <= pallas_gpu_narrow.SMEM_BYTES, (fmt, m, cfg)

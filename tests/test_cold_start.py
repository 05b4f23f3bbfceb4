"""Cold start from an artifact: weights.bin round-trips every stored dtype and is taken without a copy on a CPU;
`kiln serve` logs one ready line with each start-up phase; benchmarks/cold_start.py reads it back; after ready the
first request compiles nothing (test_artifact checks the programs themselves)."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kiln.compile import weightfile
from kiln.models.errors import KilnError

ROOT = Path(__file__).resolve().parents[1]


def test_weights_file_round_trips_every_dtype_zero_copy_on_cpu(tmp_path):
    rng = np.random.default_rng(0)
    flat = {
        "a_f32": rng.standard_normal((5, 7)).astype(np.float32),
        "b_bf16": rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16),
        "c_int8": rng.integers(-127, 128, (9,)).astype(np.int8),
        "d_int4_odd": rng.integers(-7, 8, (3, 5)).astype(ml_dtypes.int4),  # 15 values: half a byte left over
        "e_fp8": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
        "f_scalar": np.float32(3.5).reshape(()),
    }
    meta = weightfile.save(tmp_path, flat)
    assert meta["tensors"]["d_int4_odd"]["bytes"] == 8  # two int4 values a byte
    assert all(t["offset"] % weightfile.ALIGN == 0 for t in meta["tensors"].values())
    mapped = weightfile.MappedWeights(tmp_path, meta)
    for f in mapped.checks(_Now()):
        f.result()
    for name, want in flat.items():
        got = mapped.array(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32), err_msg=name)

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    placed = weightfile.place(mapped, "a_f32", jax.ShapeDtypeStruct((5, 7), jnp.float32, sharding=cpu))
    view = mapped.array("a_f32")
    assert placed.unsafe_buffer_pointer() == view.ctypes.data  # XLA reads the mapped file: no host copy
    np.testing.assert_array_equal(np.asarray(placed), flat["a_f32"])

    # an accelerator's upload waits for the checks of the chunks that hold its tensor
    assert [list(mapped.chunks_of(n)) for n in ("a_f32", "f_scalar")] == [[0], [0]]
    mapped.meta = {**meta, "chunk_bytes": 4096}  # every tensor starts a page: a chunk of its own
    assert [list(mapped.chunks_of(n)) for n in sorted(flat)] == [[i] for i in range(len(flat))]
    mapped.meta = meta

    # an accelerator's upload staged through pinned host memory gives the same values (the path runs on a CPU too)
    staged = weightfile.staged_upload(mapped.array("b_bf16"), cpu)
    assert staged.sharding.memory_kind == cpu.memory_kind
    np.testing.assert_array_equal(np.asarray(staged), flat["b_bf16"])

    data = bytearray((tmp_path / weightfile.FILE).read_bytes())
    data[meta["tensors"]["c_int8"]["offset"]] ^= 1
    (tmp_path / weightfile.FILE).write_bytes(bytes(data))
    with pytest.raises(KilnError, match=r"does not match its sha256 in manifest\.json at bytes 0-"):
        for f in weightfile.MappedWeights(tmp_path, meta).checks(_Now()):
            f.result()


def test_every_upload_mode_places_every_tensor_and_refuses_a_changed_byte(tmp_path, monkeypatch):
    """weightfile.Uploads, as an accelerator's load runs it (here onto a CPU device): every mode places every tensor
    with its values, "pieces" a tensor larger than PIECE as row blocks joined on the device, and a changed byte is
    refused before it is uploaded."""
    rng = np.random.default_rng(1)
    flat = {f"w{i:02d}": rng.standard_normal((int(rng.integers(1, 40)), 100)).astype(np.float32) for i in range(12)}
    flat["big"] = rng.standard_normal((64, 200)).astype(ml_dtypes.bfloat16)  # 25600 bytes: 7 pieces
    flat["q4"] = rng.integers(-7, 8, (3, 5)).astype(ml_dtypes.int4)
    meta = weightfile.save(tmp_path, flat)
    step = 4096  # every tensor's page its own chunk, so a tensor waits for its own checks on a small file
    data = (tmp_path / weightfile.FILE).read_bytes()
    meta = {**meta, "chunk_bytes": step,
            "chunks": [hashlib.sha256(data[i : i + step]).hexdigest() for i in range(0, len(data), step)]}  # fmt: skip
    monkeypatch.setattr(weightfile, "PIECE", step)  # "big" in 7 row blocks, most of the w's in 2-4
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    wants = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu) for n, a in flat.items()}

    def upload(mode: str) -> dict:
        uploads = weightfile.Uploads(weightfile.MappedWeights(tmp_path, meta), mode)
        with ThreadPoolExecutor(3) as up, ThreadPoolExecutor(2) as ck:
            jobs, checks = uploads.submit(wants, up, ck)
            got = {n: a for f in jobs for n, a in f.result().items()}
            for f in checks:
                f.result()
        return got

    for mode in weightfile.UPLOADS:
        got = upload(mode)
        assert set(got) == set(flat), mode
        for name, want in flat.items():
            np.testing.assert_array_equal(np.asarray(got[name]).astype(np.float32), want.astype(np.float32),
                                          err_msg=f"{mode} {name}")  # fmt: skip

    def no_memory(*parts):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    with monkeypatch.context() as m:  # a join that runs out of device memory: the tensor goes up whole
        m.setattr(weightfile, "_join", no_memory)
        got = upload("pieces")
        np.testing.assert_array_equal(np.asarray(got["big"]).astype(np.float32), flat["big"].astype(np.float32))
    changed = bytearray(data)
    for name in ("w03", "big"):  # a tensor uploaded whole (as pinned, sync, direct) or in pieces
        at = meta["tensors"][name]["offset"]
        changed[at] ^= 1
        (tmp_path / weightfile.FILE).write_bytes(bytes(changed))
        for mode in weightfile.UPLOADS:
            with pytest.raises(KilnError, match=rf"sha256 in manifest\.json at bytes {at}-"):
                upload(mode)
        changed[at] ^= 1


def test_int4_goes_up_as_its_bytes_and_is_read_as_int4_on_the_devices(tmp_path, monkeypatch):
    """On an accelerator (here a CPU device taken for one) an int4 tensor whose shards' last dimension is even goes up
    as its stored bytes, read as int4 by the devices, in every upload mode; a platform that ordered the nibbles
    otherwise, or lacked the bitcast, gets the host's unpacking instead: the values are the same either way."""
    rng = np.random.default_rng(2)
    shapes = {"a": (6, 8), "big": (64, 256), "odd": (3, 5), "vec": (10,)}  # "big": 8192 bytes, 2 pieces
    flat = {n: rng.integers(-8, 8, s).astype(ml_dtypes.int4) for n, s in shapes.items()}
    meta = weightfile.save(tmp_path, flat)
    mapped = weightfile.MappedWeights(tmp_path, meta)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    monkeypatch.setattr(weightfile, "PIECE", 4096)
    monkeypatch.setattr(weightfile, "on_accelerator", lambda sharding: True)
    widened = []
    monkeypatch.setattr(weightfile, "_int4_of_bytes", lambda p, f=weightfile._int4_of_bytes: widened.append(p) or f(p))

    def check(label: str) -> None:
        for mode in weightfile.UPLOADS:
            for name, want in flat.items():
                got = weightfile.place(mapped, name, jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=cpu), mode)
                assert got.dtype == jnp.int4 and got.shape == want.shape, (label, mode, name)
                np.testing.assert_array_equal(np.asarray(got).astype(np.int8), want.astype(np.int8),
                                              err_msg=f"{label} {mode} {name}")  # fmt: skip

    check("bytes")
    assert len(widened) == 3 * len(weightfile.UPLOADS)  # every tensor but "odd" went up packed
    assert {p.dtype for p in widened} == {np.dtype(np.uint8)} and widened[0].shape == (6, 4)
    monkeypatch.setattr(weightfile, "_int4_of_bytes", lambda p, f=weightfile._int4_of_bytes: f((p << 4) | (p >> 4)))
    check("nibbles the other way")

    def no_bitcast(p):
        raise NotImplementedError("bitcast_convert_type to a narrower type")

    monkeypatch.setattr(weightfile, "_int4_of_bytes", no_bitcast)
    check("no bitcast")


def resident_pages(path: Path) -> int:
    """Pages of the file in the page cache, by mincore(2) on a mapping of it: a mapping reads nothing (a probe by
    read, as checks.cached_share's, starts the kernel's readahead of an uncached file)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                             ctypes.c_int, ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, 1, 1, f.fileno(), 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)


def test_page_cache_probe_and_uploads_that_wait_for_earlier_checks(tiny_artifact, tmp_path, monkeypatch):
    """An accelerator artifact's weight chunks are checked from kiln serve's prefetch at once only when weights.bin is
    in the page cache (checks.in_page_cache: False once its pages are dropped, True once read), else from the load's
    start (start_chunks), with the file read into the page cache meanwhile by a process of its own where jax's
    libraries are cached (checks.read_ahead), and Uploads then waits for those checks (`checked`) instead of queueing
    its own: a failed one refuses its tensor."""
    import shutil

    from kiln.compile import checks
    from kiln.compile.checks import MANIFEST, MANIFEST_SHA256, Prefetch, in_page_cache

    art = tmp_path / "gpu_art"  # the tiny artifact relabelled for cuda (the prefetch reads only its manifest and files)
    shutil.copytree(tiny_artifact, art)
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["target"]["platform"] = "cuda"
    (art / MANIFEST).write_text(json.dumps(manifest))
    (art / MANIFEST_SHA256).write_text(hashlib.sha256((art / MANIFEST).read_bytes()).hexdigest())
    weights = art / manifest["weights"]["file"]
    libraries_cached = checks.libraries_cached
    for cached, libraries in ((True, True), (False, False), (False, True)):
        monkeypatch.setattr(checks, "libraries_cached", lambda libraries=libraries: libraries)
        if not cached:
            # dropped until mincore finds none of its pages (a read probe would start reading it: none here); the last
            # Prefetch's mapping of weights.bin let go first (DONTNEED keeps mapped pages). This case failed in two
            # loaded full runs (session 18), never alone: a fixed number of drops did not always empty it
            for _ in range(100):
                gc.collect()
                with open(weights, "rb") as f:
                    os.fsync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                if not resident_pages(weights):
                    break
                time.sleep(0.05)
            assert not resident_pages(weights), f"{resident_pages(weights)} pages of weights.bin stay cached"
        pre = Prefetch(art)
        assert (pre.chunks(manifest["weights"]) is not None) == cached, (cached, resident_pages(weights))
        # an uncached file with jax's libraries cached: a process of its own reads it into the page cache meanwhile
        assert (pre._reader is not None) == (libraries and not cached)
        if pre._reader is not None:
            assert pre._reader.wait(timeout=30) == 0 and checks.in_page_cache(weights)
        pre.start_chunks()  # the load's start: an uncached file's checks begin now
        assert all(f.result() is None for f in pre.chunks(manifest["weights"]))
        pre.close()
    assert checks.cached_share(tmp_path / "missing.bin") == 0.0
    probed = []
    with monkeypatch.context() as m:  # jaxlib's largest shared library, at least half of its probes cached
        for share, want in ((0.6, True), (0.4, False)):
            m.setattr(checks, "cached_share", lambda path, probes=16, share=share: probed.append(path) or share)
            assert libraries_cached() is want
    assert "jaxlib" in str(probed[0]) and ".so" in probed[0].name
    assert checks.read_ahead(tmp_path / "gone.bin") is None  # no file: nothing to read
    assert 0 < checks.memory_available() < 1 << 50
    with monkeypatch.context() as m:  # a file over half the available memory would evict what the load needs
        m.setattr(checks.os.path, "getsize", lambda path: 1 << 62)
        assert checks.read_ahead(weights) is None

    flat = {"a": np.arange(5000, dtype=np.float32), "b": np.ones((3, 7), np.float32)}
    meta = weightfile.save(tmp_path, flat)
    path = tmp_path / weightfile.FILE
    assert in_page_cache(path) and not in_page_cache(tmp_path / "missing.bin")
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped, no root needed
    assert not in_page_cache(path)
    path.read_bytes()
    assert in_page_cache(path)

    mapped = weightfile.MappedWeights(tmp_path, meta)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    wants = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu) for n, a in flat.items()}
    failed = _Now().submit(lambda: (_ for _ in ()).throw(KilnError("chunk 0 refused")))
    for checked, ok in (([_Now().submit(lambda: None)], True), ([failed], False)):
        with ThreadPoolExecutor(2) as up:
            jobs, waited = weightfile.Uploads(mapped, "pinned").submit(wants, up, None, checked)
            assert waited == checked
            if ok:
                got = {n: a for f in jobs for n, a in f.result().items()}
                np.testing.assert_array_equal(np.asarray(got["a"]), flat["a"])
            else:
                with pytest.raises(KilnError, match="chunk 0 refused"):
                    jobs[0].result()


class _Now:
    """An executor that runs at once (the checks' pool, in a test)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001
            f.set_exception(e)
        return f


@pytest.fixture(scope="module")
def tiny_artifact(tiny_cpu) -> Path:
    """A tiny llama's cpu artifact (the session fixture, test_artifact.compile_tiny: --buckets 8,32 --max-num-seqs 4
    --kv-tokens 512 --max-model-len 128); tests that change it copy it first."""
    return tiny_cpu[1]


def test_serve_logs_each_start_up_phase_and_the_benchmark_reads_them(tiny_artifact, tmp_path):
    """benchmarks/cold_start.py starts `kiln serve` once, waits for /health 200 and sends two completions: the ready
    line names every phase, the phases add up to no more than the time to /health 200."""
    out = tmp_path / "runs.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cold_start.py"), str(tiny_artifact), "-n", "1", "--requests",
           "2", "--json", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    phases = ("imports", "load", "manifest", "checksums", "executables", "weights", "kv", "tokenizer", "warmup",
              "server", "total", "cpu")  # fmt: skip
    assert set(phases) <= set(run), run
    assert run["total"] <= run["health_200"] + 0.5  # the process's own clock against the benchmark's
    # the phases (perf_counter) fit in the total (/proc's process age, in clock ticks); on a loaded machine the two
    # clocks were seen 0.55 s apart over 3 s, so the bound allows a fifth of the total
    assert run["imports"] + run["load"] + run["kv"] + run["warmup"] <= 1.2 * run["total"] + 0.05
    assert max(run["manifest"], run["executables"], run["weights"]) <= run["load"] + 0.01
    assert run["weight_gb"] > 0 and len(run["ttft"]) == 2
    assert "one-token completion after ready: request 1" in result.stdout


def test_load_allocates_the_kv_cache_while_programs_load(tiny_artifact):
    """load starts init_kv as soon as it is deserialized; make_kv hands that cache out once, zeroed and shaped as the
    programs take it, then allocates fresh ones."""
    from kiln.compile import artifact

    art = artifact.load(tiny_artifact)
    assert art.first_kv is not None
    maps = [
        line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines() if "weights.bin" in line
    ]
    ptr = jax.tree.leaves(art.weights)[0].unsafe_buffer_pointer()  # the weights are views of the mapping: no copy
    assert any(int(lo, 16) <= ptr < int(hi, 16) for lo, hi in maps)
    first, second = art.make_kv(), art.make_kv()
    assert art.first_kv is None
    for kv in (first, second):
        assert len(kv.k) == art.cfg.num_layers and kv.k[0].shape[1] == art.num_pages
        assert not any(np.asarray(a).any() for a in kv.k + kv.v)
    assert first.k[0].unsafe_buffer_pointer() != second.k[0].unsafe_buffer_pointer()


def test_deferred_programs_answer_while_the_rest_load_and_compile_nothing(tiny_artifact, monkeypatch):
    """A deferred start (a CPU's `kiln serve`) is ready with the first buckets' programs: a request answered before
    the rest are in gives a fully loaded engine's tokens (its 20-token prompt in 8-token chunks instead of one 32-token
    step); the rest load once the engine is idle, each run once without writing K/V (a second request served from the
    first one's prefix-cached pages gives the same tokens), and nothing compiles."""
    import asyncio
    import time

    from test_artifact import count_compilations

    from kiln.compile import artifact
    from kiln.serving import llm as llm_module
    from kiln.serving.params import SamplingParams

    prompt, params = list(range(3, 23)), SamplingParams(max_tokens=6, temperature=0.0)
    want = llm_module.LLM(str(tiny_artifact)).generate([prompt], params)[0].new_token_ids
    geometry = artifact.lower.Geometry.from_dict(artifact.read_manifest(tiny_artifact)["geometry"])
    assert artifact.first_programs(geometry) == {"init_kv", "step_t8"}
    cpu_like = dataclasses.replace(geometry, buckets=(1, 4, 16, 64, 256), max_num_seqs=16)  # the cpu target's buckets
    assert artifact.first_programs(cpu_like) == {"init_kv", "step_t16"}
    rest = {"step_t1", "step_t4", "step_t64", "step_t256", "decode_t1", "decode_t4", "decode_t16"}
    assert artifact.later_order(cpu_like, rest) == ["step_t1", "decode_t1", "step_t4", "step_t64", "step_t256",
                                                    "decode_t4", "decode_t16"]  # fmt: skip

    monkeypatch.setattr(llm_module, "LATER_IDLE_S", 1e6)  # the rest wait until the test lets them in
    engine = llm_module.build_engine(str(tiny_artifact), warmup=True, defer_programs=True)
    assert engine.runner.buckets == (8,) and engine.scheduler.max_num_batched_tokens == 8
    assert engine.later.names == ["decode_t8", "step_t32"] and not engine.runner.decode  # decodes in step_t8

    async def ask(llm, rid: str) -> list[int]:
        tokens = []
        async for out in llm.generate(rid, prompt, params):
            tokens += out.new_token_ids
        return tokens

    with count_compilations() as events:
        served = llm_module.AsyncLLM(engine)
        try:
            assert asyncio.run(ask(served, "before")) == want
            assert engine.runner.buckets == (8,)
            monkeypatch.setattr(llm_module, "LATER_IDLE_S", 0.0)
            served.abort("none")  # wakes the engine thread, which finds itself idle long enough
            deadline = time.monotonic() + 60
            while 32 not in engine.runner.programs and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.runner.buckets == (8, 32) and engine.scheduler.max_num_batched_tokens == 32
            assert 8 in engine.runner.decode
            assert asyncio.run(ask(served, "after")) == want
            assert engine.stats().prefix_cache_hits >= 16  # the first request's two full pages, read after the warm-up
        finally:
            served.shutdown()
    assert events == [], events


def test_deferred_programs_load_between_steps_under_steady_traffic(tiny_artifact, monkeypatch):
    """An engine that never idles loads the deferred programs between two steps once it has worked LATER_BUSY_S:
    the running request's tokens are a fully loaded engine's, and nothing compiles."""
    import asyncio

    from test_artifact import count_compilations

    from kiln.serving import llm as llm_module
    from kiln.serving.params import SamplingParams

    prompt, params = list(range(3, 23)), SamplingParams(max_tokens=8, temperature=0.0)
    want = llm_module.LLM(str(tiny_artifact)).generate([prompt], params)[0].new_token_ids
    monkeypatch.setattr(llm_module, "LATER_IDLE_S", 1e6)  # never idle long enough
    monkeypatch.setattr(llm_module, "LATER_BUSY_S", 0.0)  # one program between every two steps
    engine = llm_module.build_engine(str(tiny_artifact), warmup=True, defer_programs=True)
    assert engine.runner.buckets == (8,) and not engine.runner.decode

    async def ask(llm) -> list[int]:
        return [t async for out in llm.generate("busy", prompt, params) for t in out.new_token_ids]

    with count_compilations() as events:
        served = llm_module.AsyncLLM(engine)
        try:
            assert asyncio.run(ask(served)) == want
        finally:
            served.shutdown()
    assert not engine.later.pending() and engine.runner.buckets == (8, 32) and 8 in engine.runner.decode
    assert events == [], events


def test_run_ahead_gather_primed_for_a_deferred_decode_bucket_compiles_nothing_later(tiny_artifact, tmp_path):
    """The artifact brings each decode bucket's run-ahead token gather compiled (gather_t<T>), so a deferred start
    compiles none; an artifact compiled before that (no gather_t<T>) still loads, and prime_run_ahead compiles
    Runner.dispatch_ahead's jitted gather for a decode bucket before its program is in: the program's real sampled
    tokens then hit that compilation (same shape, dtype and sharding). Either way nothing compiles after."""
    import shutil

    from test_artifact import count_compilations

    from kiln.compile import artifact
    from kiln.models.batch import make_batch
    from kiln.serving import llm as llm_module
    from kiln.serving import runner as runner_module

    old = tmp_path / "old"  # the same artifact without its gather programs
    shutil.copytree(tiny_artifact, old)
    manifest = artifact.read_manifest(old)
    assert manifest["programs"]["gather_t8"]["executable"] == "programs/gather_t8.cpu"
    for path in old.glob("programs/gather_t*"):
        path.unlink()
    del manifest["programs"]["gather_t8"], manifest["files"]
    artifact.write_manifest(old, manifest)

    for folder, compiled in ((tiny_artifact, True), (old, False)):
        with count_compilations() as events:
            engine = llm_module.build_engine(str(folder), warmup=True, defer_programs=True)
        assert (events == []) is compiled, events  # the old artifact's gather compiles before ready
        assert (8 in engine.runner.gathers) is compiled and not engine.runner.decode
        engine = llm_module.build_engine(str(folder), warmup=False)
        runner = engine.runner
        assert runner.can_run_ahead and list(runner.decode) == [8]
        llm_module.prime_run_ahead(runner, runner.kv.k[0].sharding.mesh, [8], engine.decode_steps)
        num_seqs = runner.seqs_per_bucket[8]
        batch = make_batch([], runner.page_size, 8, num_seqs, runner.max_pages_per_seq)
        with count_compilations() as events:
            out, runner.kv = runner.decode[8](runner.weights, runner.kv, batch, runner.sampling_batch([], num_seqs))
            runner.warm_gather(8, out.tokens)  # the gather dispatch_ahead runs on these tokens
            gathered = runner.gathers.get(8, runner_module._last_tokens)(out.tokens, np.arange(8) % 4)
        assert events == [], events
        np.testing.assert_array_equal(np.asarray(gathered), np.asarray(out.tokens)[-1][np.arange(8) % 4])


def test_the_serve_path_imports_no_pallas_kernel():
    """`kiln serve`'s modules leave jax's Pallas (and kiln's Pallas kernels, for GPUs and TPUs) out until a program is
    lowered: importing jax.experimental.pallas.triton cost a CPU start 0.14-0.24 CPU-s (SmolLM2 on 2 cores, 2026-12-01),
    a tenth of its 2 s target; a kernel module is imported where it is called."""
    code = (
        "import sys, kiln.serving.serve_cmd, kiln.serving.llm, kiln.compile.artifact, kiln.serving.app; "
        "print(sorted(m for m in sys.modules if m.startswith('jax.experimental.pallas') or '.pallas_' in m))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout


def test_prefetched_checks_are_taken_by_the_load_and_refuse_a_changed_byte(tiny_artifact, tmp_path, monkeypatch):
    """kiln serve's Prefetch (the checks started before jax's import) stands in for the load's own: a load that takes
    it checks no file again, yet a byte changed in an executable or in weights.bin before the prefetch, or a
    tokenizer file changed after it checked it, is refused in the load's sentence. `kiln serve ARTIFACT` starts it
    (cli.readahead_artifact) with Python's cyclic GC off."""
    import shutil

    from kiln.compile import artifact
    from kiln.compile.checks import Prefetch

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    from kiln.serving.serve_cmd import _deserialize_for_first_device

    with monkeypatch.context() as m:  # every file and chunk comes from the prefetch
        m.setattr(artifact, "check_file", None)
        m.setattr(weightfile.MappedWeights, "check_chunk", None)
        pre = Prefetch(art)
        pre.deserialize_first(_deserialize_for_first_device)  # kiln serve: as soon as jax is imported
        made = pre.executable("programs/step_t8.cpu", artifact.read_manifest(art)["files"]["programs/step_t8.cpu"])
        loaded = artifact.load(art, defer=True, prefetch=pre)
        assert loaded.programs[8].runtime_executable() is made.result()  # taken, not deserialized again
        assert pre.executable("programs/step_t8.cpu", "0" * 64) is None
        artifact.verify_checksums(art, {"files": {"tokenizer.json": loaded.manifest["files"]["tokenizer.json"]}}, pre)
        assert loaded.load_later("step_t32") is not None
        pre.close()

    def flipped(path: Path, at: float) -> None:  # a new file in its place, as `kiln compile` writes one
        data = bytearray(path.read_bytes())
        data[int(len(data) * at)] ^= 0x01
        path.with_name("new").write_bytes(bytes(data))
        path.with_name("new").replace(path)

    cases = [("programs/step_t8.cpu", r"step_t8\.cpu does not match its sha256"),
             ("weights/weights.bin", r"weights\.bin does not match its sha256 in manifest\.json at bytes")]  # fmt: skip
    for name, message in cases:
        good = (art / name).read_bytes()
        flipped(art / name, 0.4)
        with pytest.raises(KilnError, match=message):
            artifact.load(art, defer=True, prefetch=Prefetch(art))
        (art / name).write_bytes(good)

    import gc

    from kiln.serving.cli import readahead_artifact

    try:  # kiln serve ARTIFACT starts the prefetch, without the cyclic GC until ready, before it imports anything
        pre = readahead_artifact(["serve", "--port", "0", str(art)])
        assert isinstance(pre, Prefetch) and pre.folder == art and not gc.isenabled() and pre.platform() == "cpu"
        pre.close()
    finally:
        gc.enable()
    assert readahead_artifact(["serve", str(tmp_path)]) is None and gc.isenabled()  # not an artifact

    pre = Prefetch(art)
    digest = artifact.read_manifest(art)["files"]["tokenizer.json"]
    assert pre.file("tokenizer.json", digest).result() is None  # checked as it was
    flipped(art / "tokenizer.json", 0.5)  # then changed: checked again
    with pytest.raises(KilnError, match=r"tokenizer\.json does not match its sha256"):
        artifact.verify_checksums(art, {"files": {"tokenizer.json": digest}}, pre)
    pre.close()


def test_prefetch_parses_the_checked_tokenizer_and_finds_plain_serves_artifact(tiny_artifact, tmp_path, monkeypatch):
    """The prefetch parses tokenizer.json from the bytes that passed their check (beside jax's import), and the load's
    tokenizer is that one; plain `kiln serve` (the embedded model) and `kiln serve MODEL` find the artifact that
    ensure_artifact keeps under KILN_ARTIFACTS before jax is imported (serve_artifact), and nothing where they
    cannot tell; jax's import reads only jax's packages' metadata (plugin_scan_by_name)."""
    import importlib.metadata
    import os
    import shutil

    from kiln.compile import artifact, checks
    from kiln.compile.build import model_name
    from kiln.serving import llm as llm_module

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    digest = artifact.read_manifest(art)["files"]["tokenizer.json"]
    pre = checks.Prefetch(art)
    backend = pre.tokenizer(digest).result()
    assert pre.tokenizer("0" * 64) is None  # checked against another digest: not taken
    tok = llm_module._checked_tokenizer(art, pre)
    assert tok.backend is backend
    assert tok.encode("hello world") == llm_module._checked_tokenizer(art).encode("hello world")
    pre.close()
    data = bytearray((art / "tokenizer.json").read_bytes())
    data[len(data) // 2] ^= 0x01
    (art / "tokenizer.json").write_bytes(bytes(data))
    pre = checks.Prefetch(art)
    with pytest.raises(KilnError, match=r"tokenizer\.json does not match its sha256"):
        llm_module._checked_tokenizer(art, pre)
    pre.close()

    source = Path(artifact.read_manifest(tiny_artifact)["source"]["path"])  # the tiny model's folder
    root = tmp_path / "artifacts"
    kept = root / f"{model_name(source)}.cpu"
    shutil.copytree(tiny_artifact, kept)
    monkeypatch.setenv("KILN_ARTIFACTS", str(root))
    assert checks.serve_artifact(["serve", str(source), "--port", "0"]) == kept
    assert checks.serve_artifact(["serve", "--no-access-log", "--model", str(source), "--target", "cpu"]) == kept
    assert checks.serve_artifact(["serve", "--port", "0", str(art)]) == art  # an artifact folder as given
    assert checks.serve_artifact(["serve", "--target=jit", str(source)]) is None
    assert checks.serve_artifact(["serve", "--target", "tpu-v5e-1", str(source)]) is None
    assert checks.serve_artifact(["serve", "org/model"]) is None and checks.serve_artifact(["generate"]) is None
    shutil.copytree(kept, root / f"{model_name(source)}.other")
    assert checks.serve_artifact(["serve", str(source)]) is None  # two candidates: no guess
    shutil.rmtree(root / f"{model_name(source)}.other")
    config = source / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))  # the source changed since
    assert checks.serve_artifact(["serve", str(source)]) is None
    try:
        from kiln.models.checkpoint import default_model_path

        assert checks._source_path(None) == default_model_path()  # the embedded model, found without its import
    except KilnError:
        assert checks._source_path(None) is None

    with checks.plugin_scan_by_name():
        ours = {d.metadata["Name"] for d in importlib.metadata.distributions()}  # not jax's call: every one
        jax_globals = {"__name__": "jax._src.numpy.array_constructors", "md": importlib.metadata}
        names = eval("{d.metadata['Name'] for d in md.distributions()}", jax_globals)  # noqa: S307 (jax's call)
    assert "jax" in names and "numpy" not in names and "numpy" in ours
    assert "numpy" in {d.metadata["Name"] for d in importlib.metadata.distributions()}


def test_a_cpu_artifacts_first_programs_deserialize_beside_jaxs_import(tiny_artifact):
    """kiln serve of a CPU artifact makes jax's CPU client with jaxlib before jax is imported and deserializes the
    first programs on it meanwhile (checks.start_early_cpu); once jax is in, that client becomes jax's cpu backend
    and the load takes those executables (a fresh process: the client is jax's for the process's life)."""
    from kiln.compile import checks
    from kiln.models.kernels import cpu_quant

    assert checks.KERNEL_TARGETS == (cpu_quant.TARGET, cpu_quant.ATTENTION_TARGET)
    code = f"""
import sys
from kiln.compile import checks
pre = checks.Prefetch({str(tiny_artifact)!r})
checks.start_early_cpu(pre)
assert "jax" not in sys.modules
import jax
from kiln.serving.serve_cmd import _adopt_early_client, _cpu_only
_cpu_only()
assert _adopt_early_client()
from kiln.compile import artifact
art = artifact.load({str(tiny_artifact)!r}, defer=True, prefetch=pre)
digest = art.manifest["files"]["programs/step_t8.cpu"]
assert art.programs[8].runtime_executable() is pre.executable("programs/step_t8.cpu", digest).result()
assert jax.devices()[0].client is checks.early_cpu_client()
from kiln.serving.llm import LLM
from kiln.serving.params import SamplingParams
print(LLM({str(tiny_artifact)!r}).generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0))[0].new_token_ids)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from kiln.serving.llm import LLM
    from kiln.serving.params import SamplingParams

    want = LLM(str(tiny_artifact)).generate([[3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert result.stdout.strip() == str(want.new_token_ids)

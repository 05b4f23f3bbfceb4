"""An artifact on disk: manifest and checksums, and `load` — from a folder to weights on device and ready programs.

Layout (see DESIGN.md, Artifacts):

    <artifact>/manifest.json                 format, model config, target, runtime, mesh, geometry, sha256 of files
    <artifact>/manifest.sha256               sha256 of manifest.json's bytes (the manifest drives the geometry)
    <artifact>/tokenizer.json ...            the tokenizer and chat template (tokenizer_dir is the artifact root)
    <artifact>/weights/weights.bin           the flat weight dict in the target's dtype, memory-mapped at load
                                             (kiln.compile.weightfile; sha256 per 32 MiB chunk in the manifest)
    <artifact>/programs/<name>.exported      jax.export serialization (portable StableHLO)
    <artifact>/programs/<name>.<platform>    serialized compiled executable (the fast path)

Programs: init_kv (a zeroed, sharded KV cache), step_t<T> for every token bucket T and, with decode_steps > 1,
decode_t<T> for every bucket of at most max_num_seqs tokens and, on one device, its run-ahead token gather gather_t<T>
(kiln.compile.lower.programs; an artifact compiled without the gathers loads, and the runner jits them).

Serialized executables are trusted code: load only from a path the operator gave; `load` checks the manifest against
manifest.sha256 before it reads anything else, each executable's sha256 before it deserializes it and its inputs and
outputs against the geometry after, and every other file's sha256 before it returns: any edited byte is refused in
one sentence.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import jax

from kiln.compile import executable, lower, weightfile
from kiln.compile.checks import (  # noqa: F401 (FORMAT_VERSION, MANIFEST*, FIRST_TOKENS and sha256: this module's API)
    FIRST_TOKENS,
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_SHA256,
    Prefetch,
    check_file,
    first_step,
    read_manifest,
    sha256,
)
from kiln.compile.convert import from_flat, make_mesh, to_flat, weight_shardings
from kiln.models.batch import KVCache
from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.gguf_quant import register_kernels
from kiln.models.transformer import Weights
from kiln.targets.detect import local_devices
from kiln.targets.target import Target

log = logging.getLogger("kiln.compile")


def first_programs(geom: lower.Geometry) -> set[str]:
    """The programs a deferred load deserializes before it returns: init_kv and step_t<T> of the largest bucket of at
    most FIRST_TOKENS tokens (the smallest bucket if none is that small)."""
    return {"init_kv", f"step_t{first_step(geom.buckets)}"}


def later_order(geom: lower.Geometry, names: set[str]) -> list[str]:
    """The order in which the programs a deferred load left out follow: the smallest bucket's step and decode
    programs (one sequence decodes in them), then the other step programs by size, then the other decode programs."""
    small = min(geom.buckets)
    head = [n for n in (f"step_t{small}", f"decode_t{small}") if n in names]
    rest = sorted(names - set(head), key=lambda n: (n.startswith("decode"), int(n.rsplit("_t", 1)[1])))
    return head + rest


def runtime_versions(platform: str, device_kind: str | None, device_count: int | None) -> dict:
    """What an executable is bound to: platform, device kind and count, and the jax/jaxlib/libtpu versions."""
    import jaxlib

    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    return {
        "platform": platform,
        "device_kind": device_kind,
        "device_count": device_count,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "libtpu": libtpu if platform == "tpu" else None,
    }


def write_file(path: Path, data: bytes) -> None:
    """Write atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _files(folder: Path) -> list[str]:
    """Every file the manifest's "files" lists: all but the manifest, its digest and weights.bin (checked by chunk)."""
    skip = {MANIFEST, MANIFEST_SHA256, weightfile.FILE}
    return sorted(n for p in folder.rglob("*") if p.is_file() and (n := str(p.relative_to(folder))) not in skip)


def _hash_all(folder: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        return dict(zip(names, pool.map(lambda n: sha256(folder / n), names), strict=True))


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write manifest.json with the sha256 of every other file of the folder, and manifest.sha256 with the sha256 of
    manifest.json's bytes (so the manifest, which drives the geometry, is checked too)."""
    manifest["files"] = _hash_all(folder, _files(folder))
    data = (json.dumps(manifest, indent=1) + "\n").encode()
    write_file(folder / MANIFEST, data)
    write_file(folder / MANIFEST_SHA256, (hashlib.sha256(data).hexdigest() + "\n").encode())


def verify_checksums(folder: Path, manifest: dict, prefetch: Prefetch | None = None) -> None:
    """Raise a one-sentence KilnError unless every file the manifest lists is there with its sha256 (taking the
    checks a Prefetch made of those files)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        checks = [(prefetch and prefetch.file(name, digest)) or pool.submit(check_file, folder, name, digest)
                  for name, digest in _listed(manifest).items()]  # fmt: skip
        for f in checks:
            f.result()


def _listed(manifest: dict) -> dict[str, str]:
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise KilnError("The artifact's manifest lists no files; recompile it with `kiln compile`.")
    return files


@dataclass
class LoadedArtifact:
    """An artifact ready to serve: weights on device (sharded), one program per token bucket, a KV allocator.

    programs[T](weights, kv, batch, sampling) -> (StepOut, kv) runs the step program of bucket T; kv is donated.
    Batch must be padded to (T, max_num_seqs, max_pages_per_seq) and SamplingBatch to max_num_seqs rows.
    """

    path: Path
    manifest: dict
    cfg: ModelConfig
    target: Target
    geometry: lower.Geometry
    mesh: jax.sharding.Mesh
    weights: Weights
    programs: dict[int, Callable]
    decode_programs: dict[int, Callable]  # T -> multi-step decode program (geometry.decode_steps tokens per call)
    gathers: dict[int, Callable]  # T -> run-ahead token gather of decode_t<T> (Runner.dispatch_ahead), where compiled
    init_kv: Callable
    recompiled: bool  # the executables did not fit this runtime and were compiled from .exported at load
    timings: dict[str, float] = field(default_factory=dict)  # seconds of each load phase (they overlap)
    weight_bytes: int = 0  # bytes of weights.bin
    first_kv: Future | None = None  # the KV cache allocated during the load (make_kv's first result)
    later: list[str] = field(default_factory=list)  # programs a deferred load left out (load_later), in load order
    _later: dict[str, Callable[[], Callable]] = field(default_factory=dict, repr=False)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.geometry.buckets

    @property
    def decode_steps(self) -> int:
        return self.geometry.decode_steps

    @property
    def max_num_seqs(self) -> int:
        return self.geometry.max_num_seqs

    @property
    def max_pages_per_seq(self) -> int:
        return self.geometry.max_pages_per_seq

    @property
    def seqs_per_bucket(self) -> dict[int, int]:
        """S of each bucket's program (T -> min(T, max_num_seqs))."""
        return {t: self.geometry.seqs(t) for t in self.geometry.buckets}

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def num_pages(self) -> int:
        return self.geometry.num_pages

    @property
    def max_model_len(self) -> int:
        return self.geometry.max_model_len

    @property
    def tokenizer_dir(self) -> Path:
        return self.path

    def load_later(self, name: str) -> Callable:
        """Deserialize the deferred program `name` (its bytes passed their sha256 during the load; its signature is
        checked here): a step_t<T> or decode_t<T> callable like those of programs and decode_programs. Raises
        KilnError or XLA's error when it does not load (the server keeps serving with the programs it has)."""
        return self._later.pop(name)()

    def make_kv(self) -> KVCache:
        """A zeroed KV cache on the devices, sharded like the programs expect (compiles nothing). The first call
        takes the one `load` allocated while the other programs deserialized."""
        if self.first_kv is not None:
            kv, self.first_kv = self.first_kv.result(), None
            return kv
        return self.init_kv()


def _mismatch(manifest: dict, here: dict) -> str | None:
    """Why the artifact's executables do not fit this runtime, or None when they do."""
    built = manifest.get("runtime")
    if built is None:
        return "it holds no executables for this platform"
    if any(entry.get("executable") is None for entry in manifest["programs"].values()):
        return "some programs have no executable"
    for key in ("platform", "device_kind", "device_count", "jax", "jaxlib", "libtpu"):
        if built.get(key) != here.get(key):
            return f"it was compiled for {key} {built.get(key)} and this runtime has {here.get(key)}"
    return None


def _parse(folder: Path, manifest: dict) -> tuple[Target, ModelConfig, lower.Geometry]:
    """The target, model config and geometry a manifest states, refused in one sentence when a field is missing or
    malformed (an artifact of another kiln, or a manifest written by hand)."""
    try:
        target = Target.from_dict(manifest["target"])
        cfg = ModelConfig.from_dict(manifest["model"]["config"])
        geom = lower.Geometry.from_dict(manifest["geometry"])
        for name in ("programs", "step_out", "weights"):
            if not isinstance(manifest[name], dict | list):
                raise TypeError(name)
        for key in ("file", "file_bytes", "tensors", "chunk_bytes", "chunks"):
            manifest["weights"][key]  # noqa: B018 (present, or KeyError)
    except (KeyError, TypeError, ValueError, AttributeError, KilnError) as e:
        raise KilnError(
            f"The manifest of {folder} is incomplete or malformed ({e.__class__.__name__}: {str(e)[:80]}); "
            f"recompile it with `kiln compile`."
        ) from None
    return target, cfg, geom


def load(
    path: str | Path,
    *,
    verify: bool = True,
    write_back: bool = True,
    defer: bool = False,
    prefetch: Prefetch | None = None,
) -> LoadedArtifact:
    """Load an artifact: check the manifest, checksums and runtime, load (or once compile) the programs, map the
    weights onto the devices, start allocating the KV cache.

    manifest.json must match manifest.sha256 and every other file its sha256 in the manifest (weights.bin chunk by
    chunk); each is checked before it is used (an executable before it is deserialized), on a thread pool, while the
    executables deserialize and the weights are placed: the checks, the executables and the weights overlap. On a
    runtime that matches the manifest (platform, device kind and count, jax/jaxlib/libtpu versions) the executables
    are deserialized. Otherwise every program is compiled once from its .exported form, one log line says so, and the
    executables are written back into the artifact (write_back) with the manifest's runtime and checksums updated, so
    the next load is fast. Every refusal is one sentence (KilnError).

    defer (a CPU's deserialized executables only: each is the whole model unrolled, ~1 CPU-second to deserialize on
    2 cores): deserialize only `first_programs`; the others' bytes are checked now and kept, and `later` lists them
    for `load_later` (programs and decode_programs then hold the first bucket only).

    prefetch (`kiln serve`): the checks of this artifact's files started before jax was imported
    (kiln.compile.checks.Prefetch); the load takes each one made against its own manifest's digest and checks the rest.
    """
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    folder = Path(path)
    if not folder.is_dir():
        raise KilnError(f"The artifact {folder} does not exist.")
    if prefetch is not None and verify:
        prefetch.start_chunks()  # an accelerator's uncached weights: the disk reads them from now on
    manifest = read_manifest(folder, check=verify)
    target, cfg, geom = _parse(folder, manifest)
    local = local_devices()
    if local.platform != target.platform:
        raise KilnError(
            f"The artifact {folder.name} is for target {target.name} ({target.platform}) but this machine runs "
            f"{local.platform}; compile one with `kiln compile --target auto`."
        )
    if target.platform == "cpu":  # the CPU kernels its executables name, before they deserialize (none elsewhere:
        register_kernels(geom.weight_format)  # a GPU machine without them is no reason for a warning)
    if local.device_count < geom.tp:
        raise KilnError(
            f"The artifact {folder.name} needs {geom.tp} devices but this machine has {local.device_count}."
        )
    devices = jax.devices()[: geom.tp]
    mesh = make_mesh(devices, geom.tp)
    try:
        # an artifact compiled before the run-ahead gathers were programs of their own: the runner jits them
        names = [n for n in lower.program_names(geom) if not n.startswith("gather_t") or n in manifest["programs"]]
        entries = {name: manifest["programs"][name] for name in names}
    except (KeyError, TypeError, ValueError) as e:
        raise KilnError(
            f"The manifest of {folder} does not describe this kiln's programs ({e}); recompile it."
        ) from None
    here = runtime_versions(local.platform, local.device_kind, local.device_count)
    reason = _mismatch(manifest, here)
    if jax.process_count() > 1:  # multi-host (kiln.serving.multihost): the programs span every process's devices
        reason = reason or f"it runs as one of {jax.process_count()} processes (executables name one process's devices)"
        write_back = False  # every process compiles the same; none writes into the shared artifact
    files = _listed(manifest) if verify else {}
    on_cpu = target.platform == "cpu"
    gathers = {n for n in names if n.startswith("gather_t")}  # tiny (~2 ms each): always before ready
    first = first_programs(geom) | gathers if defer and on_cpu and reason is None else set(names)
    later = later_order(geom, set(names) - first)
    try:  # the signatures of the programs loaded now (lower.program): the deferred ones' are built as they load
        progs = {n: lower.program(cfg, geom, mesh, manifest["step_out"], n) for n in names if n in first}
    except (KeyError, TypeError, ValueError) as e:
        raise KilnError(
            f"The manifest of {folder} does not describe this kiln's programs ({e}); recompile it."
        ) from None
    timings["manifest"] = time.perf_counter() - t_start

    mapped = weightfile.MappedWeights(folder, manifest["weights"])
    tree = weight_shardings(
        cfg,
        mesh,
        jax.numpy.dtype(manifest["weights"]["dtype"]),
        geom.weight_format,
        geom.expert_parallel,
        geom.fused_linears,
    )
    abstract = to_flat(tree)
    weightfile.expect_tensors(mapped, abstract)
    loaded: dict[str, Callable] = {}
    blobs: dict[str, Future] = {}  # the deferred programs' checked bytes
    upload = weightfile.upload_mode() if not on_cpu else "direct"
    uploads_of = weightfile.Uploads(mapped, upload, verify) if not on_cpu else None
    cores = os.cpu_count() or 1
    # three pools, so that no kind of work waits behind another's queue: the executables, the sha256 checks and the
    # uploads (an accelerator's; a CPU takes the mapped weights without a copy). One executable at a time on a 2-core
    # machine (two at once measured no faster there).
    exe_pool = ThreadPoolExecutor(max_workers=max(1, min(8, cores // 4)), thread_name_prefix="kiln-exe")
    pool = ThreadPoolExecutor(max_workers=weightfile.check_threads(), thread_name_prefix="kiln-check")
    uploader = ThreadPoolExecutor(max_workers=weightfile.upload_threads(upload), thread_name_prefix="kiln-upload")
    # the KV cache is allocated on its own thread as soon as init_kv is loaded: on a CPU its first touch (1.5 GB for
    # SmolLM2: ~1 s of page faults) takes a core that the one-at-a-time deserialization leaves free
    kv_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-kv")
    first_kv: list[Future] = []
    signatures: list[Future] = []  # each executable's check_signature
    try:
        t0 = time.perf_counter()

        def read_program(name: str) -> bytes:
            rel = entries[name]["executable"]
            if verify and rel not in files:
                raise KilnError(f"The artifact's manifest lists no sha256 for {rel}; recompile it with `kiln compile`.")
            return check_file(folder, rel, files[rel]) if verify else (folder / rel).read_bytes()

        def checked(name: str) -> Future | None:
            """The prefetch's check of file `name` (with its bytes for an executable), where it made one."""
            return prefetch.file(name, files[name]) if prefetch is not None and name in files else None

        def load_program(name: str) -> None:
            rel = entries[name]["executable"]
            early = checked(rel)
            data = early.result() if early is not None else read_program(name)
            # kiln serve's prefetch may have deserialized it already, for this one device, from these checked bytes
            one = prefetch is not None and verify and len(devices) == 1
            made = prefetch.executable(rel, files[rel]) if one else None
            xla_exe = made.result() if made is not None and made.exception() is None else None
            xla_exe = xla_exe if xla_exe is not None and xla_exe.client is devices[0].client else None
            # the signature check (0.1 s a program on the CPU) runs on the checks' pool, off this one-at-a-time path
            loaded[name] = executable.load_executable(
                data, progs[name], devices, lambda c: signatures.append(pool.submit(c)), xla_exe
            )
            if name == "init_kv":  # the first program: the KV cache's first touch runs beside the others' loading
                first_kv.append(kv_pool.submit(lambda: jax.block_until_ready(loaded["init_kv"]())))

        def timed(key: str, futures: list[Future]) -> list[Future]:
            def done(_):
                if all(f.done() for f in futures):
                    timings.setdefault(key, time.perf_counter() - t0)

            for f in futures:
                f.add_done_callback(done)
            return futures

        # the programs, and meanwhile the checks of every other file and of the weights' chunks
        # in the programs' order, init_kv first (so the KV cache's first touch starts at once: in a set's order, which
        # changes with the process's string hashing, it came last in some starts and was then ~1 s of the critical path)
        programs = [exe_pool.submit(load_program, n) for n in progs if n in first] if reason is None else []
        programs = timed("executables", programs)
        blobs = {n: checked(entries[n]["executable"]) or pool.submit(read_program, n) for n in later}
        others = [n for n in files if reason is not None or n not in {e["executable"] for e in entries.values()}]
        checks = [checked(n) or pool.submit(check_file, folder, n, files[n]) for n in others]
        # the weights' chunk checks kiln serve's prefetch started (a CPU's; an accelerator's in the page cache)
        prechecked = prefetch.chunks(mapped.meta) if prefetch is not None and verify else None
        if on_cpu:  # zero-copy views of the mapping: nothing to wait for but the chunks' checks
            checks += (prechecked or mapped.checks(pool)) if verify else []
            # one device_put of every tensor (each still a view of the mapping, no copy): 483 calls of it one
            # tensor at a time took twice the CPU, holding the GIL (SmolLM2: 0.035 against 0.017 s)
            names = list(abstract) if len(devices) == 1 else []
            arrays = jax.device_put([mapped.array(n) for n in names], [abstract[n].sharding for n in names])
            flat = dict(zip(names, arrays, strict=True))
            flat |= {name: weightfile.place(mapped, name, want) for name, want in abstract.items() if name not in flat}
            timings["weights"] = time.perf_counter() - t0
        else:  # uploads, several tensors at once, each once the chunks that hold it passed their check (Uploads)
            done = sum(f.done() for f in prechecked) if prechecked else 0  # checked before the load began
            jobs, chunk_checks = uploads_of.submit(abstract, uploader, pool, prechecked)
            uploads = timed("weights", jobs)
            checks += chunk_checks
        timed("checksums", checks + list(blobs.values()))
        reason = _first_error(programs, reason)
        _first_error(list(blobs.values()), None, refuse=True)
        reason = _first_error(signatures, reason)  # a KilnError: the executables do not fit the geometry
        _first_error(checks, None, refuse=True)
        if not on_cpu:
            _first_error(uploads, None, refuse=True)
            flat = {name: a for f in uploads for name, a in f.result().items()}
            flat = {name: flat[name] for name in abstract}
            by = f"the prefetch ({done} of {len(prechecked)} done at the load's start)" if prechecked else "the load"
            spent = ", ".join(f"{k} {v:.2f}" for k, v in uploads_of.seconds.items())
            log.debug("weights: %d tensors uploaded (%s), chunks checked by %s; upload thread-seconds: %s",
                      len(flat), uploads_of.mode, by, spent)  # fmt: skip
    finally:
        for p in (exe_pool, pool, uploader, kv_pool):
            p.shutdown(wait=p is not kv_pool, cancel_futures=True)  # after a refusal, nothing more is read or loaded
    if reason is not None:
        t0 = time.perf_counter()
        loaded = _compile_programs(folder, manifest, progs.values(), target.platform, here, reason, write_back)
        timings["executables"] = time.perf_counter() - t0
    weights = from_flat(tree, flat)
    timings["load"] = time.perf_counter() - t_start

    def deferred(name: str) -> Callable[[], Callable]:
        data = blobs[name].result()
        return lambda: executable.load_executable(
            data, lower.program(cfg, geom, mesh, manifest["step_out"], name), devices
        )

    return LoadedArtifact(
        path=folder,
        manifest=manifest,
        cfg=cfg,
        target=target,
        geometry=geom,
        mesh=mesh,
        weights=weights,
        programs={t: loaded[f"step_t{t}"] for t in geom.buckets if f"step_t{t}" in loaded},
        decode_programs={t: loaded[f"decode_t{t}"] for t in geom.decode_buckets if f"decode_t{t}" in loaded},
        gathers={t: loaded[f"gather_t{t}"] for t in geom.decode_buckets if f"gather_t{t}" in loaded},
        init_kv=loaded["init_kv"],
        recompiled=reason is not None,
        timings=timings,
        weight_bytes=mapped.meta["file_bytes"],
        first_kv=first_kv[0] if first_kv and reason is None else None,
        later=later if reason is None else [],
        _later={n: deferred(n) for n in later} if reason is None else {},
    )


def _first_error(futures: list[Future], reason: str | None, refuse: bool = False) -> str | None:
    """Wait for every future. A KilnError (a file that fails its check, an executable that does not fit its
    geometry) is raised; with refuse, any other error too; otherwise another error (XLA refused the bytes, or this
    jax's internals differ) becomes the reason to compile from .exported instead."""
    for f in futures:
        e = f.exception()
        if e is None:
            continue
        if isinstance(e, KilnError) or refuse:
            raise e
        reason = reason or f"its executables do not load here ({e.__class__.__name__}: {str(e)[:200]})"
    return reason


def _compile_programs(folder: Path, manifest: dict, progs, platform: str, here: dict, reason: str, write_back: bool):
    """Compile every program from its .exported form (checked above), once, and write the executables back."""
    progs = list(progs)
    log.warning("kiln: compiling %d programs of %s from StableHLO once, because %s.", len(progs), folder, reason)
    loaded, blobs = {}, {}
    for prog in progs:
        exported = jax.export.deserialize(
            bytearray((folder / manifest["programs"][prog.name]["exported"]).read_bytes())
        )
        compiled = executable.compile_exported(exported, prog)
        blobs[prog.name] = executable.serialize(compiled)
        loaded[prog.name] = executable.from_flat_compiled(compiled, prog)
    if write_back:
        _write_back(folder, manifest, blobs, platform, here)
    return loaded


def _write_back(folder: Path, manifest: dict, blobs: dict[str, bytes], platform: str, here: dict) -> None:
    """Store executables compiled at load into the artifact and re-sign the manifest; a read-only artifact is
    left as it is (the next start compiles again)."""
    try:
        for name, blob in blobs.items():
            rel = f"programs/{name}.{platform}"
            write_file(folder / rel, blob)
            manifest["programs"][name]["executable"] = rel
        manifest["runtime"] = here
        write_manifest(folder, manifest)
    except OSError as e:
        log.warning("kiln: could not write the compiled programs back into %s (%s).", folder, e)

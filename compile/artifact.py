"""An artifact on disk: manifest and checksums, and `load` — from a folder to weights on device and ready programs.

Layout (see DESIGN.md, Artifacts):

    <artifact>/manifest.json                 format, model config, target, runtime, mesh, geometry, sha256 of files
    <artifact>/tokenizer.json ...            the tokenizer and chat template (tokenizer_dir is the artifact root)
    <artifact>/weights/                      orbax checkpoint of the flat weight dict, in the target's dtype
    <artifact>/programs/<name>.exported      jax.export serialization (portable StableHLO)
    <artifact>/programs/<name>.<platform>    serialized compiled executable (the fast path)

Programs: init_kv (a zeroed, sharded KV cache), step_t<T> for every token bucket T and, with decode_steps > 1,
decode_t<T> for every bucket of at most max_num_seqs tokens (kiln.compile.lower.programs).

Serialized executables are trusted code: load only from a path the operator gave; `load` checks every file's
sha256 before it deserializes anything.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import jax

from kiln.compile import executable, lower
from kiln.compile.convert import from_flat, make_mesh, to_flat, weight_shardings
from kiln.models.batch import KVCache
from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.transformer import Weights
from kiln.targets.detect import local_devices
from kiln.targets.target import Target

log = logging.getLogger("kiln.compile")

FORMAT_VERSION = 4  # 2: a bucket of T tokens has S = min(T, max_num_seqs); 3: decode_t<T>, want_top; 4: token mask
MANIFEST = "manifest.json"


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


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _hash_all(folder: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        return dict(zip(names, pool.map(lambda n: sha256(folder / n), names), strict=True))


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write manifest.json with the sha256 of every other file of the folder."""
    manifest["files"] = _hash_all(folder, _files(folder))
    write_file(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise KilnError(f"{folder} is not a kiln artifact (it has no {MANIFEST}); create one with `kiln compile`.")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KilnError(
            f"{path} is not valid JSON; the artifact is damaged, recompile it with `kiln compile`."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise KilnError(f"{folder} has artifact format {found}, this kiln reads {FORMAT_VERSION}; recompile it.")
    return manifest


def verify_checksums(folder: Path, manifest: dict) -> None:
    """Raise a one-sentence KilnError unless every file the manifest lists is there with its sha256."""
    files = manifest.get("files") or {}
    for name in files:
        if not (folder / name).is_file():
            raise KilnError(f"The artifact file {name} is missing from {folder}; recompile it with `kiln compile`.")
    got = _hash_all(folder, list(files))
    for name, digest in files.items():
        if got[name] != digest:
            raise KilnError(
                f"The artifact file {folder / name} does not match its sha256 in {MANIFEST} (edited or truncated); "
                f"recompile it with `kiln compile`."
            )


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
    init_kv: Callable
    recompiled: bool  # the executables did not fit this runtime and were compiled from .exported at load
    timings: dict[str, float] = field(default_factory=dict)

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

    def make_kv(self) -> KVCache:
        """A zeroed KV cache on the devices, sharded like the programs expect (compiles nothing)."""
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


def load(path: str | Path, *, verify: bool = True, write_back: bool = True) -> LoadedArtifact:
    """Load an artifact: check checksums and runtime, load (or once compile) the programs, restore the weights.

    On a runtime that matches the manifest (platform, device kind and count, jax/jaxlib/libtpu versions) the
    executables are deserialized (milliseconds). Otherwise every program is compiled once from its .exported form,
    one log line says so, and the executables are written back into the artifact (write_back) with the manifest's
    runtime and checksums updated, so the next load is fast.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    folder = Path(path)
    if not folder.is_dir():
        raise KilnError(f"The artifact {folder} does not exist.")
    manifest = read_manifest(folder)
    if verify:
        verify_checksums(folder, manifest)
    timings["verify"] = time.perf_counter() - t0

    target = Target.from_dict(manifest["target"])
    cfg = ModelConfig.from_dict(manifest["model"]["config"])
    geom = lower.Geometry.from_dict(manifest["geometry"])
    local = local_devices()
    if local.platform != target.platform:
        raise KilnError(
            f"The artifact {folder.name} is for target {target.name} ({target.platform}) but this machine runs "
            f"{local.platform}; compile one with `kiln compile --target auto`."
        )
    if local.device_count < geom.tp:
        raise KilnError(
            f"The artifact {folder.name} needs {geom.tp} devices but this machine has {local.device_count}."
        )
    devices = jax.devices()[: geom.tp]
    mesh = make_mesh(devices, geom.tp)
    progs = lower.programs(cfg, geom, mesh, manifest["step_out"])
    here = runtime_versions(local.platform, local.device_kind, local.device_count)

    t0 = time.perf_counter()
    reason = _mismatch(manifest, here)
    loaded: dict[str, Callable] = {}
    if reason is None:
        try:
            for prog in progs:
                blob = (folder / manifest["programs"][prog.name]["executable"]).read_bytes()
                loaded[prog.name] = executable.load_executable(blob, prog, devices)
        except Exception as e:  # XLA refused the bytes, or this jax's internals differ: compile instead
            reason = f"its executables do not load here ({e.__class__.__name__}: {str(e)[:200]})"
    if reason is not None:
        log.warning("kiln: compiling %d programs of %s from StableHLO once, because %s.", len(progs), folder, reason)
        blobs = {}
        for prog in progs:
            exported = jax.export.deserialize(
                bytearray((folder / manifest["programs"][prog.name]["exported"]).read_bytes())
            )
            compiled = executable.compile_exported(exported, prog)
            blobs[prog.name] = executable.serialize(compiled)
            loaded[prog.name] = executable.from_flat_compiled(compiled, prog)
        if write_back:
            _write_back(folder, manifest, blobs, target.platform, here)
    timings["programs"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    weights = restore_weights(folder / manifest["weights"]["dir"], cfg, mesh, manifest["weights"]["dtype"],
                              geom.weight_format)  # fmt: skip
    timings["weights"] = time.perf_counter() - t0
    return LoadedArtifact(
        path=folder,
        manifest=manifest,
        cfg=cfg,
        target=target,
        geometry=geom,
        mesh=mesh,
        weights=weights,
        programs={t: loaded[f"step_t{t}"] for t in geom.buckets},
        decode_programs={t: loaded[f"decode_t{t}"] for t in geom.decode_buckets},
        init_kv=loaded["init_kv"],
        recompiled=reason is not None,
        timings=timings,
    )


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


def restore_weights(
    folder: Path, cfg: ModelConfig, mesh: jax.sharding.Mesh, dtype: str, weight_format: str = "float"
) -> Weights:
    """The orbax checkpoint of the flat weight dict, restored onto `mesh` with the tensor-parallel shardings."""
    import orbax.checkpoint as ocp

    abstract = weight_shardings(cfg, mesh, jax.numpy.dtype(dtype), weight_format)
    with ocp.StandardCheckpointer() as ckptr:
        flat = ckptr.restore(folder.resolve(), to_flat(abstract))
    return from_flat(abstract, flat)

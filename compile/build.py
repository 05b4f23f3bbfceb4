"""`kiln compile`: checkpoint + target -> artifact folder.

compile_artifact converts the weights to the target's dtype and saves them as one flat file, sizes the KV cache, then
exports every program (init_kv and the step program per token bucket) as portable StableHLO and, where the target's
compiler is reachable here, compiles and serializes it: CPU always, TPU through libtpu's deviceless topologies,
CUDA/ROCm only on a machine with that GPU. The folder is written beside its final place and renamed at the end, so
a half-written artifact is never mistaken for a finished one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from kiln.compile import executable, lower, roofline, weightfile
from kiln.compile.artifact import FORMAT_VERSION, runtime_versions, write_file, write_manifest
from kiln.compile.checks import code_fingerprint, model_name, source_fingerprint  # noqa: F401 (this module's API)
from kiln.compile.convert import check_tp, convert, default_tp, make_mesh
from kiln.compile.plan import Options, fuses_linears, make_geometry, resolve_target
from kiln.models.checkpoint import load_checkpoint, resolve_source
from kiln.models.checkpoint.tokenizer import TokenizerData
from kiln.models.errors import KilnError
from kiln.models.quant import quantize_weights, weights_format
from kiln.models.transformer import fuse_linears
from kiln.targets.detect import local_devices
from kiln.targets.target import Target

log = logging.getLogger("kiln.compile")


@dataclass
class CompileSite:
    """Where programs are lowered: the devices of the mesh, whether executables can be built, the runtime."""

    devices: list
    compiles: bool  # the target's compiler is reachable here
    runtime: dict | None  # what the executables are for (platform, device kind and count, versions)
    context: Callable[[], contextlib.AbstractContextManager]  # a fresh one for each thread that lowers or compiles


def compile_site(target: Target) -> CompileSite:
    """The devices to lower for: a deviceless TPU topology, the local devices, or (another GPU) none."""
    if target.platform == "tpu":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # deviceless: no chip is opened
        try:
            from jax.experimental import topologies

            topo = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
        except Exception as e:  # libtpu missing or unusable: jax raises several types here
            raise KilnError(
                f"Compiling for {target.name} needs libtpu (`pip install libtpu`); it failed with: {e}."
            ) from None
        devices = list(topo.devices)
        runtime = runtime_versions("tpu", devices[0].device_kind, len(devices))
        return CompileSite(devices, True, runtime, functools.partial(jax.default_device, devices[0]))
    here = local_devices()
    if here.platform == target.platform:
        runtime = runtime_versions(here.platform, here.device_kind, here.device_count)
        return CompileSite(jax.devices(), True, runtime, contextlib.nullcontext)
    return CompileSite(jax.devices(), False, None, contextlib.nullcontext)


def compile_artifact(source: str | Path | None, target_name: str, out: str | Path | None = None, **options) -> Path:
    """Compile `source` (HF folder, .gguf, None = embedded SmolLM2) for `target_name` into an artifact folder.

    options: kiln.compile.plan.Options fields. Returns the artifact's path (default artifacts/<model>.<target>/).
    """
    t_start = time.perf_counter()
    opts = Options.from_kwargs(**options)
    target = resolve_target(target_name, opts)
    src = resolve_source(source)
    out = Path(out) if out else Path(os.environ.get("KILN_ARTIFACTS", "artifacts")) / f"{model_name(src)}.{target.name}"

    site = compile_site(target)
    if target.platform in ("cuda", "rocm") and site.compiles and target.device_kind is None:
        target = target.replace(device_kind=site.runtime["device_kind"], device_count=site.runtime["device_count"])
    t0 = time.perf_counter()
    cfg, weights = load_checkpoint(src, dtype=jnp.dtype(target.compute_dtype))
    weights = quantize_weights(weights, target.weight_format, source=src)
    target = target.replace(weight_format=weights_format(weights))  # "gguf" -> the file's kinds, e.g. "q4_1,embed=q8_0"
    weights = fuse_linears(cfg, weights) if fuses_linears(target) else weights  # lower.Geometry.fused_linears
    flat = convert(weights, jnp.dtype(target.compute_dtype))
    del weights
    t_convert = time.perf_counter() - t0
    log.info("weights: %d tensors of %s read and converted to %s in %.1f s", len(flat), src.name,
             target.weight_format if target.weight_format != "float" else target.compute_dtype, t_convert)  # fmt: skip

    device_count = len(site.devices) if site.compiles else target.device_count
    tp = opts.tp if opts.tp is not None else default_tp(cfg, device_count)
    check_tp(cfg, tp, device_count if site.compiles else tp)  # a GPU not here: trust --tp, lower on host devices
    if tp > len(site.devices):
        raise KilnError(f"--tp {tp} needs {tp} devices to lower for but this machine has {len(site.devices)}.")
    weight_bytes = sum(a.nbytes // 2 if a.dtype == jnp.int4 else a.nbytes for a in flat.values())  # int4: 2 a byte
    geom = make_geometry(cfg, target, opts, tp=tp, weight_bytes=weight_bytes)
    num_pages = geom.num_pages
    mesh = make_mesh(site.devices, tp)

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "programs").mkdir(parents=True)
        t0 = time.perf_counter()
        weights_meta = _save_weights(tmp, flat)
        t_save = time.perf_counter() - t0
        log.info("weights: %.1f MiB saved in %.1f s", weight_bytes / 2**20, t_save)
        del flat
        tokenizer_files = _save_tokenizer(src, tmp)

        with site.context():
            out_avals = lower.step_out_avals(cfg, geom, mesh)
            progs = lower.programs(cfg, geom, mesh, out_avals)
            programs_meta, seconds = _build_programs(progs, site, target, tmp, num_pages, cfg=cfg)

        manifest = {
            "format": FORMAT_VERSION,
            "model": {"name": model_name(src), "config": cfg.to_dict()},
            "source": source_fingerprint(src),
            "code": code_fingerprint(),
            "options": opts.to_dict(),
            "target": target.to_dict(),
            "runtime": site.runtime,
            "compiled_with": runtime_versions(target.platform, None, None),
            "mesh": {"axes": ["tp"], "shape": [tp]},
            "geometry": geom.to_dict(),
            "kv": {"bytes": geom.kv_bytes(cfg), "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                   "head_dim": cfg.head_dim},
            "weights": {"dtype": target.compute_dtype, "format": target.weight_format, "bytes": weight_bytes,
                        **weights_meta},
            "tokenizer": {"files": tokenizer_files},
            "step_out": out_avals,
            "programs": programs_meta,
            "build": {"seconds": seconds, "convert_seconds": round(t_convert, 3), "save_seconds": round(t_save, 3),
                      "total_seconds": None},
        }  # fmt: skip
        manifest["build"]["total_seconds"] = round(time.perf_counter() - t_start, 3)
        write_manifest(tmp, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave half an artifact behind
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def compile_workers() -> int:
    """How many programs compile at once: $KILN_COMPILE_WORKERS, else two on a small machine and up to four on one
    with many cores (a GPU host; XLA's compiler releases the GIL). Two on 2 cores: the default tpu-v5e-8 SmolLM2
    artifact compiled in 351 s wall with two against 395 s with one, at the same CPU seconds (334 vs 338; BENCHMARKS,
    issue 21); one only on a single core."""
    env = os.environ.get("KILN_COMPILE_WORKERS")
    if env is None:
        cores = os.cpu_count() or 1
        return 1 if cores < 2 else min(4, max(2, cores // 4))
    if not env.isdigit() or int(env) < 1:
        raise KilnError(f"KILN_COMPILE_WORKERS must be a positive whole number, not {env!r}.")
    return int(env)


def _build_programs(progs: list, site, target: Target, tmp: Path, num_pages: int, workers: int | None = None, cfg=None):
    """Export every program (one at a time: tracing is Python) and, where the target's compiler is reachable here,
    compile and serialize it, up to `workers` compiles at once, with each step and decode program's static roofline
    (kiln.compile.roofline, given cfg). Returns (the manifest's programs entry, timings)."""
    workers = workers or compile_workers()
    programs_meta, seconds = {}, {}

    def compile_one(prog, exported) -> None:
        t0 = time.perf_counter()
        try:
            with site.context():
                compiled = executable.compile_exported(exported, prog)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            first = str(e).splitlines()[0].split(": ", 2)[-1].rstrip(".")
            raise KilnError(
                f"{prog.name} does not fit on a {target.name} device with {num_pages} KV pages ({first}); "
                f"lower --kv-memory-fraction or pass a smaller --kv-tokens."
            ) from None
        name = f"programs/{prog.name}.{target.platform}"
        write_file(tmp / name, executable.serialize(compiled))
        programs_meta[prog.name].update(executable=name, memory=_memory(compiled))
        if cfg is not None and roofline.is_step(prog):
            programs_meta[prog.name]["roofline"] = r = roofline.roofline(cfg, prog, compiled, with_sampler=False)
            log.info("%s", roofline.format_line(prog.name, r))
        seconds[prog.name]["compile"] = round(time.perf_counter() - t0, 3)
        log.info("%s: compiled in %.1f s", prog.name, time.perf_counter() - t0)

    bar = tqdm(total=len(progs) * (2 if site.compiles else 1), desc=f"compiling for {target.name}", unit="step",
               disable=None)  # fmt: skip
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for prog in progs:
            bar.set_postfix_str(prog.name)
            t0 = time.perf_counter()
            exported = executable.export(prog, target.platform)
            write_file(tmp / "programs" / f"{prog.name}.exported", exported.serialize())
            programs_meta[prog.name] = {"exported": f"programs/{prog.name}.exported", "executable": None}
            seconds[prog.name] = {"export": round(time.perf_counter() - t0, 3), "compile": None}
            log.info("%s: exported in %.1f s", prog.name, seconds[prog.name]["export"])
            bar.update()
            if site.compiles:
                futures.append(pool.submit(compile_one, prog, exported))
                futures[-1].add_done_callback(lambda _: bar.update())
        for f in futures:
            f.result()  # the first failure (in program order) is raised here
    bar.close()
    return programs_meta, seconds


def _memory(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend reports it
        return None
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    return {f: int(getattr(m, f)) for f in fields}


def _save_weights(folder: Path, flat: dict) -> dict:
    """The flat weight dict into folder/weights/weights.bin (kiln.compile.weightfile); returns the manifest's entry."""
    return weightfile.save(folder, flat)


def _save_tokenizer(src: Path, folder: Path) -> list[str]:
    """The tokenizer and chat template into the artifact's root; returns the file names written."""
    before = {p.name for p in folder.iterdir()}
    TokenizerData.from_source(src).save(folder)
    return sorted({p.name for p in folder.iterdir() if p.is_file()} - before)

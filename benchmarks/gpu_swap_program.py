"""An artifact with some programs compiled again under other XLA options, for an A/B of one bucket's options
(models/kernels/pallas_gpu.py's DECODE_XLA_OPTIONS) served from the same call without a second `kiln compile`.

    python benchmarks/gpu_swap_program.py SRC DST decode_t64 enable_triton_gemm:false [--hlo DIR]
    python benchmarks/gpu_swap_program.py DST DST decode_t16 exhaustive_tiling_search:true
    python benchmarks/gpu_swap_program.py SRC DST step_t2048 pieces_min:2048

DST is made from SRC with every file hard-linked (weights.bin is not copied; DST == SRC works in place), each named
program is compiled again from its .exported form with the options ("/" between several, an xla_gpu_ prefix may be
left out, true/false/integers typed, as gpu_profile.py's ";xla="; KILN_SETTINGS' keys trace it again from the model
under those kernel settings instead) in place of its default, its executable replaced
(a new file: SRC's stays as it was) and the manifest re-signed. Prints each compile's seconds and, per program, the
GEMMs of the old and the new executable (XLA's Triton tiling configs, cuBLAS calls), so a run shows what changed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.lib import xla_client as xc

from kiln.compile import artifact, executable, lower
from kiln.compile.convert import make_mesh
from kiln.models import quant
from kiln.models.gguf_quant import register_kernels
from kiln.models.kernels import pallas_gpu


def typed(value: str) -> bool | int | str:
    """An XLA option's value as XLA's compile options take it (true/false a bool, an integer an int)."""
    return {"true": True, "false": False}.get(value, int(value) if value.lstrip("-").isdigit() else value)


# Settings of kiln's modules a program is traced under (KEY:VALUE in the options text): the program is then lowered
# again from the model instead of compiled from its .exported. pieces_min: pallas_gpu.PIECES_CUDNN_MIN_TOKENS
# ("none" = off); block_k_new: pallas_gpu.PREFILL_BLOCK_K_NEW; fp8_out: quant.FP8_DOT_OUT (a dtype name).
KILN_SETTINGS = {
    "pieces_min": (pallas_gpu, "PIECES_CUDNN_MIN_TOKENS"),
    "block_k_new": (pallas_gpu, "PREFILL_BLOCK_K_NEW"),
    "fp8_out": (quant, "FP8_DOT_OUT"),
}


def parse_options(text: str) -> dict[str, bool | int | str]:
    """FLAG:VALUE/FLAG:VALUE as XLA compile options (gpu_profile.py's ";xla=" form); KILN_SETTINGS' keys left out."""
    options: dict[str, bool | int | str] = {}
    for item in filter(None, text.split("/")):
        flag, value = item.split(":")
        if flag not in KILN_SETTINGS:
            options[flag if flag.startswith("xla_") else f"xla_gpu_{flag}"] = typed(value)
    return options


def kiln_settings(text: str) -> dict[tuple, object]:
    """The KILN_SETTINGS items of an options text: {(module, constant): value} ("none": None, digits: an int, else a
    dtype)."""
    items = (item.split(":") for item in filter(None, text.split("/")))
    return {KILN_SETTINGS[k]: None if v == "none" else int(v) if v.isdigit() else jnp.dtype(v)
            for k, v in items if k in KILN_SETTINGS}  # fmt: skip


def recompile(folder: Path, manifest: dict, cfg, geom, mesh, name: str, text: str):
    """Program `name` of the artifact compiled again from its .exported under its default XLA options updated with
    `text` (FLAG:VALUE/...): (the compiled executable, the Program with those options, its default options, the
    compile's seconds)."""
    prog = lower.program(cfg, geom, mesh, manifest["step_out"], name)
    default = prog.compiler_options() if callable(prog.compiler_options) else prog.compiler_options
    prog.compiler_options = {**(default or {}), **parse_options(text)}
    t0 = time.perf_counter()
    settings = kiln_settings(text)
    if settings:  # traced again under those settings
        saved = {k: getattr(*k) for k in settings}
        for (module, name), v in settings.items():
            setattr(module, name, v)
        try:
            exported = executable.export(prog, manifest["target"]["platform"])
        finally:
            for (module, name), v in saved.items():
                setattr(module, name, v)
    else:
        exported = jax.export.deserialize(bytearray((folder / manifest["programs"][name]["exported"]).read_bytes()))
    compiled = executable.compile_exported(exported, prog)
    return compiled, prog, default, time.perf_counter() - t0


def link_tree(src: Path, dst: Path) -> None:
    """dst as a copy of src whose files are hard links (replaced files get new inodes: artifact.write_file)."""
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)


def gemms(hlo: str) -> list[str]:
    """One line per GEMM of an optimized HLO text: a Triton GEMM fusion's result shape and tiling, or a cuBLAS call."""
    rows = []
    for line in hlo.splitlines():
        shape = re.search(r"= \(?(\w+\[[\d,]*\])", line)
        kind = re.search(r'"kind":"(__triton\w*gemm\w*)"', line)
        if kind:  # the tiling: triton_gemm_config, or the generic emitter's block_level_fusion_config
            cfg = re.search(r'"(?:triton_gemm_config|block_level_fusion_config)":(\{.*?\})(?:,"|\}$|\})', line)
            tiling = re.sub(r'[{}"\[\]]', "", cfg.group(1)).replace(",", " ") if cfg else "?"
            rows.append(f"{kind.group(1)} {shape.group(1) if shape else '?'} {tiling}")
        elif re.search(r'custom_call_target="__cublas', line):
            target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
            rows.append(f"{target} {shape.group(1) if shape else '?'}")
    return rows


def summary(hlo: str) -> str:
    counts = collections.Counter(gemms(hlo))
    return "\n".join(f"    {n:3d} x {row}" for row, n in sorted(counts.items())) or "    (no GEMM found)"


def old_hlo(blob: bytes, devices) -> str:
    """The optimized HLO of a serialized executable (empty when this jaxlib cannot say)."""
    try:
        exe = devices[0].client.deserialize_executable(blob, executable_devices=xc.DeviceList(tuple(devices)))
        return "\n".join(m.to_string() for m in exe.hlo_modules())
    except Exception as e:  # noqa: BLE001 (a diagnosis only)
        print(f"  (the old executable's HLO is not readable here: {e.__class__.__name__}: {str(e)[:200]})")
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("swaps", nargs="+", help="PROGRAM FLAG:VALUE/... pairs, e.g. decode_t64 enable_triton_gemm:false")
    ap.add_argument("--hlo", type=Path, default=None, help="a folder for the old and new optimized HLO texts")
    args = ap.parse_args(argv)
    if len(args.swaps) % 2:
        ap.error("swaps come in pairs: PROGRAM OPTIONS")
    if args.src.resolve() != args.dst.resolve():
        link_tree(args.src, args.dst)
    folder = args.dst
    manifest = artifact.read_manifest(folder, check=True)
    target, cfg, geom = artifact._parse(folder, manifest)
    if target.platform == "cpu":
        register_kernels(geom.weight_format)
    devices = jax.devices()[: geom.tp]
    mesh = make_mesh(devices, geom.tp)
    for name, text in zip(args.swaps[::2], args.swaps[1::2], strict=True):
        entry = manifest["programs"][name]
        compiled, prog, default, compile_s = recompile(folder, manifest, cfg, geom, mesh, name, text)
        print(f"{name}: compiled with {prog.compiler_options} (default {default}) in {compile_s:.1f} s")
        before = old_hlo((folder / entry["executable"]).read_bytes(), devices) if entry.get("executable") else ""
        after = compiled.as_text()
        print(f"  GEMMs before:\n{summary(before)}\n  GEMMs after:\n{summary(after)}")
        if args.hlo:
            args.hlo.mkdir(parents=True, exist_ok=True)
            (args.hlo / f"{name}.before.hlo.txt").write_text(before)
            (args.hlo / f"{name}.after.hlo.txt").write_text(after)
        rel = entry.get("executable") or f"programs/{name}.{target.platform}"
        artifact.write_file(folder / rel, executable.serialize(compiled))
        entry["executable"] = rel
        entry["swapped_options"] = prog.compiler_options  # a note for the reader; the loader reads no such key
        artifact.write_manifest(folder, manifest)
    print(json.dumps({n: manifest["programs"][n].get("swapped_options") for n in args.swaps[::2]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The static roofline of an artifact's step and decode programs (kiln.compile.roofline), and where the target's
device is here, each program's measured time on a full batch against the bytes that batch must move.

Per program: XLA's bytes accessed and flops (cost analysis of the compiled executable), the ideal bytes (weights +
reachable KV read + KV written) and their ratio; with --sampler the sampler's own figure (compiled alone) and the
ratio without it. Measured (on the target's device only): a batch of S sequences, each at context L (the longest that
S sequences' pages allow, up to max_model_len), T // S new tokens each (one for decode); median time of --iters calls;
the bytes that batch must move (weights + its KV read + written) over that time, against --peak-gbs if given.

    python benchmarks/roofline.py ARTIFACT                      # an artifact's manifest (+ timing where it runs)
    python benchmarks/roofline.py MODEL --target tpu-v5e-8     # compile first (MODEL: HF folder, .gguf, smollm2)
    python benchmarks/roofline.py smollm2 --target cuda --out /tmp/rl --peak-gbs 4800 --sampler   # on the H200
    python benchmarks/roofline.py ART --programs step_t16 --xla-option xla_vf_vmem_memory_space_assignment=false

--xla-option recompiles the step and decode programs (all, or --programs) with XLA options and prints their lines
again: a diagnostic of what the figures are made of. The one above (a v5e's; libtpu 0.0.52) turns off XLA-TPU's
prefetches into VMEM, whose copies its cost analysis counts several times over (BENCHMARKS.md, issue 21).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from kiln.compile import artifact, executable, lower, roofline
from kiln.compile.artifact import read_manifest
from kiln.compile.build import compile_artifact, compile_site
from kiln.compile.convert import make_mesh
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.config import ModelConfig
from kiln.models.sampling import SamplingBatch
from kiln.targets.detect import local_devices
from kiln.targets.target import Target


def static_table(path: Path, sampler: bool, xla_options: dict | None = None, only: list[str] | None = None) -> None:
    m = read_manifest(path)
    print(f"# {m['model']['name']} for {m['target']['name']} (runtime {m['runtime']})")
    cfg = ModelConfig.from_dict(m["model"]["config"])
    geom = lower.Geometry.from_dict(m["geometry"])
    progs = {}
    if sampler or xla_options:
        site = compile_site(Target.from_dict(m["target"]))
        mesh = make_mesh(site.devices, geom.tp)
        with site.context():
            progs = {p.name: p for p in lower.programs(cfg, geom, mesh, m["step_out"]) if roofline.is_step(p)}
    for name, prog in m["programs"].items():
        r = prog.get("roofline")
        if not r:
            continue
        if sampler and name in progs and r["static"]["bytes"] is not None:
            with site.context():
                s = roofline.sampler_cost(cfg, progs[name])["bytes"]
            r["sampler_bytes"] = s
            r["model_bytes_ratio"] = round((r["static"]["bytes"] - s) / (r["ideal"]["bytes"] / r["steps"]), 3)
        print(roofline.format_line(name, r))
    for name, prog in progs.items() if xla_options else ():
        if only and name not in only:
            continue
        with site.context():
            compiled = recompile(prog, site, xla_options)
        r = roofline.roofline(cfg, prog, compiled, with_sampler=False)
        print(f"{roofline.format_line(name, r)}  [{xla_options}]")


def recompile(prog, site, options: dict):
    """prog exported and compiled again like `kiln compile` does (executable.compile_exported), with XLA options."""
    platform = site.devices[0].platform
    exported = executable.export(prog, platform)
    donate = tuple(i for i, d in enumerate(prog.donated_flat) if d)
    in_sh = [executable._format(a, platform) for a in prog.flat_args]
    out_sh = tuple(executable._format(a, platform) for a in prog.flat_out)
    jitted = jax.jit(exported.call, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate, keep_unused=True)
    return jitted.lower(*prog.flat_args).compile(compiler_options=options)


def batch_for(art, num_tokens: int, steps: int):
    """S sequences at the longest context their pages allow, T // S new tokens each; and that batch's ideal bytes."""
    seqs = art.seqs_per_bucket[num_tokens]
    per = max(1, num_tokens // seqs)
    pages_each = min(art.max_pages_per_seq, art.num_pages // seqs)
    context = pages_each * art.page_size - (steps - 1)  # a decode program writes steps - 1 more tokens
    chunks = [
        SeqChunk(list(np.random.randint(3, 100, per)), context - per, range(s * pages_each, (s + 1) * pages_each))
        for s in range(seqs)
    ]
    batch = make_batch(chunks, art.page_size, num_tokens, seqs, art.max_pages_per_seq)
    cfg = art.cfg
    row = cfg.num_kv_heads * cfg.head_dim * jax.numpy.dtype(art.geometry.kv_dtype).itemsize  # all devices together
    kv = 2 * cfg.num_layers * row * (seqs * context + seqs * per) * steps
    weights = sum(a.nbytes for a in jax.tree.leaves(art.weights)) * steps
    return batch, seqs, context, weights + kv


def timings(path: Path, iters: int, peak: float | None) -> None:
    art = artifact.load(path)
    sampling = SamplingBatch.neutral(art.max_num_seqs, vocab_size=art.cfg.vocab_size)
    programs = [(f"step_t{t}", t, fn, 1) for t, fn in sorted(art.programs.items())]
    programs += [(f"decode_t{t}", t, fn, art.decode_steps) for t, fn in sorted(art.decode_programs.items())]
    print(f"# measured on {jax.devices()[0].device_kind} x{len(jax.devices())}, {iters} calls each (median)")
    kv = art.make_kv()
    for name, t, fn, steps in programs:
        batch, seqs, context, must = batch_for(art, t, steps)
        rows = jax.tree.map(lambda a, n=seqs: a[:n], sampling)
        times = []
        for i in range(iters + 2):
            t0 = time.perf_counter()
            out, kv = fn(art.weights, kv, batch, rows)
            out.tokens.block_until_ready()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        gbs = must / sec / 1e9
        vs = f" = {gbs / peak:.2f} of {peak:.0f} GB/s" if peak else ""
        print(f"{name}: {sec * 1e3:.3f} ms for S={seqs} at context {context}; must move {must / 1e6:.1f} MB: "
              f"{gbs:.0f} GB/s{vs}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="an artifact folder, or a model to compile (HF folder, .gguf, smollm2)")
    p.add_argument("--target", help="compile the model for this target first")
    p.add_argument("--out", help="where the compiled artifact goes (default: a temporary folder)")
    p.add_argument("--buckets", help="comma-separated token buckets for the compile")
    p.add_argument("--sampler", action="store_true", help="also cost the sampler alone (one compile per S)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-gbs", type=float, help="the device's memory bandwidth, for the measured fraction")
    p.add_argument(
        "--xla-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recompile the step/decode programs with this XLA option and print them again (repeatable)",
    )
    p.add_argument("--programs", help="comma-separated program names for --xla-option (default: all)")
    args = p.parse_args()
    options = dict(kv.split("=", 1) for kv in args.xla_option)
    options = {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in options.items()}
    print("$ python " + " ".join(sys.argv))
    path = Path(args.source)
    if not (path / "manifest.json").exists():
        if not args.target:
            sys.exit(f"{path} is not an artifact; pass --target to compile it first.")
        out = Path(args.out or tempfile.mkdtemp(prefix="kiln-roofline-")) / f"model.{args.target}"
        plan = {"buckets": tuple(int(b) for b in args.buckets.split(","))} if args.buckets else {}
        t0 = time.perf_counter()
        path = compile_artifact(None if args.source == "smollm2" else args.source, args.target, out=out, **plan)
        print(f"# compiled in {time.perf_counter() - t0:.1f} s into {path}")
    static_table(path, args.sampler, options, args.programs.split(",") if args.programs else None)
    target = Target.from_dict(read_manifest(path)["target"])
    if local_devices().platform == target.platform and read_manifest(path)["runtime"]:
        timings(path, args.iters, args.peak_gbs)
    else:
        print(f"# not timed: no {target.platform} device here")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU seconds of each part of a CPU artifact's start, run one after another in one process, so that each figure is
that part's own (in `kiln serve` they overlap on threads, and XLA does its work on threads of its own, so the ready
line can only give wall times): imports, manifest, the sha256 of weights.bin and of the executables, the
deserialization and signature check of each program a deferred start loads before ready, the KV cache, the weights,
the tokenizer, and each program's first and second call on Runner.warmup's batch (the difference is what the warm-up
saves the first request). CPU seconds are the process's (all threads), from time.process_time; a busy machine
inflates them far less than the wall times printed beside them. As in `kiln serve`, Python's cyclic GC is off and jax
starts only its cpu platform (where it would find no accelerator); the serve path's own figures are benchmarks/
cold_start.py's.

    python benchmarks/cpu_start_phases.py ARTIFACT [--programs step_t1,step_t16,decode_t1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

gc.disable()  # as `kiln serve ARTIFACT` starts (kiln.serving.cli.readahead_artifact)
T0, W0 = time.process_time(), time.perf_counter()
ROWS: list[tuple[str, float, float]] = []
_last = [T0, W0]


def mark(name: str) -> None:
    c, w = time.process_time(), time.perf_counter()
    ROWS.append((name, c - _last[0], w - _last[1]))
    _last[:] = [c, w]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--programs", default=None, help="step/decode programs to load (default: first_programs)")
    args = p.parse_args()
    from kiln.compile.checks import plugin_scan_by_name

    with plugin_scan_by_name():  # as kiln serve imports it (kiln.serving.cli)
        import jax

    mark("import jax")
    from kiln.serving.serve_cmd import _cpu_only

    _cpu_only()  # only jax's cpu platform where jax would find no accelerator, as kiln serve does for a cpu artifact
    import numpy as np

    from kiln.compile import artifact, executable, lower, weightfile
    from kiln.compile.convert import from_flat, make_mesh, to_flat, weight_shardings
    from kiln.models.batch import SeqChunk, make_batch
    from kiln.serving import llm
    from kiln.serving.runner import Runner

    mark("import kiln (engine, artifact)")
    from pathlib import Path

    folder = Path(args.artifact)
    manifest = artifact.read_manifest(folder)
    _, cfg, geom = artifact._parse(folder, manifest)
    artifact.register_kernels(geom.weight_format)  # kiln's CPU kernels its executables name (as artifact.load does)
    devices = jax.devices()[:1]
    mesh = make_mesh(devices, 1)
    names = args.programs.split(",") if args.programs else sorted(artifact.first_programs(geom) - {"init_kv"})
    names += [n for n in lower.program_names(geom) if n.startswith("gather_t") and n in manifest["programs"]]
    # the signatures of the programs loaded (as artifact.load builds them)
    progs = {n: lower.program(cfg, geom, mesh, manifest["step_out"], n) for n in ["init_kv", *names]}
    mark("manifest, device client, program signatures")
    mapped = weightfile.MappedWeights(folder, manifest["weights"])
    for i in range(len(manifest["weights"]["chunks"])):
        mapped.check_chunk(i)
    mark(f"sha256 of weights.bin ({mapped.meta['file_bytes'] / 1e6:.0f} MB)")
    files = manifest["files"]
    blobs = {}
    for n in ["init_kv", *names]:
        rel = manifest["programs"][n]["executable"]
        blobs[n] = artifact.check_file(folder, rel, files[rel])
    mark(f"read + sha256 of {len(blobs)} executables")
    loaded, checks = {}, []
    for n in blobs:
        loaded[n] = executable.load_executable(blobs[n], progs[n], devices, checks.append)
        mark(f"deserialize {n}")
        for check in checks:
            check()
        checks.clear()
        mark(f"  check_signature {n}")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    kv = loaded["init_kv"]()
    jax.block_until_ready(kv)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    gb = 2 * len(kv.k) * kv.k[0].nbytes / 1e9
    mark(f"KV cache, {gb:.2f} GB (sys {r1.ru_stime - r0.ru_stime:.2f} s: first touch)")
    tree = weight_shardings(cfg, mesh, jax.numpy.dtype(manifest["weights"]["dtype"]), geom.weight_format,
                            geom.expert_parallel, geom.fused_linears)  # fmt: skip
    weights = from_flat(tree, {n: weightfile.place(mapped, n, w) for n, w in to_flat(tree).items()})
    mark("weights placed (zero-copy views)")
    llm._checked_tokenizer(folder)
    mark("tokenizer (files checked, loaded)")
    steps = {int(n.rsplit("_t", 1)[1]): loaded[n] for n in names if n.startswith("step_t")}
    decodes = {int(n.rsplit("_t", 1)[1]): loaded[n] for n in names if n.startswith("decode_t")}
    gathers = {int(n.rsplit("_t", 1)[1]): loaded[n] for n in names if n.startswith("gather_t")}
    runner = Runner(steps, weights, kv, page_size=geom.page_size, max_num_seqs=geom.max_num_seqs,
                    max_pages_per_seq=geom.max_pages_per_seq, buckets=tuple(sorted(steps)),
                    seqs_per_bucket={t: geom.seqs(t) for t in geom.buckets}, decode=decodes,
                    gathers=gathers)  # fmt: skip
    calls = [(f"step_t{t}", p, t, t) for t, p in sorted(steps.items())]
    calls += [(f"decode_t{t}", p, t, 1) for t, p in sorted(decodes.items())]
    for rep in ("first", "second"):
        for name, program, t, num_tokens in calls:  # Runner.warmup's batch: one live sequence, a cached page
            start, num_seqs = geom.page_size, runner.seqs_per_bucket[t]
            pages = list(range(-(-(start + num_tokens + 16) // geom.page_size)))
            batch = make_batch([SeqChunk([0] * num_tokens, start, pages)], geom.page_size, t, num_seqs,
                               geom.max_pages_per_seq)  # fmt: skip
            out, runner.kv = program(runner.weights, runner.kv, batch, runner.sampling_batch([], num_seqs))
            np.asarray(out.tokens)
            mark(f"{rep} call {name}")
            if name.startswith("decode") and rep == "first":
                runner.warm_gather(t, out.tokens)
                mark(f"  run-ahead gather {name} (a jit compile)")
    rest = [t for t in geom.decode_buckets if t not in decodes]  # a deferred start primes their gathers before ready
    if rest:
        llm.prime_run_ahead(runner, mesh, rest, geom.decode_steps)
        how = "first calls of the artifact's" if all(t in gathers for t in rest) else "jit compiles"
        mark(f"run-ahead gathers of decode_t{','.join(map(str, rest))} ({how})")
    width = max(len(n) for n, _, _ in ROWS)
    print(f"| {'part':{width}} | CPU s | wall s |\n|{'-' * (width + 2)}|---:|---:|")
    for n, c, w in ROWS:
        print(f"| {n:{width}} | {c:.2f} | {w:.2f} |")
    print(f"| {'total (after the interpreter started)':{width}} | {time.process_time() - T0:.2f} | "
          f"{time.perf_counter() - W0:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()

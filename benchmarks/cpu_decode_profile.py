"""Where a served CPU decode step goes: the decode programs of one or more artifacts, called as the runner calls them
(S live sequences at context 100, decode_steps tokens per call), the artifacts taking turns call by call; then, with
--trace, one jax.profiler trace per artifact and S, every thunk's self time (its time minus the thunks nested in it)
summed per op kind (ffi_call: kiln's custom calls; while: a loop; ..._fusion: XLA's fused elementwise ops; ynn_fusion:
YNNPACK's), per decode step. Under load the per-op minimum over the calls is the figure to read (a thunk that ran
undisturbed at least once), the median is shown beside it.

    python benchmarks/cpu_decode_profile.py ARTIFACT [ARTIFACT ...] [--seqs 1,16] [--runs 10] [--trace]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from kiln.compile import artifact
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.sampling import SamplingBatch

SKIP = ("ThunkExecutor", "$", "PjitFunction", "CommonPjRt", "PjRt", "end:")


def op_self_times(trace_dir: str) -> dict[str, list[float]]:
    """op name -> the self times (us) of its thunk events in the trace under trace_dir."""
    f = sorted(glob.glob(trace_dir + "/**/perfetto_trace.json.gz", recursive=True))[-1]
    events = [e for e in json.load(gzip.open(f))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    times = collections.defaultdict(list)
    for es in by_thread.values():
        es.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in es:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            e["child"] = 0.0
            if stack:
                stack[-1]["child"] += e["dur"]
            stack.append(e)
        for e in es:
            if not e["name"].startswith(SKIP):
                times[e["name"]].append(e["dur"] - e["child"])
    return times


def by_kind(times: dict[str, list[float]], steps: int) -> list[tuple[str, float, float, float]]:
    """(kind, per step: count, min-based ms, median-based ms), largest first."""
    kinds = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for name, v in times.items():
        k = kinds[re.sub(r"\.\d+$", "", name)]
        per_step, v = len(v) / steps, sorted(v)
        k[0] += per_step
        k[1] += v[0] * per_step / 1e3
        k[2] += v[len(v) // 2] * per_step / 1e3
    return sorted(((n, *x) for n, x in kinds.items()), key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--seqs", default="1,16")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--trace", action="store_true", help="also a jax.profiler trace: time per op kind")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    arts = [artifact.load(Path(p), verify=False) for p in args.artifacts]
    kvs = [a.make_kv() for a in arts]
    print(f"jax {jax.__version__}; per call of decode_steps tokens: wall median (min) ms, process CPU median ms")
    for s in [int(x) for x in args.seqs.split(",")]:
        calls = []
        for i, art in enumerate(arts):
            t = min(b for b in art.decode_programs if b >= s)
            chunks = [SeqChunk([5], 100, list(range(j * 8, j * 8 + 8))) for j in range(s)]
            batch = make_batch(chunks, art.page_size, t, art.seqs_per_bucket[t], art.max_pages_per_seq)
            sampling = SamplingBatch.neutral(art.seqs_per_bucket[t], vocab_size=art.cfg.vocab_size)

            def call(i=i, art=art, program=art.decode_programs[t], batch=batch, sampling=sampling):
                out, kvs[i] = program(art.weights, kvs[i], batch, sampling)
                np.asarray(out.tokens)

            calls.append(call)
        wall, cpu = [[] for _ in arts], [[] for _ in arts]
        for r in range(args.runs + 2):
            for i, call in enumerate(calls):
                t0, c0 = time.perf_counter(), time.process_time()
                call()
                if r >= 2:
                    wall[i].append(1e3 * (time.perf_counter() - t0))
                    cpu[i].append(1e3 * (time.process_time() - c0))
        for i, path in enumerate(args.artifacts):
            k = arts[i].decode_steps
            print(f"S={s} {path}: {statistics.median(wall[i]):.1f} ({min(wall[i]):.1f}) ms wall, "
                  f"{statistics.median(cpu[i]):.1f} ms CPU per call of {k} steps; "
                  f"{statistics.median(cpu[i]) / k:.2f} CPU ms a step", flush=True)  # fmt: skip
        if not args.trace:
            continue
        for i, path in enumerate(args.artifacts):
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d, create_perfetto_trace=True):
                    for _ in range(5):
                        calls[i]()
                rows = by_kind(op_self_times(d), 5 * arts[i].decode_steps)
            print(f"S={s} {path}: thunks sum {sum(r[2] for r in rows):.2f} ms min-based, "
                  f"{sum(r[3] for r in rows):.2f} median-based, per step")  # fmt: skip
            for name, n, lo, med in rows[: args.top]:
                print(f"  {lo:8.3f} ms min  {med:8.3f} ms med  {n:6.1f}/step  {name}")


if __name__ == "__main__":
    main()

"""One artifact's multi-step decode programs of up to 16 tokens at concurrency 1, against each other and against the
engine that runs them (one LLM: its runner's own programs, weights and cache).

1. The programs alone: one 1152-token sequence, 30 calls enqueued back to back, two rounds alternated.
2. The engine at c = 1 without HTTP (LLM.generate, a 1024-token prompt, 256 tokens): gpu_e2e.engine_tpot_ms (ms per
   decode step, the request's ends included), the steady state (collect to collect of two multi-step decodes in a
   row, p50: the device's time per program call as the engine runs it), and the buckets its dispatches took.
3. The programs alone again: a GPU that has been busy for a while can run the same program slower than one fresh from
   the compile (H200, session 26: 35.0 ms a call before a 10 s served run, 36.6 after, in new processes each).

--pages first,last times the programs with the sequence on the pool's first and its last pages, alternated; --bare
runs them from the artifact as `load` gives it, no LLM (and no engine); --read times one read of the weights. H100,
session 30 (h200_decode.sh's pages phase): neither pages nor process changed decode_t1 by more than 0.2%, but the
first process after the compile ran it 3.1% faster than the five after it. Session 31: chance, not the order; 4 of 19
processes ran at that speed (45.1 against 46.6 ms a call), set at the process's start (BENCHMARKS.md). --trace
traces 10 calls of each program: the kernels' time a call and the time no kernel runs (is a fast process's gain in
the kernels or in the gaps? session 32: the gaps), and after which kernels the gaps fall.

    python benchmarks/gpu_decode_buckets.py ARTIFACT [--programs-only]   # e.g. --buckets 1,16,1024 --max-num-seqs 16
    python benchmarks/gpu_decode_buckets.py ARTIFACT --programs-only --pages first,last [--bare] [--read] [--trace]
"""

import argparse
import collections
import itertools
import sys
import tempfile
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.compile.artifact import load
from kiln.serving import runner as R
from kiln.serving.llm import LLM
from kiln.serving.params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import gpu_e2e  # noqa: E402
from gpu_e2e import decode_inputs, engine_tpot_ms, pipelined_ms  # noqa: E402
from gpu_profile import trace_events  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("artifact")
ap.add_argument("--programs-only", action="store_true", help="time the decode programs only, not the engine")
ap.add_argument("--pages", default="last", help="where the sequence's pages lie in the pool: first, last or first,last")
ap.add_argument("--bare", action="store_true", help="the artifact as load gives it, no LLM (implies --programs-only)")
ap.add_argument("--read", action="store_true", help="also time one read of all the weights (a jitted sum), TB/s")
ap.add_argument("--trace", action="store_true", help="also trace 10 calls of each program: kernel sum and gaps")
args = ap.parse_args()
places = args.pages.split(",")
if not set(places) <= {"first", "last"}:
    sys.exit(f"--pages takes first and/or last, not {args.pages!r}")
sys.stdout.reconfigure(line_buffering=True)

seen = collections.Counter()  # (method, bucket, steps) of every dispatch
collected = []  # (perf_counter, steps) as each collect returns
for name in ("dispatch", "dispatch_ahead"):
    f = getattr(R.Runner, name)

    def w(self, *a, _f=f, _n=name, **kw):
        p = _f(self, *a, **kw)
        seen[(_n, p.bucket, p.steps)] += 1
        return p

    setattr(R.Runner, name, w)
_collect = R.Runner.collect


def collect(self, pending):
    res = _collect(self, pending)
    collected.append((time.perf_counter(), pending.steps))
    return res


R.Runner.collect = collect

if args.bare:  # run: what holds the programs, weights and cache (an artifact's own, or the LLM's runner)
    art = load(args.artifact)
    run, k = types.SimpleNamespace(decode=art.decode_programs, weights=art.weights, kv=art.make_kv()), art.decode_steps
    geom = art
else:
    llm = LLM(args.artifact)
    run, k = llm.engine.runner, llm.engine.decode_steps
    geom = run
vocab = run.weights.embed.shape[0]
ctx = 1024 + 128  # the mean context of a 1024 in / 256 out request
last = run.kv.num_pages - -(-(ctx + 1) // geom.page_size)  # the pool's last pages: no prompt of ours is there
inputs = {}
for where, t in itertools.product(places, sorted(t for t in run.decode if t <= 16)):
    first_page = {"first": 0, "last": last}[where]
    inputs[where, t] = jax.device_put(decode_inputs(geom, t, 1, ctx, vocab, first_page))
    out, run.kv = run.decode[t](run.weights, run.kv, *inputs[where, t])  # the first call, out of the timing
    np.asarray(out.tokens)


def time_programs(when: str) -> None:
    for rep in range(2):
        for (where, t), (batch, sb) in inputs.items():
            ms, run.kv = pipelined_ms(run.decode[t], run.weights, run.kv, batch, sb, 30)
            print(
                f"{when}{' (bare)' if args.bare else ''}, rep {rep}: decode_t{t} c=1 {where} pages {ms:.2f} ms a call "
                f"of {k} steps, {ms / k:.3f} ms/token"
            )


def read_weights() -> None:
    """Bytes per second of one pass over the weights where the programs read them (the process's own buffers)."""
    leaves = jax.tree.leaves(run.weights)
    total = jax.jit(lambda ws: sum(jnp.sum(w, dtype=jnp.float32) for w in ws))
    np.asarray(total(leaves))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        np.asarray(total(leaves))
        times.append(time.perf_counter() - t0)
    size = sum(w.nbytes for w in leaves)
    print(f"weights read: {size / 1e9:.2f} GB at {size / np.median(times) / 1e12:.2f} TB/s (p50 of 10, wall)")
    if all(len(w.sharding.device_set) == 1 for w in leaves):  # where the load put them (its uploads run in threads)
        at = [w.unsafe_buffer_pointer() for w in leaves]
        span = max(a + w.nbytes for a, w in zip(at, leaves, strict=True)) - min(at)
        rising = sum(b > a for a, b in itertools.pairwise(at)) / max(1, len(at) - 1)
        print(f"weights' buffers: {len(at)} over {span / 1e9:.2f} GB of addresses ({span / size:.3f}x their bytes), "
              f"{rising:.0%} of consecutive ones at rising addresses")  # fmt: skip
    if jax.devices()[0].platform == "gpu":  # and PyTorch's copy in its own buffers, for a ceiling of this process
        print(f"torch copy: {gpu_e2e.ceilings(matmul=False)['copy_bytes_per_s'] / 1e12:.2f} TB/s")


def trace_programs() -> None:
    """Each program's 10 calls back to back under jax.profiler: the device's kernel time a call, and the time of the
    calls' span (first kernel's start to last kernel's end) that no kernel covers (a fast process against a slow one:
    the kernels, or the gaps between them?)."""
    for (where, t), (batch, sb) in inputs.items():
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(10):
                    out, run.kv = run.decode[t](run.weights, run.kv, batch, sb)
                np.asarray(out.tokens)
            events, gpu = trace_events(d)
        spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                       if e.get("ph") == "X" and e.get("pid") in gpu)  # fmt: skip
        if not spans:
            print(f"traced: decode_t{t} {where} pages, no device kernels in the trace")
            continue
        busy, end, last = 0.0, spans[0][0], spans[0][2]
        gaps = collections.defaultdict(list)  # the kernel that ended before a gap -> its gaps (us)
        for a, b, name in spans:  # the union of the kernels' intervals (us)
            if a > end:
                gaps[last].append(a - end)
            busy += max(0.0, b - max(a, end))
            if b > end:
                end, last = b, name
        span = end - spans[0][0]
        print(f"traced: decode_t{t} {where} pages, kernels {busy / 10e3:.2f} ms a call, span {span / 10e3:.2f}, "
              f"no kernel {(span - busy) / 10e3:.2f} ({len(spans) // 10} kernels a call)")  # fmt: skip
        every = sorted(g for v in gaps.values() for g in v)
        if every:  # how the time no kernel runs is spread: a few long waits, or a little after every kernel?
            q = [every[int(f * (len(every) - 1))] for f in (0.5, 0.9, 0.99)]
            long = [g for g in every if g > 5]
            print(f"  gaps: {len(every) / 10:.0f} a call, p50 / p90 / p99 {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} us, "
                  f"over 5 us: {len(long) / 10:.0f} a call holding {sum(long) / 10e3:.2f} ms")  # fmt: skip
            for name, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:6]:
                print(f"  after {name[:60]:<60} {len(v) / 10:6.0f} a call, {sum(v) / 10e3:.3f} ms a call")


time_programs("programs alone")
if args.trace:
    trace_programs()
if args.read:
    read_weights()
if args.programs_only or args.bare:
    sys.exit(0)
vocab = min(49000, vocab)  # ids any test vocabulary has
rng = np.random.default_rng(0)
llm.generate([rng.integers(0, vocab, 1024).tolist()], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
seen.clear()
for rep in range(2):
    collected.clear()
    tpot = engine_tpot_ms(llm, rng, vocab, 1, 1024, 256)
    gaps = [(b - a) * 1e3 for (a, sa), (b, sb) in itertools.pairwise(collected) if sa == sb == k]
    print(
        f"engine c=1 rep {rep}: {tpot:.3f} ms per decode step; steady state {np.median(gaps):.2f} ms a {k}-step call "
        f"(collect to collect, p50 of {len(gaps)}), {np.median(gaps) / k:.3f} ms/token"
    )
print("dispatches (method, bucket, steps):", dict(seen))
time_programs("programs alone after the engine")

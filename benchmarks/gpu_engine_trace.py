"""Does the GPU wait for kiln's host between two programs? The engine (LLM.generate, no HTTP) runs --concurrency
1024-token prompts at once under jax.profiler, with the Runner's and Engine's methods annotated in the trace; printed:
each method's host time (untraced run), the GPU's idle time (gaps between its kernels, all streams merged) over the
whole run and from the first run-ahead decode on, the largest gaps with the kernels around them and the methods the
host was in meanwhile.

    python benchmarks/gpu_engine_trace.py ARTIFACT [--output-len 128] [--concurrency 64]

H100, session 26, Llama-3-8B shape at c = 1: 8.1 ms idle in a 720 ms decode (1.1%; one 2.1 ms gap between the
prefill and the first decode, the rest under 50 us, inside programs): the host is never what the GPU waits for.
"""

import argparse
import collections
import itertools
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from kiln.serving import engine as E
from kiln.serving import runner as R
from kiln.serving.llm import LLM
from kiln.serving.params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from gpu_profile import trace_events  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("artifact")
ap.add_argument("--output-len", type=int, default=128)
ap.add_argument("--concurrency", type=int, default=1, help="prompts given to the engine at once")
args = ap.parse_args()

host = []  # (method, seconds) of every annotated call


def annotate(cls, name: str) -> None:
    f = getattr(cls, name)

    def w(self, *a, _f=f, _n=name, **kw):
        t0 = time.perf_counter()
        with jax.profiler.TraceAnnotation(f"kiln.{_n}"):
            r = _f(self, *a, **kw)
        host.append((_n, time.perf_counter() - t0))
        return r

    setattr(cls, name, w)


for n in ("dispatch", "dispatch_ahead", "collect", "sampling_batch"):
    annotate(R.Runner, n)
for n in ("step", "_record", "_postprocess", "_run_ahead", "_dispatch_next"):
    annotate(E.Engine, n)

llm = LLM(args.artifact)
rng = np.random.default_rng(0)
params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)


def generate():
    vocab = min(30000, llm.engine.runner.weights.embed.shape[0])
    llm.generate([rng.integers(0, vocab, 1024).tolist() for _ in range(args.concurrency)], params)


generate()
host.clear()
t0 = time.perf_counter()
generate()
print(f"untraced: {(time.perf_counter() - t0) * 1e3:.1f} ms for {args.concurrency} x 1024 in / {args.output_len} out")
per = collections.defaultdict(list)
for n, s in host:
    per[n].append(s * 1e3)
for n, v in per.items():
    print(f"  host {n:16s} n={len(v):4d} mean {np.mean(v):7.3f} ms, p50 {np.median(v):7.3f}, max {np.max(v):7.3f}")

with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
        generate()
    events, gpu = trace_events(d)
xs = [e for e in events if e.get("ph") == "X"]
kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in xs if e.get("pid") in gpu)
marks = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in xs if str(e.get("name")).startswith("kiln."))
if not kernels:
    sys.exit(f"no GPU kernels in the trace ({len(marks)} annotations): run it where the artifact's target is a GPU")
busy = []  # [start, end, first kernel, last kernel] of each run of overlapping kernels
for a, b, n in kernels:
    if busy and a <= busy[-1][1]:
        busy[-1][1], busy[-1][3] = max(busy[-1][1], b), n
    else:
        busy.append([a, b, n, n])
gaps = [(nxt[0] - cur[1], cur[1], nxt[0], cur[3], nxt[2]) for cur, nxt in itertools.pairwise(busy)]
ahead = next((a for a, _, n in marks if n == "kiln.dispatch_ahead"), None)  # the first run-ahead decode
for what, start in (("whole run", busy[0][0]), ("from the first run-ahead decode", ahead)):
    if start is None:
        continue
    part = [g for g in gaps if g[1] >= start]
    span, idle = busy[-1][1] - start, sum(g[0] for g in part)
    print(f"{what}: {span / 1e3:.1f} ms, GPU idle {idle / 1e3:.2f} ms ({idle / span:.1%}) in {len(part)} gaps, "
          f"{sum(g[0] > 50 for g in part)} of them over 50 us")  # fmt: skip
for g in sorted(gaps, reverse=True)[:10]:
    inside = sorted({n for a, b, n in marks if a < g[2] and b > g[1]})
    print(f"  {g[0]:8.1f} us after {g[3][:48]!r} before {g[4][:48]!r}; host in {inside}")

"""One artifact's multi-step decode programs of up to 16 tokens at concurrency 1, against each other (same weights, one
1152-token sequence, 30 calls enqueued back to back, three rounds alternated), then the engine at c = 1 without HTTP
(LLM.generate: a 1024-token prompt, 256 tokens; ms per decode step) and the buckets its dispatches took.

    python benchmarks/gpu_decode_buckets.py ARTIFACT [--programs-only]   # e.g. --buckets 1,16,1024 --max-num-seqs 16
"""

import collections
import sys
import time

import jax
import numpy as np

from kiln.compile.artifact import load
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.sampling import SamplingBatch
from kiln.serving import runner as R
from kiln.serving.llm import LLM
from kiln.serving.params import SamplingParams

path = next(a for a in sys.argv[1:] if not a.startswith("--"))
art = load(path)
kv = art.make_kv()
ctx = 1024 + 128  # the mean context of a 1024 in / 256 out request
per_seq = -(-(ctx + 1) // art.page_size)
progs = {}
for t in sorted(art.decode_programs):
    if t > 16:
        continue
    s = art.seqs_per_bucket[t]
    chunks = [SeqChunk([5], ctx, list(range(per_seq)))]
    batch = jax.device_put(make_batch(chunks, art.page_size, t, s, art.max_pages_per_seq))
    sb = jax.device_put(SamplingBatch.neutral(s, vocab_size=art.cfg.vocab_size))
    progs[t] = (art.decode_programs[t], batch, sb)
    o, kv = progs[t][0](art.weights, kv, batch, sb)
    np.asarray(o.tokens)
k = art.decode_steps
for rep in range(3):
    for t, (prog, batch, sb) in progs.items():
        n = 30
        t0 = time.perf_counter()
        for _ in range(n):
            o, kv = prog(art.weights, kv, batch, sb)
        np.asarray(o.tokens)
        ms = (time.perf_counter() - t0) / n * 1e3
        print(f"rep {rep} decode_t{t} c=1: {ms:.2f} ms a call of {k} steps, {ms / k:.3f} ms/token", flush=True)
del kv, progs
if "--programs-only" in sys.argv:
    sys.exit(0)
seen = collections.Counter()
for name in ("dispatch", "dispatch_ahead"):
    f = getattr(R.Runner, name)

    def w(self, *a, _f=f, _n=name, **kw):
        p = _f(self, *a, **kw)
        seen[(_n, p.bucket, p.steps)] += 1
        return p

    setattr(R.Runner, name, w)
llm = LLM(path)
rng = np.random.default_rng(0)
vocab = min(49000, art.cfg.vocab_size)  # ids any test vocabulary has
llm.generate([rng.integers(0, vocab, 1024).tolist()], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
for rep in range(2):
    times = {}
    for m in (1, 256):
        p = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([rng.integers(0, vocab, 1024).tolist()], p)
        times[m] = time.perf_counter() - t0
    print(
        f"engine c=1 rep {rep}: TTFT-ish {times[1] * 1e3:.1f} ms, {(times[256] - times[1]) / 255 * 1e3:.3f} ms per "
        f"decode step",
        flush=True,
    )
print("dispatches (method, bucket, steps):", dict(seen))

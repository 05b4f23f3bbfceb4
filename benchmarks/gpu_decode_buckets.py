"""One artifact's multi-step decode programs of up to 16 tokens at concurrency 1, against each other (same weights, one
1152-token sequence, 30 calls enqueued back to back, three rounds alternated), then the engine at c = 1 without HTTP
(gpu_e2e.engine_tpot_ms: a 1024-token prompt, 256 tokens; ms per decode step) and the buckets its dispatches took.

    python benchmarks/gpu_decode_buckets.py ARTIFACT [--programs-only]   # e.g. --buckets 1,16,1024 --max-num-seqs 16
"""

import argparse
import collections
import sys
from pathlib import Path

import jax
import numpy as np

from kiln.compile.artifact import load
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.sampling import SamplingBatch
from kiln.serving import runner as R
from kiln.serving.llm import LLM
from kiln.serving.params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import engine_tpot_ms, pipelined_ms  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("artifact")
ap.add_argument("--programs-only", action="store_true", help="time the decode programs only, not the engine")
args = ap.parse_args()

art = load(args.artifact)
kv = art.make_kv()
ctx = 1024 + 128  # the mean context of a 1024 in / 256 out request
per_seq = -(-(ctx + 1) // art.page_size)
progs = {}
for t in sorted(t for t in art.decode_programs if t <= 16):
    s = art.seqs_per_bucket[t]
    chunks = [SeqChunk([5], ctx, list(range(per_seq)))]
    batch = jax.device_put(make_batch(chunks, art.page_size, t, s, art.max_pages_per_seq))
    sb = jax.device_put(SamplingBatch.neutral(s, vocab_size=art.cfg.vocab_size))
    progs[t] = (art.decode_programs[t], batch, sb)
    o, kv = progs[t][0](art.weights, kv, batch, sb)  # the first call, out of the timing
    np.asarray(o.tokens)
k = art.decode_steps
for rep in range(3):
    for t, (prog, batch, sb) in progs.items():
        ms, kv = pipelined_ms(prog, art.weights, kv, batch, sb, 30)
        print(f"rep {rep} decode_t{t} c=1: {ms:.2f} ms a call of {k} steps, {ms / k:.3f} ms/token", flush=True)
vocab = min(49000, art.cfg.vocab_size)  # ids any test vocabulary has
del kv, progs, art  # the engine below loads its own weights and cache
if args.programs_only:
    sys.exit(0)
seen = collections.Counter()
for name in ("dispatch", "dispatch_ahead"):
    f = getattr(R.Runner, name)

    def w(self, *a, _f=f, _n=name, **kw):
        p = _f(self, *a, **kw)
        seen[(_n, p.bucket, p.steps)] += 1
        return p

    setattr(R.Runner, name, w)
llm = LLM(args.artifact)
rng = np.random.default_rng(0)
llm.generate([rng.integers(0, vocab, 1024).tolist()], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
for rep in range(2):
    print(f"engine c=1 rep {rep}: {engine_tpot_ms(llm, rng, vocab, 1, 1024, 256):.3f} ms per decode step", flush=True)
print("dispatches (method, bucket, steps):", dict(seen))

"""A decode program under sustained load: one artifact's decode_t<T> (one live 1152-token sequence) called back to
back for --seconds, its time per call printed for each second beside the GPU's SM and memory clocks, power,
temperature and clock-event reasons (nvidia-smi, once a second). Session 26 saw an H200 run the same program 4.6%
slower after 10 s of serving than fresh from the compile (BENCHMARKS.md): how fast is it after a minute, and is the
GPU clocked down (reasons: 0x4 software power cap, 0x20 / 0x40 thermal, 0x8 hardware slowdown)?

    python benchmarks/gpu_sustained.py ARTIFACT [--seconds 60] [--bucket 1]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from kiln.compile.artifact import load

sys.path.insert(0, str(Path(__file__).parent))
from gpu_clocks import watch  # noqa: E402
from gpu_e2e import decode_inputs, pipelined_ms  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("artifact")
ap.add_argument("--seconds", type=float, default=60)
ap.add_argument("--bucket", type=int, default=1, help="the decode program's token bucket")
args = ap.parse_args()
sys.stdout.reconfigure(line_buffering=True)

art = load(args.artifact)
kv = art.make_kv()
prog, k = art.decode_programs[args.bucket], art.decode_steps
batch, sb = jax.device_put(decode_inputs(art, args.bucket, 1, 1152, art.cfg.vocab_size))
first, kv = pipelined_ms(prog, art.weights, kv, batch, sb, 2)
per_second = max(1, int(1000 / first))  # calls in about a second

log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
clocks = watch(log)
windows = []
t0 = time.time()
while time.time() - t0 < args.seconds:
    ms, kv = pipelined_ms(prog, art.weights, kv, batch, sb, per_second)
    windows.append((time.time() - t0, ms))
if clocks:
    clocks.terminate()
    clocks.wait()
log.seek(0)
gpu = [line.strip() for line in log if line.strip()]
print(f"decode_t{args.bucket}, {k} steps a call, {per_second} calls a window; nvidia-smi lines: {len(gpu)}")
for i, (t, ms) in enumerate(windows):
    print(f"  t={t:6.1f} s  {ms:7.2f} ms a call  {ms / k:6.3f} ms/token   {gpu[i] if i < len(gpu) else ''}")
ms = np.array([m for _, m in windows])
head, tail = ms[: max(1, len(ms) // 10)], ms[-max(1, len(ms) // 4) :]
print(f"first tenth {head.mean():.2f} ms a call, last quarter {tail.mean():.2f} ({tail.mean() / head.mean() - 1:+.1%})")

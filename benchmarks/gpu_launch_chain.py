"""What a chain of weight-streaming kernels costs a kernel on one GPU, and whether XLA's programmatic dependent launch
(PDL) lets one kernel's stream overlap the previous one's tail (issues 16 and 18: a batch-1 decode step is such a chain,
~11 launches a layer).

* mgpu: N Mosaic GPU (Pallas) kernels in one jit, each streaming its own 16 MB weight GMEM -> SMEM by TMA
  (plgpu.emit_pipeline, --steps stages of --rows x 256 bf16 in flight, 128 blocks) and adding 1 to the previous
  kernel's small output, so that XLA runs them in order; nothing is computed on the weight: the stream alone.
* mgpu pdl: the same kernels letting the next one launch at once (griddepcontrol.launch_dependents) and waiting for
  the previous one (griddepcontrol.wait) only before they read its output: under XLA's --xla_gpu_enable_pdl the next
  weight stream could start while this kernel drains.
* xla: N bf16 GEMVs v @ W (XLA's choice), alternating (4096, 2048) and (2048, 4096) weights (16.8 MB each).

Each chain is timed by a jax.profiler trace: the device span of one call over N (the gaps between kernels included)
and the summed kernel time over N, medians of 5 calls. Run once per value of the flag:
    XLA_FLAGS=--xla_gpu_enable_pdl=false python3 benchmarks/gpu_launch_chain.py
    XLA_FLAGS=--xla_gpu_enable_pdl=true python3 benchmarks/gpu_launch_chain.py [--rows 128]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl  # noqa: F401 (Mosaic GPU's pallas entry points)
from jax.experimental.pallas import mosaic_gpu as plgpu

N, BLOCKS = 32, 128
R, C = 32768, 256  # a 16 MB bf16 weight as TMA-sized rows (a box is at most 256 elements a dimension)


def streaming_kernel(pdl: bool, rows: int, steps: int):
    def body(w_gmem, x_gmem, o_gmem):
        b = jax.lax.axis_index("b")
        per = R // BLOCKS
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
        plgpu.emit_pipeline(
            lambda idx, w_smem: None,
            grid=(per // rows,),
            in_specs=[plgpu.BlockSpec((rows, C), lambda i: (b * (per // rows) + i, 0))],
            max_concurrent_steps=steps,
        )(w_gmem)
        if pdl:
            plgpu.griddepcontrol_wait()
        o_gmem[b] = x_gmem[b] + 1.0

    out = jax.ShapeDtypeStruct((BLOCKS, 128), jnp.float32)
    return plgpu.kernel(body, out_type=out, grid=(BLOCKS,), grid_names=("b",))


def device_us(fn, *args, reps: int = 5) -> tuple[float, float, int]:
    """(device span of a call / N, summed kernel time / N, kernels a call), medians over reps calls."""
    jax.block_until_ready(fn(*args))
    spans, busy, counts = [], [], []
    for _ in range(reps):
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn(*args))
        data = json.load(gzip.open(glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0]))
        events = data["traceEvents"] if isinstance(data, dict) else data
        names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
        dev = [e for e in events if e.get("ph") == "X" and "/device:" in names.get(e.get("pid"), "")
               and not any(m in e["name"].lower() for m in ("memcpy", "memset"))]  # fmt: skip
        spans.append(max(e["ts"] + e["dur"] for e in dev) - min(e["ts"] for e in dev))
        busy.append(sum(e["dur"] for e in dev))
        counts.append(len(dev))
    return statistics.median(spans) / N, statistics.median(busy) / N, counts[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="weight rows a pipeline step (x 256 bf16)")
    ap.add_argument("--steps", type=int, default=4, help="pipeline steps in flight")
    args = ap.parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (R, C), jnp.bfloat16) for i in range(N)]
    x0 = jnp.zeros((BLOCKS, 128), jnp.float32)
    for pdl in (False, True):
        kernel = streaming_kernel(pdl, args.rows, args.steps)

        @jax.jit
        def chain(ws, x, kernel=kernel):
            for w in ws:
                x = kernel(w, x)
            return x

        ok = bool(jnp.all(chain(ws, x0) == N))
        span, busy, n = device_us(chain, ws, x0)
        print(f"mgpu pdl={pdl} rows={args.rows} steps={args.steps} [{flags}]: span {span:.2f} us a kernel, kernel "
              f"time {busy:.2f} us, {n} kernels, result ok {ok}", flush=True)  # fmt: skip
    gemv = [jax.random.normal(jax.random.fold_in(key, 100 + i), (4096, 2048) if i % 2 == 0 else (2048, 4096),
                              jnp.bfloat16) * 0.02 for i in range(N)]  # fmt: skip

    @jax.jit
    def xla_chain(ws, v):
        for w in ws:
            v = v @ w
        return v

    span, busy, n = device_us(xla_chain, gemv, jnp.ones((1, 4096), jnp.bfloat16))
    print(f"xla gemv chain [{flags}]: span {span:.2f} us a GEMV, kernel time {busy:.2f} us, {n} kernels "
          f"(16.8 MB each; 4.0 us at 4.2 TB/s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

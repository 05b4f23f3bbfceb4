"""Which mixture-of-experts dispatch (kiln.models.moe) is fastest on XLA's CPU, by row count T.

One MoE MLP (routing included) of a Qwen3-30B-A3B-like layer scaled down to run on a CPU (hidden E, X experts of width
F, top k), float32, timed for the three dispatches: "gather" (each token's k experts' weights gathered, batched
matvecs), "sorted" (pairs sorted by expert, jax.lax.ragged_dot, which XLA's CPU lowers to a masked dot over every
expert) and "dense" (every token through every expert). Each is jitted, warmed up, timed as the median of many runs.
The model picks gather for T * k <= X / 2, above it dense on CPU and sorted elsewhere (kiln.models.moe).

    python benchmarks/cpu_moe.py [--hidden 512] [--experts 32] [--width 256] [--top-k 4] [--rows 1,4,16,64,256,1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models import moe

sys.path.insert(0, str(Path(__file__).parent))
from cpu_matmul import timeit  # noqa: E402  (median ms after warm-up)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    e, x, f, k = args.hidden, args.experts, args.width, args.top_k
    rng = np.random.default_rng(0)
    router = jnp.asarray(rng.normal(0, 0.3, (e, x)).astype(np.float32))
    gate, up = (jnp.asarray(rng.normal(0, 0.02, (x, e, f)).astype(np.float32)) for _ in range(2))
    down = jnp.asarray(rng.normal(0, 0.02, (x, f, e)).astype(np.float32))
    runs = {}
    for name, dispatch in (
        ("gather", moe.experts_gather),
        ("sorted", moe.experts_sorted),
        ("dense", moe.experts_dense),
    ):

        def mlp(h, dispatch=dispatch):
            weights, experts = moe.route(h, router, k, True)
            return dispatch(h, gate, up, down, weights, experts, jax.nn.silu)

        runs[name] = jax.jit(mlp)
    print(f"# {' '.join(sys.argv)}")
    print(f"# E={e} X={x} F={f} k={k} float32, jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print(f"{'T':>6} {'gather ms':>10} {'sorted ms':>10} {'dense ms':>10}  fastest  (model uses)")
    for t in (int(r) for r in args.rows.split(",")):
        h = jnp.asarray(rng.normal(size=(t, e)).astype(np.float32))
        ms = {name: timeit(fn, h, runs=args.runs) for name, fn in runs.items()}
        used = "gather" if moe.uses_gather(t, k, x) else "dense"
        row = " ".join(f"{ms[n]:>10.3f}" for n in ("gather", "sorted", "dense"))
        print(f"{t:>6} {row}  {min(ms, key=ms.get):<7}  ({used})")


if __name__ == "__main__":
    main()

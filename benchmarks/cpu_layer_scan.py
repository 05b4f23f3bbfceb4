"""Should the CPU's layer loop be a jax.lax.scan over stacked weights (one layer's HLO instead of 30, so executables
~30x smaller to deserialize at start-up)? Times a SmolLM2-shaped stack of 30 MLP layers (E=576, F=1536, float32,
the weights the decode reads) unrolled against scanned, for M rows, on this CPU, and counts the dynamic-slice
fusions XLA puts before the scanned dots (each copies one layer's weight slice on every step).

    python benchmarks/cpu_layer_scan.py [--rows 1,4,16] [--runs 30]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, E, F = 30, 576, 1536


def layer(x: jax.Array, w: dict) -> jax.Array:
    return x + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]  # (M, E)


@jax.jit
def unrolled(x: jax.Array, ws: list[dict]) -> jax.Array:
    for w in ws:
        x = layer(x, w)
    return x


@jax.jit
def scanned(x: jax.Array, stacked: dict) -> jax.Array:
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    shapes = {"gate": (E, F), "up": (E, F), "down": (F, E)}
    ws = [{k: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02) for k, s in shapes.items()}
          for _ in range(LAYERS)]  # fmt: skip
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *ws)
    hlo = scanned.lower(jnp.ones((1, E)), stacked).compile().as_text()
    print(f"jax {jax.__version__}, {LAYERS} layers E={E} F={F} float32; scanned HLO: "
          f"{sum(ln.strip().startswith('%dynamic-slice') for ln in hlo.splitlines())} weight-slice copies per "
          f"layer step")  # fmt: skip
    print("| rows | unrolled ms | scanned ms | scanned / unrolled |\n|---:|---:|---:|---:|")
    for m in map(int, args.rows.split(",")):
        x = jnp.ones((m, E))
        best = {}
        for fn, w in ((unrolled, ws), (scanned, stacked)):
            fn(x, w).block_until_ready()
        for _ in range(args.runs):  # alternated, so a busy moment hits both
            for name, fn, w in (("unrolled", unrolled, ws), ("scanned", scanned, stacked)):
                t0 = time.perf_counter()
                fn(x, w).block_until_ready()
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
        u, s = best["unrolled"] * 1e3, best["scanned"] * 1e3
        print(f"| {m} | {u:.2f} | {s:.2f} | {s / u:.2f} |", flush=True)
    print(" ".join(sys.argv))


if __name__ == "__main__":
    main()

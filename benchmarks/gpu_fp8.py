"""Which fp8 dot pays at which row count: Llama-3-8B's linear layers (q, k, v, o, gate, up, down) of `--layers` layers
chained in one jit, at M rows, with bf16 weights, fp8 weights widened inside the dot (weight-only) and fp8 x fp8 with
the rows quantized per token (kiln.models.quant._fp8_dot's two paths, each forced). Prints microseconds per layer,
the weight stream's TB/s and each fp8 path's speed-up over bf16; FP8_WEIGHT_ONLY_MAX_ROWS is chosen from this table.

    python benchmarks/gpu_fp8.py --rows 1,16,64,128,256,512,2048 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from kiln.models import quant
from kiln.models.quant import QuantArray

E, F, Q, KV = 4096, 14336, 4096, 1024  # Llama-3-8B
SHAPES = {"wq": (E, Q), "wk": (E, KV), "wv": (E, KV), "wo": (Q, E), "w_gate": (E, F), "w_up": (E, F), "w_down": (F, E)}


def make_layers(n: int, fmt: str) -> list[dict]:
    key = jax.random.key(0)
    layers = []
    for i in range(n):
        layer = {}
        for j, (name, (k, m)) in enumerate(SHAPES.items()):
            w = jax.random.normal(jax.random.fold_in(key, i * 16 + j), (m, k), jnp.float32) * 0.02  # (out, in)
            if fmt == "bf16":
                layer[name] = w.T.astype(jnp.bfloat16)  # (in, out)
            else:
                scale = jnp.max(jnp.abs(w), axis=1) / quant.FP8_MAX
                layer[name] = QuantArray((w / scale[:, None]).astype(jnp.float8_e4m3fn), scale.astype(jnp.bfloat16))
        layers.append(layer)
    return layers


def chain(x, layers):
    for lw in layers:
        q, k, v = quant.linears(x, lw["wq"], lw["wk"], lw["wv"])  # (M, Q), (M, KV) x2
        o = quant.dot(q + jnp.tile(k + v, (1, Q // KV)), lw["wo"])  # (M, E)
        g, u = quant.linears(x + o, lw["w_gate"], lw["w_up"])  # (M, F)
        x = x + quant.dot(jax.nn.silu(g) * u, lw["w_down"]) * 0.01  # (M, E)
    return x


def time_fn(fn, *args, reps: int = 20) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,128,256,512,2048")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    bf16, fp8 = make_layers(args.layers, "bf16"), make_layers(args.layers, "fp8")
    layer_bytes = sum(k * m for k, m in SHAPES.values())  # fp8 bytes; bf16 twice that
    saved = quant.FP8_WEIGHT_ONLY_MAX_ROWS
    results = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.layers} layers of Llama-3-8B's linears")
    print("| M | bf16 us/layer | TB/s | fp8 weight-only us | TB/s | x bf16 | fp8 x fp8 us | x bf16 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        x = jax.random.normal(jax.random.key(m), (m, E), jnp.float32).astype(jnp.bfloat16)
        row = {"rows": m}
        for name, layers, limit in (("bf16", bf16, saved), ("fp8_weight_only", fp8, 1 << 30), ("fp8_fp8", fp8, -1)):
            quant.FP8_WEIGHT_ONLY_MAX_ROWS = limit  # read when traced: one fresh jit per variant
            fn = jax.jit(lambda x, ls: chain(x, ls))
            row[name] = time_fn(fn, x, layers) / args.layers * 1e6
        quant.FP8_WEIGHT_ONLY_MAX_ROWS = saved
        b, w, f = row["bf16"], row["fp8_weight_only"], row["fp8_fp8"]
        print(f"| {m} | {b:.1f} | {2 * layer_bytes / b / 1e6:.2f} | {w:.1f} | {layer_bytes / w / 1e6:.2f} | "
              f"{b / w:.2f} | {f:.1f} | {b / f:.2f} |", flush=True)  # fmt: skip
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

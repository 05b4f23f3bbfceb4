"""kiln's Pallas TPU attention against JAX's shipped ragged paged attention, compiled deviceless (no TPU needed).

Per shape (model heads, page size, bucket T, S sequences, pages per sequence), each kernel with its KV write, as a
server step would run it, jitted with the cache donated and compiled for a v5e topology:

* kiln: models.kernels.pallas_tpu.paged_attention on K and V caches (KVH, P, page_size, D), the row-major layout
  kiln pins;
* jax: jax.experimental.pallas.ops.tpu.ragged_paged_attention on its combined cache (P, page_size, 2 * KVH, D) (K and
  V interleaved by head; the layout a server calling it would keep), the new K/V scattered in first (JAX's kernel
  writes nothing).

Printed: whether it compiles (else the first line of the refusal), compile seconds, XLA's bytes accessed and flops
(kiln's kernel declares its worst case through pl.CostEstimate; JAX's declares nothing, so XLA counts its kernel as
zero and only the write shows), temporaries, and the cache's bytes in the compiled layout over its logical bytes (the
padding every DMA of it pays). No TPU is reached, so no times: which kernel is faster is for a TPU to say.

    python benchmarks/tpu_kernels.py [--topology v5e:1x1]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402

from kiln.compile.roofline import _bytes_of  # noqa: E402
from kiln.models.batch import Batch  # noqa: E402
from kiln.models.kernels import pallas_tpu  # noqa: E402

# name, heads, kv heads, head_dim, page size, T, S, max pages per sequence, pages in the pool
SHAPES = [
    ("SmolLM2-135M decode", 9, 3, 64, 16, 64, 64, 128, 8192),
    ("Llama-3-8B decode 8K", 32, 8, 128, 16, 64, 64, 512, 32768),
    ("Llama-3-8B mixed 8K", 32, 8, 128, 16, 512, 64, 512, 32768),
    ("Llama-3-8B tp=8 shard decode", 4, 1, 128, 16, 64, 64, 512, 32768),
    ("Qwen3-8B-like d128 g4 ps32 prefill", 32, 8, 128, 32, 2048, 16, 256, 8192),
]


def kiln_fn(d: int):
    def f(q, k, v, k_pages, v_pages, batch):
        return pallas_tpu.paged_attention(q, k, v, k_pages, v_pages, batch, scale=d**-0.5)

    return f


def jax_fn(d: int, vmem_limit: int | None = None):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    def f(q, k, v, kv_pages, batch):
        num_pages, ps, combined, _ = kv_pages.shape
        rows = kv_pages.reshape(num_pages * ps, combined, d)
        new = jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, d)  # (T, 2 * KVH, D) interleaved
        slot = jnp.where(batch.slot_mapping < 0, num_pages * ps, batch.slot_mapping)
        kv_pages = rows.at[slot].set(new.astype(kv_pages.dtype), mode="drop").reshape(kv_pages.shape)
        out = ragged_paged_attention(
            q,
            kv_pages,
            batch.seq_lens,
            batch.block_tables,
            batch.query_start,
            batch.num_seqs,
            sm_scale=d**-0.5,
            vmem_limit_bytes=vmem_limit,
        )
        return out, kv_pages

    return f


def use_topology_for_tuned_blocks(dev) -> None:
    """JAX's tuned block-size table asks jax.devices()[0] for the TPU generation (a CPU here): answer with the
    topology's device."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

    kind = dev.device_kind
    version = {"TPU v5 lite": 5, "TPU v5": 5, "TPU v6 lite": 6, "TPU v4": 4}.get(kind, -1)
    tuned.get_tpu_version = lambda: version
    tuned.get_device_name = lambda num_devices=None: (
        " ".join(kind.split()[:2]) + (f"-{num_devices}" if num_devices is not None else "")
    )


def compile_one(dev, fn, args, donate, cache_args, out_cache):
    """Compile fn deviceless with the caches (args cache_args, results out_cache) pinned row-major, as kiln's
    programs pin them (a free layout makes XLA relayout a head_dim-64 cache around the kernel)."""
    sh = jax.sharding.SingleDeviceSharding(dev)
    fmt = Format(Layout(major_to_minor=(0, 1, 2, 3)), sh)
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), args)
    in_sh = tuple(fmt if i in cache_args else jax.tree.map(lambda _: sh, a) for i, a in enumerate(args))
    out_sh = tuple(fmt if i in out_cache else sh for i in range(1 + len(out_cache)))
    t0 = time.perf_counter()
    try:
        with jax.default_device(dev):
            jitted = jax.jit(fn, donate_argnums=donate, in_shardings=in_sh, out_shardings=out_sh)
            compiled = jitted.lower(*avals).compile()
    except Exception as e:  # a refusal of the shape: report its first line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"error": f"{type(e).__name__}: {msg[:150]}"}
    seconds = time.perf_counter() - t0
    ca, m = compiled.cost_analysis(), compiled.memory_analysis()
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    params = re.findall(r"= (\w+\[[0-9,]+\]\{[^}]*\}) parameter\((\d+)\)", entry)
    logical = sum(a.size * a.dtype.itemsize for i in cache_args for a in jax.tree.leaves(args[i]))
    physical = sum(_bytes_of(p) for p, _ in params if p.split("]")[0].count(",") == 3)  # the 4-D caches
    return {
        "seconds": seconds,
        "bytes": ca.get("bytes accessed"),
        "flops": ca.get("flops"),
        "temp": m.temp_size_in_bytes,
        "padding": physical / logical if logical else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5e:1x1")
    args = p.parse_args()
    print("$ python " + " ".join(sys.argv))
    dev = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices[0]
    print(f"# {dev.device_kind} ({args.topology}), jax {jax.__version__}, bf16")
    use_topology_for_tuned_blocks(dev)
    print("| shape | kernel | compiles | compile s | XLA bytes | XLA flops | temp | cache layout / logical |")
    print("|---|---|---|---|---|---|---|---|")
    bf = jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    for name, h, kvh, d, ps, t, s, max_pages, num_pages in SHAPES:
        q, kv = spec((t, h, d), bf), spec((t, kvh, d), bf)
        batch = Batch.abstract(t, s, max_pages)
        pages = spec((kvh, num_pages, ps, d), bf)
        combined = spec((num_pages, ps, 2 * kvh, d), bf)
        runs = {
            "kiln": compile_one(dev, kiln_fn(d), (q, kv, kv, pages, pages, batch), (3, 4), (3, 4), (1, 2)),
            "jax": compile_one(dev, jax_fn(d), (q, kv, kv, combined, batch), (3,), (3,), (1,)),
        }
        if "VmemOom" in runs["jax"].get("error", ""):  # vLLM's TPU backend raises JAX's scoped VMEM limit too
            runs["jax, 100 MiB VMEM"] = compile_one(
                dev, jax_fn(d, 100 << 20), (q, kv, kv, combined, batch), (3,), (3,), (1,)
            )
        for kernel, r in runs.items():
            if "error" in r:
                print(f"| {name} | {kernel} | no: {r['error']} | | | | | |")
                continue
            print(
                f"| {name} | {kernel} | yes | {r['seconds']:.1f} | {r['bytes'] / 1e6:.1f} MB | "
                f"{r['flops'] / 1e9:.2f} G | {r['temp'] / 1e6:.1f} MB | {r['padding']:.2f}x |"
            )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

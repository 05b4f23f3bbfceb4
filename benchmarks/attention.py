"""Time kiln's GPU paged attention against a copy-bandwidth ceiling and JAX's shipped Pallas kernel.

    python benchmarks/attention.py [--quick] [--sweep] [--json FILE]

Decode with Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16) at batch 1/8/64/256 and
context 512/2K/8K/32K, page sizes 16 and 64; then mixed prefill+decode batches against their parts run as separate
calls. In the same run: a large device-to-device copy (bytes read + written per second: the ceiling) and
jax.experimental.pallas.ops.gpu.paged_attention on the same inputs. Each time is the median over trials of a loop
of calls enqueued back to back (one block_until_ready per trial), divided by the calls; inputs rotate over page
up to 4 page sets (toward 256 MB, several times the 50 MB L2) where one set is smaller. Effective bandwidth = KV bytes
read / time; `frac` is that over the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.batch import Batch
from kiln.models.kernels import pallas_gpu

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = jnp.bfloat16
ROTATE_BYTES = 256 << 20


def bench(fn, *, trials: int = 7, target_s: float = 0.02) -> float:
    """Median seconds per call of fn() (fn enqueues work and returns arrays)."""
    jax.block_until_ready(fn())
    t = time.perf_counter()
    jax.block_until_ready(fn())
    once = max(time.perf_counter() - t, 1e-6)
    n = max(1, min(200, int(target_s / once)))
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        outs = [fn() for _ in range(n)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy-like elementwise op."""
    x = jax.random.normal(jax.random.key(0), (1 << 31,), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.bfloat16(1))
    t = bench(lambda: f(x), trials=9, target_s=0.05)
    return 2 * (1 << 31) * 2 / t


def decode_sets(rng, batch: int, ctx: int, page_size: int, num_sets: int):
    """num_sets decode batches over disjoint shuffled pages of one pool. Returns (pages count, [Batch], tables)."""
    ppseq = ctx // page_size
    per_set = batch * ppseq
    num_pages = per_set * num_sets
    perm = rng.permutation(num_pages).astype(np.int32)
    out = []
    for i in range(num_sets):
        tables = perm[i * per_set : (i + 1) * per_set].reshape(batch, ppseq)  # (B, pages)
        pos = ctx - 1
        slots = tables[:, pos // page_size] * page_size + pos % page_size
        b = Batch(
            token_ids=jnp.zeros(batch, jnp.int32),
            positions=jnp.full(batch, pos, jnp.int32),
            slot_mapping=jnp.asarray(slots, jnp.int32),
            block_tables=jnp.asarray(tables),
            seq_lens=jnp.full(batch, ctx, jnp.int32),
            query_start=jnp.arange(batch + 1, dtype=jnp.int32),
            num_seqs=jnp.array([batch], jnp.int32),
            logits_index=jnp.arange(batch, dtype=jnp.int32),
        )
        out.append(b)
    return num_pages, out


def rand(key, shape):
    return jax.random.normal(key, shape, DTYPE)


def make_ours(sets, qkv, kw):
    """A jitted loop over the rotating sets; pages are donated and threaded through, as in the step program."""

    def run(kp, vp, qkv, sets):
        outs = []
        for (q, k, v), b in zip(qkv, sets, strict=True):
            o, kp, vp = pallas_gpu.paged_attention(q, k, v, kp, vp, b, scale=HEAD_DIM**-0.5, **kw)
            outs.append(o)
        return outs, kp, vp

    return jax.jit(run, donate_argnums=(0, 1))


def make_jax(sets, qs):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    def run(kp, vp, qs, sets):
        outs = []
        for q, b in zip(qs, sets, strict=True):
            ppseq = b.block_tables.shape[1]
            splits = min(16, ppseq)
            outs.append(
                jax_pa.paged_attention(
                    q,
                    kp,
                    vp,
                    b.block_tables,
                    b.seq_lens,
                    k_splits=splits,
                    pages_per_compute_block=max(1, min(8, ppseq // splits)),
                )  # fmt: skip
            )
        return outs

    return jax.jit(run)


class Pages:
    """K/V page pool whose buffers are donated to each call and replaced by its results."""

    def __init__(self, num_pages, page_size, key):
        shape = (KV_HEADS, num_pages, page_size, HEAD_DIM)
        k1, k2 = jax.random.split(key)
        self.k, self.v = rand(k1, shape), rand(k2, shape)

    def call(self, fn, *args):
        outs, self.k, self.v = fn(self.k, self.v, *args)
        return outs


def time_decode(rng, batch, ctx, page_size, copy_bw, kw, with_jax=True):
    set_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    num_sets = int(min(4, max(1, -(-ROTATE_BYTES // set_bytes))))
    num_pages, sets = decode_sets(rng, batch, ctx, page_size, num_sets)
    key = jax.random.key(int(rng.integers(2**31)))
    pages = Pages(num_pages, page_size, key)
    ks = jax.random.split(key, 3 * num_sets)
    qkv = [
        (rand(ks[3 * i], (batch, HEADS, HEAD_DIM)), rand(ks[3 * i + 1], (batch, KV_HEADS, HEAD_DIM)),
         rand(ks[3 * i + 2], (batch, KV_HEADS, HEAD_DIM)))
        for i in range(num_sets)
    ]  # fmt: skip
    ours = make_ours(sets, qkv, kw)
    t_ours = bench(lambda: pages.call(ours, qkv, sets)) / num_sets
    row = {"batch": batch, "ctx": ctx, "page": page_size, "sets": num_sets, "us": t_ours * 1e6}
    row["frac"] = set_bytes / t_ours / copy_bw
    if with_jax:
        qs = [q * HEAD_DIM**-0.5 for q, _, _ in qkv]
        theirs = make_jax(sets, qs)
        t_jax = bench(lambda: theirs(pages.k, pages.v, qs, sets)) / num_sets
        row.update(jax_us=t_jax * 1e6, jax_frac=set_bytes / t_jax / copy_bw, speedup=t_jax / t_ours)
    return row


def mixed_batch(rng, parts, page_size, num_tokens, num_seqs, pool_offset=0):
    """parts: list of (cached, new). Returns Batch over fresh shuffled pages starting at pool_offset."""
    from kiln.models.batch import SeqChunk, make_batch

    max_pages = max(-(-(c + n) // page_size) for c, n in parts)
    need = sum(-(-(c + n) // page_size) for c, n in parts)
    perm = pool_offset + rng.permutation(need)
    chunks, used = [], 0
    for c, n in parts:
        p = -(-(c + n) // page_size)
        chunks.append(SeqChunk(tokens=[0] * n, start=c, pages=list(perm[used : used + p])))
        used += p
    return jax.tree.map(jnp.asarray, make_batch(chunks, page_size, num_tokens, num_seqs, max_pages)), need


def time_batch(rng, parts, page_size, kw, num_tokens=None, num_seqs=None):
    n_tok = sum(n for _, n in parts)
    num_tokens = num_tokens or -(-n_tok // 16) * 16
    num_seqs = num_seqs or len(parts)
    kv_bytes = sum(c + n for c, n in parts) * KV_HEADS * HEAD_DIM * 2 * 2
    num_sets = int(min(4, max(1, -(-ROTATE_BYTES // kv_bytes))))
    sets, offset = [], 0
    for _ in range(num_sets):
        b, need = mixed_batch(rng, parts, page_size, num_tokens, num_seqs, offset)
        sets.append(b)
        offset += need
    key = jax.random.key(int(rng.integers(2**31)))
    pages = Pages(offset, page_size, key)
    ks = jax.random.split(key, 3)
    qkv = [
        (rand(ks[0], (num_tokens, HEADS, HEAD_DIM)), rand(ks[1], (num_tokens, KV_HEADS, HEAD_DIM)),
         rand(ks[2], (num_tokens, KV_HEADS, HEAD_DIM)))
    ] * num_sets  # fmt: skip
    fn = make_ours(sets, qkv, kw)
    t = bench(lambda: pages.call(fn, qkv, sets)) / num_sets
    return t, kv_bytes


def fmt_row(r):
    s = f"{r['batch']:>5} {r['ctx']:>6} {r['page']:>4} {r['us']:>9.1f} {r['frac']:>6.2f}"
    if "jax_us" in r:
        s += f" {r['jax_us']:>9.1f} {r['jax_frac']:>6.2f} {r['speedup']:>6.2f}"
    return s + f"  {r.get('note', '')}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few decode shapes only")
    ap.add_argument("--sweep", action="store_true", help="also try tile, warp, stage and split settings")
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args(argv)
    print("command: python benchmarks/attention.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind}", flush=True)
    rng = np.random.default_rng(0)
    results = {"decode": [], "sweep": [], "mixed": []}
    copy_bw = copy_bandwidth()
    results["copy_bw"] = copy_bw
    print(f"copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s", flush=True)

    if args.sweep:
        print("\n# sweep: batch ctx page | us frac | settings", flush=True)
        grid = [
            (64, 2048, {}), (64, 2048, {"block_k": 32}), (64, 2048, {"block_k": 128}),
            (64, 2048, {"num_stages": 2}), (64, 2048, {"num_stages": 4}), (64, 2048, {"num_warps": 8}),
            (64, 2048, {"num_splits": 2}), (64, 2048, {"write_kv_in": "xla"}),
            (64, 2048, {"block_k": 128, "num_warps": 8}),
            (256, 8192, {}), (256, 8192, {"block_k": 128}), (256, 8192, {"num_stages": 4}),
            (1, 32768, {}), (1, 32768, {"num_splits": 16}), (1, 32768, {"num_splits": 32}),
            (1, 32768, {"num_splits": 128}), (1, 32768, {"block_k": 128}), (1, 32768, {"num_stages": 4}),
        ]  # fmt: skip
        for b, c, kw in grid:
            try:
                r = time_decode(rng, b, c, 16, copy_bw, kw, with_jax=False)
                r["note"] = json.dumps(kw)
            except Exception as e:
                r = {"batch": b, "ctx": c, "page": 16, "us": float("nan"), "frac": float("nan"), "note": repr(e)[:200]}
            results["sweep"].append(r)
            print(fmt_row(r), flush=True)

    print("\n# decode: batch ctx page | kiln us, frac of copy bw | jax us, frac | jax/kiln time", flush=True)
    shapes = [(b, c) for b in (1, 8, 64, 256) for c in (512, 2048, 8192, 32768)]
    if args.quick:
        shapes = [(64, 2048), (1, 32768), (256, 8192)]
    for page in (16, 64):
        for b, c in shapes:
            try:
                r = time_decode(rng, b, c, page, copy_bw, {})
            except Exception as e:
                r = {"batch": b, "ctx": c, "page": page, "us": float("nan"), "frac": float("nan")}
                r["note"] = f"{type(e).__name__}: {str(e)[:160]}"
            results["decode"].append(r)
            print(fmt_row(r), flush=True)

    if not args.quick:
        print("\n# mixed vs separate (page 16): us mixed | us prefill part + us decode part | ratio", flush=True)
        mixes = {
            "1x512-token chunk (1536 cached) + 63 decodes @2K": ([(1536, 512)], [(2047, 1)] * 63),
            "4x256-token prompts + 124 decodes @2K": ([(0, 256)] * 4, [(2047, 1)] * 124),
            "1x2048-token prompt + 255 decodes @4K": ([(0, 2048)], [(4095, 1)] * 255),
            "8x64-token chunks (1K cached) + 56 decodes @8K": ([(1024, 64)] * 8, [(8191, 1)] * 56),
        }
        for name, (pre, dec) in mixes.items():
            t_mix, _ = time_batch(rng, pre + dec, 16, {})
            t_pre, _ = time_batch(rng, pre, 16, {})
            t_dec, _ = time_batch(rng, dec, 16, {})
            r = {"name": name, "mixed_us": t_mix * 1e6, "prefill_us": t_pre * 1e6, "decode_us": t_dec * 1e6}
            r["mixed_over_separate"] = t_mix / (t_pre + t_dec)
            results["mixed"].append(r)
            print(
                f"{name:52s} {r['mixed_us']:9.1f} | {r['prefill_us']:9.1f} + {r['decode_us']:9.1f} "
                f"| {r['mixed_over_separate']:.2f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.batch import Batch, SeqChunk, make_batch
from kiln.models.kernels import pallas_gpu

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = jnp.bfloat16
ROTATE_BYTES = 256 << 20
CALLS = 8  # kernel calls per dispatch, so that host dispatch does not set the pace of small cases


def bench(fn, *, trials: int = 7, target_s: float = 0.02) -> float:
    """Median seconds per call of fn() (fn enqueues work and returns arrays); n calls per trial, one sync."""
    jax.block_until_ready(fn())
    t = time.perf_counter()
    jax.block_until_ready(fn())
    once = max(time.perf_counter() - t, 1e-6)
    n = max(1, min(200, int(target_s / once)))
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(n):
            last = fn()
        jax.block_until_ready(last)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def copy_bandwidth() -> dict[str, float]:
    """Bytes read + written per second by 4 GiB device-to-device copies: an XLA copy, an XLA elementwise op, and
    PyTorch's copy_ where PyTorch is there. The largest is the ceiling."""
    n = 1 << 31  # bf16 elements
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    out = {}
    for name, f in (("xla_copy", jax.jit(lambda x: x.copy())), ("xla_add", jax.jit(lambda x: x + jnp.bfloat16(1)))):
        out[name] = 2 * n * 2 / bench(lambda f=f: f(x), trials=9, target_s=0.05)
    x = None
    try:
        import torch

        a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        times = []
        for _ in range(9):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                b.copy_(a)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 5e3)
        out["torch_copy"] = 2 * n * 2 / statistics.median(times)
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # no PyTorch or no CUDA in it: the XLA figures stand
        print(f"torch copy skipped: {e}")
    return out


def decode_sets(rng, batch: int, ctx: int, page_size: int, num_sets: int) -> tuple[int, list[Batch]]:
    """num_sets decode batches (every sequence at length ctx) over disjoint shuffled pages of one pool."""
    ppseq = ctx // page_size
    per_set = batch * ppseq
    perm = rng.permutation(per_set * num_sets).astype(np.int32)
    out = []
    for i in range(num_sets):
        tables = perm[i * per_set : (i + 1) * per_set].reshape(batch, ppseq)  # (B, pages)
        pos = ctx - 1
        slots = tables[:, pos // page_size] * page_size + pos % page_size  # (B,)
        b = Batch(
            token_ids=np.zeros(batch, np.int32),
            positions=np.full(batch, pos, np.int32),
            slot_mapping=slots.astype(np.int32),
            block_tables=tables,
            seq_lens=np.full(batch, ctx, np.int32),
            query_start=np.arange(batch + 1, dtype=np.int32),
            num_seqs=np.array([batch], np.int32),
            logits_index=np.arange(batch, dtype=np.int32),
        )
        out.append(jax.tree.map(jnp.asarray, b))
    return per_set * num_sets, out


def mixed_sets(rng, parts, page_size: int, num_sets: int) -> tuple[int, list[Batch]]:
    """num_sets batches of the sequences `parts` ((cached, new) each) over disjoint shuffled pages."""
    n_tok = sum(n for _, n in parts)
    num_tokens = -(-n_tok // 16) * 16
    max_pages = max(-(-(c + n) // page_size) for c, n in parts)
    need = sum(-(-(c + n) // page_size) for c, n in parts)
    perm = rng.permutation(need * num_sets)
    out = []
    for i in range(num_sets):
        chunks, used = [], i * need
        for c, n in parts:
            p = -(-(c + n) // page_size)
            chunks.append(SeqChunk(tokens=[0] * n, start=c, pages=list(perm[used : used + p])))
            used += p
        out.append(jax.tree.map(jnp.asarray, make_batch(chunks, page_size, num_tokens, len(parts), max_pages)))
    return need * num_sets, out


def rand(key, shape):
    return jax.random.normal(key, shape, DTYPE)


def make_ours(kw):
    """A jitted loop over the rotating sets; pages are donated and threaded through, as in the step program."""

    def run(kp, vp, qkv, sets):
        outs = []
        for (q, k, v), b in zip(qkv, sets, strict=True):
            o, kp, vp = pallas_gpu.paged_attention(q, k, v, kp, vp, b, scale=HEAD_DIM**-0.5, **kw)
            outs.append(o)
        return outs, kp, vp

    return jax.jit(run, donate_argnums=(0, 1))


def make_jax():
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


@dataclasses.dataclass
class Case:
    """One timed configuration: inputs except the pages (allocated when timed), compiled ahead in parallel."""

    row: dict
    num_pages: int
    page_size: int
    sets: list
    qkv: list
    kv_bytes: int  # KV bytes one call must read
    kw: dict
    with_jax: bool = False
    ours: object = None
    theirs: object = None
    error: str = ""

    def compile(self) -> Case:
        try:
            pages = jax.ShapeDtypeStruct((KV_HEADS, self.num_pages, self.page_size, HEAD_DIM), DTYPE)
            self.ours = make_ours(self.kw).lower(pages, pages, self.qkv, self.sets).compile()
            if self.with_jax:
                qs = [q for q, _, _ in self.qkv]
                self.theirs = make_jax().lower(pages, pages, qs, self.sets).compile()
        except Exception as e:  # reported in the table
            self.error = f"{type(e).__name__}: {str(e)[:300]}"
        return self

    def measure(self, seed: int, copy_bw: float) -> dict:
        row = dict(self.row)
        if self.error:
            return row | {"us": float("nan"), "frac": float("nan"), "note": self.error}
        shape = (KV_HEADS, self.num_pages, self.page_size, HEAD_DIM)
        k1, k2 = jax.random.split(jax.random.key(seed))
        state = {"k": rand(k1, shape), "v": rand(k2, shape)}

        def call():
            outs, state["k"], state["v"] = self.ours(state["k"], state["v"], self.qkv, self.sets)
            return outs

        n = len(self.sets)
        t = bench(call) / n
        row |= {"us": t * 1e6, "frac": self.kv_bytes / t / copy_bw}
        if self.with_jax:
            qs = [q * HEAD_DIM**-0.5 for q, _, _ in self.qkv]  # JAX's kernel takes pre-scaled queries
            t_jax = bench(lambda: self.theirs(state["k"], state["v"], qs, self.sets)) / n
            row |= {"jax_us": t_jax * 1e6, "jax_frac": self.kv_bytes / t_jax / copy_bw, "speedup": t_jax / t}
        state.clear()
        return row


def decode_case(rng, batch, ctx, page_size, kw, with_jax=True) -> Case:
    set_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    num_sets = int(min(4, max(1, -(-ROTATE_BYTES // set_bytes))))
    num_pages, sets = decode_sets(rng, batch, ctx, page_size, num_sets)
    sets = sets * max(1, CALLS // num_sets)
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    qkv = [
        (rand(keys[0], (batch, HEADS, HEAD_DIM)), rand(keys[1], (batch, KV_HEADS, HEAD_DIM)),
         rand(keys[2], (batch, KV_HEADS, HEAD_DIM)))
    ] * len(sets)  # fmt: skip
    row = {"batch": batch, "ctx": ctx, "page": page_size, "sets": num_sets, "note": json.dumps(kw) if kw else ""}
    return Case(row, num_pages, page_size, sets, qkv, set_bytes, kw, with_jax)


def mixed_case(rng, name, parts, page_size=16) -> Case:
    kv_bytes = sum(c + n for c, n in parts) * KV_HEADS * HEAD_DIM * 2 * 2
    num_sets = int(min(4, max(1, -(-ROTATE_BYTES // kv_bytes))))
    num_pages, sets = mixed_sets(rng, parts, page_size, num_sets)
    sets = sets * max(1, CALLS // num_sets)
    t = sets[0].slot_mapping.shape[0]
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    qkv = [
        (rand(keys[0], (t, HEADS, HEAD_DIM)), rand(keys[1], (t, KV_HEADS, HEAD_DIM)),
         rand(keys[2], (t, KV_HEADS, HEAD_DIM)))
    ] * len(sets)  # fmt: skip
    return Case({"name": name}, num_pages, page_size, sets, qkv, kv_bytes, {})


def fmt_row(r):
    s = f"{r['batch']:>5} {r['ctx']:>6} {r['page']:>4} {r['us']:>9.1f} {r['frac']:>6.2f}"
    if "jax_us" in r:
        s += f" {r['jax_us']:>9.1f} {r['jax_frac']:>6.2f} {r['speedup']:>6.2f}"
    return s + f"  {r.get('note', '')}"


SWEEP = [
    (64, 2048, {"num_stages": 4}), (64, 2048, {"num_stages": 2}), (1, 32768, {"num_splits": 128}),
    (1, 32768, {"num_splits": 256}), (1, 32768, {"num_splits": 33}), (256, 8192, {"write_kv_in": "xla"}),
    (64, 2048, {"write_kv_in": "xla"}),
]  # fmt: skip
MIXES = {
    "1x512-token chunk (1536 cached) + 63 decodes @2K": ([(1536, 512)], [(2047, 1)] * 63),
    "4x256-token prompts + 124 decodes @2K": ([(0, 256)] * 4, [(2047, 1)] * 124),
    "8x64-token chunks (1K cached) + 56 decodes @8K": ([(1024, 64)] * 8, [(8191, 1)] * 56),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few decode shapes only")
    ap.add_argument("--sweep", action="store_true", help="also try tile, warp, stage, split and write settings")
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument("--pages", default="16,64", help="page sizes: 16 gets the whole grid, others a subset")
    ap.add_argument("--no-mixed", action="store_true", help="skip the mixed-batch comparison")
    ap.add_argument("--only", help="comma list of groups to run: decode, sweep, mixed")
    ap.add_argument("--shapes", help="decode shapes as batch:ctx:page,... (replaces the grid)")
    ap.add_argument("--workers", type=int, default=12, help="threads compiling the cases ahead")
    args = ap.parse_args(argv)
    print("command: python benchmarks/attention.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rng = np.random.default_rng(0)

    only = set(args.only.split(",")) if args.only else {"decode", "sweep", "mixed"}
    pages = [int(p) for p in args.pages.split(",")]
    shapes = [(b, c, 16) for b in (1, 8, 64, 256) for c in (512, 2048, 8192, 32768)] if 16 in pages else []
    subset = ((8, 8192), (64, 2048), (64, 8192), (256, 8192), (1, 32768))
    shapes += [(b, c, p) for p in pages if p != 16 for b, c in subset]
    if args.quick:
        shapes = [(64, 2048, 16), (1, 32768, 16), (256, 8192, 16)]
    if args.shapes:
        shapes = [tuple(int(x) for x in sh.split(":")) for sh in args.shapes.split(",")]
    groups = {"decode": [decode_case(rng, b, c, p, {}) for b, c, p in shapes]} if "decode" in only else {}
    if args.sweep and "sweep" in only:
        groups["sweep"] = [decode_case(rng, b, c, 16, kw, with_jax=False) for b, c, kw in SWEEP]
        groups["sweep"] += [decode_case(rng, 64, 8192, 64, {"block_k": bk}, with_jax=False) for bk in (32, 128)]
    if not args.quick and not args.no_mixed and "mixed" in only:
        groups["mixed"] = [
            mixed_case(rng, f"{name} [{part}]", parts)
            for name, (pre, dec) in MIXES.items()
            for part, parts in (("mixed", pre + dec), ("prefill", pre), ("decode", dec))
        ]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(Case.compile, [c for cs in groups.values() for c in cs]))
    print(f"compiled {sum(map(len, groups.values()))} cases in {time.perf_counter() - t0:.0f} s", flush=True)

    copies = copy_bandwidth()
    copy_bw = max(copies.values())
    results = {"copy_bw": copy_bw, "copies": copies}
    print("copy bandwidth (read + write), TB/s: " + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in copies.items()))
    print(f"ceiling used for frac: {copy_bw / 1e12:.2f} TB/s", flush=True)
    heads = {
        "decode": "# decode: batch ctx page | kiln us, frac of copy bw | jax us, frac | jax time / kiln time",
        "sweep": "# sweep: batch ctx page | us frac | settings",
        "mixed": "# mixed vs separate (page 16): us mixed | us prefill part + us decode part | mixed / separate",
    }
    for group, cases in groups.items():
        print("\n" + heads[group], flush=True)
        rows = []
        for i, case in enumerate(cases):
            rows.append(case.measure(i, copy_bw))
            case.ours = case.theirs = None
            if group != "mixed":
                print(fmt_row(rows[-1]), flush=True)
        if group == "mixed":
            for i in range(0, len(rows), 3):
                mix, pre, dec = rows[i : i + 3]
                ratio = mix["us"] / (pre["us"] + dec["us"])
                name = mix["name"].rsplit(" [", 1)[0]
                print(f"{name:50s} {mix['us']:9.1f} | {pre['us']:9.1f} + {dec['us']:9.1f} | {ratio:.2f}", flush=True)
        results[group] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

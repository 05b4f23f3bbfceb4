"""Check kiln's GPU paged-attention kernel against the reference at real sizes, on the GPU, in float32 and bf16.

    python benchmarks/attention_check.py [--quick | --decode]

Every case draws fresh random inputs; the reference runs in float32 with the highest matmul precision on the
upcast inputs. Before each kernel call the allocator is filled with NaN (poison) and the new tokens' page slots are
set to NaN, so an unwritten output or page slot shows. Passes when ||out - ref|| / ||ref|| is under 1e-4 (float32)
or 1e-2 (bf16), padding tokens are exactly zero, and the pages equal the reference's pages exactly.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.batch import SeqChunk, make_batch
from kiln.models.kernels import pallas_gpu, reference
from kiln.targets.target import KV_DTYPES

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}


def make_case(rng, lens, *, heads, kv_heads, head_dim, page_size, num_tokens, num_seqs, dtype, kv_dtype=None,
              spare_pages=64):  # fmt: skip
    """Inputs for sequences given as (cached, new) pairs, pages shuffled, T and S padded to the bucket."""
    max_kv = max(c + n for c, n in lens)
    max_pages = -(-max_kv // page_size)
    need = sum(-(-(c + n) // page_size) for c, n in lens)
    num_pages = need + spare_pages
    perm = rng.permutation(num_pages)
    chunks, used = [], 0
    for cached, new in lens:
        n_pages = -(-(cached + new) // page_size)
        chunks.append(SeqChunk(tokens=[1] * new, start=cached, pages=list(perm[used : used + n_pages])))
        used += n_pages
    batch = jax.tree.map(jnp.asarray, make_batch(chunks, page_size, num_tokens, num_seqs, max_pages))
    key = jax.random.key(int(rng.integers(2**31)))
    ks = jax.random.split(key, 5)
    pages_shape = (kv_heads, num_pages, page_size, head_dim)
    q = jax.random.normal(ks[0], (num_tokens, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (num_tokens, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (num_tokens, kv_heads, head_dim), jnp.float32).astype(dtype)
    kp = jax.random.normal(ks[3], pages_shape, jnp.float32).astype(kv_dtype or dtype)
    vp = jax.random.normal(ks[4], pages_shape, jnp.float32).astype(kv_dtype or dtype)
    return q, k, v, kp, vp, batch


def poison_slots(pages, slots):
    """NaN at the slots the call must write."""
    kvh, p, ps, d = pages.shape
    flat = pages.reshape(kvh, p * ps, d)
    slots = slots[slots >= 0]
    return flat.at[:, slots].set(jnp.nan).reshape(pages.shape)


def run_case(
    name,
    rng,
    lens,
    *,
    dtype,
    kv_dtype=None,
    heads=32,
    kv_heads=8,
    head_dim=128,
    page_size=16,
    num_tokens=None,
    num_seqs=None,
    sliding_window=None,
    soft_cap=None,
    **kernel_kw,
) -> tuple[bool, str]:
    n_tok = sum(n for _, n in lens)
    num_tokens = num_tokens or n_tok
    num_seqs = num_seqs or len(lens)
    q, k, v, kp, vp, batch = make_case(
        rng, lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        num_tokens=num_tokens, num_seqs=num_seqs, dtype=dtype, kv_dtype=kv_dtype,
    )  # fmt: skip
    scale = head_dim**-0.5
    opts = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda *a: reference.paged_attention(*a, **opts))
        pages = (kp, vp) if kv_dtype else (f32(kp), f32(vp))  # an fp8 cache: the reference rounds the writes too
        want, wk, wv = ref(f32(q), f32(k), f32(v), *pages, batch)
    kp_p = poison_slots(kp, batch.slot_mapping)
    vp_p = poison_slots(vp, batch.slot_mapping)
    fn = jax.jit(lambda *a: pallas_gpu.paged_attention(*a, **opts, **kernel_kw), donate_argnums=(3, 4))
    # Poison the allocator: the output buffer will most likely reuse this NaN-filled memory.
    junk = jnp.full((num_tokens * heads * head_dim * 8,), jnp.nan, jnp.float32).block_until_ready()
    del junk
    got, gk, gv = fn(q, k, v, kp_p, vp_p, batch)
    got = f32(got)
    n_live = int(batch.query_start[int(batch.num_seqs[0])])
    err = float(jnp.linalg.norm(got[:n_live] - want[:n_live]) / jnp.linalg.norm(want[:n_live]))
    finite = bool(jnp.all(jnp.isfinite(got)))
    pad_zero = bool(jnp.all(got[n_live:] == 0))
    pages_ok = bool(jnp.array_equal(f32(gk), wk.astype(kp.dtype).astype(jnp.float32), equal_nan=False)) and bool(
        jnp.array_equal(f32(gv), wv.astype(vp.dtype).astype(jnp.float32))
    )
    ok = finite and pad_zero and pages_ok and err < TOL[dtype]
    line = (
        f"{'PASS' if ok else 'FAIL'} {name:34s} {jnp.dtype(dtype).name:8s} {jnp.dtype(kp.dtype).name:13s} "
        f"T={num_tokens:5d} S={num_seqs:4d} "
        f"rel_err={err:.2e} finite={finite} pad_zero={pad_zero} pages_equal={pages_ok}"
    )
    return ok, line


def cases(rng, quick: bool, only_decode: bool = False):
    """(name, lens, kwargs): decode, long decode (split KV), prefill, mixed, GQA 1/4/8, windows, page sizes."""
    dec = [(int(c), 1) for c in rng.integers(1, 4000, size=64)]
    mixed = [(1536, 512), (0, 300), (777, 77)] + [(int(c), 1) for c in rng.integers(1, 3000, size=40)]
    out = [
        ("decode B=64 ctx<4K", dec, {}),
        ("decode B=1 ctx=32767 (split KV)", [(32766, 1)], {}),
        ("decode B=3 ctx~9K splits=7", [(9001, 1), (5, 1), (8190, 1)], {"num_splits": 7}),
        ("prefill 1000+531", [(0, 1000), (0, 531)], {}),
        ("mixed chunked+decode, padding", mixed, {"num_tokens": 1024, "num_seqs": 64}),
        ("mixed, K/V written by XLA", mixed, {"num_tokens": 1024, "num_seqs": 64, "write_kv_in": "xla"}),
        ("mixed page 64", mixed, {"num_tokens": 1024, "num_seqs": 64, "page_size": 64}),
        ("mixed GQA 1 (8/8 heads, D=64)", mixed, {"heads": 8, "kv_heads": 8, "head_dim": 64, "num_tokens": 1024}),
        ("mixed GQA 8 (32/4, D=256)", mixed, {"heads": 32, "kv_heads": 4, "head_dim": 256, "num_tokens": 1024}),
        ("mixed GQA 3 (9/3, D=64)", mixed, {"heads": 9, "kv_heads": 3, "head_dim": 64, "num_tokens": 1024}),
        ("mixed window 512 + soft cap 30", mixed, {"sliding_window": 512, "soft_cap": 30.0, "num_tokens": 1024}),
        ("decode window 1000, splits 4", dec[:16], {"sliding_window": 1000, "num_splits": 4}),
    ]
    decode = [  # the decode-only kernel (pallas_gpu._decode_kernel: the multi-step decode programs' attention)
        ("decode kernel B=64 ctx<4K", dec, {"decode": True}),
        ("decode kernel B=1 ctx=32767", [(32766, 1)], {"decode": True}),
        ("decode kernel B=3 of T=S=16, splits 7", [(9001, 1), (5, 1), (0, 1)],
         {"decode": True, "num_splits": 7, "num_tokens": 16, "num_seqs": 16}),
        ("decode kernel GQA 8 D=256 window+cap", dec[:16],
         {"decode": True, "heads": 32, "kv_heads": 4, "head_dim": 256, "sliding_window": 1000, "soft_cap": 30.0}),
        ("decode kernel page 64", dec[:8], {"decode": True, "page_size": 64}),
    ]  # fmt: skip
    if only_decode:
        return decode
    return out[:4] if quick else out + decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode", action="store_true", help="only the decode-only kernel's cases")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--page-size", type=int, help="use this page size in every case")
    ap.add_argument("--kv-dtype", default=None, help="the pages' dtype (fp8 = float8_e4m3fn); default: q's")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rng = np.random.default_rng(int(time.time()))
    dtypes = (jnp.float32, jnp.bfloat16)
    kv_dtype = KV_DTYPES[args.kv_dtype] if args.kv_dtype else None
    jobs = [(name, lens, dtype, kw) for dtype in dtypes for name, lens, kw in cases(rng, args.quick, args.decode)]
    if args.page_size:
        jobs = [(f"{n} page {args.page_size}", ls, dt, kw | {"page_size": args.page_size}) for n, ls, dt, kw in jobs]
    seeds = rng.integers(2**31, size=len(jobs))

    def one(i):
        name, lens, dtype, kw = jobs[i]
        try:
            return run_case(name, np.random.default_rng(seeds[i]), lens, dtype=dtype, kv_dtype=kv_dtype, **kw)
        except Exception as e:  # report and go on: one broken case must not hide the others
            return False, f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}"

    failed = 0
    with ThreadPoolExecutor(args.workers) as pool:  # compiles overlap; results print in order
        for ok, line in pool.map(one, range(len(jobs))):
            failed += not ok
            print(line, flush=True)
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

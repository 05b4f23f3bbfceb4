"""The decode attention alone at the Llama-3-8B decode programs' shapes, per knob setting: device microseconds a layer
(kiln.models.kernels.pallas_gpu.paged_attention_qkv under kernels.decode_batch(), the fused bf16 qkv (T, 8, 6, 128),
bf16 pages of 16 tokens (--kv-dtype fp8: float8_e4m3fn pages), every live sequence at --context keys; T = S = the decode
bucket of the concurrency, as gpu_profile.py builds it), with every kernel the call launches (the XLA combine of the KV
splits, the RoPE fusion when it is not in the kernel) summed from a jax.profiler trace. A whole-program variant in
gpu_profile costs a ~30 s compile of the 8B model; here a setting compiles in a second or two.

    python benchmarks/gpu_attn_sweep.py --concurrency 1,64 --variants "rope=xla,,num_stages=2,block_k=128;num_warps=8"
    python benchmarks/gpu_attn_sweep.py --prefill 16 --variants ",rows_big=128,rows_big=128;num_warps=8"

--prefill N: the general (prefill) kernel instead, on the batch of the N-th 2048-token step of a prefill-bound c = 64
run (kiln's Scheduler driven here with 64 prompts of --prompt-len tokens at once, budget 2048, buckets 16/64/256/2048,
as the served artifact has them: new prompts' pieces plus one decode token of every sequence already prefilled; T =
2048, S = 256, 132 pages a sequence at most), with its causal attention FLOPs and their rate. --peer (with --prefill
on a step whose pieces are whole fresh prompts of one length, e.g. step 0: two prompts of 1024) also times
jax.nn.dot_product_attention with implementation "cudnn" (cuDNN's flash attention) and "xla" on the same causal
problem (B prompts x their tokens, 32 query / 8 KV heads, bf16): the rate a tuned kernel reaches on these FLOPs.

A variant is ";"-separated KEY=N keyword arguments of pallas_gpu.paged_attention (num_splits, block_k, num_warps,
num_stages), "dot=f16" / "dot=q" for an fp8 cache's dots in float16 / q's dtype (pallas_gpu.FP8_CACHE_DOT),
"rope=kernel" / "rope=xla" for q and k rotated by the kernel or by XLA before it (pallas_gpu.ROPE_IN_KERNEL), and
"pieces=cudnn" / "pieces=kernel" for the prefill pieces' own keys through cudnn_gpu.piece_attention or the kernel
("ref": reference.piece_attention, a CPU check; the empty variant is today's default). --check compares each variant's
output on the first layer with reference.paged_attention_qkv (float32 on the same bf16 inputs; relative error), and with
pieces=cudnn first checks cudnn_gpu.piece_attention against reference.piece_attention (its output, and the log-sum-exp
it reads out of cuDNN's statistics). Each layer has its own pages (donated and threaded through, as the program does),
so the K/V are read from HBM, not L2."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import glob
import gzip
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models import kernels
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.kernels import pallas_gpu
from kiln.models.transformer import rope_tables
from kiln.targets.target import KV_DTYPES

KVH, G, D, PAGE = 8, 4, 128, 16  # Llama-3-8B


def device_kernels(trace_dir: str) -> dict[str, tuple[float, int]]:
    """Summed microseconds and launches per kernel name of the GPU events in the jax.profiler trace."""
    data = json.load(gzip.open(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "/device:" in names.get(e.get("pid"), ""):
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    return {n: (total[n], count[n]) for n in total}


def prefill_step(index: int, prompt_len: int, num_prompts: int = 64) -> list[tuple[int, int]]:
    """(start, tokens) of each item of the index-th 2048-token step kiln's Scheduler makes for num_prompts prompts of
    prompt_len distinct tokens arriving at once (budget 2048, buckets 16/64/256/2048, 8-step decodes once all decode;
    every step's sampled token appended, as the engine does)."""
    from kiln.serving.block_manager import BlockManager
    from kiln.serving.params import SamplingParams
    from kiln.serving.scheduler import Scheduler, Sequence

    sch = Scheduler(BlockManager(1 << 16, PAGE), max_num_seqs=256, max_num_batched_tokens=2048,
                    max_model_len=prompt_len + 1088, buckets=(16, 64, 256, 2048))  # fmt: skip
    rng = np.random.default_rng(0)
    for i in range(num_prompts):
        prompt = rng.integers(0, 100000, prompt_len).tolist()
        sch.add(Sequence(str(i), prompt, prompt_len, SamplingParams(max_tokens=256, ignore_eos=True), 0, i))
    seen = 0
    while sch.has_work():
        out = sch.schedule()
        if out.num_tokens > 256:
            if seen == index:
                return [(it.start, it.num_tokens) for it in out.seqs]
            seen += 1
        sch.update(out, [1] * len(out.seqs))
    raise SystemExit(f"the run has {seen} steps of more than 256 tokens; --prefill {index} is past them")


def peer_rates(items: list[tuple[int, int]], flops: float, layers: int, reps: int) -> list[dict]:
    """jax.nn.dot_product_attention (cuDNN, XLA) on the step's pieces where they are B whole fresh prompts of one
    length: device us a call from a profiler trace, and the rate on the same causal FLOPs as kiln's kernel."""
    pieces = {n for a, n in items if n > 1}
    if any(a for a, n in items if n > 1) or len(pieces) != 1 or any(n == 1 for _, n in items):
        print("--peer: this step is not whole fresh prompts of one length (try --prefill 0); no peer", flush=True)
        return []
    b, n = sum(1 for _, m in items if m > 1), pieces.pop()
    key = jax.random.key(7)
    q = jax.random.normal(key, (b, n, KVH * G, D), jnp.float32).astype(jnp.bfloat16)
    kvs = [jax.random.normal(jax.random.fold_in(key, i), (b, n, KVH, D), jnp.float32).astype(jnp.bfloat16)
           for i in range(2 * layers)]  # fmt: skip
    out = []
    for impl in ("cudnn", "xla"):
        fn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl))
        try:
            jax.block_until_ready([fn(q, kvs[2 * i], kvs[2 * i + 1]) for i in range(layers)])
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d, create_perfetto_trace=True):
                    for _ in range(reps):
                        res = [fn(q, kvs[2 * i], kvs[2 * i + 1]) for i in range(layers)]
                    jax.block_until_ready(res)
                ks = device_kernels(d)
        except Exception as e:  # noqa: BLE001
            print(f"peer {impl}: failed: {str(e)[:800]}", flush=True)
            continue
        us = sum(v for v, _ in ks.values()) / (layers * reps)
        print(f"peer {impl} on {b} x {n} causal: {us:.2f} us a layer, {flops / us / 1e6:.0f} TFLOP/s", flush=True)
        out.append({"peer": impl, "us_per_layer": us, "flops_per_layer": flops, "kernels": ks})
    return out


def rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def probe_pieces(qkv, batch, tables) -> None:
    """cudnn_gpu.piece_attention (cuDNN's packed call and its statistics as cudnn_gpu reads them) against
    reference.piece_attention on the pieces' tokens: the output's relative error, the log-sum-exp's largest error."""
    from kiln.models.kernels import cudnn_gpu, reference

    rot = pallas_gpu._rope_slots(qkv, *tables, G + 1)
    t = qkv.shape[0]
    q, k, v = rot[:, :, :G].reshape(t, KVH * G, D), rot[:, :, G], rot[:, :, G + 1]
    want, want_lse, covered = jax.jit(functools.partial(reference.piece_attention, scale=D**-0.5))(q, k, v, batch)
    got, lse, _ = jax.jit(functools.partial(cudnn_gpu.piece_attention, scale=D**-0.5))(q, k, v, batch)
    cov = np.asarray(covered)
    out_err = rel(np.asarray(got)[cov], np.asarray(want)[cov])
    lse_err = float(np.max(np.abs(np.asarray(lse)[cov] - np.asarray(want_lse)[cov])))
    print(f"pieces probe: {cov.sum()} piece tokens; output rel err {out_err:.2e}, log-sum-exp max abs err "
          f"{lse_err:.3e}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--context", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=16, help="page sets cycled through (each its own HBM)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="rope=xla,")
    ap.add_argument("--prefill", type=int, default=None, help="the N-th 2048-token step of a c = 64 run (see above)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--peer", action="store_true", help="--prefill: cuDNN's and XLA's attention on the same FLOPs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--interpret", action="store_true", help="Pallas's interpreter (a CPU check of this script)")
    ap.add_argument("--check", action="store_true", help="each variant's output against the reference (see above)")
    ap.add_argument("--kv-dtype", default="bfloat16", help="the pages' dtype: bfloat16 or fp8 (float8_e4m3fn)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, D, 2) / D))
    results, rope_default, dot_default = [], pallas_gpu.ROPE_IN_KERNEL, pallas_gpu.FP8_CACHE_DOT
    kv_dtype = jnp.dtype(KV_DTYPES.get(args.kv_dtype, args.kv_dtype))
    levels = [int(x) for x in args.concurrency.split(",")] if args.prefill is None else [args.prefill]
    for c in levels:
        flops = 0.0
        if args.prefill is None:
            t = s = max(16, 1 << (c - 1).bit_length())
            per_seq = max_pages = -(-(args.context + 9) // PAGE)
            chunks = [SeqChunk([5], args.context, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(c)]
        else:  # one step of a c = 64 run: each item its own pages, the keys before its piece already in them
            t, s, max_pages = 2048, 256, -(-(args.prompt_len + 1088) // PAGE)
            items = prefill_step(c, args.prompt_len)
            per_seq = -(-(max(a + n for a, n in items) + 1) // PAGE)
            chunks = [SeqChunk([5] * n, a, list(range(i * per_seq, (i + 1) * per_seq))) for i, (a, n) in
                      enumerate(items)]  # fmt: skip
            # QK^T and PV (2 x 2 x D FLOPs a key) of every query head over its causal keys, a layer
            flops = sum(4.0 * D * KVH * G * (n * a + n * (n + 1) / 2) for a, n in items)
            print(
                f"prefill step {c}: {len(items)} items ({sum(n == 1 for _, n in items)} decodes; pieces "
                f"{[(a, n) for a, n in items if n > 1]}), {flops / 1e9:.1f} GFLOP of attention a layer",
                flush=True,
            )
        batch = jax.device_put(make_batch(chunks, PAGE, t, s, max_pages))
        tables = rope_tables(batch.positions, inv_freq, jnp.bfloat16)
        key = jax.random.key(c)
        qkv = jax.random.normal(key, (t, KVH, G + 2, D), jnp.float32).astype(jnp.bfloat16)
        shape = (KVH, per_seq * len(chunks) + 1, PAGE, D)
        pages = [
            jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32).astype(kv_dtype)
            for i in range(2 * args.layers)
        ]
        want = None
        if args.check:
            from kiln.models.kernels import reference

            ref = functools.partial(reference.paged_attention_qkv, scale=D**-0.5)
            rot = pallas_gpu._rope_slots(qkv, *tables, G + 1).astype(jnp.float32)
            want = jax.jit(ref)(rot, pages[0].astype(jnp.float32), pages[1].astype(jnp.float32), batch)[0]
        for variant in args.variants.split(","):
            opts = dict(o.split("=") for o in variant.split(";") if o)
            pallas_gpu.ROPE_IN_KERNEL = opts.pop("rope", "kernel" if rope_default else "xla") == "kernel"
            pallas_gpu.FP8_CACHE_DOT = {"f16": jnp.float16, "q": None, "": dot_default}[opts.pop("dot", "")]
            pieces = opts.pop("pieces", None)
            kw = {k: int(v) for k, v in opts.items()}
            if pieces is not None:
                from kiln.models.kernels import cudnn_gpu, reference

                kw["pieces"] = {"cudnn": cudnn_gpu.piece_attention, "ref": reference.piece_attention, "kernel": None}[
                    pieces
                ]
                if pieces == "cudnn" and args.check:
                    probe_pieces(qkv, batch, tables)

            def attend(qkv, kp, vp, batch, tables, kw=kw):
                with kernels.decode_batch() if args.prefill is None else contextlib.nullcontext():
                    return pallas_gpu.paged_attention_qkv(qkv, kp, vp, batch, scale=D**-0.5, rope=tables,
                                                         interpret=args.interpret, **kw)  # fmt: skip

            layer = jax.jit(attend, donate_argnums=(1, 2))

            try:
                if want is not None:  # layer 0's pages, not donated
                    got = jax.jit(attend)(qkv, pages[0], pages[1], batch, tables)[0]
                    print(f"{variant or 'default'}: rel err against the reference {rel(got, want):.2e}", flush=True)
                for i in range(args.layers):  # compile and warm up
                    _, pages[2 * i], pages[2 * i + 1] = layer(qkv, pages[2 * i], pages[2 * i + 1], batch, tables)
                jax.block_until_ready(pages)
                with tempfile.TemporaryDirectory() as d:
                    with jax.profiler.trace(d, create_perfetto_trace=True):
                        for _ in range(args.reps):
                            for i in range(args.layers):
                                out, pages[2 * i], pages[2 * i + 1] = layer(
                                    qkv, pages[2 * i], pages[2 * i + 1], batch, tables
                                )
                        jax.block_until_ready((out, pages))
                    ks = device_kernels(d)
            except Exception as e:  # noqa: BLE001
                print(f"c={c} {variant or 'default'}: failed: {str(e)[:1500]}", flush=True)
                continue
            n = args.layers * args.reps
            us = sum(v for v, _ in ks.values()) / n
            launches = sum(k for _, k in ks.values()) / n
            parts = ", ".join(f"{name[:60]} {v / n:.2f} us x{k / n:.0f}" for name, (v, k) in
                              sorted(ks.items(), key=lambda p: -p[1][0]))  # fmt: skip
            rate = f", {flops / us / 1e6:.0f} TFLOP/s" if flops and us else ""
            print(f"{'c' if args.prefill is None else 'step'}={c} T={t} {variant or 'default'}: {us:.2f} us a layer"
                  f"{rate}, {launches:.1f} launches ({parts})", flush=True)  # fmt: skip
            results.append({"concurrency": c, "prefill_step": args.prefill, "variant": variant, "us_per_layer": us,
                            "flops_per_layer": flops, "kv_dtype": kv_dtype.name, "kernels": ks})  # fmt: skip
        pallas_gpu.ROPE_IN_KERNEL = rope_default
        pallas_gpu.FP8_CACHE_DOT = dot_default
        del pages
        if args.peer and args.prefill is not None:
            results += peer_rates(items, flops, args.layers, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Engine throughput without HTTP: the embedded SmolLM2 (or --model) driven through Engine.step() in this process.

For each concurrency c, c requests (random prompts of --prompt-len tokens, --max-tokens output tokens each,
ignore_eos, greedy) are submitted at once; reported: output tokens/s over the run, mean time per output token of a
request (TPOT, after its first token), time to first token, and the bucket compile times measured at start.

    python benchmarks/engine.py --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

from kiln.models.batch import make_batch
from kiln.serving.llm import build_engine
from kiln.serving.params import SamplingParams


def compile_times(engine) -> dict[int, float]:
    r = engine.runner
    out = {}
    for t in r.buckets:
        t0 = time.perf_counter()
        s = r.seqs_per_bucket[t]
        batch = make_batch([], r.page_size, t, s, r.max_pages_per_seq)
        step_out, r.kv = r.programs[t](r.weights, r.kv, batch, r.sampling_batch([], s))
        np.asarray(step_out.tokens)
        out[t] = time.perf_counter() - t0
    return out


def run(engine, concurrency: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = engine.cfg.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first, last, count = {}, {}, {}
    for i in range(concurrency):
        engine.add_request(f"b{seed}-{i}", rng.integers(100, vocab, prompt_len).tolist(), params)
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
    wall = time.perf_counter() - t0
    total = sum(count.values())
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in count if count[r] > 1]
    return {
        "concurrency": concurrency,
        "output_tok_s": total / wall,
        "tpot_ms": 1000 * float(np.mean(tpot)),
        "ttft_s": float(np.mean([first[r] - t0 for r in first])),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = build_engine(
        args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    load = time.perf_counter() - t0
    ct = compile_times(engine)
    print(f"# {engine.model_name}: load {load:.1f}s; jax {jax.__version__} on {jax.devices()[0].device_kind}, "
          f"{platform.machine()}; max_num_seqs {args.max_num_seqs}")  # fmt: skip
    print("compile (first call) per bucket: " + ", ".join(f"T={t}: {s:.1f}s" for t, s in ct.items()))
    print(f"prompt {args.prompt_len} tokens, {args.max_tokens} output tokens per request, greedy\n")
    print("| concurrency | output tok/s | TPOT ms | TTFT s | wall s |")
    print("|---:|---:|---:|---:|---:|")
    for i, c in enumerate(args.concurrency):
        r = run(engine, c, args.prompt_len, args.max_tokens, seed=i)
        print(f"| {c} | {r['output_tok_s']:.1f} | {r['tpot_ms']:.1f} | {r['ttft_s']:.2f} | {r['wall_s']:.1f} |")
    print("\ncommand: python benchmarks/engine.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if v is not None))  # fmt: skip


if __name__ == "__main__":
    main()

"""kiln generate's engine before and after the one plan (issue 13), and against kiln serve.

plans: the old jit-path defaults (reference attention, float32, one token per dispatch, buckets 1/16/64/256, 16384 KV
tokens) against the cpu target's plan (xla_cpu attention, 4 decode steps per dispatch, buckets 1/4/16/64/256); every
bucket compiled first (warmup) so only decoding is timed; min of 3.
serve: the same engine (jit path, the cpu plan) against `kiln serve` on the compiled cpu artifact, alternating, 3
rounds, tokens/s after the first token (the server streams).
Both: the embedded SmolLM2, one chat prompt, greedy, 128 tokens, ignore_eos.

    python benchmarks/generate_plan.py plans
    python benchmarks/generate_plan.py serve [--artifact DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import httpx

from kiln.serving.llm import LLM, build_engine
from kiln.serving.params import SamplingParams

PROMPT = "Write a short poem about the sea and the wind and the stars"
N = 128
OLD = dict(attention="reference", decode_steps=1, buckets=(1, 16, 64, 256), kv_tokens=16384)
PORT = 8123


def prompt_ids(engine) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def plans() -> None:
    for name, options in (("before (old jit defaults)", OLD), ("after (the cpu target's plan)", {})):
        t0 = time.perf_counter()
        engine = build_engine(None, warmup=True, **options)
        built = time.perf_counter() - t0
        llm, ids = LLM(engine=engine), prompt_ids(engine)
        params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
        llm.generate([ids], params)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            out = llm.generate([ids], params)[0]
            times.append(time.perf_counter() - t)
        print(f"{name}: build+warmup {built:.1f} s, {N} tokens in {min(times):.2f} s = {N / min(times):.1f} tok/s; "
              f"first ids {out.new_token_ids[:8]}", flush=True)  # fmt: skip


def generate_rate(engine, ids: list[int]) -> float:
    engine.add_request(f"g{time.perf_counter()}", ids, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    first, n = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            n += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def serve_rate(model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True}
    first = None
    with httpx.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter()
    return (N - 1) / (time.perf_counter() - first)  # the first chunk is the prefill's one token


def serve(artifact: str) -> None:
    from kiln.compile import ensure_artifact

    art = ensure_artifact(None, "cpu", out=artifact)
    cmd = [sys.executable, "-m", "kiln.serving.cli", "serve", str(art), "--port", str(PORT), "--no-access-log"]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        engine = build_engine(None, warmup=True)
        ids = prompt_ids(engine)
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        model = httpx.get(f"http://127.0.0.1:{PORT}/v1/models").json()["data"][0]["id"]
        gen, srv = [], []
        for _ in range(3):
            gen.append(generate_rate(engine, ids))
            srv.append(serve_rate(model, ids))
        g, s = statistics.median(gen), statistics.median(srv)
        print(f"generate (jit, cpu plan) {[round(x, 1) for x in gen]} median {g:.1f} tok/s; serve (artifact) "
              f"{[round(x, 1) for x in srv]} median {s:.1f} tok/s; generate / serve {g / s:.2f}")  # fmt: skip
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["plans", "serve"])
    ap.add_argument("--artifact", default="artifacts/generate-plan.cpu")
    args = ap.parse_args()
    plans() if args.what == "plans" else serve(args.artifact)

"""`kiln bench`: a load generator that speaks the OpenAI completions API to any server (kiln, llama.cpp, vLLM).

Prompts are random token ids of exactly --input-len tokens (sent as a token-id prompt, which kiln, vLLM and
llama.cpp's server accept); every request asks for exactly --output-len tokens with ignore_eos, and the counts that
come back are checked. Per concurrency level it reports TTFT, time per output token (TPOT) and inter-token latency
(ITL) at p50/p90/p99, request throughput and output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio
import httpx
import numpy as np
from tqdm import tqdm

from kiln.models.errors import KilnError


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds to the first token
    latency: float = 0.0  # seconds to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    error: str = ""


@dataclass
class LevelReport:
    concurrency: int
    num_prompts: int
    failed: int
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]


JSON_HEADERS = {"content-type": "application/json"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer source (HF folder or .gguf) giving the vocab size")
    p.add_argument("--vocab-size", type=int, default=None, help="draw prompt ids below this (instead of --tokenizer)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,8", help="comma-separated concurrency levels")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: 4 x concurrency)")
    p.add_argument("--seed", type=int, default=0, help="prompts of level C come from (seed, C): the same in every run, "
                   "none shared between levels; rerunning a level against the same server needs another seed (its "
                   "prefix cache holds the prompts)")  # fmt: skip
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", dest="json_out", default=None, help="write the results as JSON to this file")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    a = np.asarray(values) * 1000.0
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}  # fmt: skip


async def one_request(client: httpx.AsyncClient, url: str, body: bytes, output_len: int) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    usage_tokens = None
    chunks = 0
    try:
        async with client.stream("POST", url, content=body, headers=JSON_HEADERS) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                choices = msg.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(ok=False, error=f"{e.__class__.__name__}: {e}")
    res.latency = time.perf_counter() - start
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if res.output_tokens != output_len:
        res.error = f"asked for {output_len} tokens, got {res.output_tokens}"
        return res
    res.ok = True
    return res


def level_prompts(seed: int, concurrency: int, repeat: int, n: int, vocab: int, length: int) -> list[list[int]]:
    """n prompts of `length` random ids below `vocab` for one level, drawn from (seed, concurrency, repeat: how many
    times this run met the level before): a level's prompts are the same in every run with that seed (two servers
    compared at a level get the same ones) and differ from every other level's, which a server's prefix cache would
    otherwise answer without computing them (with one generator per run, a c = 64 run after a c = 1 run of another
    invocation began with c = 1's prompts: issue 16, session 13)."""
    rng = np.random.default_rng([seed, concurrency, repeat])
    return [rng.integers(0, vocab, length).tolist() for _ in range(n)]


async def run_level(args, model: str, concurrency: int, prompts: list[list[int]]) -> LevelReport:
    n = len(prompts)
    url = args.base_url.rstrip("/") + "/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=n, desc=f"concurrency {concurrency}", file=sys.stderr)

    # The client's own one-time work stays out of the timed window: the request bodies are encoded here (~0.1 ms
    # each), and anyio's asyncio backend, which httpx's first request would import (~50 ms on a small machine), is
    # loaded now; nothing the server does moves out of it (issue 16, session 15). The bytes are those httpx's json=
    # sent.
    rest = {"max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    bodies = [json.dumps({"model": model, "prompt": prompt, **rest}, ensure_ascii=False, separators=(",", ":"),
                         allow_nan=False).encode() for prompt in prompts]  # fmt: skip
    await anyio.sleep(0)

    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:

        async def task(body: bytes) -> RequestResult:
            async with sem:
                r = await one_request(client, url, body, args.output_len)
            bar.update(1)
            return r

        start = time.perf_counter()
        results = await asyncio.gather(*(task(b) for b in bodies))
        duration = time.perf_counter() - start
    bar.close()
    good = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"kiln bench: a request failed: {r.error}", file=sys.stderr)
            break
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    return LevelReport(
        concurrency=concurrency,
        num_prompts=n,
        failed=len(results) - len(good),
        duration_s=duration,
        request_throughput=len(good) / duration,
        output_tokens_per_s=sum(r.output_tokens for r in good) / duration,
        ttft_ms=percentiles([r.ttft for r in good]),
        tpot_ms=percentiles(tpot),
        itl_ms=percentiles([x for r in good for x in r.itl]),
    )


def resolve_model_and_vocab(args) -> tuple[str, int]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        try:
            r = httpx.get(args.base_url.rstrip("/") + "/models", headers=headers, timeout=30)
            model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise KilnError(f"Could not read the model name from {args.base_url}/models ({e}); pass --model.") from None
    if args.vocab_size:
        return model, args.vocab_size
    if args.tokenizer:
        from kiln.serving.tokenizer import Tokenizer

        return model, Tokenizer.from_source(Path(args.tokenizer)).vocab_size
    raise KilnError("kiln bench needs --tokenizer PATH or --vocab-size N to draw prompt token ids.")


def _trip(d: dict[str, float]) -> str:
    return f"{d['p50']:.1f} / {d['p90']:.1f} / {d['p99']:.1f}"


def print_table(reports: list[LevelReport]) -> None:
    head = ("conc", "reqs", "fail", "req/s", "out tok/s", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
            "ITL p50/p90/p99 ms")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in reports:
        cells = (r.concurrency, r.num_prompts, r.failed, f"{r.request_throughput:.2f}", f"{r.output_tokens_per_s:.1f}",
                 _trip(r.ttft_ms), _trip(r.tpot_ms), _trip(r.itl_ms))  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")


def run(args) -> int:
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        raise KilnError(f"--concurrency must be comma-separated integers, not {args.concurrency!r}.") from None
    if not levels or min(levels) < 1 or args.input_len < 1 or args.output_len < 1:
        raise KilnError("--concurrency, --input-len and --output-len must be positive.")
    if args.seed < 0:
        raise KilnError(f"--seed must be a non-negative integer, not {args.seed}.")
    model, vocab = resolve_model_and_vocab(args)
    reports = []
    for i, c in enumerate(levels):
        prompts = level_prompts(args.seed, c, levels[:i].count(c), args.num_prompts or 4 * c, vocab, args.input_len)
        reports.append(asyncio.run(run_level(args, model, c, prompts)))
    print(f"kiln bench: {args.base_url} model={model} input={args.input_len} output={args.output_len}")
    print_table(reports)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"base_url": args.base_url, "model": model, "input_len": args.input_len,
                       "output_len": args.output_len, "levels": [asdict(r) for r in reports]}, f, indent=2)  # fmt: skip
    return 1 if any(r.failed for r in reports) else 0

"""The cost of structured outputs: output tok/s with every row constrained by a JSON schema against unconstrained
rows, on the embedded SmolLM2 (or --model) through Engine.step() in this process, and the host time to fill the
token bitmask per step at 1, 16 and 64 rows.

Each run submits `concurrency` chat requests at once, greedy, exactly --max-tokens output tokens each: the free rows
ignore EOS, the constrained rows follow a schema whose array needs more items than fit (minItems), so both produce
the same number of tokens and the difference is the constraint's cost (mask fill on the host, mask transfer and
application on the device, single steps). The two kinds alternate for --rounds rounds; the best round of each counts.

    python benchmarks/structured.py --concurrency 16
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import numpy as np

from kiln.models.sampling import mask_words
from kiln.serving.llm import LLM, build_engine
from kiln.serving.params import SamplingParams, StructuredOutputsParams
from kiln.serving.structured import fill_masks

SCHEMA = {
    "type": "array",
    "minItems": 1000,  # never complete within max_tokens: every row produces exactly max_tokens tokens
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
}


def run(llm: LLM, prompts: list[list[int]], constrained: bool, max_tokens: int) -> tuple[float, int]:
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not constrained, structured_outputs=spec)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.new_token_ids) for o in outs)


def mask_fill_ms(llm: LLM, rows: int, steps: int = 30) -> float:
    """Mean host ms to fill `rows` rows of the bitmask, over `steps` steps of JSON generation."""
    engine = llm.engine
    guides = [engine.guides().guide(StructuredOutputsParams(json=SCHEMA)) for _ in range(rows)]
    text = engine.tokenizer.encode("[" + '{"name":"Ann","age":31,"role":"user","tags":["a","b"]},' * 20, False)
    words = np.full((rows, mask_words(engine.cfg.vocab_size)), -1, np.int32)
    total = 0.0
    for i in range(steps):
        t0 = time.perf_counter()
        fill_masks([(g, r) for r, g in enumerate(guides)], words)
        total += time.perf_counter() - t0
        for g in guides:
            assert g.accept(text[i])
    return 1000 * total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    engine = build_engine(args.model, max_model_len=1024, max_num_seqs=max(args.concurrency))
    llm = LLM(engine=engine)
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "List some users as JSON."}])
    prompt = tok.encode(chat, add_special_tokens=False)
    print(f"# {engine.model_name}; jax {jax.__version__} on {jax.devices()[0].device_kind}, {platform.machine()}")
    run(llm, [prompt] * max(args.concurrency), False, 4)  # compile the buckets
    run(llm, [prompt] * max(args.concurrency), True, 4)
    print(f"{args.max_tokens} output tokens per request, greedy, best of {args.rounds} rounds\n")
    print("| concurrency | unconstrained tok/s | JSON-schema tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for c in args.concurrency:
        best = {False: 0.0, True: 0.0}
        for _ in range(args.rounds):
            for constrained in (False, True):
                wall, tokens = run(llm, [prompt] * c, constrained, args.max_tokens)
                assert tokens == c * args.max_tokens, tokens
                best[constrained] = max(best[constrained], tokens / wall)
        print(f"| {c} | {best[False]:.1f} | {best[True]:.1f} | {best[True] / best[False]:.2f} |")
    print("\n| rows | mask fill ms per step (host) |\n|---:|---:|")
    for rows in (1, 16, 64):
        print(f"| {rows} | {mask_fill_ms(llm, rows):.3f} |")
    print("\ncommand: python benchmarks/structured.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if v is not None))  # fmt: skip


if __name__ == "__main__":
    main()

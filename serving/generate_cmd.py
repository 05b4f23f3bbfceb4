"""`kiln generate`: run one prompt through the engine in this process and stream the text to stdout.

    kiln generate [--model SRC] [--max-tokens N] [--temperature T] [--chat/--no-chat] PROMPT...

The model is a Hugging Face folder, a .gguf file or an artifact folder (default: the embedded SmolLM2), planned as
`kiln compile` plans it for this machine's target (the same attention, dtype, buckets and decode steps) and jitted
here. With a chat template (and unless --no-chat) the prompt is sent as one user message.
"""

from __future__ import annotations

import argparse
import sys
import time

from kiln.compile.compile_cmd import add_plan_arguments, plan_options
from kiln.models.errors import KilnError
from kiln.serving.params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="the prompt (several words are joined with spaces)")
    parser.add_argument("--model", default=None, help="HF folder, .gguf file or artifact (default: embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's, else 0.7)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass (default: the model's, else 1)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="apply the chat template (default: when the model has one)",
    )  # fmt: skip
    parser.add_argument("--stats", action="store_true", help="print timing to stderr at the end")
    parser.add_argument("--target", default="auto", help="the target whose plan is jitted here (default: auto)")
    add_plan_arguments(parser.add_argument_group("plan (default: the target's, as `kiln compile` plans it)"))


def run(args: argparse.Namespace) -> int:
    from kiln.serving.llm import build_engine

    t0 = time.perf_counter()
    engine = build_engine(args.model, target=args.target, **plan_options(args))
    tok = engine.tokenizer
    text = " ".join(args.prompt)
    chat = args.chat if args.chat is not None else bool(tok.chat_template)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(text)
    defaults = tok.generation_defaults
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature if args.temperature is not None else defaults.get("temperature", 0.7),
        top_p=args.top_p if args.top_p is not None else defaults.get("top_p", 1.0),
        top_k=args.top_k if args.top_k is not None else defaults.get("top_k", 0),
        seed=args.seed,
    )
    if len(ids) >= engine.max_model_len:
        raise KilnError(f"The prompt has {len(ids)} tokens; the context holds {engine.max_model_len}.")
    params.max_tokens = min(params.max_tokens, engine.max_model_len - len(ids))
    engine.add_request("generate", ids, params)
    t1 = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter()
            n += len(out.new_token_ids)
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        t2 = time.perf_counter()
        decode = (t2 - first) / max(n - 1, 1) if first else 0.0
        print(
            f"load {t1 - t0:.1f}s, prompt {len(ids)} tokens, first token {(first or t2) - t1:.2f}s, "
            f"{n} tokens, {1 / decode if decode else 0:.1f} tokens/s after the first",
            file=sys.stderr,
        )
    return 0

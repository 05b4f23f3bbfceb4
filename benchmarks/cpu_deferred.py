"""A CPU artifact served with deferred programs (what `kiln serve` does on a CPU), in one process: AsyncLLM answers
K concurrent prompts while only the first buckets' programs are in, waits until the engine, idle, has loaded the
rest, answers the same prompts again, and prints whether the greedy tokens agree and how many jax compilations
happened from the engine's start to the end (there must be none).

    python benchmarks/cpu_deferred.py ARTIFACT [-k 4] [--prompt-tokens 40] [--max-tokens 12]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from jax import monitoring

from kiln.serving import llm
from kiln.serving.params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("-k", type=int, default=4, help="concurrent prompts")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args()
    t0 = time.perf_counter()
    engine = llm.build_engine(args.artifact, warmup=True, defer_programs=True)
    runner = engine.runner
    later = list(engine.later.names) if engine.later else []
    print(f"ready after {time.perf_counter() - t0:.1f} s: buckets {runner.buckets}, decode {sorted(runner.decode)}, "
          f"deferred {later}", flush=True)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def ask(served, rid: str, prompt: list[int]) -> list[int]:
        tokens = []
        async for out in served.generate(rid, prompt, params):
            tokens += out.new_token_ids
        return tokens

    async def batch(served, tag: str) -> list[list[int]]:
        prompts = [list(range(100 + i, 100 + i + args.prompt_tokens)) for i in range(args.k)]
        return await asyncio.gather(*[ask(served, f"{tag}{i}", q) for i, q in enumerate(prompts)])

    events: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event.startswith("/jax/core/compile/") or "compilation_cache" in event:
            events.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    served = llm.AsyncLLM(engine)
    try:
        before = asyncio.run(batch(served, "before"))
        print(f"answered with buckets {runner.buckets}", flush=True)
        while (
            engine.later is not None
            and engine.later.pending()
            or any(
                (n.startswith("step") and int(n[6:]) not in runner.programs)
                or (n.startswith("decode") and int(n[8:]) not in runner.decode)
                for n in later
            )
        ):
            time.sleep(0.2)
        print(f"every program in after {time.perf_counter() - t0:.1f} s: buckets {runner.buckets}, decode "
              f"{sorted(runner.decode)}", flush=True)  # fmt: skip
        after = asyncio.run(batch(served, "after"))
    finally:
        served.shutdown()
        monitoring.unregister_event_duration_listener(listen)
    print(f"same tokens before and after: {before == after}; jax compilations: {len(events)} {events}")
    print(" ".join(sys.argv))


if __name__ == "__main__":
    main()

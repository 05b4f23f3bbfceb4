"""Is the sampler's cond recorded in XLA-GPU's CUDA graph? The sampler alone, behind a few ms of matmuls, at each
decode bucket size S, for each top_k form: which conds and custom calls of the optimized HLO sit inside a
command_buffer computation (recorded: no host) and which do not (a cond outside copies its predicate to the host,
which waits for the device there); how long a call takes to return while the previous one is still queued (returns
at once when every cond is recorded, after the whole program when one is not); and the sampler's own time on a greedy
step and on a sampling step (temperature, top-p, top-20 logprobs).

    python benchmarks/gpu_sampler_graph.py --rows 16,64,256 --variants pieces,lax [--hlo DIR] [--json OUT]

Variants: pieces = kiln.models.sampling as it is (top_k in rounds over 4096-wide pieces on GPUs); lax = every top_k
a single lax.top_k over the whole row (the sampler before session 9).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models import sampling
from kiln.models.sampling import SamplingBatch

TOP_K = sampling.top_k


def analyse(text: str) -> dict:
    """Conditionals, whiles, sorts and custom-call targets of an optimized HLO module's text, split by whether they
    are reachable from a command_buffer computation (recorded in the CUDA graph) or not."""
    comps, calls, body = {}, collections.defaultdict(set), None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            body = comps.setdefault(head.group(1), [])
            continue
        if body is None or not line.startswith(" "):
            continue
        body.append(line)
        name = list(comps)[-1]
        for m in re.finditer(r"(?:to_apply|calls|condition|body|true_computation|false_computation)=%([\w.\-]+)", line):
            calls[name].add(m.group(1))
        for m in re.finditer(r"branch_computations=\{([^}]*)\}", line):
            calls[name].update(x.strip().lstrip("%") for x in m.group(1).split(","))
    graphed, todo = set(), [c for c in comps if c.startswith("command_buffer")]
    while todo:
        c = todo.pop()
        if c not in graphed:
            graphed.add(c)
            todo.extend(calls[c])
    out = {"recorded": collections.Counter(), "host": collections.Counter()}
    for c, lines in comps.items():
        side = out["recorded"] if c in graphed else out["host"]
        for line in lines:
            for op in ("conditional", "while", "sort"):
                if re.search(rf"= [^=]* {op}\(", line):
                    side[op] += 1
            m = re.search(r'custom_call_target="([^"]+)"', line)
            if m:
                side[m.group(1)] += 1
    out["command_buffers"] = sum(c.startswith("command_buffer") for c in comps)
    return {k: dict(v) if isinstance(v, collections.Counter) else v for k, v in out.items()}


def batch(rows: int, vocab: int, sampled: bool) -> SamplingBatch:
    sb = SamplingBatch.neutral(rows, vocab_size=vocab)
    if sampled:
        sb.temperature[:] = 0.8
        sb.top_p[:] = 0.9
        sb.seeds[:] = np.arange(rows)
        sb.want_top[0] = 1
    return jax.device_put(sb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--variants", default="pieces,lax")
    ap.add_argument("--matmuls", type=int, default=6, help="(4096, 8192) x (8192, 8192) bf16 matmuls before sampling")
    ap.add_argument("--width", type=int, default=8192, help="the matmuls' size (small for a CPU dry run)")
    ap.add_argument("--hlo", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    key = jax.random.key(0)
    w = (jax.random.normal(key, (args.width, args.width), jnp.float32) * 0.01).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 1), (args.width // 2, args.width), jnp.float32).astype(jnp.bfloat16)
    results = []
    for variant in args.variants.split(","):
        # jax caches each cond branch's trace by its function (sampling._sample): without this the second variant
        # reruns the first one's sampler (the first device run of this script, session 9, did: its "lax" rows were
        # the pieces form)
        jax.clear_caches()
        sampling.top_k = TOP_K if variant == "pieces" else (lambda v, k: tuple(jax.lax.top_k(v, k)))
        for rows in [int(r) for r in args.rows.split(",")]:
            base = jax.random.normal(jax.random.fold_in(key, rows), (rows, args.vocab), jnp.float32) * 3
            pos = jnp.arange(rows, dtype=jnp.int32) + 1000

            def program(w, x, base, sb, pos, rows=rows):
                h = x
                for _ in range(args.matmuls):
                    h = jnp.tanh(h @ w)
                logits = base + h[:rows, :1].astype(jnp.float32) * 1e-3
                return sampling.sample(logits, sb, pos)

            row = {"variant": variant, "rows": rows}
            sbs = {"greedy": batch(rows, args.vocab, False), "sampled": batch(rows, args.vocab, True)}
            t0 = time.perf_counter()
            compiled = jax.jit(program).lower(w, x, base, sbs["greedy"], pos).compile()
            row["compile_s"] = time.perf_counter() - t0
            text = compiled.as_text()
            row["hlo"] = analyse(text)
            if args.hlo:
                Path(args.hlo).mkdir(parents=True, exist_ok=True)
                (Path(args.hlo) / f"sampler_{variant}_s{rows}.hlo.txt").write_text(text)
            # the sampler alone (one call at a time)
            alone = (
                jax.jit(lambda base, sb, pos: sampling.sample(base, sb, pos)).lower(base, sbs["greedy"], pos).compile()
            )
            for kind, sb in sbs.items():
                jax.block_until_ready(compiled(w, x, base, sb, pos))
                n, returned = 12, []
                t0 = time.perf_counter()
                for _ in range(n):
                    out = compiled(w, x, base, sb, pos)
                    returned.append(time.perf_counter())
                jax.block_until_ready(out)
                program_ms = (time.perf_counter() - t0) / n * 1e3
                dispatch_ms = (returned[-1] - returned[0]) / (n - 1) * 1e3
                jax.block_until_ready(alone(base, sb, pos))
                t0 = time.perf_counter()
                for _ in range(20):
                    o = alone(base, sb, pos)
                jax.block_until_ready(o)
                sampler_ms = (time.perf_counter() - t0) / 20 * 1e3
                row[kind] = {"program_ms": program_ms, "dispatch_ms": dispatch_ms, "sampler_ms": sampler_ms}
                print(f"{variant} S={rows} {kind}: a call returns after {dispatch_ms:.2f} ms of a {program_ms:.2f} ms "
                      f"program; the sampler alone {sampler_ms:.3f} ms a call; compile {row['compile_s']:.1f} s",
                      flush=True)  # fmt: skip
            print(f"{variant} S={rows} HLO: {row['hlo']}", flush=True)
            results.append(row)
    sampling.top_k = TOP_K
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

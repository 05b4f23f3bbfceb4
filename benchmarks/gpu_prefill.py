"""Where a prefill-bound concurrency-64 run goes on one GPU: kiln's engine over an artifact (no HTTP), the bench's
load (N prompts of random ids at once, greedy, ignore_eos), every engine step timed on the host, and the served
prefill step program profiled per kernel on a batch recorded from the run.

    python benchmarks/gpu_prefill.py ARTIFACT --swap step_t2048 enable_triton_gemm:false --runs A,B,A,B \\
        --kernels A,B --json OUT.json

Each run draws fresh prompts (none in the prefix cache) and reports its output tok/s, the prefill phase (until the
step that computed the last prompt token returned) and the decode tail after it, and per kind of step (step_t<T> with
prefill tokens, multi-step decode_t<T>) the count, the device time per step (dispatch returned -> tokens read, the
device idle before: a step that waits for the previous one's tokens) and the host gap before it (previous tokens read
-> this dispatch returned, when the device has nothing queued), split into the engine's work before runner.dispatch,
the batch's building in it and the program's call (jax's dispatch, host -> device copies, XLA's launch); the first
run of each variant also prints its steps. A step dispatched before the previous one's tokens were read (queued, or
a decode run ahead) has no gap: its device time starts when that read returns. Variant B (C, ...: one per --swap) is
A with one program compiled again from its .exported under other XLA options (as gpu_swap_program.py does, in this
process: same weights and KV cache), put in the runner in place of A's; runs alternate as listed; "V@F" runs variant
V with the scheduler's FILL at F (kiln.serving.scheduler.FILL, read each step), "V+ahead" / "V-ahead" with the
engine's prefill_ahead on / off (the next step queued while one with prompt work behind it runs; plain V: the
engine's default).
Every line worth keeping is printed (a device call may bring back few files).

--agree N: the same prompts (fresh ones, the prefix cache off for them) with N output tokens through the engine with
prefill_ahead off, then on, then off with the prompts in reverse order: how many requests' greedy tokens are
identical to the first run's, and where the others first differ (the queued steps batch the prompts' pieces and
decodes differently, so bf16 sums may round otherwise; a random-weight model's near-ties can then flip a token: the
reversed run shows how often another batch mix alone does).

--kernels: the step program of the largest bucket called on the batch of the run's middle prefill step (recorded:
its chunks, decodes and prompt pieces as the scheduler made them), pipelined, then a jax.profiler trace of 3 calls
summed per kernel, per variant.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import ceilings, log  # noqa: E402
from gpu_profile import kernel_table  # noqa: E402
from gpu_swap_program import recompile  # noqa: E402

from kiln.compile import executable  # noqa: E402
from kiln.compile.convert import make_mesh  # noqa: E402
from kiln.models.batch import SeqChunk, make_batch  # noqa: E402
from kiln.serving import scheduler as scheduler_module  # noqa: E402
from kiln.serving.llm import LLM, build_engine  # noqa: E402
from kiln.serving.params import SamplingParams  # noqa: E402


def swapped_program(engine, art_path: Path, name: str, text: str):
    """Program `name` of the artifact compiled again from its .exported with the XLA options `text`, callable like
    the runner's programs, and its compile seconds."""
    from kiln.compile import artifact

    manifest = artifact.read_manifest(art_path, check=False)
    _, cfg, geom = artifact._parse(art_path, manifest)
    mesh = make_mesh(jax.devices()[: geom.tp], geom.tp)
    compiled, prog, _, seconds = recompile(art_path, manifest, cfg, geom, mesh, name, text)
    return executable.from_flat_compiled(compiled, prog), seconds


class Timeline:
    """Wraps a Runner's dispatch / dispatch_ahead / collect and records, per step, when each returned on the host."""

    def __init__(self, runner):
        self.runner, self.steps, self.recorded = runner, [], None
        self._dispatch, self._ahead, self._collect = runner.dispatch, runner.dispatch_ahead, runner.collect
        runner.dispatch, runner.dispatch_ahead, runner.collect = self.dispatch, self.dispatch_ahead, self.collect
        self.record_at = -1  # the index of the prefill step whose batch is kept (chunks) for --kernels
        self.current: dict = {}  # the row of the dispatch in progress (timed() writes its program call into it)

    def timed(self, program):
        """program, recording when its call began and returned in the current row (the call alone: jax's dispatch,
        the batch's host -> device copies, XLA's launch; runner.dispatch builds the batch before it)."""

        def call(*args):
            t0 = time.perf_counter()
            out = program(*args)
            self.current.update(t_program=t0, t_program_end=time.perf_counter())
            return out

        return call

    def _row(self, sched, ahead: bool) -> dict:
        prompt = sum(it.num_tokens for it in sched.seqs if it.start < it.seq.num_prompt)
        return {"bucket": self.runner.bucket(sched.num_tokens), "steps": sched.steps, "seqs": len(sched.seqs),
                "prompt_tokens": prompt, "decodes": len(sched.seqs) - sum(
                    1 for it in sched.seqs if it.start < it.seq.num_prompt), "ahead": ahead}  # fmt: skip

    def dispatch(self, sched):
        row = self._row(sched, False)
        if row["prompt_tokens"] and sum(1 for r in self.steps if r["prompt_tokens"]) == self.record_at:
            self.recorded = [SeqChunk(list(it.seq.tokens[it.start : it.start + it.num_tokens]), it.start,
                                      list(it.seq.table.pages)) for it in sched.seqs]  # fmt: skip
        self.current = row
        t0 = time.perf_counter()
        pending = self._dispatch(sched)
        row.update(t_call=t0, t_dispatched=time.perf_counter())
        pending.row = row
        self.steps.append(row)
        return pending

    def dispatch_ahead(self, sched, prev, rows):
        row = self._row(sched, True)
        self.current = row
        t0 = time.perf_counter()
        pending = self._ahead(sched, prev, rows)
        row.update(t_call=t0, t_dispatched=time.perf_counter())
        pending.row = row
        self.steps.append(row)
        return pending

    def collect(self, pending):
        t0 = time.perf_counter()
        out = self._collect(pending)
        pending.row.update(t_collect=t0, t_read=time.perf_counter())
        return out


def summarize(steps: list[dict], t0: float, wall: float, tokens: int) -> dict:
    """The run's phases and, per kind of step, count / device ms / host gap ms (see the module docstring)."""
    steps = [r for r in steps if "t_read" in r]  # a run-ahead step whose sequences all ended is never read
    last_prefill = max(i for i, r in enumerate(steps) if r["prompt_tokens"])
    kinds: dict[str, list] = collections.defaultdict(list)
    prev_read, queued = t0, 0
    for r in steps:
        queued += not r["ahead"] and r["t_dispatched"] < prev_read  # dispatched behind a step not read yet
        kind = f"decode_t{r['bucket']}" if r["steps"] > 1 else f"step_t{r['bucket']}"
        # a step dispatched before the previous one's tokens were read (run-ahead) is queued behind it: its device
        # time starts when the previous one's tokens came back
        start = max(r["t_dispatched"], prev_read)
        gap = max(0.0, r["t_dispatched"] - prev_read) if not r["ahead"] else 0.0
        # the gap's parts: the engine's work before runner.dispatch (recording the tokens, scheduling), the batch
        # built in runner.dispatch, the program's call
        program = r.get("t_program", r["t_call"])
        engine = 0.0 if r["ahead"] else max(0.0, r["t_call"] - prev_read)  # a run-ahead step: before that read
        parts = (engine, program - r["t_call"], r.get("t_program_end", program) - program)
        kinds[kind].append((r["t_read"] - start, gap, r["prompt_tokens"], r["decodes"], *parts))
        prev_read = r["t_read"]
    prefill_end = steps[last_prefill]["t_read"] - t0
    table = {}
    for kind, rows in sorted(kinds.items(), key=lambda kv: -sum(x[0] for x in kv[1])):
        dev = [x[0] for x in rows]
        table[kind] = {"count": len(rows), "device_ms_mean": 1e3 * float(np.mean(dev)),
                       "device_ms_median": 1e3 * float(np.median(dev)), "device_s": float(np.sum(dev)),
                       "host_gap_ms_mean": 1e3 * float(np.mean([x[1] for x in rows])),
                       "host_gap_s": float(np.sum([x[1] for x in rows])),
                       "prompt_tokens": int(sum(x[2] for x in rows)),
                       "decode_rows": int(sum(x[3] for x in rows)),
                       "engine_ms_mean": 1e3 * float(np.mean([x[4] for x in rows])),
                       "batch_ms_mean": 1e3 * float(np.mean([x[5] for x in rows])),
                       "call_ms_mean": 1e3 * float(np.mean([x[6] for x in rows]))}  # fmt: skip
    return {
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "prefill_phase_s": prefill_end,
        "decode_tail_s": wall - prefill_end,
        "steps": len(steps),
        "queued_steps": queued,
        "kinds": table,
    }


def one_run(llm: LLM, timeline: Timeline, n: int, input_len: int, output_len: int, seed: int, record_at: int = -1):
    rng = np.random.default_rng([seed, n, 7])
    vocab = min(128000, llm.engine.cfg.vocab_size)
    prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    timeline.steps, timeline.recorded, timeline.record_at = [], None, record_at
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.new_token_ids) for o in outs)
    assert tokens == n * output_len, f"{tokens} tokens, expected {n * output_len}"
    return summarize(timeline.steps, t0, wall, tokens), list(timeline.steps)


def agree(llm: LLM, n: int, input_len: int, output_len: int) -> dict:
    """--agree: the same n prompts, greedy, the prefix cache off, through prefill_ahead off, then on, then off again
    with the prompts in reverse order (another batch mix without the queueing: how often such a mix alone flips a
    token of this model, the baseline for off against on)."""
    engine = llm.engine
    rng = np.random.default_rng([12345, n])
    vocab = min(128000, engine.cfg.vocab_size)
    prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    bm, caching = engine.scheduler.bm, engine.scheduler.bm.enable_prefix_caching
    bm.enable_prefix_caching = False
    runs = {}
    try:
        for name, ahead, order in (("off", False, 1), ("on", True, 1), ("off_reversed", False, -1)):
            engine.prefill_ahead = ahead
            runs[name] = [o.new_token_ids for o in llm.generate(prompts[::order], params)][::order]
    finally:
        bm.enable_prefix_caching = caching
    out = {"requests": n}
    for other in ("on", "off_reversed"):
        pairs = list(zip(runs["off"], runs[other], strict=True))
        same = sum(a == b for a, b in pairs)
        first = sorted(next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y) for a, b in pairs if a != b)
        log(f"agreement, prefill_ahead off against {other}: {same} of {n} requests' {output_len} greedy tokens "
            f"identical; the others first differ at tokens {first}")  # fmt: skip
        out[other] = {"identical": same, "first_difference": first}
    return out


def kernel_profile(runner, program, bucket: int, chunks: list, top: int) -> dict:
    """The recorded batch through `program`: ms pipelined (10 calls) and the per-kernel sums of 3 traced calls."""
    s = runner.seqs_per_bucket[bucket]
    batch = jax.device_put(make_batch(chunks, runner.page_size, bucket, s, runner.max_pages_per_seq))
    sb = jax.device_put(runner.sampling_batch([], s))
    weights, kv = runner.weights, runner.kv
    for _ in range(2):
        out, kv = program(weights, kv, batch, sb)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(10):
        out, kv = program(weights, kv, batch, sb)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - t0) / 10 * 1e3
    rows, kernel_ms = [], 0.0
    if jax.devices()[0].platform == "gpu":  # (jax.profiler's plugin tracer crashed on this repository's CPU machine)
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(3):
                    out, kv = program(weights, kv, batch, sb)
                jax.block_until_ready(out)
            rows, kernel_ms = kernel_table(d, 3)
    runner.kv = kv
    classes = collections.Counter()
    for name, k_ms, _ in rows:
        low = name.lower()
        if "attention" in low:
            classes["attention"] += k_ms
        elif any(w in low for w in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "_dot", "matmul")):
            classes["GEMMs"] += k_ms
        else:
            classes["other"] += k_ms
    return {"ms": ms, "kernel_ms": kernel_ms, "classes": dict(classes), "kernels": rows[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--swap", nargs=2, action="append", default=[], metavar=("PROGRAM", "OPTIONS"),
                    help="variant B (again: C, D, ...): A with PROGRAM compiled under these XLA options "
                    "(FLAG:VALUE/...), e.g. step_t2048 enable_triton_gemm:false")  # fmt: skip
    ap.add_argument("--runs", default="A,B,A,B", help="the variants' runs in order (B, C, ...: --swap; V@F: variant "
                    "V with kiln.serving.scheduler.FILL = F; V+ahead / V-ahead: the engine's prefill_ahead on / "
                    "off)")  # fmt: skip
    ap.add_argument("--kernels", default="A,B", help="variants whose served prefill step is profiled per kernel")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=24)
    ap.add_argument("--record-step", type=int, default=16, help="which prefill step's batch --kernels replays (0 = "
                    "the first)")  # fmt: skip
    ap.add_argument("--agree", type=int, default=0, help="greedy tokens, prefill_ahead off against on: N out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    ceil = ceilings() if torch.cuda.is_available() else {"copy_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11,
                                                           "device": "none (a dry run)"}  # fmt: skip
    log(f"{ceil['device']}: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")  # fmt: skip
    t0 = time.perf_counter()
    engine = build_engine(args.artifact, warmup=True)
    llm = LLM(engine=engine)
    runner = engine.runner
    log(f"engine ready in {time.perf_counter() - t0:.1f} s; buckets {runner.buckets}")
    top_bucket = runner.buckets[-1]
    timeline = Timeline(runner)
    programs = {"A": (runner.programs, runner.decode)}
    for letter, (name, text) in zip("BCDEFG", args.swap, strict=False):
        prog, secs = swapped_program(engine, args.artifact, name, text)
        kind, t = name.rsplit("_t", 1)
        table = dict(runner.decode if kind == "decode" else runner.programs)
        table[int(t)] = prog
        programs[letter] = (runner.programs, table) if kind == "decode" else (table, runner.decode)
        log(f"{letter}: {name} compiled with {text} in {secs:.1f} s")

    # every program timed when the runner calls it (--kernels calls the unwrapped ones)
    timed = {
        v: tuple({t: timeline.timed(f) for t, f in table.items()} for table in pair) for v, pair in programs.items()
    }

    def use(variant: str):
        runner.programs, runner.decode = timed[variant]

    use("A")
    one_run(llm, timeline, 8, args.input_len, 16, seed=999)  # the first calls of a run's shapes, off the record
    runs, recorded = [], None
    fill, default_ahead = scheduler_module.FILL, engine.prefill_ahead
    for i, variant in enumerate(args.runs.split(",")):
        name, _, fill_text = variant.partition("@")  # A@0.5: variant A with the scheduler's FILL at 0.5
        letter, sign, ahead = name[:1], name[1:2], name[2:]  # A+ahead / A-ahead: prefill_ahead on / off
        if ahead not in ("", "ahead") or sign not in ("", "+", "-"):
            raise SystemExit(f"--runs: {variant!r} is not V, V+ahead, V-ahead or one of them @FILL")
        use(letter)
        scheduler_module.FILL = float(fill_text) if fill_text else fill
        engine.prefill_ahead = {"+": True, "-": False}.get(sign, default_ahead)
        summary, steps = one_run(llm, timeline, args.num_prompts, args.input_len, args.output_len, seed=i,
                                 record_at=args.record_step if recorded is None else -1)  # fmt: skip
        recorded = recorded or timeline.recorded
        summary["variant"] = variant
        runs.append(summary)
        k = summary["kinds"]
        parts = "; ".join(f"{n} x{v['count']} {v['device_ms_mean']:.1f} ms (gap {v['host_gap_ms_mean']:.2f}: "
                          f"engine {v['engine_ms_mean']:.2f}, batch {v['batch_ms_mean']:.2f}, call "
                          f"{v['call_ms_mean']:.2f})" for n, v in k.items())  # fmt: skip
        log(f"run {i} {variant}: {summary['output_tokens_per_s']:.0f} tok/s, {summary['wall_s']:.3f} s = prefill "
            f"phase {summary['prefill_phase_s']:.3f} + tail {summary['decode_tail_s']:.3f}; "
            f"{summary['queued_steps']} steps queued; {parts}")  # fmt: skip
        if all(r["variant"] != variant for r in runs[:-1]):  # the first run of each variant
            log(f"  steps of run {i} (bucket, steps, prompt tokens, decodes, device ms, gap ms, program call ms):")
            prev = None
            for r in (r for r in steps if "t_read" in r):
                start = max(r["t_dispatched"], prev if prev is not None else r["t_call"])
                gap = 0.0 if prev is None or r["ahead"] else max(0.0, r["t_dispatched"] - prev)
                call = r.get("t_program_end", 0.0) - r.get("t_program", 0.0)
                log(f"    {r['bucket']:5d} x{r['steps']} {r['prompt_tokens']:5d} {r['decodes']:3d} "
                    f"{(r['t_read'] - start) * 1e3:7.2f} {gap * 1e3:6.2f} {call * 1e3:6.2f}")  # fmt: skip
                prev = r["t_read"]
    agreement = agree(llm, args.num_prompts, args.input_len, args.agree) if args.agree else None
    engine.prefill_ahead = default_ahead
    profiles = {}
    if recorded:
        log(f"the recorded prefill step: {sum(len(c.tokens) for c in recorded)} tokens in {len(recorded)} chunks "
            f"({sum(1 for c in recorded if len(c.tokens) == 1)} decodes)")  # fmt: skip
        for variant in filter(None, args.kernels.split(",")):
            if variant not in programs:  # (a letter of --swap; V@F runs profile as V)
                continue
            prof = kernel_profile(runner, programs[variant][0][top_bucket], top_bucket, recorded, args.top)
            profiles[variant] = prof
            classes = ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["classes"].items(), key=lambda kv: -kv[1]))
            log(f"step_t{top_bucket} {variant}: {prof['ms']:.2f} ms pipelined, kernels {prof['kernel_ms']:.2f} ms "
                f"({classes})")  # fmt: skip
            for name, k_ms, n in prof["kernels"]:
                log(f"    {k_ms:7.3f} ms  x{n:<4d} {name[:150]}")
    by = collections.defaultdict(list)
    for r in runs:
        by[r["variant"]].append(r["output_tokens_per_s"])
    log("tok/s by variant: " + "; ".join(f"{v}: {', '.join(f'{x:.0f}' for x in xs)}" for v, xs in by.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "args": vars(args) | {"artifact": str(args.artifact)},
                                               "runs": runs, "profiles": profiles, "agreement": agreement},
                                              indent=1, default=str))  # fmt: skip


if __name__ == "__main__":
    main()

"""The H200's concurrency-64 run emulated on the CPU: kiln's Engine, Scheduler, Runner and (--served) its HTTP app
driven by kiln bench, over fake step programs with the artifact's argument tree (Llama-3-8B: 32 layers, buckets
16/64/256/2048, S = min(T, 256), 8-step decodes, 22500 KV pages of 16) whose device time is emulated: each program
ends --device-ms after it starts (it starts when dispatched or when the one before it ends), and collect() sleeps
until then, as a read of a GPU's tokens waits. So the host's work, the scheduler's mix and the HTTP path run for real,
on the device's timing, without a device: what a change to them does to the run can be measured here first.

    python benchmarks/gpu_emulate.py                       # the engine alone (LLM.generate), 3 runs
    python benchmarks/gpu_emulate.py --served              # kiln serve's app + kiln bench, 3 runs
    python benchmarks/gpu_emulate.py --launch-ms 6 --fill 0.5
    python benchmarks/gpu_emulate.py --launch-ms 5 --runs 6 --prefill-ahead off,on   # A/B, alternated

The default device times are issue 16's session-14 H200 measurements (gpu_prefill.py, the Llama-3-8B artifact, bf16:
step_t2048 48.0 ms, step_t256 10.4, decode_t64 54.7 for 8 tokens, decode_t16 45.4); --launch-ms adds host time
inside every program call (held like a launch: a busy loop with the GIL), for the part of the H200's ~8.5 ms gap
between prefill steps that this CPU's fake calls lack. --fill sets the scheduler's FILL; --prefill-ahead on,off,...
sets Engine.prefill_ahead per run, cycling (default: the engine's default). Each run prints its time,
the engine's timeline (gpu_prefill.summarize: prefill phase, tail, per kind device ms and host gap) and, served,
kiln bench's figures and when the first request reached the server and the engine (one machine's monotonic clock).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_prefill import Timeline, summarize  # noqa: E402

from kiln.models.batch import Batch, KVCache  # noqa: E402
from kiln.models.sampling import SamplingBatch, StepOut  # noqa: E402
from kiln.serving import scheduler as scheduler_module  # noqa: E402
from kiln.serving.block_manager import BlockManager  # noqa: E402
from kiln.serving.engine import Engine  # noqa: E402
from kiln.serving.llm import LLM, AsyncLLM  # noqa: E402
from kiln.serving.params import SamplingParams  # noqa: E402
from kiln.serving.runner import Runner  # noqa: E402
from kiln.serving.scheduler import Scheduler  # noqa: E402

V, LAYERS, MAX_PAGES, PAGES, PAGE = 128256, 32, 132, 22500, 16
BUCKETS, SEQS = (16, 64, 256, 1024, 2048), {16: 16, 64: 64, 256: 256, 1024: 256, 2048: 256}
DEVICE_MS = {"step_t16": 5.0, "step_t64": 8.0, "step_t256": 10.4, "step_t1024": 22.0, "step_t2048": 48.0,
             "decode_t16": 45.4, "decode_t64": 54.7, "decode_t256": 150.0}  # fmt: skip
BENCH = """import sys, time
from kiln.serving import bench_cmd
run_level = bench_cmd.run_level
async def timed(*a, **k):
    print("START", time.perf_counter(), flush=True)
    report = await run_level(*a, **k)
    print("END", time.perf_counter(), flush=True)
    return report
bench_cmd.run_level = timed
from kiln.serving.cli import main
sys.exit(main(sys.argv[1:]))
"""


def word_tokenizer(folder: Path):
    """gpu_e2e.write_checkpoint's tokenizer (one word a token id), as kiln's Tokenizer."""
    from gpu_e2e import write_word_tokenizer

    from kiln.serving.tokenizer import Tokenizer as KilnTokenizer

    write_word_tokenizer(folder, V)
    return KilnTokenizer.from_source(folder)


class FakeWeights(dict):
    """A pytree of 32 layers x 7 tiny leaves (the artifact's leaf count) with the `embed` the Runner reads."""

    embed = property(lambda self: self["embed"])


jax.tree_util.register_pytree_node(FakeWeights, lambda w: ((dict(w),), None), lambda _, c: FakeWeights(c[0]))


def fake_engine(device_ms: dict[str, float], launch_ms: float, tokenizer) -> Engine:
    layer = {n: jnp.zeros((8,), jnp.bfloat16) for n in "abcdefg"}
    weights = FakeWeights(embed=jnp.zeros((V, 1), jnp.bfloat16), layers=[dict(layer) for _ in range(LAYERS)])
    kv = KVCache([jnp.zeros((1, PAGES, 1, 1), jnp.bfloat16) for _ in range(LAYERS)],
                 [jnp.zeros((1, PAGES, 1, 1), jnp.bfloat16) for _ in range(LAYERS)])  # fmt: skip

    def program(t: int, steps: int):
        lead = (steps, SEQS[t]) if steps > 1 else (SEQS[t],)

        def fn(w, kv, batch, sampling):
            top = jnp.zeros((*lead, 20), jnp.int32)
            out = StepOut(tokens=jnp.full(lead, 7, jnp.int32), logprobs=jnp.zeros(lead, jnp.float32), top_ids=top,
                          top_logprobs=top.astype(jnp.float32))  # fmt: skip
            return out, kv

        abstract = (Batch.abstract(t, SEQS[t], MAX_PAGES), SamplingBatch.abstract(SEQS[t], V))
        compiled = jax.jit(fn, donate_argnums=(1,)).lower(weights, kv, *abstract).compile()

        def call(*args):
            end = time.perf_counter() + launch_ms / 1e3
            while time.perf_counter() < end:  # the launch's host time, the GIL held
                pass
            return compiled(*args)

        return call

    runner = Runner({t: program(t, 1) for t in BUCKETS}, weights, kv, page_size=PAGE, max_num_seqs=256,
                    max_pages_per_seq=MAX_PAGES, buckets=BUCKETS, seqs_per_bucket=SEQS,
                    decode={t: program(t, 8) for t in (16, 64, 256)})  # fmt: skip
    device_free = [0.0]  # when the emulated device finishes what is queued
    dispatch, ahead, collect = runner.dispatch, runner.dispatch_ahead, runner.collect

    def queued(pending, kind: str):
        start = max(time.perf_counter(), device_free[0])
        device_free[0] = pending.done_at = start + device_ms[f"{kind}_t{pending.bucket}"] / 1e3
        return pending

    def read(pending):
        wait = pending.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return collect(pending)

    runner.dispatch = lambda sched: queued(dispatch(sched), "decode" if sched.steps > 1 else "step")
    runner.dispatch_ahead = lambda sched, prev, rows: queued(ahead(sched, prev, rows), "decode")
    runner.collect = read
    scheduler = Scheduler(BlockManager(PAGES, PAGE), max_num_seqs=256, max_num_batched_tokens=BUCKETS[-1],
                          max_model_len=2112, buckets=BUCKETS)  # fmt: skip
    return Engine(runner, scheduler, cfg=SimpleNamespace(vocab_size=V), tokenizer=tokenizer, model_name="emulated",
                  decode_steps=8)  # fmt: skip


def timeline_line(timeline: Timeline, tokens: int) -> str:
    steps = [r for r in timeline.steps if "t_read" in r]
    t0, t1 = steps[0]["t_call"], max(r["t_read"] for r in steps)
    s = summarize(steps, t0, t1 - t0, tokens)
    kinds = "; ".join(f"{k} x{v['count']} {v['device_ms_mean']:.1f} ms (gap {v['host_gap_ms_mean']:.2f}: engine "
                      f"{v['engine_ms_mean']:.2f}, batch {v['batch_ms_mean']:.2f}, call {v['call_ms_mean']:.2f})"
                      for k, v in s["kinds"].items())  # fmt: skip
    return (
        f"engine timeline {s['wall_s']:.3f} s (first dispatch -> last read) = prefill phase "
        f"{s['prefill_phase_s']:.3f} + tail {s['decode_tail_s']:.3f}; {s['queued_steps']} steps queued; {kinds}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served", action="store_true", help="through kiln serve's app and kiln bench")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--launch-ms", type=float, default=0.0, help="host time held inside every program call")
    ap.add_argument("--device-ms", default="", help="KIND_T=MS,... overriding the H200's (e.g. step_t2048=40)")
    ap.add_argument("--fill", type=float, default=None, help="kiln.serving.scheduler.FILL for this run")
    ap.add_argument("--prefill-ahead", default="", help="on / off per run, cycling (e.g. off,on: alternated); "
                    "default: Engine's default")  # fmt: skip
    args = ap.parse_args()
    device_ms = dict(DEVICE_MS)
    device_ms.update({k: float(v) for k, v in (x.split("=") for x in args.device_ms.split(",") if x)})
    if args.fill is not None:
        scheduler_module.FILL = args.fill
    with tempfile.TemporaryDirectory() as d:
        engine = fake_engine(device_ms, args.launch_ms, word_tokenizer(Path(d)))
    ahead = [{"on": True, "off": False}[x] for x in args.prefill_ahead.split(",") if x] or [engine.prefill_ahead]
    timeline = Timeline(engine.runner)
    runner = engine.runner
    runner.programs = {t: timeline.timed(f) for t, f in runner.programs.items()}
    runner.decode = {t: timeline.timed(f) for t, f in runner.decode.items()}
    arrivals: list[float] = []
    add = engine.add_request
    engine.add_request = lambda *a, **k: (arrivals.append(time.perf_counter()), add(*a, **k))[1]
    tokens = args.num_prompts * args.output_len
    print(f"device ms {device_ms}; launch {args.launch_ms} ms; FILL {scheduler_module.FILL}; "
          f"prefill_ahead per run {ahead}", flush=True)  # fmt: skip
    if not args.served:
        llm = LLM(engine=engine)
        rng = np.random.default_rng(1)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        for i in range(args.runs):
            prompts = [rng.integers(0, 128000, args.input_len).tolist() for _ in range(args.num_prompts)]
            timeline.steps, engine.prefill_ahead = [], ahead[i % len(ahead)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            assert all(len(o.new_token_ids) == args.output_len for o in outs), "a request lost tokens"
            print(f"run {i} ahead {'on' if engine.prefill_ahead else 'off'}: {wall:.3f} s, {tokens / wall:.0f} "
                  f"tok/s; {timeline_line(timeline, tokens)}", flush=True)  # fmt: skip
        return
    import uvicorn

    from kiln.serving.app import ServerConfig, build_app

    app = build_app(AsyncLLM(engine), ServerConfig())
    received: list[float] = []

    async def asgi(scope, receive, send):  # when each completion request's headers reached the app
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            received.append(time.perf_counter())
        await app(scope, receive, send)

    server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.runs):
            timeline.steps, received[:], arrivals[:] = [], [], []
            engine.prefill_ahead = ahead[i % len(ahead)]  # (read by the engine's thread at its next step)
            out = Path(d) / f"bench{i}.json"
            cmd = [sys.executable, "-c", BENCH, "bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--vocab-size",
                   "128000", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--concurrency", str(args.num_prompts), "--num-prompts", str(args.num_prompts), "--seed",
                   str(100 + i), "--json", str(out)]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if not out.exists():
                print(f"run {i}: kiln bench failed: {res.stderr[-2000:]}", flush=True)
                continue
            level = json.loads(out.read_text())["levels"][0]
            clock = {
                k: float(v) for k, v in (ln.split()[:2] for ln in res.stdout.splitlines() if ln[:3] in ("STA", "END"))
            }
            last_read = max(r["t_read"] for r in timeline.steps if "t_read" in r)
            on = "on" if engine.prefill_ahead else "off"
            print(f"run {i} ahead {on}: {level['duration_s']:.3f} s, {level['output_tokens_per_s']:.0f} tok/s, "
                  f"TTFT p50 / p99 {level['ttft_ms']['p50']:.0f} / {level['ttft_ms']['p99']:.0f} ms, TPOT p50 / p99 "
                  f"{level['tpot_ms']['p50']:.2f} / {level['tpot_ms']['p99']:.2f} ms; bench start -> first request "
                  f"at the app {1e3 * (received[0] - clock['START']):.0f} ms (last "
                  f"{1e3 * (received[-1] - clock['START']):.0f}) -> first in the engine "
                  f"{1e3 * (arrivals[0] - clock['START']):.0f} ms (last {1e3 * (arrivals[-1] - clock['START']):.0f}); "
                  f"last tokens read -> bench end {1e3 * (clock['END'] - last_read):.0f} ms", flush=True)  # fmt: skip
            print(f"  {timeline_line(timeline, tokens)}", flush=True)
    server.should_exit = True


if __name__ == "__main__":
    main()

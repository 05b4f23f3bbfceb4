"""Tensor parallelism on two GPUs of one host, and the one-GPU end-to-end figures, in one device call.

On a machine with two GPUs (the device tool's nvidia-h200-x2; NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and
the others are inherited, never changed), for a Llama-3-8B-shaped model with random bf16 weights:

1. each GPU's copy bandwidth, GPU 0's bf16 matmul rate, and the all-reduce time of one layer's activations
   (B x 4096 bf16 over 2 GPUs, XLA/NCCL) at the batch sizes used;
2. kiln compile for cuda with tp=1 (GPU 0) and tp=2 (both), in parallel;
3. correctness: tp=2 against tp=1, greedy tokens over 64 steps on several prompts, top logprobs compared;
4. kiln serve + kiln bench: tp=1 at every --concurrency (input 1024, output 256) against the roofline of
   gpu_e2e.py, then tp=2 at --tp-concurrency, with the speed-up over tp=1;
5. optionally (--hf) the Hugging Face transformers peer (static cache + torch.compile) on GPU 1 while tp=1 runs on
   GPU 0.

    python benchmarks/tp_gpu.py --out /tmp/tp --hf
    python benchmarks/tp_gpu.py --dry-run-cpu --out /tmp/tp     # the same flow on fake CPU devices, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_e2e  # noqa: E402

KILN = [sys.executable, "-m", "kiln.serving.cli"]

ALLREDUCE = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
hidden, sizes = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")]
mesh = Mesh(jax.devices()[:2], ("tp",))
out = {}
reps = 64
for b in sizes:
    def body(x):
        for _ in range(reps):  # unrolled: a fori_loop would add a while loop's per-iteration host round trip
            x = jax.lax.psum(x, "tp") * 0.5
        return x
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    dtype = jnp.float32 if jax.devices()[0].platform == "cpu" else jnp.bfloat16
    x0 = np.concatenate([np.full((b, hidden), 1.0), np.full((b, hidden), 3.0)]).astype(dtype)
    x = jax.device_put(x0, jax.sharding.NamedSharding(mesh, P("tp")))
    got = np.asarray(f(x).astype(jnp.float32))
    if not np.allclose(got, 2.0):  # (1 + 3) / 2 on both devices, every repetition
        raise SystemExit(f"wrong all-reduce result at B={b}: {got.min()}..{got.max()}")
    t = []
    for _ in range(5):
        t0 = time.perf_counter(); f(x).block_until_ready(); t.append((time.perf_counter() - t0) / reps)
    out[b] = sorted(t)[2] * 1e6
print(json.dumps(out))
"""

# The all-reduce variants tried by --allreduce-variants: name -> environment changes. None of them turns NVLink
# multicast on: NCCL's protocols and XLA's one-shot kernel (peer memory writes and a signal barrier; XLA builds it with
# multimem off) only.
VARIANTS = {
    "nccl default": {},
    "NCCL_PROTO=LL, 1 channel": {"NCCL_PROTO": "LL", "NCCL_MAX_NCHANNELS": "1"},
    "no command buffers": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "no command buffers, NCCL_PROTO=LL": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=", "NCCL_PROTO": "LL"},
    "no command buffers, xla one-shot kernel": {
        "XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
    },
}

GREEDY = """
import json, sys
from kiln.serving.llm import LLM
from kiln.serving.params import SamplingParams
import numpy as np
art, n_prompts, steps, vocab, longest = sys.argv[1], *map(int, sys.argv[2:6])
rng = np.random.default_rng(0)
prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(8, longest, n_prompts)]
llm = LLM(art)
p = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=5)
outs = llm.generate(prompts, p)
print(json.dumps([{"tokens": o.new_token_ids,
                   "top": [[[t, lp] for t, lp in x.top] for x in o.logprobs]} for o in outs]))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


EXTRA_ENV: dict[str, str] = {}  # --env / the chosen all-reduce variant, for every process this script starts


def env_for(devices: str | None, cpu_devices: int | None = None) -> dict:
    env = dict(os.environ)  # NCCL_NVLS_ENABLE=0 and the other multicast switches are inherited unchanged
    for k, v in EXTRA_ENV.items():
        env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # several JAX processes share GPU 0 (compiles run in parallel)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if cpu_devices:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}").strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


def json_of(cmd: list[str], env: dict, timeout: float) -> object:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(a: list[dict], b: list[dict]) -> dict:
    """Greedy agreement of tp=2 (b) with tp=1 (a): steps equal before the first divergence, and the largest
    difference of the chosen token's logprob over the agreeing steps."""
    same, total, max_diff = 0, 0, 0.0
    first_div = []
    for x, y in zip(a, b, strict=True):
        n = len(x["tokens"])
        total += n
        k = next((i for i in range(n) if x["tokens"][i] != y["tokens"][i]), n)
        same += k
        first_div.append(k)
        for i in range(k):
            lx, ly = dict((t, lp) for t, lp in x["top"][i]), dict((t, lp) for t, lp in y["top"][i])
            t = x["tokens"][i]
            if t in lx and t in ly:
                max_diff = max(max_diff, abs(lx[t] - ly[t]))
    return {"agreeing_steps": same, "steps": total, "first_divergence": first_div, "max_logprob_diff": max_diff}


def serve_and_bench(art: Path, env: dict, args, levels: list[int], tag: str, out: Path) -> list[dict]:
    server, port, ready_s = gpu_e2e.start_server(art, env, "--no-access-log")
    results = []
    try:
        log(f"{tag}: kiln serve ready in {ready_s:.1f} s")
        for c in levels:
            res = out / f"bench_{tag}_c{c}.json"
            subprocess.run([*KILN, "bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--vocab-size",
                            str(args.vocab), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                            "--concurrency", str(c), "--num-prompts", str(max(c, args.min_prompts)),
                            "--json", str(res)], check=False, timeout=args.bench_timeout)  # fmt: skip
            if res.exists():
                results.append(json.loads(res.read_text())["levels"][0])
    finally:
        server.terminate()
        server.wait(60)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/kiln-tp")
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--tp-concurrency", default="1,64")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--buckets", default="16,256,2048")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-tokens", type=int, default=None)
    ap.add_argument("--bench-timeout", type=float, default=240)
    ap.add_argument("--hf", action="store_true", help="run the transformers peer on GPU 1 during the tp=1 phase")
    ap.add_argument("--hf-budget-s", type=float, default=200)
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny model, cpu target, 2 fake CPU devices")
    ap.add_argument("--allreduce-variants", action="store_true",
                    help="time the all-reduce under each VARIANTS environment first, and run the rest with the fastest "
                         "correct one at the smallest batch")  # fmt: skip
    ap.add_argument("--only-tp2", action="store_true", help="compile and bench tp=2 only (tp=1 from an earlier run)")
    ap.add_argument("--skip-greedy", action="store_true", help="no tp=2 vs tp=1 greedy comparison")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process started (repeatable)")
    args = ap.parse_args()
    EXTRA_ENV.update(kv.split("=", 1) for kv in args.env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"command": "python benchmarks/tp_gpu.py " + " ".join(sys.argv[1:])}
    levels = [int(c) for c in args.concurrency.split(",")]
    tp_levels = [int(c) for c in args.tp_concurrency.split(",")]
    dry = args.dry_run_cpu
    target = "cpu" if dry else "cuda"
    hidden = 64 if dry else 4096
    args.vocab = 250 if dry else 128000

    # 1. ceilings and all-reduce
    if dry:
        report["ceilings"] = ceil = {"copy_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11, "device": "cpu (dry run)"}
    else:
        import torch

        report["ceilings"] = ceil = gpu_e2e.ceilings()
        report["copy_bandwidth_per_gpu"] = []
        for d in range(torch.cuda.device_count()):
            with torch.cuda.device(d):
                report["copy_bandwidth_per_gpu"].append(gpu_e2e.ceilings(matmul=False)["copy_bytes_per_s"])
        log(f"copy bandwidth per GPU (TB/s): {[round(b / 1e12, 2) for b in report['copy_bandwidth_per_gpu']]}; "
            f"matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")  # fmt: skip
    sizes = sorted(set(tp_levels + [2048]))
    ar_cmd = [sys.executable, "-c", ALLREDUCE, str(hidden), ",".join(map(str, sizes))]
    if args.allreduce_variants:
        report["allreduce_variants"] = {}
        base = dict(EXTRA_ENV)
        for name, changes in VARIANTS.items():
            EXTRA_ENV.clear()
            EXTRA_ENV.update(base | changes)
            try:
                report["allreduce_variants"][name] = res = json_of(ar_cmd, env_for(None, 2 if dry else None), 300)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                res = {"error": str(e)[-300:]}
            log(f"all-reduce {name}: {res}")
        ok = {n: r for n, r in report["allreduce_variants"].items() if "error" not in r}
        best = min(ok, key=lambda n: ok[n][str(min(sizes))])
        EXTRA_ENV.clear()
        EXTRA_ENV.update(base | VARIANTS[best])
        report["allreduce_chosen"] = best
        log(f"chosen for the rest of the run: {best}")
    report["allreduce_us"] = json_of(ar_cmd, env_for(None, 2 if dry else None), 300)
    log(f"all-reduce of B x {hidden} activations over 2 devices (us): {report['allreduce_us']}")

    # 2. checkpoint and compiles
    if dry:
        sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
        from tiny_models import make_model

        ckpt = out / "tiny-llama"
        if not (ckpt / "config.json").exists():
            make_model("llama", ckpt)
            from tiny_tokenizer import write_tokenizer

            write_tokenizer(ckpt)
    else:
        ckpt = out / "llama3-8b-random"
        t0 = time.time()
        gpu_e2e.write_checkpoint(ckpt)
        log(f"checkpoint written in {time.time() - t0:.0f} s")
    hf_proc = None
    if args.hf and not dry:
        hf_proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "gpu_e2e.py"), "--phase", "hf",
                                    "--out", str(out), "--concurrency", args.concurrency, "--input-len",
                                    str(args.input_len), "--output-len", str(args.output_len), "--hf-budget-s",
                                    str(args.hf_budget_s), "--json", str(out / "hf.json")],
                                   env=env_for("1"))  # fmt: skip
    max_len = args.input_len + args.output_len + 64
    compiles = {}
    t0 = time.time()
    for tp, devices in ((2, "0,1"),) if args.only_tp2 else ((1, "0"), (2, "0,1")):
        cmd = [*KILN, "compile", "--model", str(ckpt), "--target", target, "--out", str(out / f"art_tp{tp}"),
               "--tp", str(tp), "--max-model-len", str(max_len), "--buckets", args.buckets,
               "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
        if args.kv_tokens:
            cmd += ["--kv-tokens", str(args.kv_tokens)]
        env = env_for(None if dry else devices, 2 if dry else None)
        compiles[tp] = subprocess.Popen(cmd, env=env)
    for tp, p in compiles.items():
        if p.wait() != 0:
            raise SystemExit(f"kiln compile tp={tp} failed")
    report["compile_s"] = time.time() - t0
    log(f"compiled tp=1 and tp=2 in {report['compile_s']:.0f} s")

    # 3 + 4. tp=1 on GPU 0: greedy reference, then the server
    longest = min(200, max_len - 64 - 1)
    env1 = env_for(None if dry else "0", 2 if dry else None)
    greedy_cmd = [sys.executable, "-c", GREEDY, "ART", "4", "64", str(args.vocab), str(longest)]
    greedy = {tp: None for tp in (1, 2)}
    if not args.skip_greedy:
        greedy[1] = json_of([str(out / "art_tp1") if a == "ART" else a for a in greedy_cmd], env1, 300)
    report["tp1"] = [] if args.only_tp2 else serve_and_bench(out / "art_tp1", env1, args, levels, "tp1", out)
    if hf_proc is not None:
        try:
            hf_proc.wait(timeout=max(10, args.hf_budget_s))
        except subprocess.TimeoutExpired:
            hf_proc.kill()
            log("HF peer killed: over its budget")
        if (out / "hf.json").exists():
            report["hf"] = json.loads((out / "hf.json").read_text())
    env2 = env_for(None if dry else "0,1", 2 if dry else None)
    if not args.skip_greedy:
        greedy[2] = json_of([str(out / "art_tp2") if a == "ART" else a for a in greedy_cmd], env2, 300)
        report["agreement"] = compare(greedy[1], greedy[2])
        log(f"tp=2 vs tp=1 greedy: {report['agreement']}")
    report["tp2"] = serve_and_bench(out / "art_tp2", env2, args, tp_levels, "tp2", out)

    # 5. tables
    print("\n## one GPU (tp=1): kiln vs the roofline")
    print("| concurrency | out tok/s | roofline tok/s | fraction | TPOT p50 ms | roofline TPOT ms | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in report["tp1"]:
        roof = gpu_e2e.roofline(ceil, r["concurrency"], args.input_len, args.output_len)
        print(f"| {r['concurrency']} | {r['output_tokens_per_s']:.0f} | {roof['output_tokens_per_s']:.0f} | "
              f"{r['output_tokens_per_s'] / roof['output_tokens_per_s']:.2f} | {r['tpot_ms']['p50']:.2f} | "
              f"{roof['tpot_ms']:.2f} | {r['ttft_ms']['p50']:.0f} |")  # fmt: skip
    if report.get("hf"):
        print("\n## peer: transformers, static cache + torch.compile, same weights/batch/lengths (GPU 1)")
        print("| batch | HF out tok/s | kiln tp=1 out tok/s | kiln / HF |")
        print("|---|---|---|---|")
        kiln_by_c = {r["concurrency"]: r["output_tokens_per_s"] for r in report["tp1"]}
        for r in report["hf"]["levels"]:
            k = kiln_by_c.get(r["concurrency"])
            ratio = f"{k / r['output_tokens_per_s']:.2f}" if k else "-"
            print(f"| {r['concurrency']} | {r['output_tokens_per_s']:.0f} | {k or 0:.0f} | {ratio} |")
    print("\n## tp=2 vs tp=1")
    print("| concurrency | tp=1 out tok/s | tp=2 out tok/s | speed-up | tp=1 TPOT p50 ms | tp=2 TPOT p50 ms |")
    print("|---|---|---|---|---|---|")
    by1 = {r["concurrency"]: r for r in report["tp1"]}
    for r in report["tp2"]:
        a = by1.get(r["concurrency"])
        if a:
            print(f"| {r['concurrency']} | {a['output_tokens_per_s']:.0f} | {r['output_tokens_per_s']:.0f} | "
                  f"{r['output_tokens_per_s'] / a['output_tokens_per_s']:.2f} | {a['tpot_ms']['p50']:.2f} | "
                  f"{r['tpot_ms']['p50']:.2f} |")  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=2))
    log("report written to " + str(out / "report.json"))


if __name__ == "__main__":
    main()

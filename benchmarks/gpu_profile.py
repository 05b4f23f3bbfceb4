"""Where a decode step's time goes on one GPU: a Llama-3-8B-shaped model with random weights made on the device
(no checkpoint, no artifact), the jitted step and multi-step decode programs timed at each concurrency, and a
jax.profiler trace of each summed per kernel (which kernels take the step's time, and how much of the step no
kernel runs: launch gaps and host waits).

    python benchmarks/gpu_profile.py --concurrency 1,64,256 [--quantize int4] [--json OUT]
    python benchmarks/gpu_profile.py --concurrency 1,64 --programs multi --variants "separate,fused,fused;block_k=128"

A variant is a weight layout (separate q/k/v and gate/up weights, or fused: kiln.models.transformer.fuse_linears,
what artifacts store), then optionally ";qkv=split" (the fused layout's q, k and v cut apart by XLA instead of read
out of the one array by pallas_gpu.paged_attention_qkv) and ";KEY=N" keyword arguments of pallas_gpu.paged_attention
(num_splits, block_k, num_warps, num_stages, rows_small; decode=0 runs the general kernel in the decode programs
instead of the decode-only one); a variant that forces num_splits runs at concurrencies up to 16 only. ";sampler=M"
traces the programs with the sample() of the module benchmarks/M.py (a past sampler, e.g. `git show
7b7a036:models/sampling.py > benchmarks/sampler_7b7a036.py`), or "greedy" (sampling.sample_greedy: no cond);
";cb=FUSION/CUBLAS/CONDITIONAL" compiles them with that xla_gpu_enable_command_buffer ("/" for ","; the whole list:
XLA takes no "+TYPE" there); ";topk_rows=N" traces the sampler's lax.top_k calls in row blocks of N (the S = 16
TopK was recorded in the CUDA graph on the H200, the S = 64 one not: does S = 64 as four blocks of 16 become so?);
";max_c=N" runs a variant at concurrencies up to N only; ";min_t=N" makes N the smallest bucket (default 16, the
cuda target's: c = 1 runs in 16 rows; min_t=1: in one, as a 1-token bucket would). ";rope=kernel" / ";rope=xla": q
and k rotated by the decode kernel or by XLA before it (pallas_gpu.ROPE_IN_KERNEL on / off; off by default);
";xla=FLAG:VALUE/..." compiles the programs with those XLA options (the xla_gpu_ prefix may be left out;
true/false/integers typed) instead of the program's default (pallas_gpu.DECODE_XLA_OPTIONS / STEP_XLA_OPTIONS of its
bucket, what kiln compile uses).
";kvdot=f16" / ";kvdot=q": --kv-dtype fp8's attention dots in float16 / q's dtype (pallas_gpu.FP8_CACHE_DOT).
";narrow=xla" runs --quantize fp8's or int4's decode dots through XLA (quant's weight-only GEMM / grouped or
dequantized dot) instead of the Pallas kernel (kiln.models.kernels.pallas_gpu_narrow), ";narrow=pallas" the kernel
up to 128 rows whatever quant.PALLAS_MAX_ROWS says; ";gu=1" lays gate|up out as one group ([all gate | all up]);
";fp8_wo=N": quant.FP8_WEIGHT_ONLY_MAX_ROWS (--quantize fp8's dots weight-only up to N rows, fp8 x fp8 above);
";fp8_2t=N": quant.FP8_TWO_TERM_MAX_ROWS (those fp8 x fp8 dots' rows as two fp8 terms up to N rows, one above).
--narrow-configs JSON sets the kernel's configs (gpu_fp8.py --pallas --json's output) before the programs trace.
(The lead's topk_rows=16 check of session 8 ran after "fused" in the same process before jax.clear_caches() was
called per variant, so it reran the plain top_k.)
--hlo DIR writes each variant's compiled decode program at the first concurrency (and counts its conditionals and
loops), and the fusion behind each listed kernel is printed.

Besides the time per token, each program's dispatch time is printed: how long the call takes to return while the
previous call's program is still queued. JAX dispatch is asynchronous, but an XLA-GPU conditional or loop that is not
recorded in a CUDA graph copies its predicate to the host, which waits there for the device: a program with one in
every step returns only as it ends. (The time per token counts the first call's dispatch too: 3 calls of an 8-step
program, so a 5.7 ms first dispatch adds ~0.24 ms a token.)

The roofline beside each figure is what benchmarks/gpu_e2e.py uses: weight bytes + the KV bytes of every sequence
at the context, over the copy bandwidth measured in the same run.

--prefill T times the step program on T prompt tokens instead (T / 1024 fresh prompts, the first step of a c = 64
run; S = 256 as the artifact's step program), its floor the matmul FLOPs (prefill_flops) over the matmul rate
measured in the same run (--quantize fp8: torch._scaled_mm's fp8 rate). ";fp8_out=float32" makes float32 the result
dtype of the one-term fp8 x fp8 dots (quant.FP8_DOT_OUT; by default x's, bf16) that prefill steps run.

    python benchmarks/gpu_profile.py --prefill 2048 --quantize fp8 --variants "fused,fused;fp8_out=float32"
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import importlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import LLAMA3_8B, MATMUL_M, ceilings, log, matmul_rate  # noqa: E402
from gpu_swap_program import parse_options  # noqa: E402

from kiln.models import quant  # noqa: E402
from kiln.models import sampling as sampling_module  # noqa: E402
from kiln.models import step as step_module  # noqa: E402
from kiln.models import transformer as transformer_module  # noqa: E402
from kiln.models.batch import KVCache, SeqChunk, make_batch  # noqa: E402
from kiln.models.config import ModelConfig  # noqa: E402
from kiln.models.kernels import pallas_gpu, pallas_gpu_narrow  # noqa: E402
from kiln.models.sampling import SamplingBatch  # noqa: E402
from kiln.models.step import jit_decode_steps, jit_step  # noqa: E402
from kiln.models.transformer import Weights  # noqa: E402
from kiln.targets.target import KV_DTYPES


def random_weights(cfg: ModelConfig, weight_format: str, fused: bool = False) -> Weights:
    """Random leaves of the format's shapes and dtypes (fused: the fused layout), made on the device: small normals
    for floats (scales included), -7..7 for integer weights, normals of sd 64 for fp8 weights, ones for norms."""
    abstract = Weights.abstract(cfg, jnp.bfloat16, weight_format, fused)
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    key = jax.random.key(0)
    leaves = []
    for i, (path, a) in enumerate(paths):
        k = jax.random.fold_in(key, i)
        name = jax.tree_util.keystr(path)
        if jnp.issubdtype(a.dtype, jnp.integer):
            leaves.append(jax.random.randint(k, a.shape, -7, 8, jnp.int8).astype(a.dtype))
        elif a.dtype == jnp.float8_e4m3fn:  # fp8 weights: normal values across e4m3's range, not zeros
            leaves.append((jax.random.normal(k, a.shape, jnp.float32) * 64).astype(a.dtype))
        elif "norm" in name:
            leaves.append(jnp.ones(a.shape, a.dtype))
        else:
            leaves.append((jax.random.normal(k, a.shape, jnp.float32) * 0.02).astype(a.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def prefill_flops(cfg: ModelConfig, tokens: int, seqs: int) -> float:
    """The matmul FLOPs of a step of `tokens` prompt tokens: every linear layer on each token, the LM head on `seqs`
    rows (attention's few percent left out)."""
    e, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = e * (q + 2 * kv) + q * e + 3 * e * cfg.intermediate_size
    return 2.0 * (cfg.num_layers * per_layer * tokens + cfg.vocab_size * e * seqs)


def fp8_matmul_rate() -> float:
    """float8_e4m3fn matmul FLOP/s (torch._scaled_mm, bf16 out; gpu_e2e.matmul_rate) on the current CUDA device."""
    import torch

    m = MATMUL_M
    x = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    y = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    return matmul_rate(functools.partial(torch._scaled_mm, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), x, y)


def weight_bytes(weights: Weights) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights))


def trace_events(trace_dir: str) -> tuple[list[dict], set]:
    """The events of the perfetto trace that jax.profiler wrote to trace_dir, and the ids of the GPU's processes."""
    path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    gpu_pids = {pid for pid, name in names.items() if "/device:" in name}
    if not gpu_pids:
        log(f"no device process in the trace (processes: {sorted(set(names.values()))})")
    return events, gpu_pids


def kernel_table(trace_dir: str, steps: int) -> tuple[list[tuple[str, float, int]], float]:
    """(kernel name, ms per step, launches per step) sorted by time, and the summed kernel ms per step, from the
    perfetto trace that jax.profiler wrote: events of the GPU's processes."""
    events, gpu_pids = trace_events(trace_dir)
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            total[e["name"]] += e.get("dur", 0) / 1e3
            count[e["name"]] += 1
    rows = [(n, ms / steps, count[n] // steps) for n, ms in total.most_common()]
    return rows, sum(total.values()) / steps


def profile(fn, weights, kv, batch, sb, steps: int) -> tuple[list, float, KVCache]:
    """kernel_table of `steps` calls of fn (the cache donated and threaded through); returns the cache too."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                out, kv = fn(weights, kv, batch, sb)
            jax.block_until_ready(out)
        return (*kernel_table(d, steps), kv)


def dump_hlo(fn, args, folder: str, stem: str) -> dict[str, str]:
    """Write fn's optimized HLO for args to folder/STEM.hlo.txt (a variant's name made file-safe);
    return each instruction's line by its name, to name a profile's kernels."""
    text = fn.as_text() if isinstance(fn, jax.stages.Compiled) else fn.lower(*args).compile().as_text()
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / (re.sub(r"[^\w.-]+", "_", stem) + ".hlo.txt")).write_text(text)
    return {m.group(1): m.group(0) for m in re.finditer(r"%([\w.-]+) = [^\n]*", text)}


def sample_fn(name: str):
    """The sample() of benchmarks/NAME.py, or "greedy": kiln.models.sampling.sample_greedy (no cond)."""
    return sampling_module.sample_greedy if name == "greedy" else importlib.import_module(name).sample


def top_k_in_rows(n: int):
    """lax.top_k over the rows of a 2-D operand in blocks of n rows (the same result)."""
    top_k = jax.lax.top_k

    def blocked(x, k):
        if x.ndim != 2 or x.shape[0] <= n:
            return top_k(x, k)
        parts = [top_k(x[i : i + n], k) for i in range(0, x.shape[0], n)]
        return tuple(jnp.concatenate(p, axis=0) for p in zip(*parts, strict=True))

    return blocked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--prefill", type=int, default=0, help="T > 0: the step program on T prompt tokens (no decodes)")
    ap.add_argument("--context", type=int, default=1152)
    ap.add_argument("--quantize", default="float")
    ap.add_argument("--kv-dtype", default="bfloat16", help="bfloat16 or fp8")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--programs", default="step,multi", help="which programs to time: step, multi (decode) or both")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--variants", default="fused", help="layouts (separate, fused), each with ;KEY=N")
    ap.add_argument("--hlo", default=None, help="a folder for each variant's compiled decode program (HLO text)")
    ap.add_argument("--narrow-configs", default=None, help="a JSON of pallas_gpu_narrow configs (gpu_fp8.py --pallas)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="a tiny model with reference attention (no GPU)")
    args = ap.parse_args()
    if args.dry_run:
        ceil = {"copy_bytes_per_s": 1e10, "bf16_flops_per_s": 1e12}
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)  # fmt: skip
        cfg, attention = ModelConfig.from_hf({**LLAMA3_8B, **small}), "reference"
    else:
        ceil = ceilings(matmul=bool(args.prefill))
        if args.prefill and args.quantize == "fp8":
            ceil["fp8_flops_per_s"] = fp8_matmul_rate()
        cfg, attention = ModelConfig.from_hf(LLAMA3_8B), "pallas_gpu"
    page = 16
    concurrency = [int(c) for c in args.concurrency.split(",")]
    per_seq = -(-(args.context + args.decode_steps + 1) // page)
    kv_dtype = jnp.dtype(KV_DTYPES[args.kv_dtype])
    prompts = -(-args.prefill // 1024)  # --prefill: the step's prompts, of up to 1024 tokens each
    per_seq = max(per_seq, -(-args.prefill // max(prompts, 1) // page))
    kv = KVCache.create(cfg, per_seq * max(*concurrency, prompts) + 1, page, kv_dtype)
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
    attention_fn, get_qkv = pallas_gpu.paged_attention, step_module.get_attention_qkv
    sample_default, top_k_default = step_module.sample, jax.lax.top_k
    gate_up_groups = transformer_module.gate_up_groups
    rope_default = pallas_gpu.ROPE_IN_KERNEL
    kvdot_default = pallas_gpu.FP8_CACHE_DOT
    pallas_rows = dict(quant.PALLAS_MAX_ROWS)
    fp8_wo, fp8_2t, fp8_out = quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS, quant.FP8_DOT_OUT
    if args.narrow_configs:
        for key, kcfg in json.loads(Path(args.narrow_configs).read_text()).items():
            fmt, *dims = key.split(",")
            pallas_gpu_narrow.CONFIGS[(fmt, *map(int, dims))] = kcfg and pallas_gpu_narrow.Config(**kcfg)
        log(f"narrow kernel configs: {pallas_gpu_narrow.CONFIGS}")
    results = []
    for variant in args.variants.split(","):
        layout, *opts = variant.split(";")
        opts = dict(o.split("=") for o in opts)
        split_qkv = opts.pop("qkv", "") == "split"
        sampler = opts.pop("sampler", "")
        max_c = int(opts.pop("max_c", 1 << 30))
        topk_rows = int(opts.pop("topk_rows", 0))
        min_t = int(opts.pop("min_t", 16))  # the smallest bucket: c runs in max(min_t, next power of two) rows
        pallas_gpu.ROPE_IN_KERNEL = opts.pop("rope", "kernel" if rope_default else "xla") == "kernel"  # when traced
        # kvdot=f16 / q: an fp8 KV cache's attention dots in float16 / q's dtype (FP8_CACHE_DOT, read when traced)
        pallas_gpu.FP8_CACHE_DOT = {"f16": jnp.float16, "q": None}.get(opts.pop("kvdot", ""), kvdot_default)
        narrow = opts.pop("narrow", "")  # xla: XLA's dots; pallas: pallas_gpu_narrow up to 128 rows (its configs)
        # fp8_wo=N: quant.FP8_WEIGHT_ONLY_MAX_ROWS (read when traced; 0: fp8 x fp8 dots at every size)
        quant.FP8_WEIGHT_ONLY_MAX_ROWS = int(opts.pop("fp8_wo", fp8_wo))
        quant.FP8_TWO_TERM_MAX_ROWS = int(opts.pop("fp8_2t", fp8_2t))  # fp8_2t=N: two-term fp8 rows up to N rows
        # fp8_out=float32: the one-term fp8 x fp8 dots' result dtype (quant.FP8_DOT_OUT, read when traced)
        quant.FP8_DOT_OUT = jnp.dtype(opts.pop("fp8_out")) if "fp8_out" in opts else fp8_out
        for fmt in quant.PALLAS_MAX_ROWS:  # read when traced
            quant.PALLAS_MAX_ROWS[fmt] = {"xla": 0, "pallas": 128}.get(narrow, pallas_rows[fmt])
        # gu=1: gate|up as [all gate | all up] (one group: transformer.gate_up_groups), so that SiLU(gate) * up is two
        # contiguous column slices of the GEMM's output (can XLA fuse it into the down GEMM's operand then?)
        transformer_module.gate_up_groups = (lambda cfg: 1) if opts.pop("gu", "") == "1" else gate_up_groups
        # cb=FUSION/CUBLAS/CONDITIONAL: the programs compiled with this xla_gpu_enable_command_buffer ("/" for ",")
        xla = {"xla_gpu_enable_command_buffer": opts.pop("cb").replace("/", ",")} if "cb" in opts else {}
        # xla=FLAG:VALUE/FLAG:VALUE: more XLA compile options (a flag's xla_gpu_ prefix may be left out)
        xla = {**xla, **parse_options(opts.pop("xla", ""))} or None
        kwargs = {k: int(v) if v.isdigit() else v for k, v in opts.items()}
        weights = random_weights(cfg, args.quantize, fused=layout == "fused")
        wbytes = weight_bytes(weights)
        log(f"variant {variant}: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s; weights {args.quantize}: "
            f"{wbytes / 1e9:.2f} GB; KV {kv_dtype.name}")  # fmt: skip
        # traced into the programs below (fresh jits): get_attention and the step read these module attributes
        pallas_gpu.paged_attention = functools.partial(attention_fn, **kwargs)
        step_module.get_attention_qkv = (lambda name: None) if split_qkv else get_qkv
        step_module.sample = sample_fn(sampler) if sampler else sample_default
        jax.lax.top_k = top_k_in_rows(topk_rows) if topk_rows else top_k_default  # read when the programs trace
        hlo = {}
        jit_step.cache_clear()
        jit_decode_steps.cache_clear()
        # and jax's own: it caches each cond branch's trace by its function (sampling._sample), so without this a
        # variant that patches what a branch calls (topk_rows) reran the first variant's branch
        jax.clear_caches()
        step = jit_step(cfg, attention)
        multi = jit_decode_steps(cfg, attention, args.decode_steps)
        for c in [prompts] if args.prefill else concurrency:
            if ("num_splits" in kwargs and c > 16) or c > max_c:
                continue
            pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(c)]
            if args.prefill:  # c fresh prompts (the first step of a c = 64 run), S as the artifact's step program
                t, s = args.prefill, min(args.prefill, 256)
                chunks = [SeqChunk(list(range(1, t // c + 1)), 0, p) for p in pages]
                roof_ms = prefill_flops(cfg, t, s) / ceil.get("fp8_flops_per_s", ceil["bf16_flops_per_s"]) * 1e3
            else:
                t = s = max(min_t, 1 << (c - 1).bit_length())
                chunks = [SeqChunk([5], args.context, p) for p in pages]
                roof_ms = (wbytes + c * args.context * kv_token) / ceil["copy_bytes_per_s"] * 1e3
            batch = jax.device_put(make_batch(chunks, page, t, s, per_seq))
            sb = jax.device_put(SamplingBatch.neutral(s, vocab_size=cfg.vocab_size))
            row = {"variant": variant, "concurrency": c, "bucket": t, "roofline_ms": roof_ms}
            programs = (("step", step, 1), ("multi", multi, args.decode_steps))
            names = "step" if args.prefill else args.programs
            for name, fn, per in [p for p in programs if p[0] in names.split(",")]:
                t0 = time.perf_counter()
                # the variant's XLA options, else the program's default (pallas_gpu.compiler_options)
                options = xla or pallas_gpu.compiler_options("decode" if name == "multi" else "step", t, args.quantize)
                try:  # a variant that does not compile is reported, the others still run
                    fn = fn.lower(weights, kv, batch, sb).compile(options)  # one compile for the run and --hlo
                    out, kv = fn(weights, kv, batch, sb)
                    jax.block_until_ready(out)
                except Exception as e:  # noqa: BLE001
                    log(f"{variant} c={c} {name}: failed: {str(e)[:2000]}")
                    continue
                compile_s = time.perf_counter() - t0
                if args.hlo and (name == "multi" or args.prefill) and not hlo:
                    hlo = dump_hlo(fn, (weights, kv, batch, sb), args.hlo, variant)
                    ops = collections.Counter(re.findall(r" (conditional|while)\(", "\n".join(hlo.values())))
                    log(f"{variant}: the {name} program has {ops['conditional']} conditionals, {ops['while']} loops")
                n = max(3, 24 // per)
                t0 = time.perf_counter()
                returned = []
                for _ in range(n):
                    out, kv = fn(weights, kv, batch, sb)
                    returned.append(time.perf_counter())
                jax.block_until_ready(out)
                ms = (time.perf_counter() - t0) / (n * per) * 1e3
                # the calls after the first return while an earlier program is still queued, unless dispatch blocks
                dispatch_ms = (returned[-1] - returned[0]) / (n - 1) * 1e3
                first_ms = (returned[0] - t0) * 1e3
                rows, kernel_ms, kv = profile(fn, weights, kv, batch, sb, 3)
                row[name] = {"ms_per_token": ms, "kernel_ms_per_token": kernel_ms / per, "compile_s": compile_s,
                             "dispatch_ms": dispatch_ms, "first_dispatch_ms": first_ms,
                             "kernels": [(k, ms_ / per, n_) for k, ms_, n_ in rows]}  # fmt: skip
                log(f"{variant} c={c} T={t} {name}: {ms:.2f} ms/token (roofline {roof_ms:.2f}, {roof_ms / ms:.2f}), "
                    f"kernels {kernel_ms / per:.2f} ms/token, compile {compile_s:.0f} s; a call returns after "
                    f"{first_ms:.2f} ms (first) / {dispatch_ms:.2f} ms (queued), a program {ms * per:.2f}")  # fmt: skip
                for k, ms_, n_ in rows[: args.top]:
                    log(f"    {ms_ / per:7.3f} ms  x{n_:<4d} {k[:110]}  {hlo.get(k, '')[:230]}")
            results.append(row)
        pallas_gpu.paged_attention, step_module.get_attention_qkv = attention_fn, get_qkv
        step_module.sample, jax.lax.top_k = sample_default, top_k_default
        quant.PALLAS_MAX_ROWS.update(pallas_rows)
        quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS, quant.FP8_DOT_OUT = fp8_wo, fp8_2t, fp8_out
        pallas_gpu.ROPE_IN_KERNEL = rope_default
        pallas_gpu.FP8_CACHE_DOT = kvdot_default
        transformer_module.gate_up_groups = gate_up_groups
        del weights
    for r in results:
        for name in ("step", "multi"):
            if name in r:
                ms = r[name]["ms_per_token"]
                log(f"| {r['variant']} | {r['concurrency']} | {name} | {ms:.2f} | {r['roofline_ms']:.2f} | "
                    f"{r['roofline_ms'] / ms:.2f} | {r[name]['kernel_ms_per_token']:.2f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "args": vars(args), "levels": results}, indent=1))


if __name__ == "__main__":
    main()

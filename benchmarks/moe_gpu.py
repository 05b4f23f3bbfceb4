"""Mixture-of-experts on one GPU: a Qwen3-30B-A3B-shaped model (48 layers, 128 experts, top-8) with random bf16
weights made on the device (no checkpoint: 61 GB would not fit the device's disk twice), served by the engine in this
process (scheduler, runner, jitted step and decode programs: what `kiln serve --target jit` runs, without HTTP).

Three phases:
* dispatch: the MoE MLP (kiln.models.moe) at T rows through each dispatch (pallas = the grouped GPU kernels, single =
  the single-token ones at T = 1 with their routing, gather, sorted = ragged_dot, dense; kernel_options for variants),
  every layer's experts in turn in one jitted program: us a layer, and each kernel's error against dense.
* program (--program): the decode program of one sequence per variant (program_profile), with its kernels per token
  and the HLO instruction behind each; --hlo writes its optimized HLO.
* engine: c requests of --prompt-len random tokens, --max-tokens output tokens each (ignore_eos, greedy), submitted at
  once, for each concurrency c: output tok/s, TPOT, TTFT; against the bound of a decode step, which reads the
  non-expert weights, the experts the step's tokens touch (X (1 - (1 - k/X)^c) per layer for uniformly routed random
  weights: k at c = 1) and every sequence's KV at the mean context, at the copy bandwidth measured in the same run.

    python benchmarks/moe_gpu.py --concurrency 1,8,64 [--layers 48] [--profile] [--json OUT]
    python benchmarks/moe_gpu.py --concurrency "" --layers 8 --dispatches pallas,single --program base,grouped --hlo D
    python benchmarks/moe_gpu.py --program-layers 8 --program base,single_k256 --serve-best --concurrency 1,8
        (one model of 48 layers: the variants on its first 8, then the engine under the one with the least kernel
        time; benchmarks/moe_h200.sh)
    python benchmarks/moe_gpu.py --dry-run   # a tiny MoE with reference attention, on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from engine import run  # noqa: E402
from gpu_e2e import ceilings, log  # noqa: E402
from gpu_profile import kernel_table, profile, random_weights, weight_bytes  # noqa: E402
from gpu_swap_program import typed  # noqa: E402

from kiln.compile.plan import Options, resolve_target  # noqa: E402
from kiln.models import moe, quant  # noqa: E402
from kiln.models import step as step_module  # noqa: E402
from kiln.models import transformer as transformer_module  # noqa: E402
from kiln.models.batch import KVCache, SeqChunk, make_batch  # noqa: E402
from kiln.models.config import ModelConfig  # noqa: E402
from kiln.models.kernels import pallas_gpu_moe  # noqa: E402
from kiln.models.kernels.pallas_gpu_moe import experts_grouped, experts_single  # noqa: E402
from kiln.models.sampling import MAX_LOGPROBS, SamplingBatch, StepOut  # noqa: E402
from kiln.models.step import decode_steps  # noqa: E402
from kiln.models.transformer import fuse_linears  # noqa: E402
from kiln.serving.llm import engine_from_weights  # noqa: E402

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    torch_dtype="bfloat16", hidden_act="silu",
)  # fmt: skip


EXPERT_FIELDS = ("experts_gate", "experts_up", "experts_down")


def touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts that `tokens` uniformly routed tokens touch in one layer."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def kernel_options(name: str) -> dict:
    """Kernel keywords of a dispatch name pallas[_nN][_wW][_gG] (experts_grouped) or single[...][_r0][_c1][_kK][_dD]
    (experts_single, one token): output tiles of N, W warps, G pipeline stages; r0: the routing in a kernel of its own;
    c1: gate_up ranks the experts by an (X, X) compare (session 8) instead of k max-reductions; K tiles of K (default:
    pallas_gpu_moe.default_block_k, 256 on an H200, down's 128; k128 gives session 11's default); down's output tiles
    of D; eE: down's K tiles of E (default K); t1: the experts stored transposed (program_profile
    transposes the weights it runs)."""
    keys = {"n": "block_n", "w": "num_warps", "g": "num_stages", "r": "fused_route", "c": "rank_compare",
            "k": "block_k", "d": "down_block_n", "e": "down_block_k", "t": "weights_t"}  # fmt: skip
    return {keys[part[0]]: int(part[1:]) for part in name.split("_")[1:]}


def oproj_options(name: str) -> dict:
    """gemv_partials' keywords of a variant part oproj[_sS][_kK][_nN][_wW][_gG]: S split-K rows, K and N tiles, W warps,
    G pipeline stages (default: gemv_partials' own, 4 rows of K 256 and N 64 tiles, 4 warps, 3 stages)."""
    keys = {"s": "splits", "k": "block_k", "n": "block_n", "w": "num_warps", "g": "num_stages"}
    return {keys[part[0]]: int(part[1:]) for part in name.split("_")[1:]}


def _single(route_in, cfg: ModelConfig, kw: dict, h, g, u, d, weights, experts, act):
    """experts_single in experts_grouped's signature: routes by route_in (logits, live), not weights and experts."""
    logits, live = route_in
    return experts_single(h, logits, live, g, u, d, cfg.num_experts_per_tok, cfg.norm_topk_prob, act, **kw)


def dispatch_table(cfg: ModelConfig, weights, rows: list[int], copy_bw: float, only=()) -> list[dict]:
    lw = weights.layers[0]  # its router routes every layer's experts
    act = jax.nn.silu
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * lw.experts_gate.dtype.itemsize
    out = []
    for t in rows:
        h = (jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.float32)).astype(jnp.bfloat16)
        weights_k, experts = moe.route(h, lw.router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        distinct = len(np.unique(np.asarray(experts)))
        row = {"rows": t, "experts_touched": distinct, "bound_us": distinct * expert_bytes / copy_bw * 1e6}
        grouped = functools.partial(
            experts_grouped,
            block_m=moe.grouped_block_m(t, cfg.num_experts_per_tok, cfg.num_experts),
            interpret=jax.default_backend() == "cpu",  # --dry-run
        )
        dispatches = [(n, functools.partial(grouped, **kernel_options(n))) for n in only if n.startswith("pallas")]
        if t == 1:  # the single-token kernels route too: the router's logits in, every layer routed alike
            route_in = ((h @ lw.router).astype(jnp.float32), jnp.ones((1,), bool))
            for n in [n for n in only if n.startswith("single")]:
                kw = dict(kernel_options(n), interpret=grouped.keywords["interpret"])
                dispatches.append((n, functools.partial(_single, route_in, cfg, kw)))
        dispatches += [
            ("gather", moe.experts_gather),
            ("sorted", moe.experts_sorted),
            ("dense", moe.experts_dense),
        ]
        if not only:
            dispatches.insert(0, ("pallas", grouped))
        dispatches = [d for d in dispatches if d[0] in only] if only else dispatches
        layers = weights.layers
        one = (h, lw.experts_gate, lw.experts_up, lw.experts_down, weights_k, experts)
        want = jax.jit(lambda *a: moe.experts_dense(*a, act))(*one).astype(jnp.float32)
        for name, fn in dispatches:
            if name == "gather" and t * cfg.num_experts_per_tok > 1024:  # (T, k, E, F) copies: gigabytes
                continue

            def chain(h, experts_w, w, e, fn=fn):  # every layer's experts in turn, as a model runs them
                for g, u, d in experts_w:
                    h = fn(h, g, u, d, w, e, act)
                return h

            f = jax.jit(chain)  # weights as arguments
            xs = (h, [(lw.experts_gate, lw.experts_up, lw.experts_down) for lw in layers], weights_k, experts)
            try:  # a variant that does not compile or run is reported, the others still run
                jax.block_until_ready(f(*xs))
            except Exception as e:  # noqa: BLE001
                log(f"T={t} {name}: failed: {str(e)[:400]}")
                continue
            n = 5
            t0 = time.perf_counter()
            for _ in range(n):
                y = f(*xs)
            jax.block_until_ready(y)
            row[f"{name}_us"] = (time.perf_counter() - t0) / (n * len(layers)) * 1e6
            if name.startswith(("pallas", "single")):  # against every expert run densely, on these inputs
                got = jax.jit(lambda *a, fn=fn: fn(*a, act))(*one).astype(jnp.float32)
                row[f"{name}_err"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        out.append(row)
        cells = ", ".join(f"{k} {v:.0f}" if k.endswith("_us") else f"{k} {v:.1e}" for k, v in row.items()
                          if k.endswith(("_us", "_err")))  # fmt: skip
        log(f"T={t}: {distinct} experts touched; {cells}")
    return out


def _f32_logits(fn, h, logits, *args, **kw):
    """Row 0 of the router's logits sliced and cast to float32 in XLA (one fusion a layer), as before session 9."""
    return fn(h, logits[:1].astype(jnp.float32), *args, **kw)


def compiler_options(opts: list[str]) -> dict[str, str]:
    """XLA options of a variant's parts "xla:KEY=VALUE" ("+" in VALUE stands for ","; "cb=LIST" is short for
    xla_gpu_enable_command_buffer=LIST, "cb=" turns command buffers off; "cbtriton" adds Pallas's Triton calls to the
    custom calls that command buffers may record)."""
    out = {}
    for o in opts:
        if o.startswith("cb="):
            out["xla_gpu_enable_command_buffer"] = o[3:].replace("+", ",")
        elif o == "cbtriton":
            out["legacy_command_buffer_custom_call_targets"] = "__gpu$xla.gpu.triton"
        elif o.startswith("xla:"):
            key, _, value = o[4:].partition("=")
            out[key] = value.replace("+", ",")
    return out


def pick_flags(program_json: str) -> str:
    """XLA_FLAGS for the fastest --program variant of a --json file among "base" and the variants made of XLA options
    only (compiler_options), "" when base wins."""
    rows = json.loads(Path(program_json).read_text()).get("program", [])
    only_xla = [r for r in rows if r["variant"] == "base" or (compiler_options(o := r["variant"].split(";"))
                and all(p.startswith(("cb=", "xla:")) or p == "cbtriton" for p in o))]  # fmt: skip
    if not only_xla:
        return ""
    best = min(only_xla, key=lambda r: r["ms_per_token"])
    return " ".join(f"--{k}={v}" for k, v in compiler_options(best["variant"].split(";")).items())


def _greedy(logits, sampling, positions) -> StepOut:
    """An argmax and its logprob in place of kiln.models.sampling.sample (program variant "greedy")."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    zeros = jnp.zeros((logits.shape[0], MAX_LOGPROBS))
    return StepOut(tokens=tokens, logprobs=chosen, top_ids=zeros.astype(jnp.int32), top_logprobs=zeros)


def _hlo_summary(text: str) -> str:
    """How much of an optimized HLO runs in command buffers: their computations, and the Triton custom calls and
    fusions inside and outside them."""
    comps = re.split(r"\n(?=\S)", text)
    inside = [c for c in comps if re.match(r"%?command_buffer", c)]
    triton = "__gpu$xla.gpu.triton"
    total_triton = text.count(triton)
    in_triton = sum(c.count(triton) for c in inside)
    in_fusions = sum(c.count(" fusion(") for c in inside)
    return (
        f"{len(inside)} command buffers holding {in_fusions} fusions and {in_triton} of {total_triton} Triton "
        f"calls; {text.count(' conditional(')} conditionals, {text.count(' while(')} whiles"
    )


SERVABLE = ("base", "xlarouter", "single_", "noaddnorm", "noqk", "norows", "noglue", "oproj")  # served kernels only


@contextlib.contextmanager
def patched(variant: str):
    """The module attributes a program variant (program_profile) changes, restored after."""
    opts = variant.split(";")
    single_fn, experts_fn, dot_fn = pallas_gpu_moe.single_supported, pallas_gpu_moe.experts_single, quant._float_dot
    sample_fn, router, mlp_fn = step_module.sample, moe.GPU_ROUTER_KERNEL, transformer_module.moe_mlp
    glue = moe.GPU_ADD_NORM, moe.GPU_QK_NORM_ROPE, moe.GPU_ROWS, moe.GPU_OPROJ_KERNEL, moe.GPU_OPROJ_OPTS
    try:
        if "noaddnorm" in opts or "noglue" in opts:  # the o-proj's add + norm in XLA (session 11), not in the router
            moe.GPU_ADD_NORM = False
        if "noqk" in opts or "noglue" in opts:  # Qwen3's q/k norms + RoPE as XLA's fusions (session 11)
            moe.GPU_QK_NORM_ROPE = False
        for o in opts:  # oproj[_...]: the o-proj as gemv_partials' split-K rows, added inside router_add_norm
            if o == "oproj" or o.startswith("oproj_"):
                moe.GPU_OPROJ_KERNEL, moe.GPU_OPROJ_OPTS = True, oproj_options(o)
        if "norows" in opts or "noglue" in opts:  # the experts' k rows summed in XLA, added and normed by two fusions
            moe.GPU_ROWS = False
        if "grouped" in opts:
            pallas_gpu_moe.single_supported = lambda num_experts, top_k: False
        single_kw = {} if "sroute" not in opts else {"fused_route": False}
        single_kw |= kernel_options("_".join(["single", *[o[7:] for o in opts if o.startswith("single_")]]))
        if single_kw:
            pallas_gpu_moe.experts_single = functools.partial(experts_fn, **single_kw)
        if single_kw.get("weights_t"):  # the GPU's branch alone (the others would not trace the transposed experts)
            transformer_module.moe_mlp = _gpu_mlp
            moe.GPU_ADD_NORM = False  # add_norm_mlp's other branches would trace the transposed experts
        if "f32logits" in opts:  # the router's logits sliced and cast in XLA
            moe.GPU_ROUTER_KERNEL = False
            pallas_gpu_moe.experts_single = functools.partial(_f32_logits, pallas_gpu_moe.experts_single)
        if "xlarouter" in opts:  # XLA's 2-row router GEMM (session 9), not the router_logits kernel
            moe.GPU_ROUTER_KERNEL = False
        if "dot1" in opts:
            quant._float_dot = lambda x, w: x @ w
        if "greedy" in opts:
            step_module.sample = _greedy
        yield
    finally:
        pallas_gpu_moe.single_supported, pallas_gpu_moe.experts_single = single_fn, experts_fn
        quant._float_dot, step_module.sample, moe.GPU_ROUTER_KERNEL = dot_fn, sample_fn, router
        transformer_module.moe_mlp = mlp_fn
        moe.GPU_ADD_NORM, moe.GPU_QK_NORM_ROPE, moe.GPU_ROWS, moe.GPU_OPROJ_KERNEL, moe.GPU_OPROJ_OPTS = glue


def combined(rows: list[dict]) -> str | None:
    """The variant made of the fastest one-part "oproj..." and "single_..." variants by kernel time, where both beat
    the fastest base; None otherwise."""
    kernel = {}
    for r in rows:
        kernel[r["variant"]] = min(kernel.get(r["variant"], 1e9), r["kernel_ms_per_token"])
    if "base" not in kernel:
        return None
    parts = []
    for prefix in ("oproj", "single_"):
        ok = [v for v in kernel if v.startswith(prefix) and ";" not in v and kernel[v] < kernel["base"]]
        if not ok:
            return None
        parts.append(min(ok, key=kernel.get))
    return ";".join(parts)


def best_servable(rows: list[dict]) -> str:
    """The program variant made only of SERVABLE parts with the least kernel time per token, "base" if none. (Kernel
    time, not ms per token: on the H200 in session 11 that came out 0.73 or 0.79 ms for 8 layers whatever the variant,
    the first variant always 0.79, the same variant both in one run.)"""
    ok = [r for r in rows if all(o.startswith(SERVABLE) for o in r["variant"].split(";"))]
    return min(ok, key=lambda r: r["kernel_ms_per_token"])["variant"] if ok else "base"


def _gpu_mlp(h, router, w_gate, w_up, w_down, top_k, renormalize, act, live=None, dispatch=None):
    """kiln.models.moe.moe_mlp's GPU branch alone, without platform_dependent's other branches."""
    live = jnp.ones((h.shape[0],), bool) if live is None else live
    return moe._gpu(h, router, w_gate, w_up, w_down, live, top_k=top_k, renormalize=renormalize, act=act)


def _transposed(weights):
    """The weights with every layer's experts stored transposed: gate and up (X, F, E), down (X, E, F)."""
    layers = [dataclasses.replace(lw, **{f: jnp.swapaxes(getattr(lw, f), 1, 2) for f in EXPERT_FIELDS})
              for lw in weights.layers]  # fmt: skip
    return dataclasses.replace(weights, layers=layers)


def program_profile(
    cfg: ModelConfig, weights, variants: list[str], hlo_dir: str | None, attention: str, context: int = 1152
) -> list:
    """The 8-step decode program of one sequence (bucket 1) at `context` tokens, per variant, its parts joined by ";":
    "base"; "noaddnorm": the o-proj's residual add and the norm in XLA, not inside the router's kernel
    (moe.add_norm_mlp); "noqk": Qwen3's q/k norms and RoPE as XLA's fusions, not one kernel (moe.qk_norm_rope);
    "norows": the experts' k rows summed, added and normed by XLA's fusions, not pallas_gpu.add_rms_norm (moe.gpu_rows);
    "noglue": all three (session 11's program); "oproj": the o-proj as gemv_partials' float32 split-K rows, added inside
    router_add_norm (moe.GPU_OPROJ_KERNEL); "grouped": the MoE layers through experts_grouped, not the single-token
    kernels; "xlarouter": the router's logits by XLA's 2-row GEMM (session 9) instead of the router_logits kernel;
    "sroute": the single-token routing in a kernel of its own, not inside gate_up; "single_X": kernel_options X of
    experts_single (e.g. single_c1); "f32logits": row 0 of the router's logits sliced and cast in XLA; "dot1": 1-row
    float dots left to XLA as they are, not run on two rows (kiln.models.quant._float_dot); XLA options
    (compiler_options). Reports ms per token (timed without the profiler, which may turn command buffers off) and its
    kernels per token, each with the HLO instruction that launched it; hlo_dir: each variant's optimized HLO text."""
    steps, page = 8, 16
    per_seq = -(-(context + steps + 1) // page)
    kv = KVCache.create(cfg, per_seq + 1, page, jnp.bfloat16)
    batch = jax.device_put(make_batch([SeqChunk([5], context, list(range(per_seq)))], page, 1, 1, per_seq))
    sb = jax.device_put(SamplingBatch.neutral(1, vocab_size=cfg.vocab_size))
    out = []
    for variant in variants:
        opts = variant.split(";")
        # compile options typed (XLA refuses the string "true" for a bool flag; XLA_FLAGS take the strings)
        xla_opts = {k: typed(v) for k, v in compiler_options(opts).items()}
        jax.clear_caches()
        single_kw = kernel_options("_".join(["single", *[o[7:] for o in opts if o.startswith("single_")]]))
        run_weights = _transposed(weights) if single_kw.get("weights_t") else weights
        with patched(variant):  # a fresh jit (jit_decode_steps is cached), traced with the variant's patches
            t0 = time.perf_counter()
            jitted = jax.jit(functools.partial(decode_steps, cfg, attention, steps), donate_argnums=(1,))
            try:
                fn = jitted.lower(run_weights, kv, batch, sb).compile(compiler_options=xla_opts or None)
                compile_s = time.perf_counter() - t0
                res, kv = fn(run_weights, kv, batch, sb)
                jax.block_until_ready(res)
                # the 8 tokens and their logprobs: the same KV positions are written and read by every call, so
                # variants that compute alike give the same (a check of a variant's numbers against base)
                first = {"tokens": np.asarray(res.tokens).ravel().tolist(),
                         "logprobs": np.asarray(res.logprobs, np.float32).ravel().tolist()}  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log(f"program {variant}: failed: {str(e)[:400]}")
                continue
            text = fn.as_text()
            hlo = {m.group(1): m.group(0) for m in re.finditer(r"%([\w.-]+) = [^\n]*", text)}
            summary = _hlo_summary(text)
            if hlo_dir:
                Path(hlo_dir).mkdir(parents=True, exist_ok=True)
                name = "".join(c if c.isalnum() or c in "_-" else "_" for c in variant)
                (Path(hlo_dir) / f"decode_{name}.hlo.txt").write_text(text)
            n, dispatch = 24, 0.0
            t0 = time.perf_counter()
            for _ in range(n):  # back to back: each call returns once dispatched, unless the host waits on the device
                t1 = time.perf_counter()
                res, kv = fn(run_weights, kv, batch, sb)
                dispatch += time.perf_counter() - t1
            jax.block_until_ready(res)
            ms = (time.perf_counter() - t0) / (n * steps) * 1e3
            dispatch_ms = dispatch / n * 1e3
            rows, kernel_ms, kv = profile(fn, run_weights, kv, batch, sb, 3)
        launches = sum(n_ for _, _, n_ in rows) // steps
        log(f"program {variant}: {ms:.3f} ms/token, kernels {kernel_ms / steps:.3f} ms/token in {launches} launches "
            f"({cfg.num_layers} layers; compiled in {compile_s:.0f} s; a call returns after {dispatch_ms:.2f} ms); "
            f"{summary}")  # fmt: skip
        for k, ms_, n_ in rows[:40]:
            log(f"    {ms_ / steps:7.4f} ms  x{n_ // steps:<4d} {k[:60]}  {hlo.get(k, '')[:300]}")
        log(f"    tokens {first['tokens']}, logprobs {[round(x, 4) for x in first['logprobs']]}")
        out.append({"variant": variant, "ms_per_token": ms, **first, "kernel_ms_per_token": kernel_ms / steps,
                    "launches_per_token": launches, "dispatch_ms": dispatch_ms, "hlo": summary, "compile_s": compile_s,
                    "kernels": [(k, ms_ / steps, n_ // steps) for k, ms_, n_ in rows[:80]]})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--buckets", default="8,64,1024")
    ap.add_argument("--dispatch-rows", default="1,8,16,64,256,1024")
    ap.add_argument("--dispatches", default="", help="comma-separated names (default: all)")
    ap.add_argument("--profile", action="store_true", help="a per-kernel table of a c=1 run (ms per output token)")
    ap.add_argument("--program", default="", help="decode-program variants at c=1 to profile (program_profile)")
    ap.add_argument("--program-layers", type=int, default=0, help="the variants on the first N layers only")
    ap.add_argument("--serve-best", action="store_true",
                    help="the engine runs under the fastest --program variant made of SERVABLE parts")  # fmt: skip
    ap.add_argument("--serve-base", action="store_true",
                    help="with --serve-best: the engine under base too, at the first concurrency alone, before the "
                         "fastest variant")  # fmt: skip
    ap.add_argument("--serve-variant", default="base", help="the engine runs under this program variant (patched)")
    ap.add_argument("--serve-base-last", action="store_true",
                    help="with --serve-best: the engine under base too, at the first concurrency alone, after the "
                         "fastest variant (a time limit cuts it, not the variant's run)")  # fmt: skip
    ap.add_argument("--combine", action="store_true",
                    help="after --program: profile the fastest oproj* and single_* variants (each faster than base) "
                         "as one variant too")  # fmt: skip
    ap.add_argument("--hlo", default=None, help="a folder for each --program variant's optimized HLO text")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="a tiny MoE with reference attention on the CPU")
    ap.add_argument("--separate-route", action="store_true", help="single-token routing in a kernel of its own")
    ap.add_argument("--pick-flags", default=None, help="print XLA_FLAGS of a --json file's fastest variant, and exit")
    args = ap.parse_args()
    if args.pick_flags:
        print(pick_flags(args.pick_flags))
        return
    if args.separate_route:  # module attribute: kiln.models.moe calls it through the module
        pallas_gpu_moe.experts_single = functools.partial(pallas_gpu_moe.experts_single, fused_route=False)
    conc = [int(c) for c in args.concurrency.split(",") if c]
    hf = {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}
    target, attention = "cuda", None
    if args.dry_run:
        hf |= dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4)  # fmt: skip
        target, attention = "cpu", "reference"
        args.prompt_len, args.max_tokens = min(args.prompt_len, 24), min(args.max_tokens, 8)
        args.dispatch_rows, args.buckets = "1,8", "8,64"
    ceil = {"copy_bytes_per_s": 1e10} if args.dry_run else ceilings(matmul=False)
    bw = ceil["copy_bytes_per_s"]
    cfg = ModelConfig.from_hf(hf)
    t0 = time.perf_counter()
    weights = random_weights(cfg, "float")
    jax.block_until_ready(weights)
    total = weight_bytes(weights)
    expert_bytes = sum(weight_bytes(getattr(lw, f)) for lw in weights.layers for f in EXPERT_FIELDS)
    per_expert = expert_bytes / (cfg.num_layers * cfg.num_experts)
    dense_bytes = total - expert_bytes - weights.embed.nbytes  # attention, norms, router, LM head (embed: rows only)
    log(f"copy {bw / 1e12:.2f} TB/s; weights {total / 1e9:.2f} GB ({expert_bytes / 1e9:.2f} GB experts) made in "
        f"{time.perf_counter() - t0:.0f} s on {jax.devices()[0].device_kind}")  # fmt: skip
    result = {"copy_bytes_per_s": bw, "weight_bytes": total, "layers": cfg.num_layers, "jax": jax.__version__}
    rows = [int(r) for r in args.dispatch_rows.split(",") if r]
    only = [d for d in args.dispatches.split(",") if d]
    result["dispatch"] = dispatch_table(cfg, weights, rows, bw, only) if rows else []

    serve_variant = args.serve_variant
    if args.program:
        pcfg, pweights = cfg, weights
        if 0 < args.program_layers < cfg.num_layers:  # the first N layers of the same weights (one model made)
            pcfg = ModelConfig.from_hf({**hf, "num_hidden_layers": args.program_layers})
            pweights = dataclasses.replace(weights, layers=weights.layers[: args.program_layers])
        pw = fuse_linears(pcfg, pweights)  # the layout engines run
        result["program"] = program_profile(pcfg, pw, args.program.split(","), args.hlo, attention or "pallas_gpu")
        both = args.combine and combined(result["program"])
        if both:  # the fastest o-proj and experts variants together
            log(f"combined variant {both!r}")
            result["program"] += program_profile(pcfg, pw, [both], args.hlo, attention or "pallas_gpu")
        del pw, pweights
        if args.serve_best:
            serve_variant = best_servable(result["program"])
            log(f"engine runs under program variant {serve_variant!r}")
    result["serve_variant"] = serve_variant
    if not conc:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    buckets = tuple(int(b) for b in args.buckets.split(","))
    ctx = args.prompt_len + args.max_tokens
    opts = Options(buckets=buckets, max_num_seqs=max(conc), max_model_len=ctx + 16, attention=attention,
                   kv_tokens=max(conc) * (ctx + 32))  # fmt: skip
    compiles = []  # (program, s) of every XLA compilation from here on

    def on_event(event: str, secs: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((kw.get("fun_name", "?"), round(secs, 2)))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    serve = [(serve_variant, conc)]
    if args.serve_base and serve_variant != "base":  # base at the first concurrency first: a before / after
        serve.insert(0, ("base", conc[:1]))
    elif args.serve_base_last and serve_variant != "base":  # after it: a time limit cuts base, not the variant
        serve.append(("base", conc[:1]))
    result["engine"], engine = [], None
    for variant, conc in serve:
        del engine
        with patched(variant):  # every program the engine compiles is traced under it
            jax.clear_caches()
            engine = engine_from_weights(cfg, weights, resolve_target(target, opts), opts, None,
                                         "qwen3-30b-a3b-random")  # fmt: skip
            # the KV cache committed to its device, as every program's output is: a fresh (uncommitted) cache gave
            # the first program called a compilation of its own, and that program compiled again inside the timed
            # run (2026-12-01: jit(step) 11.9 s, TTFT 17.7 s at c = 1)
            engine.runner.kv = jax.device_put(engine.runner.kv, jax.devices()[0])
            t0, first = time.perf_counter(), len(compiles)
            # every measured run once first, as it will run (other prompts); compilations inside a timed run are
            # reported
            for c in conc:
                run(engine, c, args.prompt_len, args.max_tokens, seed=1000 + c)
            log(f"{variant}: compile (first runs) {time.perf_counter() - t0:.0f} s: {len(compiles) - first} "
                f"compilations ({', '.join(f'{n} {s:.1f} s' for n, s in compiles[first:first + 12])})")  # fmt: skip
            for c in conc:
                before = len(compiles)
                r = run(engine, c, args.prompt_len, args.max_tokens, seed=c)
                r["compiles"] = compiles[before:]  # none, or the run's TTFT and tok/s hold compile time
                if r["compiles"]:
                    log(f"c={c}: {len(r['compiles'])} compilations inside the timed run: {r['compiles'][:6]}")
                mean_ctx = args.prompt_len + args.max_tokens / 2
                touched_experts = touched(cfg.num_experts, cfg.num_experts_per_tok, c)
                step_bytes = dense_bytes + cfg.num_layers * touched_experts * per_expert + c * mean_ctx * kv_token
                bound_ms = step_bytes / bw * 1e3
                r |= {"variant": variant, "bound_tpot_ms": bound_ms, "bound_tok_s": c / bound_ms * 1e3,
                      "tpot_fraction": bound_ms / r["tpot_ms"]}  # fmt: skip
                result["engine"].append(r)
                log(f"{variant} c={c}: {r['output_tok_s']:.0f} tok/s, TPOT {r['tpot_ms']:.2f} ms (bound {bound_ms:.2f}"
                    f" ms: {r['tpot_fraction']:.2f} of it), TTFT {r['ttft_s']:.2f} s")  # fmt: skip
                if args.json:  # what has run so far, should a later part not finish
                    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.profile:  # c = 1, one sequence decoding: its kernels per output token
        run(engine, 1, 16, 129, seed=6)  # its programs compiled outside the trace (a 16-token prompt runs in bucket 1)
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                run(engine, 1, 16, 129, seed=7)
            table, kernel_ms = kernel_table(d, 128)
        log(f"profile c=1: kernels {kernel_ms:.2f} ms per output token; top kernels (ms/token, launches/token):")
        for name, ms, n in table[:25]:
            log(f"    {ms:7.3f} ms  x{n:<4d} {name[:120]}")
        result["profile"] = {"kernel_ms_per_token": kernel_ms, "kernels": table[:60]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

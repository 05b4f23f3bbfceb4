"""Which fp8 dot pays at which row count: Llama-3-8B's linear layers in the fused layout that artifacts store (q|k|v, o,
gate|up, down; until session 28 q, k, v, gate and up apart, whose dots on one x XLA may join) of `--layers`
layers chained in one jit, at M rows, with bf16 weights, fp8 weights widened inside the dot (weight-only) and fp8 x fp8
with the rows quantized per token, as one fp8 term or two (kiln.models.quant._fp8_dot's paths, each forced). Prints
microseconds per layer, the weight stream's TB/s and each fp8 path's speed-up over bf16; FP8_WEIGHT_ONLY_MAX_ROWS and
FP8_TWO_TERM_MAX_ROWS are chosen from this table.

    python benchmarks/gpu_fp8.py --rows 1,16,64,128,256,512,2048 [--json OUT]

--pallas: the weight-only dot's two GPU forms per Llama-3-8B weight of the fused layout (q|k|v, o, gate|up, down, LM
head; (N, K) fp8 with per-channel scales, or with --format int4 int4 with scales per channel and group of 128 inputs)
at M rows: XLA's (fp8: the convert fused into its GEMM; int4: quant._int4_xla_dot) against kiln's Pallas kernel
(kiln.models.kernels.pallas_gpu_narrow) over a list of configs, each checked against the dequantized matmul on fresh
random inputs first; the bf16 weight's XLA dot beside them. Enough distinct weights per shape (>= 512 MB) that none
is read from L2. Prints device microseconds per weight (the kernels' time in a jax.profiler trace, split-K sums
included: a wall clock over many small kernels measured the host's dispatch, session 9's first sweep) and the narrow
weight's TB/s; --json writes the best config per (format, M, N, K) (None where XLA is faster) for gpu_profile.py's
--narrow-configs and pallas_gpu_narrow.CONFIGS. Above 128 rows (prefill chunks) the configs have row blocks.

    python benchmarks/gpu_fp8.py --pallas [--format int4] --rows 16,64 [--weights qkv,o] [--budget-s 90] [--json OUT]

--forms: XLA's fp8 dot per fused weight at M rows in each of quant._fp8_dot's forms: weight-only (the weight widened
inside the GEMM: wo), fp8 x fp8 (the rows quantized per token, one fp8 term: fp8, or two: fp8-2t; cuBLASLt), or
weight-only compiled with XLA's exhaustive GEMM tiling search (wo-exh; in a process of its own: XLA keeps a GEMM's
tiling per process); device microseconds per weight (as --pallas) beside the bf16 weight's dot, and how many
concatenated weights each compiled form has (XLA joined the dots of copies that share rows: --shared-x gives every
copy one x, as sessions 9-27 did). (Written weight first, (w . x.T).T, either form compiled to the same GEMM: session
27.)

    python benchmarks/gpu_fp8.py --forms --rows 16,64 [--weights qkv,o] [--form-names wo,fp8,fp8-2t] [--shared-x]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from kiln.models import quant
from kiln.models.kernels import pallas_gpu_narrow as kn
from kiln.models.quant import QuantArray

sys.path.insert(0, str(Path(__file__).parent))
from gpu_profile import trace_events  # noqa: E402

E, F, Q, KV = 4096, 14336, 4096, 1024  # Llama-3-8B
FUSED = {"qkv": (6144, E), "o": (E, Q), "gate_up": (2 * F, E), "down": (E, F), "lm_head": (128256, E)}  # (N, K)
SHAPES = {"wqkv": (E, Q + 2 * KV), "wo": (Q, E), "w_gate_up": (E, 2 * F), "w_down": (F, E)}  # (in, out), fused


def make_layers(n: int, fmt: str) -> list[dict]:
    key = jax.random.key(0)
    layers = []
    for i in range(n):
        layer = {}
        for j, (name, (k, m)) in enumerate(SHAPES.items()):
            w = jax.random.normal(jax.random.fold_in(key, i * 16 + j), (m, k), jnp.float32) * 0.02  # (out, in)
            if fmt == "bf16":
                layer[name] = w.T.astype(jnp.bfloat16)  # (in, out)
            else:
                scale = jnp.max(jnp.abs(w), axis=1) / quant.FP8_MAX
                layer[name] = QuantArray((w / scale[:, None]).astype(jnp.float8_e4m3fn), scale.astype(jnp.bfloat16))
        layers.append(layer)
    return layers


def chain(x, layers):
    for lw in layers:
        qkv = quant.dot(x, lw["wqkv"])  # (M, Q + 2 KV)
        q, k, v = qkv[:, :Q], qkv[:, Q : Q + KV], qkv[:, Q + KV :]
        o = quant.dot(q + jnp.tile(k + v, (1, Q // KV)), lw["wo"])  # (M, E)
        gu = quant.dot(x + o, lw["w_gate_up"])  # (M, 2F)
        g, u = gu[:, :F], gu[:, F:]
        x = x + quant.dot(jax.nn.silu(g) * u, lw["w_down"]) * 0.01  # (M, E)
    return x


def time_fn(fn, *args, reps: int = 20) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def split_for(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """The smallest power-of-two split of K giving >= `programs` programs, keeping >= 2 steps of block_k each."""
    split = 1
    while (n // block_n) * split < programs and k % (block_k * split * 2) == 0 and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def candidates(m: int, n: int, k: int, fmt: str, fp8_terms: tuple[int, ...] = ()) -> list[kn.Config]:
    """The configs tried for (M, N, K), most likely first. fp8 up to 128 rows: first the fp8_x forms with each of
    fp8_terms (fp8 rows against the fp8 weight, quantized in the kernel; 2 terms keep bf16's accuracy), then the
    weight-only ones: the weight tile as the dot's first operand (swap: the wgmma M side, where Triton can feed the
    widened fp8 from registers) with block_n 64 or 128, then the x-first form that session 9 measured (best: block_n
    32); block_k 128-512, K split for 1-4 programs per SM, 4 or 8 warps, 3-5 stages (fewer where the x tile is large).
    int4: both forms at block_n 32-128 and block_k 64-512, each with the bits widening and the conversion; above 128
    rows (prefill chunks) row blocks of 64-128 with 64-256 output channels, unsplit. Configs whose tiles exceed the
    kernel's shared memory budget are left out."""
    sms = kn.SMS
    out = []
    stages = 3 if m >= 64 else 4
    fp8 = (
        (True, 64, 256, 2, 4, stages), (True, 128, 256, 2, 4, 3), (True, 64, 128, 2, 4, stages + 1),
        (True, 128, 128, 2, 8, 4), (True, 64, 512, 2, 4, 3), (True, 64, 256, 4, 4, stages),
        (True, 64, 256, 1, 4, stages), (False, 32, 256, 2, 4, stages), (False, 64, 128, 2, 4, stages + 1),
        (False, 128, 256, 2, 8, 3), (False, 64, 256, 2, 4, stages),
    )  # fmt: skip
    int4_forms = (  # session 20's first sweep: the first three won; the last three fit 128 rows' shared memory
        (True, 64, 256, 2, 4, stages), (False, 32, 512, 2, 4, 3), (True, 64, 128, 2, 4, stages + 1),
        (True, 128, 256, 2, 8, 3), (False, 128, 256, 2, 8, 3), (True, 64, 256, 1, 4, stages),
        (True, 128, 128, 2, 8, 3), (False, 64, 128, 2, 4, 3), (True, 64, 64, 2, 4, 4),
    )  # fmt: skip
    int4 = [(*form, bits) for form in int4_forms for bits in (True, False)]
    forms = [c + (False,) for c in fp8] if fmt == "fp8" else int4
    if m > 128:  # prefill chunks: row blocks of 128 (64), wider weight tiles, no split (enough programs)
        forms = [(sw, bn, bk, 0, w, st, True, bm) for sw, bn, bk, w, st, bm in (
            (False, 128, 64, 8, 4, 128), (False, 128, 128, 8, 3, 128), (False, 64, 128, 4, 4, 128),
            (True, 128, 128, 8, 3, 128), (False, 256, 64, 8, 3, 128), (False, 128, 128, 4, 3, 64),
        )]  # fmt: skip
    fp8_x = (  # fp8 rows (Config.fp8_x): the weight tile the wgmma's M side, fp8 x fp8, nothing widened
        (True, 64, 256, 2, 4, stages), (True, 128, 256, 2, 4, stages), (True, 64, 512, 2, 4, 3),
        (True, 128, 128, 2, 4, stages + 1), (True, 64, 256, 1, 4, stages), (True, 64, 256, 4, 4, stages),
        (True, 128, 512, 1, 8, 3),
    )  # fmt: skip
    if fmt == "fp8" and m <= 128:
        forms = [c + (False, 0, t) for t in fp8_terms for c in fp8_x] + [c + (0, 0) for c in forms]
    else:
        forms = [(*c, *([0] * (8 - len(c))), 0) for c in forms]
    for swap, bn, bk, per_sm, warps, st, bits, bm, x8 in forms:
        if n % bn or k % bk:
            continue
        split = split_for(n, k, bn, bk, per_sm * sms) if per_sm else 1
        cfg = kn.Config(bn, bk, split, warps, st, swap, bits, bm, x8)
        if cfg.fits(n, k) and cfg.smem_bytes(m, fmt) <= kn.SMEM_BYTES and cfg not in out:
            out.append(cfg)
    return out


def narrow_weights(n: int, k: int, fmt: str, copies: int) -> tuple[list, list]:
    """`copies` random (N, K) weights in fmt with their scales: fp8 (N,), int4 (N, K // 128)."""
    key = jax.random.key(n + k)
    ws, ss = [], []
    for i in range(copies):
        kw, ks = jax.random.fold_in(key, i), jax.random.fold_in(key, 100 + i)
        if fmt == "fp8":
            ws.append((jax.random.normal(kw, (n, k), jnp.float32) * 64).astype(jnp.float8_e4m3fn))
            ss.append((jax.random.uniform(ks, (n,), jnp.float32, 0.5, 2) / quant.FP8_MAX).astype(jnp.bfloat16))
        else:
            ws.append(jax.random.randint(kw, (n, k), -7, 8, jnp.int8).astype(jnp.int4))
            ss.append((jax.random.uniform(ks, (n, k // 128), jnp.float32, 0.5, 2) / 7).astype(jnp.bfloat16))
    return ws, ss


def weight_cases(weights: list[str], rows: list[int], fmt: str):
    """Per FUSED name: enough random (N, K) weights in fmt (narrow_weights) that none is read from L2 (>= 512 MB, 2-32
    copies) and their bf16 (K, N) dequantized copies; per M of rows, bf16 inputs (M, K), one of its own per copy.
    Yields (name, ws, ss, bf, m, xs); a shape's weights are dropped when the next one's are made.

    Each copy has its own rows, as each dot of a decode program has. With one x for all copies (sessions 9-27;
    sweep_forms' shared_x again) XLA merged their dots into GEMMs over concatenated weights (4-16 weights, fp8 x fp8
    twice as slow: session 28; the pass was not identified, DotMerger's 32 MiB limit does not explain down's) and
    quantized the rows once for all of them, neither of which a program does."""
    for name in weights:
        n, k = FUSED[name]
        ws, ss = narrow_weights(n, k, fmt, max(2, min(32, (512 << 20) // (n * k))))
        bf = [kn.dequantize(w, s).astype(jnp.bfloat16).T for w, s in zip(ws, ss, strict=True)]  # (K, N)
        for m in rows:
            keys = jax.random.split(jax.random.key(m + n), len(ws))
            xs = [jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16) for key in keys]
            yield name, ws, ss, bf, m, xs
        del ws, ss, bf


def device_us(runs: list[tuple], reps: int = 3) -> list[float]:
    """Device (kernel) microseconds per call of each (fn, *args) of runs, from one jax.profiler trace: each fn's `reps`
    calls run inside a host annotation and are waited for, so the GPU kernels inside the annotation's window are its
    own (the split-K sums included). Wall time would count the host's dispatch of many small kernels."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for i, (fn, *args) in enumerate(runs):
                with jax.profiler.TraceAnnotation(f"sweep_run_{i}"):
                    for _ in range(reps):
                        out = fn(*args)
                    jax.block_until_ready(out)
        events, gpu_pids = trace_events(d)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    windows = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("ph") == "X" and str(e.get("name", "")).startswith("sweep_run_")}  # fmt: skip
    if len(windows) != len(runs) or not gpu:
        print(f"    no annotation windows or GPU events in the trace ({len(windows)}, {len(gpu)}): wall clock instead")
        return [time_fn(fn, *args, reps=10) * 1e6 for fn, *args in runs]
    out = []
    for i in range(len(runs)):
        lo, hi = windows[f"sweep_run_{i}"]
        out.append(sum(e["dur"] for e in gpu if lo <= e["ts"] <= hi) / reps)
    return out


def sweep_pallas(rows: list[int], budget_s: float, fmt: str, weights: list[str], fp8_terms: tuple[int, ...]) -> dict:
    """Device us per weight of the bf16 weight's XLA dot, the narrow format's XLA dot and each Pallas config
    (device_us), per fused weight shape and M; the best config per (fmt, M, N, K) (None where XLA was faster). Each
    (shape, M) stops compiling configs after its share of budget_s. weights: the FUSED names to sweep; fp8_terms:
    the fp8_x forms' terms (candidates)."""
    best: dict = {}
    print(f"{fmt}: | weight (N, K) | M | bf16 XLA us | XLA us | TB/s | best Pallas us | TB/s | x XLA | x bf16 | best "
          "config | tried |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    nbytes = {"fp8": 1.0, "int4": 0.5}[fmt]  # bytes a weight value
    for name, ws, ss, bf, m, xs in weight_cases(weights, rows, fmt):
        n, k = FUSED[name]
        copies = len(ws)
        refs = {}  # the reference values by fp8 rounding (block, terms); (0, 0): x as it is

        def xla(xs, ws, ss):
            if fmt == "int4":
                return [quant._int4_xla_dot(x, w, s) for x, w, s in zip(xs, ws, ss, strict=True)]
            dims = (((1,), (1,)), ((), ()))
            outs = []
            for x, w, s in zip(xs, ws, ss, strict=True):
                acc = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
                outs.append((acc * s.astype(jnp.float32)).astype(x.dtype))
            return outs

        def bf16(xs, bf):
            return [x @ w for x, w in zip(xs, bf, strict=True)]

        runs, cfgs = [(jax.jit(bf16), xs, bf), (jax.jit(xla), xs, ws, ss)], []
        jax.block_until_ready([runs[0][0](xs, bf), runs[1][0](xs, ws, ss)])
        case_start = time.perf_counter()
        for cfg in candidates(m, n, k, fmt, fp8_terms):
            if time.perf_counter() - case_start > budget_s / (len(weights) * len(rows)):
                break

            def pallas(xs, ws, ss, cfg=cfg):
                return [kn.narrow_matmul(x, w, s, cfg) for x, w, s in zip(xs, ws, ss, strict=True)]

            fn = jax.jit(pallas)
            try:
                got = fn(xs, ws, ss)[0].astype(jnp.float32)
                rounding = (cfg.block_k, cfg.fp8_x) if cfg.fp8_x else (0, 0)
                if rounding not in refs:
                    refs[rounding] = kn.matmul_reference(xs[0], ws[0], ss[0], *rounding).astype(jnp.float32)
                ref = refs[rounding]
                err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            except Exception as e:  # noqa: BLE001
                print(f"    {cfg}: failed: {str(e)[:300]}", flush=True)
                continue
            if err > 1e-2:
                print(f"    {cfg}: wrong values (max error {err:.3g} of the largest)", flush=True)
                continue
            runs.append((fn, xs, ws, ss))
            cfgs.append(cfg)
        t_bf16, t_xla, *t_cfgs = (us / copies for us in device_us(runs))
        tb = n * k * nbytes / 1e6  # MB a weight: / us = TB/s
        tried = sorted(zip(t_cfgs, cfgs, strict=True), key=lambda p: p[0])
        head = f"| {name} ({n}, {k}) | {m} | {t_bf16:.1f} | {t_xla:.1f} | {tb / t_xla:.2f}"
        if not tried:
            print(f"{head} | - | | | | | 0 |")
            continue
        us, cfg = tried[0]
        best[f"{fmt},{m},{n},{k}"] = dataclasses.asdict(cfg) if us < t_xla else None
        print(f"{head} | {us:.1f} | {tb / us:.2f} | {t_xla / us:.2f} | {t_bf16 / us:.2f} | {cfg} | {len(tried)} |",
              flush=True)  # fmt: skip
        for u, c in tried[1:]:
            print(f"    {u:.1f} us {c}")
    return best


FORMS = {  # name: (FP8_WEIGHT_ONLY_MAX_ROWS, FP8_TWO_TERM_MAX_ROWS, XLA options); wo = weight-only
    "wo": (1 << 30, 0, None),
    "wo-exh": (1 << 30, 0, {"xla_gpu_exhaustive_tiling_search": True}),
    "fp8": (0, 0, None),  # fp8 x fp8, the rows as one fp8 term
    "fp8-2t": (0, 1 << 30, None),  # fp8 x fp8, the rows as two fp8 terms stacked as rows (bf16's accuracy)
}


def merged_weights(hlo: str, weight: int) -> int:
    """How many concatenates in a compiled program's HLO text are at least two weights of `weight` elements: XLA joins
    dots that share an operand by concatenating the others (the weights, where the rows are shared)."""
    sizes = re.findall(r"= \w+\[([\d,]+)\][^=]*? concatenate\(", hlo)
    return sum(math.prod(int(d) for d in dims.split(",")) >= 2 * weight for dims in sizes)


def each_copy(xs, copies: int) -> list:
    """The rows of each copy: xs itself, or one x (--shared-x) repeated."""
    return xs if isinstance(xs, list) else [xs] * copies


def sweep_forms(rows: list[int], weights: list[str], names: list[str], shared_x: bool = False) -> None:
    """Device us per weight of the named FORMS of quant._fp8_dot (one compile each, the knobs set while it traces)
    and of the bf16 weight's dot, per fused weight shape and M; each checked against the dequantized matmul. (XLA
    keeps each GEMM's autotuning per process: run the exhaustive forms in a process of their own.)"""
    forms = {f: FORMS[f] for f in names}
    saved = quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS
    print(f"| weight (N, K) | M | bf16 us | {' | '.join(f'{f} us (TB/s)' for f in forms)} |")
    print(f"|---|---:|---:|{'---:|' * len(forms)}")
    for name, ws, ss, bf, m, xs in weight_cases(weights, rows, "fp8"):
        n, k = FUSED[name]
        copies = len(ws)
        ref = kn.matmul_reference(xs[0], ws[0], ss[0]).astype(jnp.float32)
        xs = xs[0] if shared_x else xs  # one x argument: one HLO parameter (a list of one array would be several)
        runs = [(jax.jit(lambda xs, bf: [x @ w for x, w in zip(each_copy(xs, len(bf)), bf, strict=True)]), xs, bf)]
        jax.block_until_ready(runs[0][0](xs, bf))  # compiled (and autotuned) before the trace
        labels = []
        for form, (wo_rows, two_rows, options) in forms.items():
            quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS = wo_rows, two_rows

            def fp8(xs, ws, ss):
                return [quant._fp8_dot(x, w, s) for x, w, s in zip(each_copy(xs, len(ws)), ws, ss, strict=True)]

            try:
                t0 = time.perf_counter()
                fn = jax.jit(fp8).lower(xs, ws, ss).compile(options)
                got = fn(xs, ws, ss)[0].astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            except Exception as e:  # noqa: BLE001
                print(f"    {form}: failed: {str(e)[:300]}", flush=True)
                continue
            finally:
                quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS = saved
            merged = merged_weights(fn.as_text(), n * k)
            print(f"    {name} M={m} {form}: compiled in {time.perf_counter() - t0:.1f} s, max error {err:.3g} "
                  f"of the largest, {merged} weights concatenated", flush=True)  # fmt: skip
            runs.append((fn, xs, ws, ss))
            labels.append(form)
        t_bf16, *ts = (us / copies for us in device_us(runs))
        got = dict(zip(labels, ts, strict=True))
        mb = n * k / 1e6  # fp8 MB a weight: / us = TB/s
        cells = [f"{got[f]:.1f} ({mb / got[f]:.2f})" if f in got else "-" for f in forms]
        print(f"| {name} ({n}, {k}) | {m} | {t_bf16:.1f} | {' | '.join(cells)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,128,256,512,2048")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pallas", action="store_true", help="XLA's weight-only dot against the Pallas kernel's configs")
    ap.add_argument("--forms", action="store_true", help="XLA's fp8 dot forms per fused weight (quant._fp8_dot)")
    ap.add_argument(
        "--form-names",
        default=",".join(f for f in FORMS if "exh" not in f),
        help=f"--forms: which of {','.join(FORMS)}",
    )
    ap.add_argument("--shared-x", action="store_true", help="--forms: one x for every copy (sessions 9-27's harness)")
    ap.add_argument("--format", default="fp8", choices=("fp8", "int4"), help="--pallas: the weight format")
    ap.add_argument("--budget-s", type=float, default=1e9, help="--pallas: seconds of configs, shared by the cases")
    ap.add_argument("--weights", default=",".join(FUSED), help=f"--pallas: which of {', '.join(FUSED)}")
    # session 28: two terms ran 1.06-1.39x XLA's weight-only time at 16 rows, 2.6-4.0x at 64; one fails 28 of 32
    ap.add_argument(
        "--fp8-x", default="", help="--pallas: the fp8_x forms' terms tried first (e.g. 2,1; default '': none)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.forms:
        print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
        sweep_forms(
            [int(r) for r in args.rows.split(",")], args.weights.split(","), args.form_names.split(","), args.shared_x
        )
        return
    if args.pallas:
        print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
        rows = [int(r) for r in args.rows.split(",")]
        terms = tuple(int(t) for t in args.fp8_x.split(",") if t)
        best = sweep_pallas(rows, args.budget_s, args.format, args.weights.split(","), terms)
        if args.json:
            Path(args.json).write_text(json.dumps(best, indent=1))
        return
    rows = [int(r) for r in args.rows.split(",")]
    bf16, fp8 = make_layers(args.layers, "bf16"), make_layers(args.layers, "fp8")
    layer_bytes = sum(k * m for k, m in SHAPES.values())  # fp8 bytes; bf16 twice that
    saved = quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS
    variants = (  # name, layers, (FP8_WEIGHT_ONLY_MAX_ROWS, FP8_TWO_TERM_MAX_ROWS): read when traced
        ("bf16", bf16, saved), ("fp8_weight_only", fp8, (1 << 30, 0)), ("fp8_fp8", fp8, (-1, 0)),
        ("fp8_fp8_2t", fp8, (-1, 1 << 30)),
    )  # fmt: skip
    results = []
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.layers} layers of Llama-3-8B's linears")
    print("| M | bf16 us/layer | TB/s | fp8 weight-only us | TB/s | x bf16 | fp8 x fp8 us | x bf16 "
          "| fp8 x fp8, rows as two terms us | x bf16 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in rows:
        x = jax.random.normal(jax.random.key(m), (m, E), jnp.float32).astype(jnp.bfloat16)
        row = {"rows": m}
        for name, layers, (wo_rows, two_rows) in variants:
            quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS = wo_rows, two_rows
            fn = jax.jit(lambda x, ls: chain(x, ls))  # a fresh jit per variant
            row[name] = time_fn(fn, x, layers) / args.layers * 1e6
        quant.FP8_WEIGHT_ONLY_MAX_ROWS, quant.FP8_TWO_TERM_MAX_ROWS = saved
        b, w, f, f2 = row["bf16"], row["fp8_weight_only"], row["fp8_fp8"], row["fp8_fp8_2t"]
        print(f"| {m} | {b:.1f} | {2 * layer_bytes / b / 1e6:.2f} | {w:.1f} | {layer_bytes / w / 1e6:.2f} | "
              f"{b / w:.2f} | {f:.1f} | {b / f:.2f} | {f2:.1f} | {b / f2:.2f} |", flush=True)  # fmt: skip
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

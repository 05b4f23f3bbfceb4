"""Which weight format makes the CPU matmuls fastest at SmolLM2's shapes, and does it carry to a decode step.

Times `x @ w` (x: (M, K) float32 activations) for SmolLM2-135M's weight shapes at M = 1, 4, 16 rows with the weight
stored as float32, bfloat16, int8 (per-output-channel float32 scale) in several formulations, and in the GGUF block
formats through kiln's C++ kernel (kiln.models.kernels.cpu_quant: "gguf q8_0/q4_0/q4_1" through XLA's custom call,
"... serial" the kernel alone on one thread); then one whole step (kiln.models.step) of the real embedded SmolLM2 per
weight format: float32, int8, and its own GGUF blocks (Q4_1 layers, Q8_0 embedding/LM head). Each function is jitted,
warmed up, and timed as the median of many runs (min and p90 with --spread).

    python benchmarks/cpu_matmul.py [--runs 200] [--rows 1,4,16] [--no-model] [--only "f32,gguf q4_1"]
    python benchmarks/cpu_matmul.py --llamacpp --runs 40   # the LM head (and K-quants) against llama.cpp's ggml_mul_mat
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

# (K, N) of SmolLM2-135M's matmuls: q/o, k/v, gate/up, down, lm_head (tied embedding)
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


SPREAD = False  # --spread: each cell "median (min-p90)"


def timeit(fn, *args, runs: int) -> float | str:
    """Median milliseconds of fn(*args) over `runs` calls after warm-up (with --spread: "median (min-p90)")."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    med = 1e3 * statistics.median(times)
    if not SPREAD:
        return med
    ms = sorted(1e3 * t for t in times)
    return f"{med:.3f} ({ms[0]:.3f}-{ms[int(0.9 * (len(ms) - 1))]:.3f})"


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output channel (column of the (K, N) weight): w ~ q * scale."""
    scale = np.maximum(np.abs(w).max(axis=0), 1e-8) / 127.0  # (N,)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)  # (K, N)
    return q, scale.astype(np.float32)


def variants() -> dict:
    """name -> (prepare(w) -> weight args, fn(x, *weight args) -> (M, N) float32)."""

    def f32(x, w):
        return x @ w

    def bf16(x, w):
        return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)

    def bf16_upcast(x, w):
        return x @ w.astype(jnp.float32)

    def i8_upcast(x, q, s):
        return jnp.dot(x, q.astype(jnp.float32)) * s

    def i8_dg(x, q, s):
        return jax.lax.dot_general(x, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) * s

    def i8_i8(x, q, s):  # x quantized per row too: int8 x int8 -> int32
        xs = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), 1e-8) / 127.0  # (M, 1)
        xq = jnp.clip(jnp.round(x / xs), -127, 127).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, q, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xs * s

    def i8_i8_pad(rows):  # int8 x int8 with x padded to at least `rows` rows (XLA rewrites a 1-row dot as a matvec)
        def fn(x, q, s):
            m = x.shape[0]
            if m >= rows:
                return i8_i8(x, q, s)
            return i8_i8(jnp.pad(x, ((0, rows - m), (0, 0))), q, s)[:m]

        return fn

    def i8_bf16(x, q, s):
        return jnp.dot(x.astype(jnp.bfloat16), q.astype(jnp.bfloat16), preferred_element_type=jnp.float32) * s

    def i8_t_upcast(x, qt, s):  # weight stored transposed (N, K): the dot contracts the weight's last axis
        return jax.lax.dot_general(x, qt.astype(jnp.float32), (((1,), (1,)), ((), ()))) * s

    def f32_t(x, wt):
        return jax.lax.dot_general(x, wt, (((1,), (1,)), ((), ())))

    def i8_mul_sum(x, q, s):  # no dot: broadcast multiply and reduce (a matvec XLA may fuse with the convert)
        return jnp.sum(x[:, :, None] * q.astype(jnp.float32)[None], axis=1) * s

    def kiln_int8(x, qt, s):  # what the int8 weight format runs: (N, K) weight, two int8 terms per activation row
        from kiln.models.quant import QuantArray, dot

        return dot(x, QuantArray(qt, s))

    def kiln_prepare(w):
        from kiln.models.quant import quantize_int8

        return quantize_int8(w.T, axis=1)

    def gguf(kind):  # kiln's GGUF block format of the weight, through the custom call
        from kiln.models import gguf_quant

        def prepare(w):
            return gguf_quant.quantize(w.T, kind)

        return prepare, lambda x, q, s: gguf_quant.dot(x, q, s, kind)

    def gguf_serial(kind):  # the kernel alone on this thread (no XLA, no thread pool); host arrays
        from kiln.models import gguf_quant
        from kiln.models.kernels import cpu_quant

        def prepare(w):
            return gguf_quant.quantize(w.T, kind)

        return prepare, lambda x, q, s: cpu_quant.matmul_serial(np.asarray(x), np.asarray(q), np.asarray(s), kind)

    q = quantize
    return {
        **{f"gguf {k}": gguf(k) for k in ("q8_0", "q4_0", "q4_1")},
        **{f"gguf {k} serial": gguf_serial(k) for k in ("q8_0", "q4_1")},
        "kiln int8": (kiln_prepare, kiln_int8),
        "f32": (lambda w: (w,), f32),
        "f32 (N,K)": (lambda w: (np.ascontiguousarray(w.T),), f32_t),
        "bf16 dot": (lambda w: (jnp.asarray(w, jnp.bfloat16),), bf16),
        "bf16->f32": (lambda w: (jnp.asarray(w, jnp.bfloat16),), bf16_upcast),
        "i8->f32 dot*s": (lambda w: q(w), i8_upcast),
        "i8 dot_general f32": (lambda w: q(w), i8_dg),
        "i8 x i8->i32": (lambda w: q(w), i8_i8),
        "i8 x i8 pad2": (lambda w: q(w), i8_i8_pad(2)),
        "i8 x i8 pad4": (lambda w: q(w), i8_i8_pad(4)),
        "i8->bf16 dot*s": (lambda w: q(w), i8_bf16),
        "i8 (N,K)->f32": (lambda w: (lambda a, s: (np.ascontiguousarray(a.T), s))(*q(w)), i8_t_upcast),
        "i8 mul+sum": (lambda w: q(w), i8_mul_sum),
    }


def bench_matmuls(rows: list[int], runs: int, only: list[str] | None) -> None:
    rng = np.random.default_rng(0)
    vs = variants()
    names = [n for n in vs if not only or n in only]
    print("| K x N | M | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for k, n in SHAPES:
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        prepared = {name: tuple(jnp.asarray(a) for a in vs[name][0](w)) for name in names}
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            cells = []
            for name in names:
                fn = jax.jit(vs[name][1])
                r = runs if k * n < 10_000_000 else max(runs // 4, 20)
                fn = vs[name][1] if name.endswith("serial") else fn
                t = timeit(fn, x, *prepared[name], runs=r)
                cells.append(t if isinstance(t, str) else f"{t:.3f}")
            print(f"| {k}x{n} | {m} | " + " | ".join(cells) + " |", flush=True)


class _GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _ggml():
    """llama.cpp's CPU backend (ggml) from the xllamacpp wheel, through ctypes."""
    import xllamacpp.xllamacpp as xm

    lib = ctypes.CDLL(xm.__file__)
    p = ctypes.c_void_p
    for name, res, args in [
        ("ggml_init", p, [_GgmlInitParams]),
        ("ggml_new_tensor_2d", p, [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
        ("ggml_mul_mat", p, [p, p, p]),
        ("ggml_new_graph", p, [p]),
        ("ggml_build_forward_expand", None, [p, p]),
        ("ggml_graph_compute_with_ctx", ctypes.c_int, [p, p, ctypes.c_int]),
        ("ggml_get_data", p, [p]),
        ("ggml_free", None, [p]),
        ("ggml_cpu_init", None, []),
        ("ggml_quantize_chunk", ctypes.c_size_t, [ctypes.c_int, p, p, *[ctypes.c_int64] * 3, p]),
    ]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    lib.ggml_cpu_init()
    return lib


def _contenders(lib, ctx, graph, xla, x, q, s, qd, sd, kind: str) -> dict:
    from kiln.models.kernels import cpu_quant

    xd = jnp.asarray(x)
    return {
        "kiln": lambda: cpu_quant.matmul_serial(x, q, s, kind),
        "kiln xla": lambda: xla(xd, qd, sd).block_until_ready(),
        "ggml 1": lambda: lib.ggml_graph_compute_with_ctx(ctx, graph, 1),
        "ggml 2": lambda: lib.ggml_graph_compute_with_ctx(ctx, graph, 2),
    }


GGML_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q4_k": 12, "q5_k": 13, "q6_k": 14}  # enum ggml_type


def ggml_blocks(lib, w: np.ndarray, kind: str) -> np.ndarray:
    """An (N, K) float32 weight in llama.cpp's own quantizer (ggml_quantize_chunk): rows of blocks (N, bytes)."""
    from kiln.models import gguf_quant

    lay = gguf_quant.LAYOUTS[kind]
    n, k = w.shape
    w = np.ascontiguousarray(w, np.float32)
    raw = np.empty((n, k // lay.elems * lay.nbytes), np.uint8)
    assert lib.ggml_quantize_chunk(GGML_TYPES[kind], w.ctypes.data, raw.ctypes.data, 0, n, k, None) == raw.nbytes
    return raw


def bench_llamacpp(rows: list[int], runs: int, kinds: list[str]) -> None:
    """The LM head's matmul (576 x 49152; for the K-quants, whose blocks are 256 wide, 1536 x 18432: as many weights)
    on the same GGUF blocks (made by llama.cpp's quantizer): kiln's kernel (alone on one thread, and through XLA's
    custom call with its threads) against llama.cpp's ggml_mul_mat (1 and 2 threads); the four take turns run by run.
    Also checks that both give the same products (up to their activation rounding)."""
    from kiln.models import gguf_quant
    from kiln.models.kernels import cpu_quant

    lib = _ggml()
    rng = np.random.default_rng(0)
    print("\nkiln's kernel vs llama.cpp's (ggml from xllamacpp), same blocks; median (min) ms")
    print(
        "| format | K x N | M | kiln, 1 thread | kiln via XLA | ggml 1 thread | ggml 2 threads | kiln / ggml, 1 thr |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        k, n = (576, 49152) if gguf_quant.LAYOUTS[kind].elems == 32 else (1536, 18432)
        raw = ggml_blocks(lib, (rng.standard_normal((n, k)) * 0.05).astype(np.float32), kind)
        q, s = gguf_quant.from_blocks(raw, kind)
        xla = jax.jit(lambda x, q, s, kind=kind: gguf_quant.dot(x, q, s, kind))
        qd, sd = jnp.asarray(q), jnp.asarray(s)
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            ctx = lib.ggml_init(_GgmlInitParams(raw.nbytes + (64 << 20), None, False))
            a = lib.ggml_new_tensor_2d(ctx, GGML_TYPES[kind], k, n)
            b = lib.ggml_new_tensor_2d(ctx, 0, k, m)
            ctypes.memmove(lib.ggml_get_data(a), raw.ctypes.data, raw.nbytes)
            ctypes.memmove(lib.ggml_get_data(b), x.ctypes.data, x.nbytes)
            c = lib.ggml_mul_mat(ctx, a, b)
            graph = lib.ggml_new_graph(ctx)
            lib.ggml_build_forward_expand(graph, c)
            lib.ggml_graph_compute_with_ctx(ctx, graph, 1)
            theirs = np.ctypeslib.as_array(ctypes.cast(lib.ggml_get_data(c), ctypes.POINTER(ctypes.c_float)), (m, n))
            ours = cpu_quant.matmul_serial(x, q, s, kind)
            err = np.abs(theirs - ours).max() / np.abs(ours).max()
            assert err < 1e-2, (kind, m, err)
            fns = _contenders(lib, ctx, graph, xla, x, q, s, qd, sd, kind)
            for f in fns.values():
                f()
            times = {name: [] for name in fns}
            for _ in range(runs):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t0)
            med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            cells = [f"{med[name]:.2f} ({1e3 * min(t):.2f})" for name, t in times.items()]
            print(f"| {kind} | {k}x{n} | {m} | " + " | ".join(cells) + f" | {med['kiln'] / med['ggml 1']:.2f} |",
                  flush=True)  # fmt: skip
            lib.ggml_free(ctx)


def model_batch(num_tokens: int, page: int, vocab_size: int):
    """A decode step of num_tokens sequences (one token each, 100 tokens of context) when num_tokens <= 16, else a
    prefill chunk of num_tokens tokens of one sequence; as the cpu target's bucket of that size (S = min(T, 16))."""
    from kiln.models.batch import SeqChunk, make_batch
    from kiln.models.sampling import SamplingBatch

    num_seqs = min(num_tokens, 16)
    pages_per_seq = -(-(100 + num_tokens) // page)
    if num_tokens <= 16:
        chunks = [SeqChunk(tokens=[1], start=100, pages=range(i * 8, i * 8 + 8)) for i in range(num_tokens)]
    else:
        chunks = [SeqChunk(tokens=[1] * num_tokens, start=0, pages=range(pages_per_seq))]
    max_pages = max(8, pages_per_seq)
    sampling = SamplingBatch.neutral(num_seqs, vocab_size=vocab_size)
    return make_batch(chunks, page, num_tokens, num_seqs, max_pages), sampling


def bench_model(runs: int, token_counts: list[int], attention: str) -> None:
    """One step of the embedded SmolLM2 per weight format and bucket; the formats take turns run by run, so load
    from other processes on the machine hits them alike."""
    from kiln.models.batch import KVCache
    from kiln.models.checkpoint import default_model_path, load_checkpoint
    from kiln.models.quant import quantize_weights
    from kiln.models.step import jit_step

    cfg, weights = load_checkpoint(default_model_path(), dtype=jnp.float32)
    page = 16
    step = jit_step(cfg, attention)
    int8 = quantize_weights(weights, "int8")
    gguf = quantize_weights(weights, "gguf", source=default_model_path())
    formats = {
        "float32": jax.device_put(weights),
        "int8": jax.device_put(int8),
        "gguf (q4_1, embed q8_0)": jax.device_put(gguf),
    }
    print("\nOne step of SmolLM2-135M; T tokens: T decodes of 100-token sequences (T <= 16) or one prefill chunk")
    print(f"(median ms of {runs} runs each; the formats take turns)\n")
    print("| T | " + " | ".join(f"{n} ms" for n in formats) + " | " + " | ".join(
        f"{n} speed-up" for n in list(formats)[1:]) + " |")  # fmt: skip
    print("|---:|" + "---:|" * (2 * len(formats) - 1))
    for num_tokens in token_counts:
        batch, sampling = model_batch(num_tokens, page, cfg.vocab_size)
        state = {}
        for name, w in formats.items():
            kv = KVCache.create(cfg, 16 * 8 + 32, page, jnp.float32)
            for _ in range(3):
                _, kv = step(w, kv, batch, sampling)
            state[name] = jax.block_until_ready(kv)
        times = {name: [] for name in formats}
        for _ in range(runs if num_tokens <= 16 else max(runs // 5, 5)):
            for name, w in formats.items():
                t0 = time.perf_counter()
                out, state[name] = step(w, state[name], batch, sampling)
                jax.block_until_ready(out)
                times[name].append(time.perf_counter() - t0)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        cells = [f"{ms[n]:.2f}" for n in formats] + [f"{ms['float32'] / ms[n]:.2f}x" for n in list(formats)[1:]]
        print(f"| {num_tokens} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--tokens", default="1,4,16,256", help="token buckets of the whole-model steps")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--no-matmul", action="store_true")
    ap.add_argument("--attention", default="xla_cpu", help="attention of the whole-model steps (the cpu target's)")
    ap.add_argument("--spread", action="store_true", help="matmul cells as median (min-p90)")
    ap.add_argument("--llamacpp", action="store_true", help="only the LM head against llama.cpp's ggml (xllamacpp)")
    ap.add_argument("--kinds", default="q8_0,q4_1,q4_k,q5_k,q6_k", help="GGUF kinds of --llamacpp")
    args = ap.parse_args()
    global SPREAD
    SPREAD = args.spread
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    if args.llamacpp:
        return bench_llamacpp([int(r) for r in args.rows.split(",")], args.runs, args.kinds.split(","))
    if not args.no_matmul:
        bench_matmuls([int(r) for r in args.rows.split(",")], args.runs, args.only and args.only.split(","))
    if not args.no_model:
        bench_model(max(args.runs // 4, 20), [int(t) for t in args.tokens.split(",")], args.attention)


if __name__ == "__main__":
    main()

"""End to end on one GPU: a Llama-3-8B-shaped model with random bf16 weights, compiled for cuda, served, and driven
by `kiln bench`; the device's copy bandwidth and bf16 matmul rate measured in the same run give a roofline for every
point; Hugging Face transformers (static cache + torch.compile) on the same weights, batch and lengths is the peer.

    python benchmarks/gpu_e2e.py --phase kiln --out /tmp/e2e      # ceilings, checkpoint, compile, serve, bench
    python benchmarks/gpu_e2e.py --phase hf --out /tmp/e2e        # ceilings, checkpoint, transformers peer

Each phase prints a table and writes JSON next to it. Phases are separate so each fits one device call.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16", hidden_act="silu",
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ceilings(matmul: bool = True) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul rate, measured with torch on random data
    on the current CUDA device."""
    import torch

    n = 1 << 30  # 2 GiB of bf16 per buffer, far beyond L2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    copy_bw = 2 * a.numel() * 2 / times[len(times) // 2]
    del a, b
    if not matmul:
        torch.cuda.empty_cache()
        return {"copy_bytes_per_s": copy_bw}
    x = torch.randn(MATMUL_M, MATMUL_M, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(MATMUL_M, MATMUL_M, device="cuda", dtype=torch.bfloat16)
    flops = matmul_rate(torch.matmul, x, y)
    del x, y
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy_bw, "bf16_flops_per_s": flops, "device": torch.cuda.get_device_name()}


MATMUL_M = 8192  # the square matmul that matmul_rate times


def matmul_rate(mm, x, y) -> float:
    """FLOP/s of mm(x, y), a CUDA matmul of two MATMUL_M-square operands: 3 calls to warm up, then 10 timed."""
    import torch

    for _ in range(3):
        mm(x, y)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        mm(x, y)
    torch.cuda.synchronize()
    return 2 * MATMUL_M**3 * 10 / (time.perf_counter() - t0)


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json of a word-level tokenizer: word "tI" is token id I, Llama 3's
    <|begin_of_text|> and <|end_of_text|> at 128000 and 128001."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<|begin_of_text|>"], vocab["<|end_of_text|>"] = 128000, 128001
    del vocab["t128000"], vocab["t128001"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_checkpoint(folder: Path) -> None:
    """config.json, a word-level tokenizer of the model's vocabulary size, and random bf16 safetensors shards."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "model.safetensors.index.json").exists():
        return
    cfg = LLAMA3_8B
    (folder / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(folder, cfg["vocab_size"])
    e, f, h, kv, d, v = 4096, 14336, 32, 8, 128, cfg["vocab_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale).cpu()

    weight_map = {}
    shard = {"model.embed_tokens.weight": rnd(v, e), "model.norm.weight": 1 + rnd(e), "lm_head.weight": rnd(v, e)}
    save_file(shard, folder / "model-top.safetensors")
    weight_map.update(dict.fromkeys(shard, "model-top.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shard = {
            p + "input_layernorm.weight": 1 + rnd(e), p + "post_attention_layernorm.weight": 1 + rnd(e),
            p + "self_attn.q_proj.weight": rnd(h * d, e), p + "self_attn.k_proj.weight": rnd(kv * d, e),
            p + "self_attn.v_proj.weight": rnd(kv * d, e), p + "self_attn.o_proj.weight": rnd(e, h * d),
            p + "mlp.gate_proj.weight": rnd(f, e), p + "mlp.up_proj.weight": rnd(f, e),
            p + "mlp.down_proj.weight": rnd(e, f),
        }  # fmt: skip
        name = f"model-{i:05d}.safetensors"
        save_file(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def param_count() -> int:
    e, f, h, kv, d, v, n = 4096, 14336, 32, 8, 128, 128256, 32
    return 2 * v * e + e + n * (2 * e + e * h * d * 2 + e * kv * d * 2 + 3 * e * f)


def roofline(
    ceil: dict, concurrency: int, input_len: int, output_len: int, kv_itemsize: int = 2, weight_itemsize: float = 2
) -> dict:
    """Lower bounds: a decode step reads every weight once (weight_itemsize bytes each: 1 with int8 and fp8) plus the
    KV of every running sequence; a prefill does 2 x params FLOPs per token."""
    weight_bytes = param_count() * weight_itemsize
    kv_bytes_per_token = 32 * 2 * 8 * 128 * kv_itemsize  # layers x (K, V) x kv heads x head_dim x bytes
    avg_ctx = input_len + output_len / 2
    step_s = (weight_bytes + concurrency * avg_ctx * kv_bytes_per_token) / ceil["copy_bytes_per_s"]
    prefill_s = 2 * param_count() * input_len / ceil["bf16_flops_per_s"]
    return {
        "decode_step_s": step_s,
        "tpot_ms": step_s * 1e3,
        "output_tokens_per_s": concurrency / step_s,
        "ttft_ms_one_prompt": prefill_s * 1e3,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(art: Path, env: dict, *extra: str) -> tuple[subprocess.Popen, int, float]:
    """`kiln serve ART` on a free port; returns (process, port, seconds until /health answered 200)."""
    import httpx

    port = free_port()
    t0 = time.time()
    server = subprocess.Popen([sys.executable, "-m", "kiln.serving.cli", "serve", str(art), "--port", str(port),
                               *extra], env=env)  # fmt: skip
    while True:
        if server.poll() is not None:
            raise SystemExit(f"kiln serve exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server, port, time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def phase_kiln(args, out: Path, ceil: dict) -> dict:
    ckpt = out / "llama3-8b-random"
    art = out / "artifact"
    t0 = time.time()
    write_checkpoint(ckpt)
    log(f"checkpoint written in {time.time() - t0:.0f} s")
    kiln = [sys.executable, "-m", "kiln.serving.cli"]
    t0 = time.time()
    if not (art / "manifest.json").exists():
        subprocess.run([*kiln, "compile", "--model", str(ckpt), "--target", "cuda", "--out", str(art),
                        "--max-model-len", str(args.input_len + args.output_len + 64), *args.compile_args.split()],
                       check=True)  # fmt: skip
    compile_s = time.time() - t0
    log(f"kiln compile took {compile_s:.0f} s")
    manifest = json.loads((art / "manifest.json").read_text())
    kv_dtype = manifest["geometry"]["kv_dtype"]
    kv_itemsize = 1 if "float8" in kv_dtype else 2
    weight_format = manifest["weights"]["format"]
    weight_itemsize = {"int8": 1, "fp8": 1, "int4": 0.5}.get(weight_format, 2)
    server, port, start_s = start_server(art, dict(os.environ))
    try:
        log(f"kiln serve ready in {start_s:.1f} s")
        results = []
        for i, c in enumerate(args.concurrency):
            res = out / f"bench_c{c}.json"
            res.unlink(missing_ok=True)
            seed = ["--seed", str(args.seeds[i])] if args.seeds else []
            subprocess.run([*kiln, "bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--vocab-size", "128000",
                            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                            "--concurrency", str(c), "--num-prompts", str(max(c, args.min_prompts)),
                            "--json", str(res), *seed], check=False)  # fmt: skip
            if res.exists():
                level = json.loads(res.read_text())["levels"][0]
                results.append(level | {"seed": args.seeds[i] if args.seeds else 0})
    finally:
        server.terminate()
        server.wait(60)
    print(f"\nweights {weight_format}, KV {kv_dtype}")
    print("| concurrency | seed | out tok/s | roofline tok/s | fraction | TPOT p50 ms | TPOT p99 ms | "
          "roofline TPOT ms | TTFT p50 ms | TTFT p99 ms | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        roof = roofline(ceil, r["concurrency"], args.input_len, args.output_len, kv_itemsize, weight_itemsize)
        print(f"| {r['concurrency']} | {r['seed']} | {r['output_tokens_per_s']:.0f} | "
              f"{roof['output_tokens_per_s']:.0f} | {r['output_tokens_per_s'] / roof['output_tokens_per_s']:.2f} | "
              f"{r['tpot_ms']['p50']:.2f} | "
              f"{r['tpot_ms']['p99']:.2f} | {roof['tpot_ms']:.2f} | {r['ttft_ms']['p50']:.0f} | "
              f"{r['ttft_ms']['p99']:.0f} | {r['duration_s']:.3f} |")  # fmt: skip
    return {"compile_s": compile_s, "serve_ready_s": start_s, "kv_dtype": kv_dtype, "weight_format": weight_format,
            "levels": results}  # fmt: skip


def phase_hf(args, out: Path, ceil: dict) -> dict:
    import torch
    import transformers

    ckpt = out / "llama3-8b-random"
    write_checkpoint(ckpt)
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda").eval()
    # A static cache makes transformers compile the decoding step itself (generation_config.compile_config);
    # wrapping forward in torch.compile(mode="reduce-overhead") by hand breaks on its CUDA graphs (seen here).
    model.generation_config.cache_implementation = "static"
    model.generation_config.eos_token_id = None
    results = []
    deadline = time.time() + args.hf_budget_s
    for c in args.concurrency:
        if time.time() > deadline:
            log(f"HF peer: time budget spent, batch {c} not run")
            continue
        ids = torch.randint(0, 128000, (c, args.input_len), device="cuda")
        kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False)
        with torch.no_grad():
            model.generate(ids, **kw)  # warm-up: compiles for this batch size
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen = model.generate(ids, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        assert gen.shape[1] == args.input_len + args.output_len
        results.append({"concurrency": c, "output_tokens_per_s": c * args.output_len / dt, "seconds": dt})
        log(f"HF batch {c}: {c * args.output_len / dt:.0f} out tok/s ({dt:.1f} s)")
        torch._dynamo.reset()
    print("\n| batch | HF out tok/s (static cache + torch.compile) | roofline tok/s | fraction |")
    print("|---|---|---|---|")
    for r in results:
        roof = roofline(ceil, r["concurrency"], args.input_len, args.output_len)
        print(f"| {r['concurrency']} | {r['output_tokens_per_s']:.0f} | {roof['output_tokens_per_s']:.0f} | "
              f"{r['output_tokens_per_s'] / roof['output_tokens_per_s']:.2f} |")  # fmt: skip
    return {"levels": results}


def prefill_flops(tokens: int) -> float:
    """The matmul work of one prompt of `tokens` from position 0: every linear layer on every token (the embedding
    is a lookup and the LM head runs on the last token only) plus causal attention (QK^T and PV over half the
    square)."""
    e, h, d, v, n = 4096, 32, 128, 128256, 32
    linear = param_count() - 2 * v * e
    return 2 * linear * tokens + 2 * v * e + n * 2 * h * d * tokens * tokens


def pipelined_ms(prog, weights, kv, batch, sampling, n: int):
    """Milliseconds per call of n calls of a step program enqueued back to back (inputs already on the device, the
    tokens read once at the end), and the cache it leaves."""
    import numpy as np

    t0 = time.perf_counter()
    for _ in range(n):
        out, kv = prog(weights, kv, batch, sampling)
    np.asarray(out.tokens)
    return (time.perf_counter() - t0) / n * 1e3, kv


def decode_inputs(geom, t: int, live: int, ctx: int, vocab: int, first_page: int = 0, room: int = 0) -> tuple:
    """Numpy inputs of a decode step in bucket t: `live` sequences with ctx cached keys and one new token each, each on
    its own run of pages from first_page, sized for ctx + room + 1 keys, and neutral sampling rows. geom: an artifact
    or a Runner (page_size, seqs_per_bucket, max_pages_per_seq)."""
    from kiln.models.batch import SeqChunk, make_batch
    from kiln.models.sampling import SamplingBatch

    per_seq = -(-(ctx + room + 1) // geom.page_size)
    chunks = [SeqChunk([5], ctx, list(range(first_page + i * per_seq, first_page + (i + 1) * per_seq)))
              for i in range(live)]  # fmt: skip
    s = geom.seqs_per_bucket[t]
    return (make_batch(chunks, geom.page_size, t, s, geom.max_pages_per_seq),
            SamplingBatch.neutral(s, vocab_size=vocab))  # fmt: skip


def time_prefill(art, kv, tokens: int, ceil: dict) -> dict:
    """One prompt of `tokens` tokens through the step program of that bucket, pipelined; its time against the
    matmul rate."""
    import jax
    import numpy as np

    from kiln.models.batch import SeqChunk, make_batch
    from kiln.models.sampling import SamplingBatch

    s = art.seqs_per_bucket[tokens]
    pages = list(range(-(-(tokens + 1) // art.page_size)))
    batch = jax.device_put(make_batch([SeqChunk(list(range(7, 7 + tokens)), 0, pages)], art.page_size, tokens, s,
                                      art.max_pages_per_seq))  # fmt: skip
    sb = jax.device_put(SamplingBatch.neutral(s, vocab_size=art.cfg.vocab_size))
    prog = art.programs[tokens]
    for _ in range(2):
        o, kv = prog(art.weights, kv, batch, sb)
    np.asarray(o.tokens)
    ms, kv = pipelined_ms(prog, art.weights, kv, batch, sb, 10)
    flops = prefill_flops(tokens)
    frac = flops / (ms / 1e3) / ceil["bf16_flops_per_s"]
    log(f"prefill of one {tokens}-token prompt (T={tokens}): {ms:.2f} ms, {flops / 1e12:.1f} TFLOP of matmul work, "
        f"{flops / ms / 1e9:.0f} TFLOP/s = {frac:.2f} of the measured bf16 matmul rate")  # fmt: skip
    return {"tokens": tokens, "ms": ms, "tflop": flops / 1e12, "fraction_of_matmul_rate": frac}, kv


def engine_tpot_ms(llm, rng, vocab: int, c: int, input_len: int, output_len: int) -> float:
    """Milliseconds per decode step of the engine without HTTP (LLM.generate): c greedy requests of input_len random
    tokens run for 1 and for output_len tokens; the difference over output_len - 1 steps."""
    from kiln.serving.params import SamplingParams

    times = {}
    for m in (1, output_len):  # fresh prompts each time: the prefix cache must not serve the second run
        prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(c)]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        times[m] = time.perf_counter() - t0
    return (times[output_len] - times[1]) / (output_len - 1) * 1e3


def phase_diagnose(args, out: Path, ceil: dict) -> dict:
    """Where a decode step's time goes: the step program alone (inputs already on the device, steps pipelined),
    the program with host inputs and a read of the tokens each step (what the engine pays at least), and the
    engine without HTTP (LLM.generate). Compare with kiln bench's TPOT through the server."""
    import jax
    import numpy as np

    from kiln.compile.artifact import load
    from kiln.serving.llm import LLM
    from kiln.serving.params import SamplingParams

    art = load(out / "artifact")
    kv = art.make_kv()
    ctx = args.input_len + args.output_len // 2
    rows = []
    for c in args.concurrency:
        t = next(b for b in art.buckets if b >= c)
        s = art.seqs_per_bucket[t]
        batch, sb = decode_inputs(art, t, c, ctx, art.cfg.vocab_size)
        prog = art.programs[t]
        o, kv = prog(art.weights, kv, batch, sb)
        np.asarray(o.tokens)
        dbatch, dsb = jax.device_put(batch), jax.device_put(sb)
        n = 30
        device_ms, kv = pipelined_ms(prog, art.weights, kv, dbatch, dsb, n)
        t0 = time.perf_counter()
        for _ in range(n):
            o, kv = prog(art.weights, kv, batch, sb)
            np.asarray(o.tokens)
        sync_ms = (time.perf_counter() - t0) / n * 1e3
        row = {"concurrency": c, "bucket": t, "seqs": s, "program_ms": device_ms, "program_sync_ms": sync_ms}
        log(f"decode c={c} (T={t}, S={s}, ctx {ctx}): program {device_ms:.2f} ms/step pipelined, "
            f"{sync_ms:.2f} ms/step with host inputs + token read")  # fmt: skip
        if t in art.decode_programs and c <= s:  # the multi-step decode program: K tokens per call, same read
            k, prog = art.decode_steps, art.decode_programs[t]
            o, kv = prog(art.weights, kv, batch, sb)
            np.asarray(o.tokens)
            t0 = time.perf_counter()
            for _ in range(max(2, n // k)):
                o, kv = prog(art.weights, kv, batch, sb)
                np.asarray(o.tokens)
            row["decode_steps"] = k
            row["multi_sync_ms"] = (time.perf_counter() - t0) / (max(2, n // k) * k) * 1e3
            log(f"decode c={c}: {k} steps per dispatch, {row['multi_sync_ms']:.2f} ms/token with host inputs + read")
        rows.append(row)
    prefill = []
    for t in (b for b in art.buckets if b >= 1024):
        res, kv = time_prefill(art, kv, t, ceil)
        prefill.append(res)
    del kv
    llm = LLM(out / "artifact")
    rng = np.random.default_rng(0)
    vocab = min(128000, art.cfg.vocab_size)
    warm = [rng.integers(0, vocab, args.input_len).tolist() for _ in range(max(args.concurrency))]
    llm.generate(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # first calls, page pool
    for row in rows:
        c = row["concurrency"]
        row["engine_tpot_ms"] = engine_tpot_ms(llm, rng, vocab, c, args.input_len, args.output_len)
        log(f"engine (no HTTP) c={c}: {row['engine_tpot_ms']:.2f} ms per decode step")
    return {"diagnose": rows, "prefill": prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=["kiln", "hf", "diagnose"], required=True)
    ap.add_argument("--out", default=os.environ.get("E2E_DIR", "/tmp/kiln-e2e"))
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--seeds", default="", help="kiln bench's --seed for each level of --concurrency (one number: "
                    "for all): a level run again with another seed finds none of its prompts in the prefix cache, "
                    "with the same seed all of them")  # fmt: skip
    ap.add_argument("--compile-args", default="", help="extra arguments for kiln compile")
    ap.add_argument("--hf-budget-s", type=float, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else []
    if len(args.seeds) == 1:
        args.seeds *= len(args.concurrency)
    if args.seeds and len(args.seeds) != len(args.concurrency):
        ap.error("--seeds takes one seed, or one per --concurrency level")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if torch.cuda.is_available():
        ceil = ceilings()
    else:  # a dry run of the flow on a machine without a GPU
        ceil = {"copy_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11, "device": "none"}
    log(f"{ceil['device']}: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")  # fmt: skip
    phases = {"kiln": phase_kiln, "hf": phase_hf, "diagnose": phase_diagnose}
    result = phases[args.phase](args, out, ceil)
    result.update(ceilings=ceil, args=vars(args), command="python benchmarks/gpu_e2e.py " + " ".join(sys.argv[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

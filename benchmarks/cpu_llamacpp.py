"""kiln against llama.cpp on this machine's CPU, same GGUF (the embedded SmolLM2-135M-Instruct Q4_1), one run.

Starts `kiln serve` (default model) and llama.cpp's server (the `xllamacpp` wheel, which serves the same GGUF over an
OpenAI-compatible endpoint), then drives both with `kiln bench` at each concurrency level, alternating between the
servers level by level, and prints kiln's output throughput over llama.cpp's. Repeat --kiln-args to serve several
kiln variants (each with its own artifact) in the same run; leading NAME=VALUE words of one are environment variables
of that server (e.g. "KILN_CPU_QUANT_NOPACK=1 --quantize gguf": the kernel's per-row paths, for an A/B).

    pip install xllamacpp && python benchmarks/cpu_llamacpp.py --concurrency 1,4,16 --input-len 128 --output-len 64
    python benchmarks/cpu_llamacpp.py --greedy-chat "What is the capital of France?"   # both servers' greedy answers
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

LATER_S = 30.0  # seconds after ready for kiln serve's deferred programs (kiln.serving.llm.Later)
LLAMA_SERVER = """
import sys, time
import xllamacpp as x
p = x.CommonParams()
p.model.path = sys.argv[1]
p.n_parallel = int(sys.argv[3])
p.n_ctx = int(sys.argv[4])
p.port = int(sys.argv[2])
p.cpuparams.n_threads = int(sys.argv[5])
p.cpuparams_batch.n_threads = int(sys.argv[5])
s = x.Server(p)
print("listening", s.listening_address, flush=True)
while True:
    time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready ({url})")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"server not ready after {timeout:.0f} s ({url})")


def bench(base_url: str, model: str, args, concurrency: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kiln.serving.cli", "bench", "--base-url", base_url, "--model", model,
           "--vocab-size", str(args.vocab_size), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--concurrency", str(concurrency), "--num-prompts", str(max(2 * concurrency, 8)),
           "--json", str(out)]  # fmt: skip
    # kiln bench draws each level's prompts from (seed, level): both servers get the same prompts at a level, and no
    # level repeats an earlier one's (with one generator, concurrency 4's 8 prompts were concurrency 1's 8, answered
    # from llama.cpp's prompt cache)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["levels"][0]


def greedy_chat(question: str, threads: int, max_tokens: int = 24) -> None:
    """The greedy answer to one chat question, from llama.cpp and from kiln (float32 and --quantize gguf, jitted in
    this process) on the same GGUF and the same prompt tokens (kiln's chat template, as tests/test_engine.py's), with
    the top-3 log-probabilities of the first tokens: whether a near tie goes the same way in both."""
    from kiln.models.checkpoint import default_model_path
    from kiln.serving.llm import LLM
    from kiln.serving.params import SamplingParams

    gguf = str(default_model_path())
    port = free_port()
    llama = subprocess.Popen([sys.executable, "-c", LLAMA_SERVER, gguf, str(port), "1", "2048", str(threads)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", llama, 300)
        answers = {}
        for quantize in ("float", "gguf"):
            llm = LLM(None, target="cpu", quantize=quantize)
            tok = llm.tokenizer
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)
            [out] = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=3))
            top = [[(tok.decode([t]), lp) for t, lp in p.top] for p in out.logprobs[:3]]
            answers[f"kiln --quantize {quantize}"] = (out.new_text, top)
            del llm
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "n_probs": 3, "cache_prompt": False}
        r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=600).json()
        top = [[(t["token"], t["logprob"]) for t in p["top_logprobs"]] for p in r["completion_probabilities"][:3]]
        answers[f"llama.cpp ({threads} threads)"] = (r["content"], top)
    finally:
        llama.terminate()
        llama.wait(30)
    print(f"\ngreedy answers to {question!r}, {gguf}")
    for name, (text, top) in answers.items():
        print(f"{name}: {text!r}")
        for i, alts in enumerate(top):
            print(f"    token {i}: " + ", ".join(f"{t!r} {lp:.4f}" for t, lp in alts))
    print("command: python benchmarks/cpu_llamacpp.py " + " ".join(sys.argv[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--kiln-args", action="append", default=None, help="extra `kiln serve` arguments (repeatable)")
    ap.add_argument("--greedy-chat", default=None, help="only compare greedy answers to this chat question")
    args = ap.parse_args()
    if args.greedy_chat:
        return greedy_chat(args.greedy_chat, args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]

    from kiln.models.checkpoint import default_model_path

    gguf = str(default_model_path())
    variants = args.kiln_args or [""]
    llama_port = free_port()
    ctx = max(levels) * (args.input_len + args.output_len + 16)
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            kilns = []  # (label, port, process); each variant compiles its artifact into its own folder
            for i, extra in enumerate(variants):
                port = free_port()
                words = extra.split()
                env = {**os.environ}
                while words and "=" in words[0] and words[0].split("=")[0].isupper():
                    name, _, value = words.pop(0).partition("=")
                    env[name] = value
                if len(variants) > 1:
                    env["KILN_ARTIFACTS"] = str(Path(tmp) / f"artifacts{i}")
                proc = subprocess.Popen([sys.executable, "-m", "kiln.serving.cli", "serve", "--port", str(port),
                                         *words], env=env)  # fmt: skip
                procs.append(proc)
                kilns.append((f"kiln {extra}".strip(), port, proc))
            llama = subprocess.Popen([sys.executable, "-c", LLAMA_SERVER, gguf, str(llama_port), str(max(levels)),
                                      str(ctx), str(args.threads)])  # fmt: skip
            procs.append(llama)
            wait_ready(f"http://127.0.0.1:{llama_port}/health", llama, 300)
            for _, port, proc in kilns:
                wait_ready(f"http://127.0.0.1:{port}/health", proc, 1200)
            # a CPU kiln serve is ready before its larger programs are in and loads them while idle (~12 s for
            # SmolLM2's five): wait, or they load during llama.cpp's first level and take its cores
            time.sleep(LATER_S)
            models = [httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] for _, port, _ in kilns]
            rows = []
            for c in levels:  # alternate: every server at one level, then the next level
                ks = [bench(f"http://127.0.0.1:{port}/v1", models[i], args, c, Path(tmp) / f"k{i}-{c}.json")
                      for i, (_, port, _) in enumerate(kilns)]  # fmt: skip
                ll = bench(f"http://127.0.0.1:{llama_port}/v1", gguf, args, c, Path(tmp) / f"l{c}.json")
                rows.append((c, ks, ll))
        print(f"\nkiln vs llama.cpp, SmolLM2-135M-Instruct Q4_1, input {args.input_len}, output {args.output_len}, "
              f"{args.threads} threads")  # fmt: skip
        print("| concurrency | server | out tok/s | / llama.cpp | TTFT p50 ms | TPOT p50 ms |")
        print("|---|---|---|---|---|---|")
        for c, ks, ll in rows:
            for (label, _, _), k in zip(kilns, ks, strict=True):
                ratio = k["output_tokens_per_s"] / ll["output_tokens_per_s"]
                print(f"| {c} | {label} | {k['output_tokens_per_s']:.1f} | {ratio:.2f} | {k['ttft_ms']['p50']:.0f} | "
                      f"{k['tpot_ms']['p50']:.1f} |")  # fmt: skip
            print(f"| {c} | llama.cpp | {ll['output_tokens_per_s']:.1f} | 1.00 | {ll['ttft_ms']['p50']:.0f} | "
                  f"{ll['tpot_ms']['p50']:.1f} |")  # fmt: skip
        print("command: python benchmarks/cpu_llamacpp.py " + " ".join(sys.argv[1:]))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()

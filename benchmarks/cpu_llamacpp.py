"""kiln against llama.cpp on this machine's CPU, same GGUF (the embedded SmolLM2-135M-Instruct Q4_1), one run.

Starts `kiln serve` (default model) and llama.cpp's server (the `xllamacpp` wheel, which serves the same GGUF over an
OpenAI-compatible endpoint), then drives both with `kiln bench` at each concurrency level, alternating between the
servers level by level, and prints kiln's output throughput over llama.cpp's.

    pip install xllamacpp && python benchmarks/cpu_llamacpp.py --concurrency 1,4,16 --input-len 128 --output-len 64
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
           "--seed", "0", "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["levels"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--kiln-args", default="", help="extra arguments for `kiln serve`")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    from kiln.models.checkpoint import default_model_path

    gguf = str(default_model_path())
    kiln_port, llama_port = free_port(), free_port()
    ctx = max(levels) * (args.input_len + args.output_len + 16)
    procs = []
    try:
        kiln = subprocess.Popen([sys.executable, "-m", "kiln.serving.cli", "serve", "--port", str(kiln_port),
                                 *args.kiln_args.split()])  # fmt: skip
        procs.append(kiln)
        llama = subprocess.Popen([sys.executable, "-c", LLAMA_SERVER, gguf, str(llama_port), str(max(levels)),
                                  str(ctx), str(args.threads)])  # fmt: skip
        procs.append(llama)
        wait_ready(f"http://127.0.0.1:{llama_port}/health", llama, 300)
        wait_ready(f"http://127.0.0.1:{kiln_port}/health", kiln, 1200)
        kiln_model = httpx.get(f"http://127.0.0.1:{kiln_port}/v1/models").json()["data"][0]["id"]
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for c in levels:  # alternate: both servers at one level, then the next level
                k = bench(f"http://127.0.0.1:{kiln_port}/v1", kiln_model, args, c, Path(tmp) / f"k{c}.json")
                ll = bench(f"http://127.0.0.1:{llama_port}/v1", gguf, args, c, Path(tmp) / f"l{c}.json")
                rows.append((c, k, ll))
        print(f"\nkiln vs llama.cpp, SmolLM2-135M-Instruct Q4_1, input {args.input_len}, output {args.output_len}, "
              f"{args.threads} threads")  # fmt: skip
        print("| concurrency | kiln out tok/s | llama.cpp out tok/s | kiln / llama.cpp | kiln TTFT p50 ms | "
              "llama.cpp TTFT p50 ms | kiln TPOT p50 ms | llama.cpp TPOT p50 ms |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for c, k, ll in rows:
            ratio = k["output_tokens_per_s"] / ll["output_tokens_per_s"]
            print(f"| {c} | {k['output_tokens_per_s']:.1f} | {ll['output_tokens_per_s']:.1f} | {ratio:.2f} | "
                  f"{k['ttft_ms']['p50']:.0f} | {ll['ttft_ms']['p50']:.0f} | {k['tpot_ms']['p50']:.1f} | "
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

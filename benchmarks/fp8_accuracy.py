"""SmolLM2 with fp8 weights against float32: relative logit error and argmax agreement per parity prompt, teacher-forced
along float32's greedy path (tests/test_fp8.py's procedure, 32 new tokens), with each --blocks setting of how the dots
of up to FP8_WEIGHT_ONLY_MAX_ROWS rows (here the prompts' 128-token step and every decode step) take their rows:

* 0: bf16 (weight-only, today's decode dot);
* B: quantized as pallas_gpu_narrow's fp8_x kernel would at decode, each row's blocks of B inputs to float8_e4m3fn
  with a scale each (-1: the whole row, as quant's fp8 x fp8 dots); BxT: as T such terms (quant.quantize_fp8_terms,
  Config.fp8_x = T). A block must divide SmolLM2's 576 and 1536 inputs (32, 64, 192);
* prefill: the prompts' step with its rows as one fp8 term a row (the served fp8 x fp8 dots of prompts above 128
  tokens), every decode step bf16.

Runs on the CPU with the kernel's reference numerics (pallas_gpu_narrow.matmul_reference). The issue's bar: argmax
agreement >= 28 of 32 on every prompt.

    python benchmarks/fp8_accuracy.py --blocks 0,32,64,192,-1,32x2,64x2,192x2,-1x2,prefill
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from test_quant import NEW_TOKENS, greedy, smollm2_reference  # noqa: E402

from kiln.models import quant  # noqa: E402
from kiln.models.kernels import pallas_gpu_narrow as kn  # noqa: E402
from kiln.models.transformer import forward, logits  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="0,64,-1,64x2,prefill", help="a row's fp8 scale's inputs[xTERMS], or prefill")
    args = ap.parse_args()
    cfg, weights, _, prompts, _, ref_seqs, ref = smollm2_reference()
    q = quant.quantize_weights(weights, "fp8")
    weight_only = quant._fp8_dot
    for spec in args.blocks.split(","):
        prefill = spec == "prefill"
        block, terms = (-1, 1) if prefill else (int(v) for v in (spec + "x1").split("x")[:2])

        def dot(x, w, s, block=block, terms=terms, prefill=prefill):
            rows = x.shape[0]  # the prompts' step 128, a decode step 4
            if block and (rows > 16 if prefill else rows <= quant.FP8_WEIGHT_ONLY_MAX_ROWS):
                return kn.matmul_reference(x, w, s, x.shape[1] if block < 0 else block, terms)
            return weight_only(x, w, s)

        @jax.jit
        def run(weights, kv, batch):
            hidden, kv = forward(cfg, weights, kv, batch)
            return logits(cfg, weights, hidden), kv

        quant._fp8_dot = dot  # read when traced: run is a fresh jit
        t0 = time.perf_counter()
        try:
            _, forced = greedy(cfg, q, prompts, run, forced=ref_seqs, new_tokens=NEW_TOKENS)
        finally:
            quant._fp8_dot = weight_only
        report = []
        for s in range(len(prompts)):
            err = float(np.linalg.norm(forced[s] - ref[s]) / np.linalg.norm(ref[s]))
            report.append(f"{int((forced[s].argmax(-1) == ref[s].argmax(-1)).sum())} of {NEW_TOKENS}, {err:.1%}")
        name = "prefill" if prefill else {0: "weight-only", -1: "row"}.get(block, str(block))
        name += f", {terms} terms" if terms > 1 else ""
        print(f"block {name}: {'; '.join(report)} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

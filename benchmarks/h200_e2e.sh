#!/usr/bin/env bash
# One device call on an H200 (the device tool's nvidia-h200): checkpoint, then kiln compile while the transformers
# peer runs on the GPU, then the decode-step and 2K-prefill diagnosis, then kiln serve + kiln bench against the roofline.
# Usage (repo root, kiln importable): bash benchmarks/h200_e2e.sh OUTDIR RESULTDIR
# Variants: E2E_COMPILE_EXTRA="--kv-dtype fp8" adds compile options; E2E_PHASES="kiln" runs only some phases;
# E2E_CONC="64,256" other concurrency levels.
set -uo pipefail
out=${1:-/tmp/e2e}; res=${2:-/tmp/e2e-results}; mkdir -p "$out" "$res"
conc=${E2E_CONC:-1,8,64,256}
compile_args="--buckets 16,64,256,2048 --max-num-seqs 256 --kv-tokens 360000 --max-model-len 2112 ${E2E_COMPILE_EXTRA:-}"
phases=${E2E_PHASES:-hf diagnose kiln}
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_e2e, pathlib; gpu_e2e.write_checkpoint(pathlib.Path('$out/llama3-8b-random'))"
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m kiln.serving.cli compile --model "$out/llama3-8b-random" --target cuda \
  --out "$out/artifact" $compile_args > "$res/compile.log" 2>&1 &
compile_pid=$!
if [[ " $phases " == *" hf "* ]]; then
  python3 benchmarks/gpu_e2e.py --phase hf --out "$out" --concurrency $conc --hf-budget-s 120 --json "$res/hf.json" \
    > "$res/hf.log" 2>&1
  grep -E "HF batch|budget|Error" "$res/hf.log" | tail -8
fi
wait $compile_pid; date; tail -2 "$res/compile.log"
if [[ " $phases " == *" diagnose "* ]]; then
  python3 benchmarks/gpu_e2e.py --phase diagnose --out "$out" --concurrency $conc --json "$res/diagnose.json" 2>&1 \
    | grep -E "decode|engine|prefill|TB/s"; date
fi
if [[ " $phases " == *" kiln "* ]]; then
  python3 benchmarks/gpu_e2e.py --phase kiln --out "$out" --concurrency $conc --json "$res/kiln.json" 2>&1 \
    | grep -v -E "it/s\]|^INFO: |kiln.access"
fi

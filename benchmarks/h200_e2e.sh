#!/usr/bin/env bash
# One device call on an H200 (the device tool's nvidia-h200): checkpoint, then kiln compile (one artifact per weight
# format, all at once) while the transformers peer runs on the GPU, then the decode-step and 2K-prefill diagnosis, then
# kiln serve + kiln bench against the roofline, per weight format.
# Usage (repo root, kiln importable): bash benchmarks/h200_e2e.sh OUTDIR RESULTDIR
# Variants: E2E_COMPILE_EXTRA="--kv-dtype fp8" adds compile options; E2E_PHASES="kiln" runs only some phases;
# E2E_CONC="64,256" other concurrency levels; E2E_FORMATS="float fp8" the weight formats (--quantize) to serve;
# E2E_BUCKETS="16,64,256,2048" other token buckets (compile --buckets; the default has 1024: a 1024-token prompt in
# one step, TTFT p50 at c = 1 38 against 54 ms, session 22). OUTDIR (checkpoint and artifacts, ~40 GB with fp8) is
# removed at the end unless E2E_KEEP=1: a warm machine keeps its disk for the next call (session 30's next call ran
# out of its 64 GB).
set -uo pipefail
out=${1:-/tmp/e2e}; res=${2:-/tmp/e2e-results}; mkdir -p "$out" "$res"
conc=${E2E_CONC:-1,8,64,256}
compile_args="--buckets ${E2E_BUCKETS:-16,64,256,1024,2048} --max-num-seqs 256 --kv-tokens 360000 --max-model-len 2112 ${E2E_COMPILE_EXTRA:-}"
phases=${E2E_PHASES:-hf diagnose kiln}
formats=${E2E_FORMATS:-float}
python3 benchmarks/gpu_clocks.py "$res/gpu_clocks.csv" &  # clocks beside the results (gpu_clocks.py says why)
watch_pid=$!; trap 'kill $watch_pid 2> /dev/null' EXIT
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_e2e, pathlib; gpu_e2e.write_checkpoint(pathlib.Path('$out/llama3-8b-random'))"
dir_of() { if [[ $1 == float ]]; then echo "$out"; else echo "$out/$1"; fi; }  # gpu_e2e.py --out: DIR/artifact
pids=()
for f in $formats; do
  d=$(dir_of "$f"); mkdir -p "$d"; [[ $f == float ]] || ln -sfn "$out/llama3-8b-random" "$d/llama3-8b-random"
  q=(); [[ $f == float ]] || q=(--quantize "$f")
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m kiln.serving.cli compile --model "$out/llama3-8b-random" \
    --target cuda --out "$d/artifact" $compile_args "${q[@]}" > "$res/compile_$f.log" 2>&1 &
  pids+=($!)
done
if [[ " $phases " == *" hf "* ]]; then
  python3 benchmarks/gpu_e2e.py --phase hf --out "$out" --concurrency "$conc" --hf-budget-s 120 --json "$res/hf.json" \
    > "$res/hf.log" 2>&1
  grep -E "HF batch|budget|Error" "$res/hf.log" | tail -8
fi
wait "${pids[@]}"; date; for f in $formats; do tail -2 "$res/compile_$f.log"; done
if [[ " $phases " == *" diagnose "* ]]; then
  python3 benchmarks/gpu_e2e.py --phase diagnose --out "$out" --concurrency "$conc" --json "$res/diagnose.json" 2>&1 \
    | grep -E "decode|engine|prefill|TB/s"; date
fi
if [[ " $phases " == *" kiln "* ]]; then
  for f in $formats; do
    python3 benchmarks/gpu_e2e.py --phase kiln --out "$(dir_of "$f")" --concurrency "$conc" --json "$res/kiln_$f.json" \
      2>&1 | grep -v -E "it/s\]|^INFO: |kiln.access"
  done
fi
[[ ${E2E_KEEP:-0} == 1 ]] || rm -rf "$out"

#!/usr/bin/env bash
# One device call on an H200 (the device tool's nvidia-h200): a Llama-3-8B-shaped checkpoint (random bf16), kiln compile
# for cuda with a small bucket set (a start loads every program; fewer programs compile faster), then
# benchmarks/cold_start.py: CS_WARM starts with the page cache warm, CS_COLD with it dropped before each start (root),
# and the disk's read rate of weights.bin, uncached, in the same run.
# Usage (repo root, kiln importable): bash benchmarks/h200_cold_start.sh WORKDIR RESULTDIR
set -uo pipefail
work=${1:-/tmp/cs}; res=${2:-/tmp/cs-results}; mkdir -p "$work" "$res"
warm=${CS_WARM:-5}; cold=${CS_COLD:-2}
compile_args=${CS_COMPILE_ARGS:---buckets 16,256 --max-num-seqs 16 --kv-tokens 65536 --max-model-len 2048 --decode-steps 1}
echo "$(date +%T) checkpoint"
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_e2e, pathlib; gpu_e2e.write_checkpoint(pathlib.Path('$work/llama3-8b-random'))" || exit 1
echo "$(date +%T) compile"
python3 -m kiln.serving.cli compile --model "$work/llama3-8b-random" --target cuda --out "$work/artifact" $compile_args \
  > "$res/compile.log" 2>&1 || { tail -20 "$res/compile.log"; exit 1; }
tail -1 "$res/compile.log"; grep -E "weights:" "$res/compile.log"
echo "$(date +%T) warm starts"
python3 benchmarks/cold_start.py "$work/artifact" -n "$warm" --requests 10 --json "$res/warm.json" 2>&1 | tee "$res/warm.txt"
echo "$(date +%T) uncached starts"
python3 benchmarks/cold_start.py "$work/artifact" -n "$cold" --requests 3 --drop-caches --json "$res/cold.json" 2>&1 \
  | tee "$res/cold.txt"
echo "$(date +%T) done"

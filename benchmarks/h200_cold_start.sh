#!/usr/bin/env bash
# One device call on an H200 (the device tool's nvidia-h200): a Llama-3-8B-shaped checkpoint (random bf16), kiln compile
# for cuda with a small bucket set (a start loads every program; fewer programs compile faster), the upload rate of
# each mode in a fresh process (benchmarks/h2d_upload.py), then benchmarks/cold_start.py with the fastest (env
# KILN_UPLOAD): CS_WARM starts with the page cache warm, CS_COLD with the page cache dropped before each start (root)
# and the disk's read rate of weights.bin, uncached, in the same run; then CS_WARM_OTHER warm starts with the "direct"
# mode (the default before 2026-12-01), if another won (default none). Before the starts: what the serve path imports
# (python -X importtime, the 25 costliest modules) and the device client's start, in a fresh process.
# CS_MODES: the upload modes h2d_upload.py times (MODE@N: with N sha256 threads); CS_H2D_ARGS: more of its options;
# CS_PRIME_GB: h2d_upload.py once more with device memory filled first (--prime-gb). CS_ENVS: environment variants
# the warm and uncached starts alternate (cold_start.py --envs), e.g. "KILN_UPLOAD=pieces,KILN_UPLOAD=pinned".
# Usage (repo root, kiln importable): bash benchmarks/h200_cold_start.sh WORKDIR RESULTDIR
set -uo pipefail
work=${1:-/tmp/cs}; res=${2:-/tmp/cs-results}; mkdir -p "$work" "$res"
warm=${CS_WARM:-5}; cold=${CS_COLD:-2}; other=${CS_WARM_OTHER:-0}; modes=${CS_MODES:-pieces,pinned,sync}
compile_args=${CS_COMPILE_ARGS:---buckets 16,256 --max-num-seqs 16 --kv-tokens 65536 --max-model-len 2048 --decode-steps 1}
echo "$(date +%T) checkpoint"
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_e2e, pathlib; gpu_e2e.write_checkpoint(pathlib.Path('$work/llama3-8b-random'))" || exit 1
echo "$(date +%T) compile"
# shellcheck disable=SC2086  # $compile_args: several flags
python3 -m kiln.serving.cli compile --model "$work/llama3-8b-random" --target cuda --out "$work/artifact" $compile_args \
  > "$res/compile.log" 2>&1 || { tail -20 "$res/compile.log"; exit 1; }
tail -1 "$res/compile.log"; grep -E "weights:" "$res/compile.log"
echo "$(date +%T) upload rate by mode (each in a fresh process, every chunk checked)"
# shellcheck disable=SC2086  # CS_H2D_ARGS: several flags or none
python3 benchmarks/h2d_upload.py "$work/artifact" --modes "$modes" --best "$work/best" ${CS_H2D_ARGS:-} 2>&1 | tee "$res/h2d.txt"
first=$(cat "$work/best" 2>/dev/null || echo pinned)
if [ -n "${CS_PRIME_GB:-}" ]; then
  echo "$(date +%T) upload rate with $CS_PRIME_GB GB of device memory filled first"
  python3 benchmarks/h2d_upload.py "$work/artifact" --modes "$first" --prime-gb "$CS_PRIME_GB" 2>&1 | tee "$res/h2d_prime.txt"
fi
envs=(); [ -n "${CS_ENVS:-}" ] && envs=(--envs "$CS_ENVS")
echo "$(date +%T) imports of the serve path"
python3 -X importtime -c "
import time; t0 = time.perf_counter()
import kiln.serving.serve_cmd, kiln.serving.llm, kiln.compile.artifact, kiln.serving.app, kiln.serving.graceful
t1 = time.perf_counter(); import jax; jax.devices(); t2 = time.perf_counter()
print(f'serve-path imports {t1 - t0:.2f} s, device client {t2 - t1:.2f} s', flush=True)" 2> "$work/importtime.txt"
sort -t'|' -k2 -n "$work/importtime.txt" | tail -25 | tee "$res/importtime.txt"
echo "$(date +%T) warm starts, KILN_UPLOAD=$first"
KILN_UPLOAD=$first python3 benchmarks/cold_start.py "$work/artifact" -n "$warm" --requests 10 "${envs[@]}" \
  --json "$res/warm.json" 2>&1 \
  | tee "$res/warm.txt"
echo "$(date +%T) uncached starts, KILN_UPLOAD=$first"
KILN_UPLOAD=$first python3 benchmarks/cold_start.py "$work/artifact" -n "$cold" --requests 3 --drop-caches "${envs[@]}" \
  --json "$res/cold.json" 2>&1 | tee "$res/cold.txt"
if [ "$first" != direct ] && [ "$other" -gt 0 ]; then
  echo "$(date +%T) warm starts, KILN_UPLOAD=direct"
  KILN_UPLOAD=direct python3 benchmarks/cold_start.py "$work/artifact" -n "$other" --requests 10 \
    --json "$res/warm_direct.json" 2>&1 | tee "$res/warm_direct.txt"
fi
echo "$(date +%T) done"

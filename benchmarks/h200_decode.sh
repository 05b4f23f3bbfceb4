#!/usr/bin/env bash
# The decode measurements issue 16 has left for a device call (sessions 26-27), one phase or more a call; each phase
# asks left() for its time and stops its commands there, so a call returns what it has.
#   narrow     fp8's in-kernel fp8 x fp8 Pallas GEMM (pallas_gpu_narrow Config.fp8_x = 2: each x tile as two fp8
#              terms quantized in the kernel, weight-only's accuracy; one term fails the 28-of-32 bar in 2 of 4 block
#              sizes, benchmarks/fp8_accuracy.py): the per-weight config sweep at 16 and 64 rows (gpu_fp8.py --pallas
#              --json), then the decode programs with XLA's dots and with the kernel at those configs, alternated
#              (gpu_profile.py), then bf16. If narrow=pallas wins, its configs go to pallas_gpu_narrow.CONFIGS and
#              quant.PALLAS_MAX_ROWS["fp8"] to 64 (or 16).
#   forms      XLA's fp8 dot forms per weight with each copy's own rows (gpu_fp8.py --forms), then with one x shared
#              by the copies as sessions 9-27 measured (--shared-x: XLA merged the copies' dots, session 27's 2x of
#              fp8 x fp8; session 28)
#   wo         the c = 64 fp8 program with XLA's fp8 x fp8 dots in its 64-row bucket (fp8_wo=16; rows as two fp8
#              terms, quant.FP8_TWO_TERM_MAX_ROWS, or one: fp8_2t=0) against today's weight-only dots, alternated,
#              then the row sweep that chose FP8_WEIGHT_ONLY_MAX_ROWS (now in the fused layout)
#   exhaustive fp8's c = 1 program with XLA's exhaustive GEMM tiling search (its default since session 28:
#              pallas_gpu.FORMAT_DECODE_XLA_OPTIONS) against XLA's default search, alternated, each run a process of its
#              own (XLA keeps a GEMM's tiling per process; no autotune cache dir)
#   exhaustive64  the same for fp8's c = 64 program (its 64-token decode keeps XLA's default search): the exhaustive
#              search against the default, alternated, each run a process of its own
#   sustained  a bf16 artifact's decode_t1 under 90 s of back-to-back calls with the GPU's clocks (gpu_sustained.py),
#              then its programs against the engine (gpu_decode_buckets.py)
#   pages      the same artifact's decode programs on the pool's first and last pages, in a bare process (load), in
#              an LLM's, and bare with kiln serve's allocator settings (no preallocation), twice each, one process a
#              run (gpu_decode_buckets.py --pages first,last [--bare]; session 30: 34.2 ms a call bare on the first
#              pages, 35.7 in an LLM on the last; H100: the same in every one of the six, 46.5-46.7 ms, but 45.1 in
#              the first process after the compile)
#   fresh      the same artifact's decode programs in four bare processes in a row after the compile (the third
#              uploading its weights in order, KILN_UPLOAD=sync; the fourth after 60 s idle), each with one read of
#              its weights and a torch copy (TB/s) and where its weights lie, nvidia-smi's clocks every second: is
#              the first process after a compile the fast one, and is it the memory, the weights' placement or the
#              programs (session 31: no, the fast ones were the 3rd and 4th; not the upload or the address span)
#   placement  the same artifact in three processes, each timing decode_t1 as loaded, then after moving its KV cache
#              and then its weights to new buffers (gpu_placement.py; session 31: four bare processes ran at 46.5,
#              46.6, 45.1, 45.1 ms a call on an H100, six more pinned to CPUs as they came 45.1 or 46.6)
#   trace      the same artifact in six bare processes, each timing its decode programs and tracing 10 calls of
#              each (gpu_decode_buckets.py --trace): in a fast process against a slow one, is the 3% in the kernels'
#              time or in the time no kernel runs (session 32: the gaps), and after which kernels the gaps fall
#   fp8t1      fp8's c = 1 in a 1-token bucket: an fp8 artifact of buckets 1, 16 and 1024 (its decode_t1 with the
#              exhaustive tiling search that decode_t16 has, FORMAT_DECODE_XLA_OPTIONS), decode_t1 against decode_t16
#              in three bare processes (bf16's 1-token program was 0.4% faster in an artifact, session 26; fp8's
#              weight-only GEMMs are further from copy rate at 16 rows, session 28)
#   prefill    the 2048-token step program on two fresh 1024-token prompts (gpu_profile.py --prefill 2048), bf16 and
#              fp8 per kernel against the matmul floor; PREFILL_FORMATS and PREFILL_FP8 (fp8's gpu_profile variants,
#              default "fused") choose others (session 36 ran "fused,fused;fp8_out=bfloat16,
#              fused;xla=enable_triton_gemm:false,fused": the fp8 x fp8 dots' bf16 results, made default then)
#   prefill_ab fp8 and bf16 artifacts of buckets 64, 256 and 2048 (the c = 64 run's programs), compiled side by side;
#              fp8's engine at c = 64 with the fp8 x fp8 dots' results in bf16 (quant.FP8_DOT_OUT, A) against float32
#              (B: step_t2048 traced again), alternated x3, then bf16's twice (gpu_prefill.py, no HTTP); AB_FORMATS
#              chooses the formats (default "fp8 float"), AB_SWAP B's setting (gpu_swap_program's KILN_SETTINGS)
#   cb         bf16's c = 1 decode program with XLA's command buffers (CUDA graphs) and without (cb=), in three
#              processes of gpu_profile, both in each: are session 32's gaps between kernels the graphs' launches
#   envs       the bf16 artifact in bare processes, three rounds of three environments: CUDA_MODULE_LOADING=EAGER
#              (every kernel's code loaded at the start, not at first use), none (the default), and
#              CUDA_DEVICE_MAX_CONNECTIONS=32 (a hardware queue per stream): does either set a process's speed
#              (session 32: a slow process loses ~0.35 us after each kernel; 4 of 19 default processes were fast);
#              ENVS (one VAR=VALUE each, KILN_DEFAULT=1 for none) and ROUNDS choose others (session 33: neither
#              sets it; 32 queues gave 2 fast of 3 on an H100, but on an H200 a default process was fast, a 32 one slow)
#   served_envs  the same environments served: per round and environment a kiln serve of that artifact (gpu_e2e.py
#              --phase kiln, c = 1, 4 requests of 1024 in / 256 out); by default CUDA_DEVICE_MAX_CONNECTIONS=32
#              against none (2026-12-07, H100: KILN_SETTLE=3 against none, 167.1-167.4 tok/s against 167.3-167.8,
#              TPOT 5.83-5.84 ms in all six, 10.5-12.3 s more start: no gain, KILN_SETTLE removed)
#   reload     the same artifact in three bare processes, each timing decode_t1 as loaded and then five new instances
#              of its executable on the same weights and cache (gpu_reload.py): is a slow process's speed its
#              program instance's (then a server could re-instance it) or its CUDA context's
#              (session 34, H100: the instance's: 13 of 18 fast, 45.3-45.5 against 46.8-46.9 ms, in all three
#              processes both speeds; but in a kiln serve every new instance timed within 0.6% of its rival, 18
#              tries, 2026-12-07: re-instancing at the start, KILN_SETTLE, gained nothing served and was removed)
# Usage (repo root, on the device, .whl carried: see benchmarks/device_env.sh):
#     DEADLINE=580 bash benchmarks/h200_decode.sh "$OUT" narrow
set -uo pipefail
res=${1:?usage: h200_decode.sh RESULTDIR [PHASES]}; phases=${2:-narrow forms wo exhaustive sustained}; mkdir -p "$res"
# shellcheck disable=SC1091  # benchmarks/device_env.sh: the wheels, kiln importable, left()
source benchmarks/device_env.sh install  # (an argument of its own: not this script's "$1")
keep="variant|ms/token|^\\||Error|failed"  # gpu_profile lines worth the call's output
profile() { timeout "$(left)" python3 benchmarks/gpu_profile.py --programs multi --top 30 "$@"; }
# alternate C A B FILE: fp8's c = C program as variant A, B, A, B, each run a process of its own (XLA keeps a GEMM's
# tiling per process), appended to FILE
alternate() {
  for v in "$2" "$3" "$2" "$3"; do
    profile --concurrency "$1" --quantize fp8 --variants "$v" 2>&1 | tee -a "$4" | grep -E "$keep"
  done
}
work=/tmp/h16
# checkpoint: the random-weight Llama-3-8B-shaped checkpoint both artifacts compile from, in $work/llama3-8b-random
# (gpu_e2e.write_checkpoint returns at once where it is whole)
checkpoint() {
  mkdir -p "$work"
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_e2e, pathlib
gpu_e2e.write_checkpoint(pathlib.Path('$work/llama3-8b-random'))"
}
# rounds FILE DEFAULT_ENVS PATTERN CMD...: CMD once under each environment of ENVS (one VAR=VALUE each; DEFAULT_ENVS
# where ENVS is unset), ROUNDS times over (3 by default), each run's output appended to FILE, its PATTERN lines shown
rounds() {
  local file=$1 defaults=$2 pattern=$3; shift 3
  for _ in $(seq "${ROUNDS:-3}"); do
    for e in ${ENVS:-$defaults}; do
      echo "-- $e" | tee -a "$file"
      env "$e" timeout "$(left)" "$@" 2>&1 | tee -a "$file" | grep -E "$pattern"
    done
  done
}
# bf16_artifact: a bf16 artifact of buckets 1, 16 and 1024 in $work/artifact (compiled once: a warm machine keeps it
# for its next call, and its phases share it)
bf16_artifact() {
  [[ -f $work/artifact/manifest.json ]] && return 0
  checkpoint
  timeout "$(left)" python3 -m kiln.serving.cli compile --model "$work/llama3-8b-random" --target cuda \
    --out "$work/artifact" --buckets 1,16,1024 --max-num-seqs 16 --kv-tokens 40000 --max-model-len 2112 \
    > "$res/compile.log" 2>&1 || { tail -5 "$res/compile.log"; return 1; }
}
for phase in $phases; do
  echo "== $(date +%T) $phase, $(left) s left"
  case $phase in
    narrow)
      timeout "$(left)" python3 benchmarks/gpu_fp8.py --pallas --fp8-x 2 --rows 16,64 --budget-s 120 \
        --json "$res/narrow.json" 2>&1 | tee "$res/narrow_sweep.txt" | grep -v -E "^ +[0-9.]+ us|it/s"
      [[ -s $res/narrow.json ]] || { echo "no configs: the sweep did not finish"; continue; }
      profile --concurrency 1,64 --quantize fp8 --narrow-configs "$res/narrow.json" --json "$res/narrow_programs.json" \
        --variants "fused;narrow=xla,fused;narrow=pallas,fused;narrow=xla,fused;narrow=pallas" 2>&1 \
        | tee "$res/narrow_programs.txt" | grep -E "$keep"
      profile --concurrency 1,64 --variants fused 2>&1 | tee "$res/bf16_programs.txt" | grep -E "$keep"
      ;;
    forms)
      timeout "$(left)" python3 benchmarks/gpu_fp8.py --forms --rows 16,64 2>&1 | tee "$res/forms.txt"
      timeout "$(left)" python3 benchmarks/gpu_fp8.py --forms --rows 16 --weights qkv,o,down --shared-x 2>&1 \
        | tee "$res/forms_shared.txt"
      ;;
    wo)
      v="fused,fused;fp8_wo=16,fused;fp8_wo=16;fp8_2t=0"
      profile --concurrency 64 --quantize fp8 --variants "$v,$v" 2>&1 | tee "$res/fp8_wo.txt" | grep -E "$keep"
      timeout "$(left)" python3 benchmarks/gpu_fp8.py --rows 16,64,128,256 2>&1 | tee "$res/fp8_rows.txt"
      ;;
    exhaustive) alternate 1 "fused;xla=exhaustive_tiling_search:false" fused "$res/exhaustive.txt" ;;
    exhaustive64) alternate 64 fused "fused;xla=exhaustive_tiling_search:true" "$res/exhaustive64.txt" ;;
    sustained)
      bf16_artifact || continue
      timeout "$(left)" python3 benchmarks/gpu_sustained.py "$work/artifact" --seconds 90 2>&1 \
        | tee "$res/sustained.txt"
      timeout "$(left)" python3 benchmarks/gpu_decode_buckets.py "$work/artifact" 2>&1 | tee "$res/buckets.txt"
      ;;
    pages)
      bf16_artifact || continue
      for v in bare llm serve-env bare llm serve-env; do  # serve-env: bare, with kiln serve's allocator settings
        flags=(--programs-only --pages "first,last"); envs=()
        [[ $v == llm ]] || flags+=(--bare)
        [[ $v == serve-env ]] && envs=(XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95)
        echo "-- $v" | tee -a "$res/pages.txt"
        env "${envs[@]}" timeout "$(left)" python3 benchmarks/gpu_decode_buckets.py "$work/artifact" "${flags[@]}" 2>&1 \
          | tee -a "$res/pages.txt" | grep "programs alone"
      done
      ;;
    fresh)
      bf16_artifact || continue
      python3 benchmarks/gpu_clocks.py "$res/fresh_clocks.csv" & smi=$!
      for i in 1 2 3 4; do  # the third uploads its weights one tensor at a time, in order (KILN_UPLOAD=sync)
        [[ $i == 4 ]] && { echo "-- 60 s idle" | tee -a "$res/fresh.txt"; sleep 60; }
        upload=pieces; [[ $i == 3 ]] && upload=sync
        echo "-- $(date +%T) process $i, KILN_UPLOAD=$upload" | tee -a "$res/fresh.txt"
        KILN_UPLOAD=$upload timeout "$(left)" python3 benchmarks/gpu_decode_buckets.py "$work/artifact" --bare \
          --pages first --read 2>&1 | tee -a "$res/fresh.txt" | grep -E "programs alone|weights|torch copy"
      done
      kill "$smi"
      ;;
    placement)
      bf16_artifact || continue
      for i in 1 2 3; do
        echo "-- process $i" | tee -a "$res/placement.txt"
        timeout "$(left)" python3 benchmarks/gpu_placement.py "$work/artifact" 2>&1 | tee -a "$res/placement.txt" \
          | grep -E "moved|loaded|Error"
      done
      ;;
    trace)
      bf16_artifact || continue
      for i in 1 2 3 4 5 6; do
        echo "-- process $i" | tee -a "$res/trace.txt"
        timeout "$(left)" python3 benchmarks/gpu_decode_buckets.py "$work/artifact" --bare --pages first --trace 2>&1 \
          | tee -a "$res/trace.txt" | grep -E "rep 1|traced|  gaps|  after|Error"
      done
      ;;
    fp8t1)
      if [[ ! -f $work/fp8/manifest.json ]]; then
        checkpoint
        timeout "$(left)" python3 -c "import sys
from kiln.models.kernels import pallas_gpu as p
p.FORMAT_DECODE_XLA_OPTIONS['fp8'][1] = dict(p.FORMAT_DECODE_XLA_OPTIONS['fp8'][16])
from kiln.serving.cli import main
sys.exit(main(sys.argv[1:]))" compile --model "$work/llama3-8b-random" --target cuda --quantize fp8 --out "$work/fp8" \
          --buckets 1,16,1024 --max-num-seqs 16 --kv-tokens 40000 --max-model-len 2112 > "$res/compile_fp8.log" 2>&1 \
          || { tail -5 "$res/compile_fp8.log"; continue; }
      fi
      for i in 1 2 3; do
        echo "-- process $i" | tee -a "$res/fp8t1.txt"
        timeout "$(left)" python3 benchmarks/gpu_decode_buckets.py "$work/fp8" --bare --pages first 2>&1 \
          | tee -a "$res/fp8t1.txt" | grep -E "rep 1|Error"
      done
      ;;
    envs)
      bf16_artifact || continue
      rounds "$res/envs.txt" "CUDA_MODULE_LOADING=EAGER KILN_DEFAULT=1 CUDA_DEVICE_MAX_CONNECTIONS=32" "rep 1|Error" \
        python3 benchmarks/gpu_decode_buckets.py "$work/artifact" --bare --pages first
      ;;
    served_envs)
      bf16_artifact || continue
      rounds "$res/served_envs.txt" "CUDA_DEVICE_MAX_CONNECTIONS=32 KILN_DEFAULT=1" "^\| 1 \||Error" \
        python3 benchmarks/gpu_e2e.py --phase kiln --out "$work" --concurrency 1 --min-prompts 4
      ;;
    reload)
      bf16_artifact || continue
      for i in 1 2 3; do
        echo "-- process $i" | tee -a "$res/reload.txt"
        timeout "$(left)" python3 benchmarks/gpu_reload.py "$work/artifact" --reloads 5 2>&1 | tee -a "$res/reload.txt" \
          | grep -E "decode_t|instances|Error"
      done
      ;;
    prefill)
      for q in ${PREFILL_FORMATS:-float fp8}; do
        v=fused; [[ $q == fp8 ]] && v=${PREFILL_FP8:-fused}
        timeout "$(left)" python3 benchmarks/gpu_profile.py --prefill 2048 --quantize "$q" --top 25 \
          --hlo "$res/prefill_hlo_$q" --variants "$v" 2>&1 | tee "$res/prefill_$q.txt" | grep -E "$keep| ms  x"
      done
      (cd "$res" && tar czf prefill_hlo.tgz prefill_hlo_* && rm -rf prefill_hlo_*/)
      ;;
    prefill_ab)
      checkpoint
      for q in ${AB_FORMATS:-fp8 float}; do  # side by side
        [[ -f $work/c64_$q/manifest.json ]] && continue
        timeout "$(left)" python3 -m kiln.serving.cli compile --model "$work/llama3-8b-random" --target cuda \
          --quantize "$q" --out "$work/c64_$q" --buckets 64,256,2048 --max-num-seqs 256 --kv-tokens 360000 \
          --max-model-len 2112 > "$res/compile_c64_$q.log" 2>&1 &
      done
      wait
      for q in ${AB_FORMATS:-fp8 float}; do
        runs=A,A; [[ $q == fp8 ]] && runs="A,B,A,B,A,B --swap step_t2048 ${AB_SWAP:-fp8_out:float32}"
        # shellcheck disable=SC2086  # runs: the --runs value and, for fp8, the swap; bf16's 16 GB of weights and the
        # 47 GB cache need more than the 75% that jax preallocates on an 80 GB H100
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "$(left)" python3 benchmarks/gpu_prefill.py "$work/c64_$q" \
          --kernels "" --runs $runs 2>&1 \
          | tee "$res/prefill_ab_$q.txt" | tail -30
      done
      ;;
    cb)
      for v in "fused,fused;cb=" "fused;cb=,fused" "fused,fused;cb="; do
        echo "-- $v" | tee -a "$res/cb.txt"
        profile --concurrency 1 --variants "$v" 2>&1 | tee -a "$res/cb.txt" | grep -E "$keep"
      done
      ;;
    *) echo "unknown phase $phase (narrow forms wo exhaustive exhaustive64 sustained pages fresh placement trace fp8t1 prefill prefill_ab cb envs served_envs reload)" ;;
  esac
done
echo "== $(date +%T) done, $(left) s left"

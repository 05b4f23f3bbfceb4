#!/usr/bin/env bash
# Issue 18 on one H200, one process (benchmarks/moe_gpu.py): a Qwen3-30B-A3B-shaped model of 48 layers made once; the
# 8-step decode program of one sequence per variant on its first MOE_LAYERS layers (default 8: --program, kernels per
# token from the profiler), the fastest o-proj and experts variants together (--combine), then the served runs of all
# 48 layers: under base at the first concurrency (--serve-base), then at MOE_CONCURRENCY (default 1,8) under the
# fastest variant that changes only the served kernels (--serve-best: moe_gpu.SERVABLE); compilations inside a timed
# run are logged, the JSON is written after each served run. (Session 11: 277 s of command on a fresh machine; session
# 13: the model 7 s, 9 variants ~10 s each, base's served c = 1 ~85 s with its compilations; the best's did not fit.)
#   bash benchmarks/moe_h200.sh OUT   (log and JSON land in OUT)
# MOE_VARIANTS, MOE_DISPATCH_ROWS (default "": no dispatch table), MOE_CONCURRENCY, MOE_BUCKETS override; MOE_HLO=DIR
# writes each variant's optimized HLO there; XLA-option
# variants (cb=, xla:) are profiled but not served (XLA_FLAGS are read once per process).
set -u
out=${1:?usage: moe_h200.sh OUT}
mkdir -p "$out"
here=$(dirname "$0")
variants=${MOE_VARIANTS:-"base,oproj,oproj_g5,oproj_s8_k128,single_g4,single_w8,base"}
echo "$(date -u +%T) program variants: $variants"
python3 -u "$here/moe_gpu.py" --layers 48 --program-layers "${MOE_LAYERS:-8}" --program "$variants" --combine \
  --serve-best --serve-base --concurrency "${MOE_CONCURRENCY:-1,8}" --buckets "${MOE_BUCKETS:-1,8,1024}" \
  --dispatch-rows "${MOE_DISPATCH_ROWS-}" ${MOE_HLO:+--hlo "$MOE_HLO"} --json "$out/moe.json" 2>&1 \
  | grep --line-buffered -v "^W0000\|^I0000" | tee "$out/moe.log"
echo "$(date -u +%T) done"

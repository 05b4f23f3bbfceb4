#!/usr/bin/env bash
# Issue 18 on one H200, c = 1: the 8-step decode program of a Qwen3-30B-A3B-shaped model per variant (MOE_LAYERS
# layers, default 8; benchmarks/moe_gpu.py --program), then the served c = 1 run of all 48 layers under the XLA options
# of the fastest variant made of options only (moe_gpu.py --pick-flags), with its per-kernel profile; the routing in
# a kernel of its own there if the base variant failed.
#   bash benchmarks/moe_h200.sh OUT   (logs, JSON and the variants' optimized HLO land in OUT)
# MOE_VARIANTS, MOE_DISPATCHES, MOE_DISPATCH_ROWS ("" skips the dispatch table), MOE_CONCURRENCY, MOE_BUCKETS override.
set -u
out=${1:?usage: moe_h200.sh OUT}
mkdir -p "$out"
here=$(dirname "$0")
cbc=FUSION+CUBLAS+CUBLASLT+CUSTOM_CALL+CUDNN+WHILE+CONDITIONAL
variants=${MOE_VARIANTS:-"base,greedy,cb=,cb=$cbc,cb=$cbc;xla:xla_gpu_graph_min_graph_size=1"}
echo "$(date -u +%T) program variants: $variants"
python3 "$here/moe_gpu.py" --layers "${MOE_LAYERS:-8}" --concurrency "" --dispatch-rows "${MOE_DISPATCH_ROWS-1}" \
  --dispatches "${MOE_DISPATCHES:-single,single_r0,single_n32,single_w8}" --program "$variants" --hlo "$out/hlo" \
  --json "$out/program.json" 2>&1 | grep -v "^W0000\|^I0000" | tee "$out/program.log"
route=$(python3 -c "import json,sys; v=[r['variant'] for r in json.load(open(sys.argv[1]))['program']]; \
print('' if 'base' in v else '--separate-route')" "$out/program.json" 2>/dev/null)
flags=$(python3 "$here/moe_gpu.py" --pick-flags "$out/program.json" 2>/dev/null | tail -1)
echo "$(date -u +%T) served c=1 with XLA_FLAGS='$flags' $route"
[ -n "$flags" ] && export XLA_FLAGS="${XLA_FLAGS:-} $flags"  # (an empty XLA_FLAGS=" " stops XLA: a file name)
python3 "$here/moe_gpu.py" --concurrency "${MOE_CONCURRENCY:-1}" \
  --buckets "${MOE_BUCKETS:-1,1024}" --dispatch-rows "" $route --profile --json "$out/served.json" 2>&1 \
  | grep -v "^W0000\|^I0000" | tee "$out/served.log"
echo "$(date -u +%T) done"

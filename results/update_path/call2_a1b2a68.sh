#!/usr/bin/env bash
# Device call 2 (session 2026-12-02): GPU tests of the merged engine, then the update_path sweep with clipping
# firing (issue 23; its tiered_cpu 14B row is also issue 22's 14B 16x1024 row); the first GGUF part rides along.
set -uo pipefail
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a $OUT/call2.log; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=a1b2a68 MEGATRAIN_CACHE=/tmp/init_cache PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
[ -f /tmp/site/megatrain-env.sh ] || bash scripts/install_offline.sh wheelhouse > $OUT/install.log 2>&1 || say "install failed"
source /tmp/site/megatrain-env.sh
mkdir -p /tmp/gguf && cp .gguf/*.part0 /tmp/gguf/ 2>/dev/null; ls -la /tmp/gguf >> $OUT/call2.log
say "kernel build"; python3 -m megatrain.kernels build >> $OUT/call2.log 2>&1; python3 -m megatrain.kernels status >> $OUT/call2.log 2>&1
say "GPU tests"
timeout 150 python3 -m pytest -m gpu tests/test_update_path_gpu.py tests/test_engine_gpu.py -q -p no:cacheprovider > $OUT/gputests2.log 2>&1; say "pytest exit $?"
tail -3 $OUT/gputests2.log >> $OUT/call2.log
left=$(( 440 - ($(date +%s) - t0) ))
say "update_path sweep (clip), budget $left s"
python3 -m experiments.run sweep=update_path results_dir=/tmp/r2 time_budget_s=$left timeout_s=200 >> $OUT/call2.log 2>&1; say "runner exit $?"
tar czf $OUT/r2.tgz -C /tmp r2; say done

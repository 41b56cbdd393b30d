#!/usr/bin/env bash
# Device call 1 (session 2026-12-04): kernels built ahead, the autocast mode's GPU test (issue 26), then
# issue 22's two missing rows -- the 3B 64x1024 pair in ONE run (MegaTrain in 8 sequential micro-batches
# beside all-on-GPU's own best configuration) and 14B 96x1024 (12 micro-batches, K=4) -- and one 14B
# 16x1024 update_path pair (hybrid beside the bound CPU path) for issue 23's diagnosis.
# Usage (repo root, wheelhouse/ carried): bash results/activations/call1c.sh <git sha>
set -uo pipefail
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a $OUT/call1.log; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=$1 MEGATRAIN_CACHE=/tmp/init_cache PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
[ -f /tmp/site/megatrain-env.sh ] || bash scripts/install_offline.sh wheelhouse > $OUT/install.log 2>&1 || say "install failed"
source /tmp/site/megatrain-env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/call1.log; nproc >> $OUT/call1.log; free -g >> $OUT/call1.log
say "kernel build"
python3 -m megatrain.kernels build >> $OUT/call1.log 2>&1
say "GPU test: autocast mode"
timeout 120 python3 -m pytest -m gpu tests/test_autocast_mode.py -q -p no:cacheprovider > $OUT/gputests.log 2>&1; say "pytest exit $?"
tail -3 $OUT/gputests.log >> $OUT/call1.log
say "3B 64x1024 pair, one run"
python3 -m experiments.run sweep=activations 'sweep.batch_sizes=[64]' micro_batches=8 sweep.name=activations_mb8 'only=[megatrain__qwen2.5-3b__*__b64__default__*,native__qwen2.5-3b__*__b64__default__*]' results_dir=/tmp/r1 time_budget_s=170 timeout_s=110 >> $OUT/call1.log 2>&1; say "runner exit $?"
say "14B 96x1024, 12 micro-batches, K=4"
python3 -m experiments.run sweep=activations 'sweep.models=[qwen2.5-14b]' 'sweep.batch_sizes=[96]' micro_batches=12 shared_init=false steps=3 warmup_steps=1 results_dir=/tmp/r1 time_budget_s=230 timeout_s=225 >> $OUT/call1.log 2>&1; say "runner exit $?"
left=$(( 565 - ($(date +%s) - t0) ))
say "14B 16x1024 update_path: hybrid, cpu pinned; budget $left s"
python3 -m experiments.run sweep=update_path 'only=[megatrain__qwen2.5-14b__*__b16__tiered_hybrid__*,megatrain__qwen2.5-14b__*__b16__tiered_cpu_pinned__*]' results_dir=/tmp/r1 time_budget_s=$left timeout_s=100 >> $OUT/call1.log 2>&1; say "runner exit $?"
tar czf $OUT/r1.tgz -C /tmp r1; say done

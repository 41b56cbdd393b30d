#!/usr/bin/env bash
# Device call 1 (session 2026-12-02): GPU tests of the new engine paths, then the activations sweep (issue 22).
set -uo pipefail
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a $OUT/call1.log; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=c9712e2 MEGATRAIN_CACHE=/tmp/init_cache PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
bash scripts/install_offline.sh wheelhouse > $OUT/install.log 2>&1 || say "install failed"
source /tmp/site/megatrain-env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/call1.log; free -g >> $OUT/call1.log; nproc >> $OUT/call1.log
say "kernel build"; python3 -c "from megatrain import cpu_adamw; cpu_adamw.extension(); print('kernel', cpu_adamw.name())" >> $OUT/call1.log 2>&1
say "GPU tests"
timeout 240 python3 -m pytest -m gpu tests/test_engine_gpu.py tests/test_update_path_gpu.py tests/test_checkpoint_layout.py -q -p no:cacheprovider > $OUT/gputests.log 2>&1; say "pytest exit $?"
tail -5 $OUT/gputests.log >> $OUT/call1.log
left=$(( 560 - ($(date +%s) - t0) ))
say "activations sweep 3B/7B, budget $left s"
python3 -m experiments.run sweep=activations results_dir=/tmp/r time_budget_s=$left timeout_s=200 >> $OUT/call1.log 2>&1; say "runner exit $?"
tar czf $OUT/r1.tgz -C /tmp r; say done

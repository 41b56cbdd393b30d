#!/usr/bin/env bash
# Device call 2 (session 2026-12-02b): kernels built ahead (host AdamW, DeepSpeed CPUAdam for call 3's ZeRO-3),
# the new GPU tests (update_path=auto, host_update_cores), then update_path with clipping firing (issue 23):
# 14B tiered cpu / hybrid / cpu_pinned and 3B pure streaming cpu / hybrid / cpu_pinned, one run.
# The GGUF's first part rides along for call 3 (accuracy_sft).
set -uo pipefail
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a $OUT/call2.log; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=$1 MEGATRAIN_CACHE=/tmp/init_cache PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
[ -f /tmp/site/megatrain-env.sh ] || bash scripts/install_offline.sh wheelhouse > $OUT/install.log 2>&1 || say "install failed"
source /tmp/site/megatrain-env.sh
mkdir -p /tmp/gguf && cp .gguf/*.part0 /tmp/gguf/ 2>/dev/null; ls -la /tmp/gguf >> $OUT/call2.log
say "kernel builds"
python3 -m megatrain.kernels build >> $OUT/call2.log 2>&1 &
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('deepspeed cpu_adam built')" > $OUT/ds_build.log 2>&1 &
wait; tail -1 $OUT/ds_build.log >> $OUT/call2.log
say "GPU tests"
timeout 150 python3 -m pytest -m gpu tests/test_step_model_choices_gpu.py -q -p no:cacheprovider > $OUT/gputests.log 2>&1; say "pytest exit $?"
tail -3 $OUT/gputests.log >> $OUT/call2.log
left=$(( 555 - ($(date +%s) - t0) ))
say "update_path (clip), budget $left s"
python3 -m experiments.run sweep=update_path 'only=[megatrain__qwen2.5-14b__*__b16__tiered_cpu__*,megatrain__qwen2.5-14b__*__b16__tiered_hybrid__*,megatrain__qwen2.5-14b__*__b16__tiered_cpu_pinned__*,megatrain__qwen2.5-3b__*__b16__streaming_cpu__*,megatrain__qwen2.5-3b__*__b16__streaming_hybrid__*,megatrain__qwen2.5-3b__*__b16__streaming_cpu_pinned__*]' results_dir=/tmp/r2 time_budget_s=$left timeout_s=200 >> $OUT/call2.log 2>&1; say "runner exit $?"
tar czf $OUT/r2.tgz -C /tmp r2; say done

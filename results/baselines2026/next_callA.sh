#!/usr/bin/env bash
# Prepared 2026-12-04 for the next session (NOT run yet): device call A of three, then B and C back to back.
# The GPU tests first (test_update_path_gpu.py: its two fixes of 2026-12-04 unverified), then baselines2026 at
# 3B 16x1024 part 1: all-on-GPU best, MegaTrain tiered and pure streaming, ZeRO-3, ZeRO-2, SuperOffload (clip).
# Carry: wheelhouse and .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 (for call B).
# Usage (repo root): bash results/baselines2026/next_callA.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh callA "$1"  # env, say, install
mkdir -p /tmp/gguf && cp .gguf/*.part0 /tmp/gguf/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/callA.log; free -g >> $OUT/callA.log
say "kernel builds"
python3 -m megatrain.kernels build >> $OUT/callA.log 2>&1 &
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('deepspeed cpu_adam built')" > $OUT/ds_build.log 2>&1 &
wait
say "GPU tests: update path"
timeout 90 python3 -m pytest -m gpu tests/test_update_path_gpu.py -q -p no:cacheprovider > $OUT/gputests.log 2>&1; say "pytest exit $?"
tail -3 $OUT/gputests.log >> $OUT/callA.log
left=$(( 560 - ($(date +%s) - t0) ))
say "baselines2026 3B part 1, budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-3b]' 'only=[native__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__pure_streaming__*,zero3__qwen2.5-3b__*__b16__default__*,zero2__qwen2.5-3b__*__b16__default__*,superoffload__qwen2.5-3b__*__b16__default__*]' results_dir=/tmp/rA time_budget_s=$left timeout_s=200 >> $OUT/callA.log 2>&1; say "runner exit $?"
tar czf $OUT/rA.tgz -C /tmp rA; say done

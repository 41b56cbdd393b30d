#!/usr/bin/env bash
# Prepared 2026-12-04 for the next session (NOT run yet): device call C, right after B (same machine): baselines2026
# part 3 -- Gemini (JIT-builds two kernels, ~2 min, then ~8 s/step), ZenFlow at 3B 64x1024 and its pinned 3B default
# (a host OOM is a row with its numbers), MegaTrain at 64x1024 beside it.
# Usage: bash results/baselines2026/next_callC.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh callC "$1"  # env, say, install
left=$(( 550 - ($(date +%s) - t0) ))
say "baselines2026 3B part 3, budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-3b]' 'only=[gemini__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b64__default__*,zenflow__qwen2.5-3b__*__b16__default__*,zenflow__qwen2.5-3b__*__b64__default__*]' results_dir=/tmp/rC time_budget_s=$left timeout_s=300 >> $OUT/callC.log 2>&1; say "runner exit $?"
tar czf $OUT/rC.tgz -C /tmp rC; say done

#!/usr/bin/env bash
# Device call 6 (session 2026-12-04b), right after call 5 (same machine: install, kernels, the shared 3B init):
# baselines2026 at 3B 16x1024 part 2 -- ZenFlow unpinned (its pinned default: host OOM predicted at 52.9 B/param
# measured at 1.5B), SuperOffload with clipping and without, FSDP2 offload, Gemini (JIT-builds two kernels,
# ~2 min) -- 8 timed steps after 4 warm-up (the sweep's own: ZenFlow's every-4th-step CPU wait falls in them
# twice), as far as the budget goes.
# Usage: bash results/baselines2026/call6.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh call6 "$1"  # env, say, install
left=$(( 555 - ($(date +%s) - t0) ))
say "baselines2026 3B part 2, budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-3b]' 'only=[zenflow__qwen2.5-3b__*__b16__unpinned__*,superoffload__qwen2.5-3b__*__b16__default__*,superoffload_noclip__qwen2.5-3b__*__b16__default__*,fsdp__qwen2.5-3b__*__b16__default__*,gemini__qwen2.5-3b__*__b16__default__*]' post=false results_dir=/tmp/r6 time_budget_s=$left timeout_s=200 >> $OUT/call6.log 2>&1; say "runner exit $?"
tar czf $OUT/r6.tgz -C /tmp r6; say done

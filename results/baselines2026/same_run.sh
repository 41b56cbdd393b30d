#!/usr/bin/env bash
# Issue 24's same-run table at 3B 16x1024 (planned 2026-12-06, not run yet): every system at ONE git SHA, in three
# calls strictly back to back on one warm machine (the REPORT's table counts rows of one SHA written within an
# hour of MegaTrain's as one call: analysis/same_run.py SAME_CALL_S), each call carrying ["wheelhouse"].
# Durations per point from the H200 rows of 2026-12-04/05 (duration_s, model build included):
#   call 1 (~8 min): kernels (host AdamW, DeepSpeed cpu_adam), all-on-GPU best (40 s), MegaTrain tiered (33),
#                    MegaTrain pure streaming (33), ZeRO-2 (123), ZeRO-3 (114), FSDP2 (93)
#   call 2 (~8.5 min): ZenFlow unpinned (95-105), ZenFlow unpinned at 64x1024 (issue 24's other shape; ~4x the
#                    16x1024 step), SuperOffload without clipping (189) with what is left
#   call 3 (~9 min): ColossalAI Gemini (253 partial before; its JIT ~2 min: timeout 300), then SuperOffload (209,
#                    partial before at a 200 s timeout) with what is left
# Each call works on a fresh machine too (install, kernels); rows land in /tmp/sr<K>, one tarball per call.
# Merge: python scripts/merge_results.py /tmp/srK/baselines2026 results/baselines2026 --replace  (K = 1, 2, 3)
# Usage (repo root): bash results/baselines2026/same_run.sh K <git sha>
set -uo pipefail
K=$1
source scripts/device_call_env.sh "sr$K" "$2"  # env, say, install
R=/tmp/sr$K
mkdir -p "$R"
snap() { tar czf "$OUT/sr$K.tgz" -C /tmp "sr$K" 2>/dev/null; }
budget() { echo $(( ${1} - ($(date +%s) - t0) )); }
build_kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/sr$K.log"
run() { python3 -m experiments.run sweep=baselines2026 post=false results_dir=$R "$@" >> "$OUT/sr$K.log" 2>&1
        say "runner exit $?"; snap; }
B16='steps=6 warmup_steps=3'
case $K in
  1) run $B16 'only=[native__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__pure_streaming__*,zero2__qwen2.5-3b__*__b16__default__*,zero3__qwen2.5-3b__*__b16__default__*,fsdp__qwen2.5-3b__*__b16__default__*]' \
       time_budget_s=$(budget 560) timeout_s=200 ;;
  2) run $B16 'only=[zenflow__qwen2.5-3b__*__b16__unpinned__*]' time_budget_s=$(budget 200) timeout_s=180
     run $B16 'only=[zenflow__qwen2.5-3b__*__b64__unpinned__*]' time_budget_s=$(budget 420) timeout_s=300
     run $B16 'only=[superoffload_noclip__qwen2.5-3b__*__b16__default__*]' time_budget_s=$(budget 565) timeout_s=300 ;;
  3) run $B16 'only=[gemini__qwen2.5-3b__*__b16__default__*]' time_budget_s=$(budget 330) timeout_s=300
     run $B16 'only=[superoffload__qwen2.5-3b__*__b16__default__*]' time_budget_s=$(budget 565) timeout_s=300 ;;
  *) say "K must be 1, 2 or 3"; exit 2 ;;
esac
say done

#!/usr/bin/env bash
# Issue 24's same-run table at 3B 16x1024: every system at ONE git SHA, in calls strictly back to back on one warm
# machine (the REPORT's table counts rows of one SHA written within an hour of MegaTrain's as one call:
# analysis/same_run.py SAME_CALL_S), each call carrying ["wheelhouse"] and, on an H200, issue 26's GGUF part K-1:
#   [".gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part<K-1>", ".gguf/PARTS.sha256", ".gguf/SHA256SUMS",
#    ".gguf/gguf-0.19.0-py3-none-any.whl"]   (every call stashes what it carries: scripts/ship_gguf.sh)
# Durations per point from the H200 rows of 2026-12-04/05 (duration_s, model build included):
#   call 1 (~8 min): kernels (host AdamW, DeepSpeed cpu_adam), all-on-GPU best (40 s), MegaTrain tiered (33),
#                    MegaTrain pure streaming (33), ZeRO-2 (123), ZeRO-3 (114), FSDP2 (93)
#   call 2 (~8.5 min): ZenFlow unpinned (95-105), ZenFlow unpinned at 64x1024 (issue 24's other shape; ~4x the
#                    16x1024 step), SuperOffload without clipping (189) with what is left
#   call 3 (~8 min): with every GGUF part on the machine, issue 26's all-on-GPU rerun_mb2 / rerun_mb4 (~50 s each:
#                    the bf16 spread yardstick); then ColossalAI Gemini (253 partial before; its JIT ~2 min)
#   call 4 (~4 min): SuperOffload with clipping (209, partial before at a 200 s timeout)
# Each call works on a fresh machine too (install, kernels); rows land in /tmp/sr<K>, one tarball per call.
# Merge: python scripts/merge_results.py /tmp/srK/baselines2026 results/baselines2026 --replace  (K = 1..4;
#        results/baselines2026_h100 on an H100; call 3's SFT rows: /tmp/sr3/accuracy_sft -> results/accuracy_sft)
# Usage (repo root): bash results/baselines2026/same_run.sh K <git sha>   (NO_Z64=1: call 2 skips ZenFlow 64x1024)
set -uo pipefail
K=$1
source scripts/device_call_env.sh "sr$K" "$2"  # env, say, install
bash scripts/ship_gguf.sh stash >> "$OUT/sr$K.log" 2>&1; have=$?  # no parts carried: exit 1, harmless
build_kernels
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/sr$K.log"
run() { python3 -m experiments.run sweep=baselines2026 post=false results_dir=$R "$@" >> "$OUT/sr$K.log" 2>&1
        say "runner exit $?"; snap; }
B16='steps=6 warmup_steps=3'
case $K in
  1) run $B16 'only=[native__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__pure_streaming__*,zero2__qwen2.5-3b__*__b16__default__*,zero3__qwen2.5-3b__*__b16__default__*,fsdp__qwen2.5-3b__*__b16__default__*]' \
       time_budget_s=$(budget 560) timeout_s=200 ;;
  2) run $B16 'only=[zenflow__qwen2.5-3b__*__b16__unpinned__*]' time_budget_s=$(budget 200) timeout_s=180
     [ -n "${NO_Z64:-}" ] || run $B16 'only=[zenflow__qwen2.5-3b__*__b64__unpinned__*]' time_budget_s=$(budget 420) timeout_s=300
     run $B16 'only=[superoffload_noclip__qwen2.5-3b__*__b16__default__*]' time_budget_s=$(budget 565) timeout_s=300 ;;
  3) if [ $have = 0 ] && bash scripts/ship_gguf.sh join >> "$OUT/sr$K.log" 2>&1; then
       say "accuracy_sft: all-on-GPU rerun_mb2, rerun_mb4"
       python3 -m experiments.run sweep=accuracy_sft 'only=[native__*__rerun_mb2__*,native__*__rerun_mb4__*]' \
         post=false results_dir=$R time_budget_s=$(budget 200) >> "$OUT/sr$K.log" 2>&1; say "accuracy_sft runner exit $?"; snap
     else
       say "GGUF incomplete or join failed: no SFT points"
     fi
     run $B16 'only=[gemini__qwen2.5-3b__*__b16__default__*]' time_budget_s=$(budget 560) timeout_s=300 ;;
  4) run $B16 'only=[superoffload__qwen2.5-3b__*__b16__default__*]' time_budget_s=$(budget 400) timeout_s=300 ;;
  *) say "K must be 1 to 4"; exit 2 ;;
esac
say done

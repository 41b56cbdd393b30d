#!/usr/bin/env bash
# Device calls (planned 2026-12-04d, SFT points widened 2026-12-05b): three calls strictly back to back, each carrying
#   ["wheelhouse", ".gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part<K-1>", ".gguf/PARTS.sha256", ".gguf/SHA256SUMS",
#    ".gguf/gguf-0.19.0-py3-none-any.whl"]           (bash scripts/ship_gguf.sh split first: 3 parts of 31.3 MiB)
# Every call works on a fresh machine too (install, kernels); the GGUF's parts survive only on a warm one, so
# issue 26's point (MegaTrain pure streaming in all-on-GPU's arithmetic beside all-on-GPU, one run) runs in the
# call that finds all three parts (`ship_gguf.sh stash` says how many it has): all-on-GPU (default; rerun_mb2,
# the same step in 2 micro-batches: its spread at bf16 rounding; fp32), MegaTrain pure streaming in fp32 and in
# all-on-GPU's arithmetic, ZenFlow (issue 24's system, not exact AdamW) -- one run. Then issue 24's missing 3B rows,
# most wanted first, as far as each call's budget goes:
#   call 1: MegaTrain pure streaming, FSDP2 offload, ZenFlow unpinned if the budget lets it start
#           (6 timed after 3: a ZenFlow row of 6 says so: its every-4th-step CPU wait falls in them once or twice)
#   call 2: ColossalAI Gemini (JIT ~2 min), SuperOffload without clipping (timeout 300 s: it builds in ~60 s)
#   call 3: after the SFT points: ZenFlow 64x1024, ZenFlow unpinned (8 timed after 4) if call 1 did not reach it
# Usage: bash results/baselines2026/chain.sh K <git sha>      (K = 1, 2, 3; CHAIN_BUDGET_S, default 540)
set -uo pipefail
K=$1
source scripts/device_call_env.sh "chain$K" "$2"  # env, say, install (a warm machine keeps /tmp/site)
R=/tmp/rc$K
snap() { tar czf "$OUT/rc$K.tgz" -C /tmp "rc$K" 2>/dev/null; }
build_kernels  # a warm machine returns at once (cached)
if bash scripts/ship_gguf.sh stash >> "$OUT/chain$K.log" 2>&1; then
  if bash scripts/ship_gguf.sh join >> "$OUT/chain$K.log" 2>&1; then
    say "accuracy_sft: all-on-GPU default/rerun_mb2/fp32, MegaTrain streaming_fp32/streaming_autocast, ZenFlow"
    MEGATRAIN_CACHE=/tmp/mtcache python3 -m experiments.run sweep=accuracy_sft \
      'sweep.systems=[native,megatrain,zero3,zenflow]' \
      'only=[native__*__default__*,native__*__rerun_mb2__*,native__*__fp32__*,megatrain__*__streaming_fp32__*,megatrain__*__streaming_autocast__*,zenflow__*__default__*]' \
      post=false results_dir=$R time_budget_s=${SFT_BUDGET_S:-380} >> "$OUT/chain$K.log" 2>&1
    say "accuracy_sft runner exit $?"; snap
  else
    say "GGUF join failed (see above)"
  fi
else
  say "GGUF incomplete on this machine: accuracy_sft waits for the call that has every part"
fi
case $K in
  1) only='[megatrain__qwen2.5-3b__*__b16__pure_streaming__*,fsdp__qwen2.5-3b__*__b16__default__*,zenflow__qwen2.5-3b__*__b16__unpinned__*]'; extra="steps=6 warmup_steps=3" ;;
  2) only='[gemini__qwen2.5-3b__*__b16__default__*,superoffload_noclip__qwen2.5-3b__*__b16__default__*]'; extra="" ;;
  3) only='[zenflow__qwen2.5-3b__*__b64__default__*,zenflow__qwen2.5-3b__*__b16__unpinned__*]'; extra="" ;;
  *) say "K must be 1, 2 or 3"; exit 2 ;;
esac
left=$(( ${CHAIN_BUDGET_S:-540} - ($(date +%s) - t0) ))
say "baselines2026 3B, call $K, budget $left s"
python3 -m experiments.run sweep=baselines2026 "only=$only" $extra post=false results_dir=$R \
  time_budget_s=$left timeout_s=300 >> "$OUT/chain$K.log" 2>&1; say "runner exit $?"; snap
say done

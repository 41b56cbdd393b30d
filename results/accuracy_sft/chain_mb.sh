#!/usr/bin/env bash
# Device calls of session 2026-12-05c: all-on-GPU's spread at bf16 rounding, the yardstick of issue 26's bf16
# verdicts (the H200's rerun_mb2 of 6727888 ran in one micro-batch: native's auto_config probe overrode the
# asked-for split; fixed, the split is now the probe's floor). Only all-on-GPU points: no kernel builds.
# Three calls strictly back to back on one warm machine, call K carrying
#   ["wheelhouse", ".gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part<K-1>", ".gguf/PARTS.sha256", ".gguf/SHA256SUMS",
#    ".gguf/gguf-0.19.0-py3-none-any.whl"]
#   call 1: install, stash part 0; call 2: stash part 1;
#   call 3: stash part 2, join; accuracy_sft all-on-GPU rerun_mb2 and rerun_mb4 (the same step in 2 and 4
#           micro-batches), each compared with the machine's committed all-on-GPU default row (runs of the
#           reference are bit-identical run to run: rerun of a9736ef, and rerun_mb2 of 6727888 as it ran)
# Usage: bash results/accuracy_sft/chain_mb.sh K <git sha>    (SFT_BUDGET_S, default 200)
set -uo pipefail
K=$1
source scripts/device_call_env.sh "mb$K" "$2"
R=/tmp/mb$K
mkdir -p "$R"
bash scripts/ship_gguf.sh stash >> "$OUT/mb$K.log" 2>&1; have=$?
[ "$K" = 3 ] || { say "stash exit $have (1 = parts still missing)"; say done; exit 0; }
[ $have = 0 ] && bash scripts/ship_gguf.sh join >> "$OUT/mb$K.log" 2>&1 || { say "GGUF incomplete or join failed"; exit 1; }
say "accuracy_sft: all-on-GPU rerun_mb2, rerun_mb4"
python3 -m experiments.run sweep=accuracy_sft 'only=[native__*__rerun_mb2__*,native__*__rerun_mb4__*]' post=false \
  results_dir=$R time_budget_s=${SFT_BUDGET_S:-200} >> "$OUT/mb$K.log" 2>&1; rc=$?
say "accuracy_sft runner exit $rc"
tar czf "$OUT/mb$K.tgz" -C /tmp "mb$K" 2>/dev/null
say done
exit $rc

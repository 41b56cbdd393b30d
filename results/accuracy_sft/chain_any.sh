#!/usr/bin/env bash
# Device calls of session 2026-12-05 for the two machine-independent points (each a same-run comparison with
# all-on-GPU training on whatever GPU comes: H200 or H100), three calls strictly back to back, call K carrying
#   ["wheelhouse", ".gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part<K-1>", ".gguf/PARTS.sha256", ".gguf/SHA256SUMS",
#    ".gguf/gguf-0.19.0-py3-none-any.whl"]          (bash scripts/ship_gguf.sh split first: 3 parts of 31.3 MiB)
#   call 1: install, kernel builds, stash part 0                                         (~1.5 min, fresh machine)
#   call 2: stash part 1                                                                    (seconds, warm machine)
#   call 3: stash part 2, join; issue 26: accuracy_sft all-on-GPU (default, rerun_ulp: its spread) and MegaTrain
#           pure streaming in all-on-GPU's arithmetic (streaming_autocast), one run; then issue 24: the 0.5B
#           accuracy-parity run (300 steps of stdlib bytes) with all-on-GPU and ZenFlow, one run, cut at the budget
# Usage: bash results/accuracy_sft/chain_any.sh K <git sha>    (CHAIN_BUDGET_S, default 540)
set -uo pipefail
K=$1
source scripts/device_call_env.sh "any$K" "$2"
R=/tmp/any$K
mkdir -p "$R"
snap() { tar czf "$OUT/any$K.tgz" -C /tmp "any$K" 2>/dev/null; }
[ "$K" = 1 ] && build_kernels
bash scripts/ship_gguf.sh stash >> "$OUT/any$K.log" 2>&1; have=$?
[ "$K" = 3 ] || { say "stash exit $have (1 = parts still missing)"; say done; exit 0; }
[ $have = 0 ] && bash scripts/ship_gguf.sh join >> "$OUT/any$K.log" 2>&1 || { say "GGUF incomplete or join failed"; exit 1; }
build_kernels  # cached on a warm machine
say "accuracy_sft: all-on-GPU default + rerun_ulp, MegaTrain streaming_autocast"
MEGATRAIN_CACHE=/tmp/mtcache python3 -m experiments.run sweep=accuracy_sft \
  'only=[native__*__default__*,native__*__rerun_ulp__*,megatrain__*__streaming_autocast__*]' post=false \
  results_dir=$R/accuracy_sft time_budget_s=260 >> "$OUT/any$K.log" 2>&1; say "accuracy_sft runner exit $?"; snap
left=$(( ${CHAIN_BUDGET_S:-540} - ($(date +%s) - t0) - 15 ))
say "accuracy parity 0.5B: native, zenflow; budget $left s"
if [ $left -gt 60 ]; then
  timeout -k 10 $left python3 scripts/accuracy_parity.py --systems native,zenflow --cache /tmp/ap_cache \
    --out $R/accuracy_parity >> "$OUT/any$K.log" 2>&1; say "accuracy parity exit $?"
fi
snap
say done

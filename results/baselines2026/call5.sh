#!/usr/bin/env bash
# Device call 5 (session 2026-12-04b), right after call 4 on the same machine (its install, kernels and the GGUF's
# first part are there): issue 26's last point (MegaTrain pure streaming in all-on-GPU's arithmetic, beside the
# reference, one run), then baselines2026 at 3B 16x1024 part 1 (all-on-GPU best, MegaTrain tiered and pure
# streaming, ZeRO-3 offload, ZeRO-2 optimizer offload; 6 timed steps after 3 warm-up: none of these has
# ZenFlow's every-4th-step wait).
# Carry: .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part1, .gguf/SHA256SUMS, .gguf/gguf-0.19.0-py3-none-any.whl
# Usage: bash results/baselines2026/call5.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh call5 "$1"  # env, say, install
snap() { tar czf $OUT/r5.tgz -C /tmp r5; }
[ -f .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 ] || cp /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 .gguf/
bash scripts/ship_gguf.sh join >> $OUT/call5.log 2>&1 || say "join failed"
say "accuracy_sft: pure streaming in autocast beside the reference"
MEGATRAIN_CACHE=/tmp/mtcache python3 -m experiments.run sweep=accuracy_sft 'only=[native__*__default__*,megatrain__*__streaming_autocast__*]' post=false results_dir=/tmp/r5 time_budget_s=170 >> $OUT/call5.log 2>&1; say "runner exit $?"; snap
left=$(( 555 - ($(date +%s) - t0) ))
say "baselines2026 3B part 1, budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-3b]' 'only=[native__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__pure_streaming__*,zero3__qwen2.5-3b__*__b16__default__*,zero2__qwen2.5-3b__*__b16__default__*]' steps=6 warmup_steps=3 post=false results_dir=/tmp/r5 time_budget_s=$left timeout_s=200 >> $OUT/call5.log 2>&1; say "runner exit $?"; snap
say done

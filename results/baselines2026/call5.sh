#!/usr/bin/env bash
# Device call 5 (planned 2026-12-04b, run 2026-12-04c on a fresh machine): install, kernels, the GGUF's first part
# kept in /tmp/gguf for call 6, then baselines2026 at 3B 16x1024 part 1 (all-on-GPU best, MegaTrain tiered and pure
# streaming, ZeRO-3 offload, ZeRO-2 optimizer offload; 6 timed steps after 3 warm-up: none of these has
# ZenFlow's every-4th-step wait).
# Carry: wheelhouse, .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0
# Usage: bash results/baselines2026/call5.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh call5 "$1"  # env, say, install
snap() { tar czf $OUT/r5.tgz -C /tmp r5; }
# A fresh machine (session 2026-12-04c: call 4's machine went back before this call): keep the GGUF's first part
# for call 6 and build the kernels the runs need (host AdamW, DeepSpeed's cpu_adam) before the clock of the sweep.
mkdir -p /tmp/gguf && cp .gguf/*.part0 /tmp/gguf/ 2>/dev/null
build_kernels
left=$(( 500 - ($(date +%s) - t0) ))
say "baselines2026 3B part 1, budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-3b]' 'only=[native__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__default__*,megatrain__qwen2.5-3b__*__b16__pure_streaming__*,zero3__qwen2.5-3b__*__b16__default__*,zero2__qwen2.5-3b__*__b16__default__*]' steps=6 warmup_steps=3 post=false results_dir=/tmp/r5 time_budget_s=$left timeout_s=200 >> $OUT/call5.log 2>&1; say "runner exit $?"; snap
say done

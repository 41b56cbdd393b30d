#!/usr/bin/env bash
# Device call 3 (session 2026-12-04), right after call 2 on the same machine (its install, kernels and the GGUF's
# first part are there): the GGUF joined, then accuracy_sft (issue 26) -- all-on-GPU bf16 (the reference), MegaTrain
# with all-on-GPU's arithmetic (mixed_precision=autocast), all-on-GPU with beta2 two fp32 ulps off (the training's
# own spread), ZeRO-3 in fp32 beside the committed fp32 pair -- then issue 24's first rows of baselines2026
# (SuperOffload with clipping and without, ZenFlow at 1.5B beside all-on-GPU and MegaTrain there), as the
# budget allows. (Ran at 3b6c5ca with its 555 lowered to 505 by a sed on the device: 585 s of device time were left.)
# Usage: bash results/accuracy_sft/call3c.sh <git sha>
set -uo pipefail
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a $OUT/call3.log; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=$1 MEGATRAIN_CACHE=/tmp/mtcache PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
source /tmp/site/megatrain-env.sh || { say "no install: a fresh machine"; exit 3; }
[ -f .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 ] || cp /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 .gguf/
bash scripts/ship_gguf.sh join >> $OUT/call3.log 2>&1 || { say "join failed"; exit 3; }
say "accuracy_sft"
python3 -m experiments.run sweep=accuracy_sft 'only=[native__*__default__*,megatrain__*__autocast__*,native__*__rerun_ulp__*,zero3__*__fp32__*]' results_dir=/tmp/r3 time_budget_s=$(( 320 - ($(date +%s) - t0) )) >> $OUT/call3.log 2>&1; say "runner exit $?"
left=$(( 505 - ($(date +%s) - t0) ))
say "baselines2026 (first rows), budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-1.5b,qwen2.5-3b]' 'only=[superoffload__qwen2.5-3b__*__b16__default__*,superoffload_noclip__qwen2.5-3b__*__b16__default__*,zenflow__qwen2.5-1.5b__*__b16__default__*,native__qwen2.5-1.5b__*__b16__default__*,megatrain__qwen2.5-1.5b__*__b16__default__*]' results_dir=/tmp/r3 time_budget_s=$left timeout_s=150 >> $OUT/call3.log 2>&1; say "runner exit $?"
tar czf $OUT/r3.tgz -C /tmp r3; say done

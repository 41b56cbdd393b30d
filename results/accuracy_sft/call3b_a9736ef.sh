#!/usr/bin/env bash
# Device call 3 (session 2026-12-02b), right after call 2 on the same machine: the GGUF joined from its two
# parts, then the accuracy_sft sweep (issue 26): all-on-GPU, MegaTrain tiered, ZeRO-3, the all-on-GPU reruns
# (as is, beta2 two ulps off), the fp32 pair, pure streaming last.
set -uo pipefail
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a $OUT/call3.log; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=$1 MEGATRAIN_CACHE=/tmp/mtcache PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
source /tmp/site/megatrain-env.sh || { say "no install: a fresh machine"; exit 3; }
[ -f .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 ] || cp /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 .gguf/
bash scripts/ship_gguf.sh join >> $OUT/call3.log 2>&1 || { say "join failed"; exit 3; }
left=$(( 560 - ($(date +%s) - t0) ))
say "accuracy_sft, budget $left s"
python3 -m experiments.run sweep=accuracy_sft results_dir=/tmp/rs time_budget_s=$left >> $OUT/call3.log 2>&1; say "runner exit $?"
tar czf $OUT/rs.tgz -C /tmp rs; say done

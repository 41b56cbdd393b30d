#!/usr/bin/env bash
# Prepared 2026-12-04 for the next session (NOT run yet): device call B, right after A on the same machine (its
# install, kernels, shared 3B init and the GGUF's first part are there). Issue 26's last point (MegaTrain pure
# streaming in all-on-GPU's arithmetic, beside the reference), then baselines2026 3B part 2: SuperOffload without
# clipping, FSDP2, ZenFlow unpinned (its pinned 3B default: host OOM predicted at 52.9 B/param).
# Carry: .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part1, .gguf/SHA256SUMS, .gguf/gguf-0.19.0-py3-none-any.whl
# Usage: bash results/baselines2026/next_callB.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh callB "$1"  # env, say, install
[ -f .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 ] || cp /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 .gguf/
bash scripts/ship_gguf.sh join >> $OUT/callB.log 2>&1 || { say "join failed"; exit 3; }
say "accuracy_sft: pure streaming in autocast beside the reference"
MEGATRAIN_CACHE=/tmp/mtcache python3 -m experiments.run sweep=accuracy_sft 'only=[native__*__default__*,megatrain__*__streaming_autocast__*]' results_dir=/tmp/rB time_budget_s=160 >> $OUT/callB.log 2>&1; say "runner exit $?"
left=$(( 550 - ($(date +%s) - t0) ))
say "baselines2026 3B part 2, budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-3b]' 'only=[superoffload_noclip__qwen2.5-3b__*__b16__default__*,fsdp__qwen2.5-3b__*__b16__default__*,zenflow__qwen2.5-3b__*__b16__unpinned__*]' results_dir=/tmp/rB time_budget_s=$left timeout_s=200 >> $OUT/callB.log 2>&1; say "runner exit $?"
tar czf $OUT/rB.tgz -C /tmp rB; say done

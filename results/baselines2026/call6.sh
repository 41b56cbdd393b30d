#!/usr/bin/env bash
# Device call 6 (planned 2026-12-04b, run 2026-12-04c), right after call 5 (same machine: install, kernels, the
# shared 3B init, the GGUF's first part): issue 26's last point (MegaTrain pure streaming in all-on-GPU's
# arithmetic beside the reference, one run), then baselines2026 at 3B 16x1024 part 2 -- ZenFlow unpinned (its pinned default: host OOM predicted at 52.9 B/param
# measured at 1.5B), SuperOffload with clipping and without, FSDP2 offload, Gemini (JIT-builds two kernels,
# ~2 min) -- 8 timed steps after 4 warm-up (the sweep's own: ZenFlow's every-4th-step CPU wait falls in them
# twice), as far as the budget goes.
# Carry: .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part1, .gguf/SHA256SUMS, .gguf/gguf-0.19.0-py3-none-any.whl
# Usage: bash results/baselines2026/call6.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh call6 "$1"  # env, say, install
[ -f .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 ] || cp /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 .gguf/ 2>/dev/null
if [ -f .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 ]; then  # call 5's machine still warm: the GGUF is whole
  bash scripts/ship_gguf.sh join >> $OUT/call6.log 2>&1 || say "join failed"
  say "accuracy_sft: pure streaming in autocast beside the reference"
  MEGATRAIN_CACHE=/tmp/mtcache python3 -m experiments.run sweep=accuracy_sft 'only=[native__*__default__*,megatrain__*__streaming_autocast__*]' post=false results_dir=/tmp/r6 time_budget_s=170 >> $OUT/call6.log 2>&1; say "runner exit $?"
  tar czf $OUT/r6.tgz -C /tmp r6
else  # a fresh machine (the GGUF's first part is gone): no accuracy_sft; build the kernels part 2 needs first
  say "fresh machine: no GGUF part 0, accuracy_sft skipped"
  build_kernels
fi
left=$(( ${CALL6_BUDGET_S:-520} - ($(date +%s) - t0) ))
say "baselines2026 3B part 2, budget $left s"
python3 -m experiments.run sweep=baselines2026 'sweep.models=[qwen2.5-3b]' 'only=[zenflow__qwen2.5-3b__*__b16__unpinned__*,gemini__qwen2.5-3b__*__b16__default__*,superoffload__qwen2.5-3b__*__b16__default__*,fsdp__qwen2.5-3b__*__b16__default__*,superoffload_noclip__qwen2.5-3b__*__b16__default__*]' post=false results_dir=/tmp/r6 time_budget_s=$left timeout_s=200 >> $OUT/call6.log 2>&1; say "runner exit $?"
tar czf $OUT/r6.tgz -C /tmp r6; say done

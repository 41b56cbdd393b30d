#!/usr/bin/env bash
# Device call of the settle change (session 2026-12-07b): the runtime split no longer tries a proposal past a
# clear measured loss (SplitChooser.beyond_a_loss) and the runner's warm-up goes on while the engine is still
# choosing (settle_steps, here 12), so the timed steps run the split it settled on. Carries ["wheelhouse"].
# One call: kernels, then 7B pure streaming 8x1024 pairs (CPU path beside the hybrid, one runner each):
# bf16 over the link with clipping firing, fp32 without clipping, fp32 with clipping; END_S (default 560) is
# when runners stop starting points.
# MODE=shadow (the fused bf16 shadow: the kernel writes it in the update pass): one point per runner, clipping
# firing: the CPU path with the bf16 shadow, the CPU path with fp32 weights, then the bf16 hybrid.
# MODE=bench (the last minutes): the host AdamW build, then scripts/bench_host_shadow.py on the node's CPU.
# Usage (repo root): [MODE=shadow|bench] bash results/update_path/chain_settle.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh settle "$1"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/settle.log"
P7='megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned__*,megatrain__qwen2.5-7b__*__b8__streaming_hybrid__*'
P7B='megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned_bf16__*,megatrain__qwen2.5-7b__*__b8__streaming_hybrid_bf16__*'
new() { python3 -m experiments.run sweep=update_path results_dir=$R post=false steps=4 warmup_steps=6 settle_steps=12 \
          timeout_s=150 'sweep.models=[qwen2.5-7b]' "$@" >> "$OUT/settle.log" 2>&1; say "runner exit $?"; snap; }
end=${END_S:-560}
if [ "${MODE:-}" = bench ]; then  # the last minutes: the kernel alone, fused shadow vs second pass
  python3 -m megatrain.kernels build >> "$OUT/settle.log" 2>&1  # the host AdamW only (no DeepSpeed build)
  say "host kernel: update alone, shadow fused, shadow by a second pass (5e8 params, median of 5)"
  PYTHONPATH=. python3 scripts/bench_host_shadow.py --params 5e8 --runs 5 --out "$OUT/shadow.jsonl" >> "$OUT/settle.log" 2>&1
  say "bench exit $?"
  exit 0
fi
build_kernels
if [ "${MODE:-}" = shadow ]; then
  say "clipping fires: 7B CPU path bf16 shadow, CPU path fp32, hybrid bf16 (end ${end} s)"
  for v in streaming_cpu_pinned_bf16 streaming_cpu_pinned streaming_hybrid_bf16; do
    new "only=[megatrain__qwen2.5-7b__*__b8__${v}__*]" time_budget_s=$(budget "$end")
  done
else
  say "clipping fires, bf16 link pair; no clipping, fp32 pair; clipping fires, fp32 pair (end ${end} s)"
  new "only=[$P7B]" time_budget_s=$(budget $((end - 280)))
  new sweep.name=update_path_noclip optim.max_grad_norm=1e9 "only=[$P7]" time_budget_s=$(budget $((end - 140)))
  new "only=[$P7]" time_budget_s=$(budget "$end")
fi
say done

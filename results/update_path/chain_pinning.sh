#!/usr/bin/env bash
# Device calls of the page-locked host state (session 2026-12-07c): EngineConfig.pin_host_state="all" (the
# *_locked variants) page-locks every host-tier group's master, m and v, where the default "stream" locks only
# the streamed buffer. Why: in some hybrid rows the CPU kernel updated all the groups 1.2-1.8x faster than in
# the CPU path's process, in steps where the GPU path took none, in others not
# (results/update_path_pinning_h100_2026-12-07.md). These calls measure it directly, in the same run:
#   K=0 (~1.5 min, the last minutes): the host kernel build, then scripts/bench_host_pinning.py: pageable,
#       page-locked, pageable again on one set of buffers, alone and under H2D+D2H copies
#   K=1 (~8-9 min): clipping fires; 7B pure streaming 8x1024: the CPU path as before / locked and the hybrid
#       locked, fp32 then the bf16 shadow; then (H200) 14B tiered 16x1024 CPU path as before / locked
#   K=2 (~8 min): 14B hybrid (H200), the 3B triple (clipping fires), then without clipping the 7B fp32 triple
#   K=3 (H200 only, ~8 min; session 2026-12-07d, 2026-12-07g): 14B tiered 16x1024, clipping fires: the CPU path,
#       the hybrid (the reserve the plan chooses: 1 GiB at the H200 defaults), the hybrid with 16 GiB of staging
#   K=4 (~7 min; 2026-12-07d, after K=0 and 1 showed no gain from "all"): clipping fires, the CPU path and the
#       hybrid as they run by default (pin_host_state "stream"), 7B fp32 8x1024 then 3B 16x1024
#   K=5 (~5 min): the kernel under copies with the host memory traffic (bench_host_pinning --copies: host_gbs),
#       then the 7B fp32 default pair of K=4
#   K=6 (~6 min; session 2026-12-07e): clipping fires, 7B pure streaming 8x1024 as they run by default: the CPU
#       path, the hybrid, the hybrid with the bf16 shadow (issue 23's 7B >= 200 target on an H200)
#   K=7 (~8 min; 2026-12-07e, kept fp32 masters as masters of record: 8 B/param each way): the GPU update-path
#       tests (-m gpu, into gputests.log), then clipping fires, 7B fp32: the CPU path, then on an 80 GB card the
#       hybrid with 16 GiB of staging (streaming_hybrid_staged: kept masters for ~all its GPU-path groups) and
#       the default hybrid; on an H200 the default hybrid (24 kept masters at 3b6c5ca) and the bf16-shadow one
#   K=9 (~5 min): clipping fires, 3B 16x1024: the CPU path, the hybrid with 16 GiB of staging (every master
#       kept: masters of record for all its GPU-path groups) and the default hybrid, no tests
#   K=8 (~7 min): clipping fires, the 3B default pair, then the 7B hybrid with the bf16 shadow (its kept copy is the
#       shadow: 12 B/param each way, the comparison for K=7's hybrid)
# On an 80 GB card (H100) the 14B points are left out (they do not fit beside this host's RAM).
# Each runner: one process per point; warm-up 6 steps + up to 6 while the runtime split is still choosing.
# Usage (repo root; carry ["wheelhouse"]): [END_S=<s>] bash results/update_path/chain_pinning.sh K <git sha>
set -uo pipefail
K=$1
source scripts/device_call_env.sh "pin$K" "$2"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/pin$K.log"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
big=1; [ "${mem:-0}" -lt 100000 ] && big=0 && say "GPU memory ${mem} MiB: no 14B points"
pts() {  # model batch variant... -> an only= list
  local m=$1 b=$2; shift 2; local out=""
  for v in "$@"; do out="${out:+$out,}megatrain__${m}__*__b${b}__${v}__*"; done; echo "only=[$out]"
}
new() { python3 -m experiments.run sweep=update_path results_dir=$R post=false steps=4 warmup_steps=6 settle_steps=6 \
          "$@" >> "$OUT/pin$K.log" 2>&1; say "runner exit $?"; snap; }
end=${END_S:-560}  # seconds into the call by which runners stop starting points
case $K in
  0)
    python3 -m megatrain.kernels build >> "$OUT/pin0.log" 2>&1  # the host AdamW only
    for c in "" --copies; do
      say "host kernel: pageable / page-locked / pageable, 2e9 params, 8 s a phase ${c}"
      PYTHONPATH=. python3 scripts/bench_host_pinning.py --params 2e9 --seconds 8 $c --out "$OUT/pinning.jsonl" \
        >> "$OUT/pin0.log" 2>&1
      say "bench exit $?"
    done
    ;;
  1)
    build_kernels
    say "clipping fires: 7B fp32 triple, 7B bf16 triple$([ $big = 1 ] && echo ', 14B tiered CPU pair') (end ${end} s)"
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' time_budget_s=$(budget $((end - 330))) \
      "$(pts qwen2.5-7b 8 streaming_cpu_pinned streaming_cpu_pinned_locked streaming_hybrid_locked)"
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' time_budget_s=$(budget $((end - 160 * big))) \
      "$(pts qwen2.5-7b 8 streaming_cpu_pinned_bf16 streaming_cpu_pinned_bf16_locked streaming_hybrid_bf16)"
    [ $big = 1 ] && new timeout_s=170 'sweep.models=[qwen2.5-14b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-14b 16 tiered_cpu_pinned tiered_cpu_pinned_locked)"
    ;;
  2)
    build_kernels
    [ $big = 1 ] && new timeout_s=170 'sweep.models=[qwen2.5-14b]' time_budget_s=$(budget 180) \
      "$(pts qwen2.5-14b 16 tiered_hybrid)"
    new timeout_s=110 'sweep.models=[qwen2.5-3b]' time_budget_s=$(budget $((end - 170))) \
      "$(pts qwen2.5-3b 16 streaming_cpu_pinned streaming_cpu_pinned_locked streaming_hybrid_locked)"
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' sweep.name=update_path_noclip optim.max_grad_norm=1e9 \
      time_budget_s=$(budget "$end") "$(pts qwen2.5-7b 8 streaming_cpu_pinned streaming_cpu_pinned_locked streaming_hybrid_locked)"
    ;;
  3)
    [ $big = 1 ] || { say "K=3 needs an H200 (14B tiered)"; exit 2; }
    build_kernels
    new timeout_s=170 'sweep.models=[qwen2.5-14b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-14b 16 tiered_cpu_pinned tiered_hybrid tiered_hybrid_staged)"
    ;;
  4)
    build_kernels
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' time_budget_s=$(budget $((end - 150))) \
      "$(pts qwen2.5-7b 8 streaming_cpu_pinned streaming_hybrid)"
    new timeout_s=110 'sweep.models=[qwen2.5-3b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-3b 16 streaming_cpu_pinned streaming_hybrid)"
    ;;
  5)
    build_kernels
    say "host kernel under copies: host memory traffic"
    PYTHONPATH=. python3 scripts/bench_host_pinning.py --params 2e9 --seconds 6 --copies --out "$OUT/pinning.jsonl" \
      >> "$OUT/pin5.log" 2>&1
    say "bench exit $?"
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-7b 8 streaming_cpu_pinned streaming_hybrid)"
    ;;
  6)
    build_kernels
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-7b 8 streaming_cpu_pinned streaming_hybrid streaming_hybrid_bf16)"
    ;;
  7)
    build_kernels
    say "GPU update-path tests"
    timeout 100 python3 -m pytest -q -m gpu tests/test_update_path_gpu.py -p no:cacheprovider > "$OUT/gputests.log" 2>&1
    say "tests exit $? ($(tail -1 "$OUT/gputests.log"))"
    if [ $big = 1 ]; then v="streaming_hybrid streaming_hybrid_bf16"; else v="streaming_hybrid_staged streaming_hybrid"; fi
    # shellcheck disable=SC2086
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-7b 8 streaming_cpu_pinned $v)"
    ;;
  8)
    build_kernels
    new timeout_s=110 'sweep.models=[qwen2.5-3b]' time_budget_s=$(budget $((end - 150))) \
      "$(pts qwen2.5-3b 16 streaming_cpu_pinned streaming_hybrid)"
    new timeout_s=150 'sweep.models=[qwen2.5-7b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-7b 8 streaming_hybrid_bf16)"
    ;;
  9)
    build_kernels
    new timeout_s=110 'sweep.models=[qwen2.5-3b]' time_budget_s=$(budget "$end") \
      "$(pts qwen2.5-3b 16 streaming_cpu_pinned streaming_hybrid_staged streaming_hybrid)"
    ;;
  *) say "K must be 0-9"; exit 2 ;;
esac
say done

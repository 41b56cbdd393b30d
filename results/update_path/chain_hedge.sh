#!/usr/bin/env bash
# Device calls of the hedge change (session 2026-12-06e): the GPU path's candidates include the split at CPU
# rates CPU_DOUBT slower than the build's probe, the probe's CPU rates are medians, and a calibration that
# disagrees with the probe beyond MODEL_DOUBT replaces it. Each call carries
#   ["wheelhouse"]
# and runs strictly back to back on one warm machine (H200; on an 80 GB card the 3B pair replaces 14B).
#   call 1: kernels, the update path's GPU tests (parity + the probe), then clipping firing, the CPU path (cores
#           bound, the default) beside the hybrid in one runner each: 7B pure streaming 8x1024 (the bf16 shadow
#           over the link, then fp32 weights), then 14B tiered 16x1024 (H200) or 3B pure streaming (H100);
#           END_S=<s> (default 560): when the runners stop starting points, for a call with less device time
#           (below 500: the two 7B pairs only)
#   call 2: the same pairs without clipping (max_grad_norm 1e9), then the 3B pair with clipping on an H200
#   call 3 (the last few minutes): kernels, then the 7B pair with the bf16 shadow over the link (END_S, 200)
# Warm-up 6 steps: the runtime split needs ~4 steps to calibrate, measure the CPU path alone once and try the
# calibrated proposal; the 4 timed steps then run the split it kept (the rows' split_* phases say which).
# Usage (repo root): bash results/update_path/chain_hedge.sh K <git sha>
set -uo pipefail
K=$1
source scripts/device_call_env.sh "hedge$K" "$2"  # env, say, install (a warm machine keeps /tmp/site)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/hedge$K.log"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
P7='megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned__*,megatrain__qwen2.5-7b__*__b8__streaming_hybrid__*'
P7B='megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned_bf16__*,megatrain__qwen2.5-7b__*__b8__streaming_hybrid_bf16__*'
P14='megatrain__qwen2.5-14b__*__b16__tiered_cpu_pinned__*,megatrain__qwen2.5-14b__*__b16__tiered_hybrid__*'
P3='megatrain__qwen2.5-3b__*__b16__streaming_cpu_pinned__*,megatrain__qwen2.5-3b__*__b16__streaming_hybrid__*'
# On an 80 GB card (H100) the 14B tiered plan does not fit beside this host's RAM: the 3B pair in its place.
THIRD=qwen2.5-14b; PT=$P14
if [ "${mem:-0}" -lt 100000 ]; then THIRD=qwen2.5-3b; PT=$P3; say "GPU memory ${mem} MiB: the 3B pair in place of 14B"; fi
new() { python3 -m experiments.run sweep=update_path results_dir=$R post=false "$@" >> "$OUT/hedge$K.log" 2>&1; say "runner exit $?"; snap; }
# settle_steps (since e5218b0): warm-up goes on while the engine is still choosing (at most 6 more steps; ~4.7 s
# each at 14B), so the 14B points' limit is 160 s and the 7B ones' 150.
STEPS='steps=4 warmup_steps=6 settle_steps=6'
case $K in
  1)
    build_kernels
    say "GPU tests: update path"
    timeout 110 python3 -m pytest -m gpu tests/test_update_path_gpu.py -q -p no:cacheprovider > "$OUT/gputests.log" 2>&1
    say "pytest exit $?"; tail -3 "$OUT/gputests.log" >> "$OUT/hedge$K.log"
    end=${END_S:-560}  # seconds into the call by which runners stop starting points (less device time left: less)
    say "clipping fires: 7B bf16 link pair, 7B fp32 link pair, $THIRD pair (end ${end} s)"
    if [ "$end" -ge 500 ]; then
      new $STEPS timeout_s=150 'sweep.models=[qwen2.5-7b]' "only=[$P7B]" time_budget_s=$(budget $((end - 300)))
      new $STEPS timeout_s=150 'sweep.models=[qwen2.5-7b]' "only=[$P7]" time_budget_s=$(budget $((end - 160)))
      new $STEPS timeout_s=160 "sweep.models=[$THIRD]" "only=[$PT]" time_budget_s=$(budget $end)
    else  # a short call: the two 7B pairs only
      new $STEPS timeout_s=150 'sweep.models=[qwen2.5-7b]' "only=[$P7B]" time_budget_s=$(budget $((end - 140)))
      new $STEPS timeout_s=150 'sweep.models=[qwen2.5-7b]' "only=[$P7]" time_budget_s=$(budget $end)
    fi
    ;;
  2)
    build_kernels  # cached on a warm machine
    NC='sweep.name=update_path_noclip optim.max_grad_norm=1e9'
    say "no clipping: 7B fp32 link pair, $THIRD pair"
    new $NC $STEPS timeout_s=150 'sweep.models=[qwen2.5-7b]' "only=[$P7]" time_budget_s=$(budget 200)
    new $NC $STEPS timeout_s=160 "sweep.models=[$THIRD]" "only=[$PT]" time_budget_s=$(budget 400)
    if [ "$THIRD" = qwen2.5-14b ]; then
      say "clipping fires: 3B pair"
      new $STEPS timeout_s=100 'sweep.models=[qwen2.5-3b]' "only=[$P3]" time_budget_s=$(budget 560)
    fi
    ;;
  3)  # the last few minutes of a session's device time: kernels, then the bf16-link 7B pair (clipping fires)
    build_kernels
    # HYBRID_ONLY=1 (under ~3 minutes): the hybrid point alone; its chooser still measures the CPU path once
    [ -n "${HYBRID_ONLY:-}" ] && P7B='megatrain__qwen2.5-7b__*__b8__streaming_hybrid_bf16__*'
    new $STEPS timeout_s=150 'sweep.models=[qwen2.5-7b]' "only=[$P7B]" time_budget_s=$(budget ${END_S:-200})
    ;;
  *) say "K must be 1, 2 or 3"; exit 2 ;;
esac
say done

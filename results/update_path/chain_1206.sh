#!/usr/bin/env bash
# Device calls of session 2026-12-06: three calls strictly back to back on one warm H200 (the 14B tiered points
# need its GPU memory: on an 80 GB card the 14B plan does not fit beside the host's 126 GiB), call K carrying
#   ["wheelhouse", ".old", ".gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part<K-1>", ".gguf/PARTS.sha256",
#    ".gguf/SHA256SUMS", ".gguf/gguf-0.19.0-py3-none-any.whl"]
# (.old/799898c.tgz = `git archive --prefix=799898c/ 799898c megatrain experiments baselines scripts analysis
#  pyproject.toml`: the commit before the kept-master change, for a same-run before/after of the hybrid rows.)
#   call 1: install, kernels (host AdamW, DeepSpeed's cpu_adam for call 3), the update path's GPU tests, then
#           issue 23's rows with clipping firing, one run: CPU path (cores bound, the default) beside the hybrid
#           GPU update path for 14B tiered 16x1024, 7B pure streaming 8x1024 and 3B pure streaming 16x1024,
#           and 799898c's hybrid beside each pure-streaming pair (sweep update_path_799898c)
#   call 2: the same six points without clipping (max_grad_norm 1e9, 10 warm-up steps: speculate="auto"
#           measures both ways in steps ~2-9)
#   call 3: the GGUF joined; issue 26's all-on-GPU rerun_mb2 / rerun_mb4 (the bf16 spread yardstick on this
#           machine), then issue 24's ZenFlow (unpinned) at 3B 64x1024 with what is left
#   call 4 (instead of 1 when little device time is left): 7B clipping fires (CPU, hybrid; then both with bf16
#           weights over the link, stream_dtype=bf16), then 14B tiered (hybrid, CPU)
#   call 5 (the last few minutes): 7B hybrid, then the CPU path
#   H100 plan (no H200 to be had, session 2026-12-06d): call 4 (part 0), then 6 (part 1: 7B bf16 pair without
#           clipping), then 7 (part 2: the accuracy_sft points the H100 table lacks: its own complete Table 3);
#           short of time: NO_THIRD=1 on call 4 (the two 7B pairs only), call 0 (stash only) in place of 6,
#           SFT_BF16_ONLY=1 and SFT_END_S=<seconds> on call 7
# Every call stashes its GGUF part first. Usage (repo root): bash results/update_path/chain_1206.sh K <git sha>
set -uo pipefail
K=$1
source scripts/device_call_env.sh "up$K" "$2"  # env, say, install (a warm machine keeps /tmp/site)
bash scripts/ship_gguf.sh stash >> "$OUT/up$K.log" 2>&1; have=$?
say "GGUF stash exit $have (0 = every part here)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/up$K.log"
P='megatrain__qwen2.5-14b__*__b16__tiered_cpu_pinned__*,megatrain__qwen2.5-14b__*__b16__tiered_hybrid__*,megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned__*,megatrain__qwen2.5-7b__*__b8__streaming_hybrid__*'
P3='megatrain__qwen2.5-3b__*__b16__streaming_cpu_pinned__*,megatrain__qwen2.5-3b__*__b16__streaming_hybrid__*'
# On an 80 GB card (H100) the 14B tiered plan does not fit beside this host's RAM: its points are left out.
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -lt 100000 ]; then
  P='megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned__*,megatrain__qwen2.5-7b__*__b8__streaming_hybrid__*'
  say "GPU memory ${mem} MiB: no 14B points"
fi
new() { python3 -m experiments.run sweep=update_path results_dir=$R post=false "$@" >> "$OUT/up$K.log" 2>&1; say "runner exit $?"; snap; }
old() {
  (cd /tmp/old/799898c && MEGATRAIN_GIT_SHA=799898c python3 -m experiments.run sweep=update_path \
     sweep.name=update_path_799898c results_dir=$R post=false "$@") >> "$OUT/up$K.log" 2>&1
  say "799898c runner exit $?"; snap
}
case $K in
  1)
    build_kernels
    rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .old/799898c.tgz -C /tmp/old || say "no old tree"
    say "GPU tests: update path"
    timeout 100 python3 -m pytest -m gpu tests/test_update_path_gpu.py -q -p no:cacheprovider > "$OUT/gputests.log" 2>&1
    say "pytest exit $?"; tail -3 "$OUT/gputests.log" >> "$OUT/up$K.log"
    ORDER='steps=4 warmup_steps=4 timeout_s=110'
    say "clipping fires: 14B tiered, 7B streaming (CPU, hybrid)"
    new $ORDER 'sweep.models=[qwen2.5-14b,qwen2.5-7b]' "only=[$P]" time_budget_s=$(budget 400)
    say "799898c: 7B streaming hybrid"
    old $ORDER 'sweep.models=[qwen2.5-7b]' 'only=[megatrain__qwen2.5-7b__*__b8__streaming_hybrid__*]' time_budget_s=$(budget 455)
    say "clipping fires: 3B streaming (CPU, hybrid)"
    new $ORDER 'sweep.models=[qwen2.5-3b]' "only=[$P3]" time_budget_s=$(budget 525)
    say "799898c: 3B streaming hybrid"
    old $ORDER 'sweep.models=[qwen2.5-3b]' 'only=[megatrain__qwen2.5-3b__*__b16__streaming_hybrid__*]' time_budget_s=$(budget 560)
    ;;
  2)
    build_kernels  # a warm machine returns at once (cached); a fresh one needs them before any timed run
    NC='sweep.name=update_path_noclip optim.max_grad_norm=1e9 steps=4 warmup_steps=10 timeout_s=130'
    say "no clipping: 14B tiered, 7B and 3B streaming (CPU, hybrid)"
    new $NC 'sweep.models=[qwen2.5-14b,qwen2.5-7b,qwen2.5-3b]' "only=[$P,$P3]" time_budget_s=$(budget 560)
    ;;
  3)
    build_kernels
    if [ $have = 0 ] && bash scripts/ship_gguf.sh join >> "$OUT/up$K.log" 2>&1; then
      say "accuracy_sft: all-on-GPU rerun_mb2, rerun_mb4"
      python3 -m experiments.run sweep=accuracy_sft 'only=[native__*__rerun_mb2__*,native__*__rerun_mb4__*]' \
        post=false results_dir=$R time_budget_s=$(budget 230) >> "$OUT/up$K.log" 2>&1; say "accuracy_sft runner exit $?"; snap
    else
      say "GGUF incomplete or join failed: no SFT points"
    fi
    # unpinned: the pinned default does not fit this host at 3B (host OOM at 16x1024, 2026-12-04)
    say "baselines2026: ZenFlow unpinned 3B 64x1024, budget $(budget 565) s"
    python3 -m experiments.run sweep=baselines2026 'only=[zenflow__qwen2.5-3b__*__b64__unpinned__*]' steps=6 warmup_steps=3 \
      post=false results_dir=$R time_budget_s=$(budget 565) timeout_s=400 >> "$OUT/up$K.log" 2>&1; say "runner exit $?"; snap
    ;;
  4)  # a short H200 call when little device time is left: 7B (fp32 and bf16 weights over the link), then 14B;
      # clipping fires (799898c's before/after is call 1's)
    build_kernels
    ORDER='steps=4 warmup_steps=4 timeout_s=110'
    P7='megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned__*,megatrain__qwen2.5-7b__*__b8__streaming_hybrid__*'
    P7B='megatrain__qwen2.5-7b__*__b8__streaming_hybrid_bf16__*,megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned_bf16__*'
    P14='megatrain__qwen2.5-14b__*__b16__tiered_hybrid__*,megatrain__qwen2.5-14b__*__b16__tiered_cpu_pinned__*'
    new $ORDER 'sweep.models=[qwen2.5-7b]' "only=[$P7]" time_budget_s=$(budget 230)
    new $ORDER 'sweep.models=[qwen2.5-7b]' "only=[$P7B]" time_budget_s=$(budget 330)
    if [ -n "${NO_THIRD:-}" ]; then say "NO_THIRD: neither 14B nor 3B (a short call)"
    elif [ "${mem:-0}" -lt 100000 ]; then  # an 80 GB card: the 3B pair in place of 14B (see above)
      new $ORDER 'sweep.models=[qwen2.5-3b]' "only=[$P3]" time_budget_s=$(budget 545)
    else
      new $ORDER 'sweep.models=[qwen2.5-14b]' "only=[$P14]" time_budget_s=$(budget 545)
    fi
    ;;
  5)  # the last few minutes of a session's device time: 7B hybrid, then the CPU path beside it (clipping fires)
    build_kernels
    new steps=3 warmup_steps=4 timeout_s=80 'sweep.models=[qwen2.5-7b]' \
      'only=[megatrain__qwen2.5-7b__*__b8__streaming_hybrid__*]' time_budget_s=$(budget 150)
    new steps=3 warmup_steps=4 timeout_s=80 'sweep.models=[qwen2.5-7b]' \
      'only=[megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned__*]' time_budget_s=$(budget 200)
    ;;
  0)  # stash this call's GGUF part; the kernels built (cached on a warm machine) so that a later call's budget is all runs
    build_kernels
    ;;
  6)  # H100 plan, call 2 (carries GGUF part 1): the bf16-stream 7B pair without clipping
    build_kernels
    new sweep.name=update_path_noclip optim.max_grad_norm=1e9 steps=4 warmup_steps=10 timeout_s=130 \
      'sweep.models=[qwen2.5-7b]' 'only=[megatrain__qwen2.5-7b__*__b8__streaming_hybrid_bf16__*,megatrain__qwen2.5-7b__*__b8__streaming_cpu_pinned_bf16__*]' \
      time_budget_s=$(budget 230)
    ;;
  7)  # H100 plan, call 3 (carries GGUF part 2): the points results/accuracy_sft_h100 lacks, most telling first
    build_kernels
    if [ $have = 0 ] && bash scripts/ship_gguf.sh join >> "$OUT/up$K.log" 2>&1; then
      sft() { MEGATRAIN_CACHE=/tmp/mtcache python3 -m experiments.run sweep=accuracy_sft post=false results_dir=$R "$@" \
                >> "$OUT/up$K.log" 2>&1; say "accuracy_sft runner exit $?"; snap; }
      say "accuracy_sft: MegaTrain tiered and pure streaming, ZeRO-3 (bf16), then the fp32 trio"
      end=${SFT_END_S:-565}  # seconds into the call by which the runners stop starting points (the device time left)
      # SFT_BF16_ONLY=1 (little device time): the three bf16 systems the H100 table lacks, no more
      first=$end; [ -n "${SFT_BF16_ONLY:-}" ] || first=$((end - 300))
      sft 'only=[megatrain__*__default__*,megatrain__*__pure_streaming__*,zero3__*__default__*]' time_budget_s=$(budget $first)
      if [ -z "${SFT_BF16_ONLY:-}" ]; then
        sft 'only=[native__*__fp32__*,megatrain__*__fp32__*,zero3__*__fp32__*]' time_budget_s=$(budget $((end - 100)))
        sft 'only=[megatrain__*__streaming_fp32__*,megatrain__*__autocast__*,native__*__rerun__*]' time_budget_s=$(budget $end)
      fi
    else
      say "GGUF incomplete or join failed: no SFT points"
    fi
    ;;
  *) say "K must be 0 to 7"; exit 2 ;;
esac
say done

#!/usr/bin/env bash
# The reproduction runs on the project's H200 node, one phase per device call (each well under 10 min).
# Run from the repo root with the wheelhouse beside it (scripts/build_wheelhouse.sh) and $OUT set:
#
#   MEGATRAIN_GIT_SHA=<sha> OUT=<dir> bash scripts/h200_repro.sh <phase>
#
# Sweep rows go to the committed results/<sweep>/ (results_dir=results: same GPU name as the rows there,
# so the runner's same-machine check passes); engine benchmarks to $OUT/engine/. Everything that comes
# back is tarred into $OUT/<phase>.tgz with the logs. Phases (what they measure, see docs/reproduction.md):
#   sweeps1   size (MegaTrain 7B/14B, all-on-GPU 7B, every system's 14B+ memory verdicts), depth (MegaTrain
#             28/42/56 layers, 84+ verdicts), width (MegaTrain 1.0x; 4x/5x verdicts)
#             and the context sweep's 1K/8K/32K points
#   context   engine long-context rows: 1K (reference), 512K full depth (the plan's verdict), 256K,
#             512K as a 4-layer slice (throughput); rollback cost of the speculative host AdamW
#   parity    accuracy parity (0.5B, real text, engine vs ZeRO-3 vs all-on-GPU)
# Session 2026-12-01c (commit in each row), each phase cut off by PHASE_BUDGET_S (default 540 s: what is
# not started is listed in the log and left for a rerun, which resumes):
#   engine    GPU tests of the gradient placement; hardware: MegaTrain 7B/14B/32B on the emulated GPUs again
#             (grad_placement=auto), ZeRO-3/Gemini 14B/32B memory verdicts; ablation: 7B pure streaming
#             full vs grads_on_host, 14B tiered full / grads_on_host / no_double_buffer / no_opt_overlap
#   baselines size: every system at 7B (baselines share one 30 GB init folder in $MEGATRAIN_CACHE);
#             hardware: ZeRO-3 / Gemini 7B on the emulated A100
#   baselines3b  size/width: the 72B/120B/4x/5x verdicts again (skip rows, with the gradient placement);
#             size: every system at 3B; tokens: ZeRO-3 at 8K/32K/158K
#   tokens    tokens sweep (3B, 8K..158K tokens per step: MegaTrain, all-on-GPU, ZeRO-3 at three points);
#             depth: MegaTrain L4-L14 on the current engine, pure streaming L4..L56
#   host_side MegaTrain 14B tiered / 7B pure streaming on emulated hosts (4 and 8 cores, 64 and 96 GiB RAM,
#             a 16 and a 32 GB/s host link: a GPU sleep after each copy, megatrain/link.py)
# Session 2026-12-01d left these (docs/sessions/2026-12-01d.md):
#   rest3b    GPU tests (engine, link); size: FSDP2 / Gemini / all-on-GPU at 3B (clipped by the budget), ZeRO-3 3B again with 3 timed
#             steps after 2 warm-up steps (its 2-step row is still speeding up: marked † in the report)
#   rest7b    host_side: the points not reached (rerun resumes); tokens: MegaTrain 158K again (the
#             plan-decided MLP chunk); size: Gemini 7B (clipped at 172 s: give it 300 s)
#   zero3tok  size: MegaTrain 14B on the current engine (the row is 7140039's, 194 TFLOPS); tokens: ZeRO-3 at
#             8K/32K/158K with 3 timed steps
# Session 2026-12-01e (three calls, cheapest points first in each, the budget clips the rest; reruns resume):
#   fillA     GPU tests (engine, link: the pin_in_place helper); all-on-GPU at 3B (size), 28 layers (depth),
#             width 1x, context 1K/8K/32K; width 1.5x/2x/3x (every system: memory verdicts, MegaTrain
#             where the plan holds it); MegaTrain context 2K/4K/16K/64K
#   fillB     size: MegaTrain 14B on the current engine, ZeRO-3 3B again (3 timed steps after 2 warm-up);
#             tokens: ZeRO-3 at 8K/32K/158K
#   fillC     context: MegaTrain 2K/4K/16K/64K (fillA ran out); size: FSDP2 / Gemini at 3B; host_side: the
#             points not reached; tokens: MegaTrain 158K again
# Left by 2026-12-01e (docs/reproduction.md, "Still missing"), one call each:
#   fillD     GPU tests (the load-wait timer); context: all-on-GPU 2K/4K/16K/32K (32K was clipped at 27 s); tokens: ZeRO-3 158K (clipped at
#             111 s), MegaTrain 158K again
#   fillE     depth: all-on-GPU and pure streaming at 42/56 layers (memory verdicts, or rows where the plan
#             holds them); context: MegaTrain 128K/256K in the sweep (one step each: sweep.long_seq_from) and 512K's plan
#             verdict; host_side: the points not reached
#   fillF     size: MegaTrain 14B again (now with the GPU load-wait timer), Gemini 7B (clipped at 172 s:
#             300 s); host_side: what fillE left
# After b2e807a (the host AdamW kernel drops the GIL; before, the main thread re-took the GIL after each torch
# call only between the worker's chunk updates). Where the update overlaps GPU work the main thread must keep
# issuing - speculative updates during the backward, when clipping does not fire - this is where it should
# show; with clipping firing every step (every random-init sweep row) the forward waits for the host tier's
# update anyway (docs/reproduction.md). So the no-clip engine benchmarks first, then the clipped rows:
#   gilA      tests (the kernel's GIL test on the device's compiler build; GPU engine tests); the no-clip
#             rows of results/engine/optimizer.md again (3B pure streaming 16x1024 vs all-on-GPU, 7B pure
#             streaming 8x1024, 14B tiered 16x1024); size: MegaTrain 14B (clip fires)
#   gilB      ablation, 14B tiered: every variant (the issue's list: double buffering, slab pool, checkpoint
#             interval, optimizer overlap, speculation, tiers = pure streaming, a plan verdict at 14B)
#   gilC      ablation, 7B pure streaming: every variant; tokens: MegaTrain 158K (the plan-decided MLP chunk;
#             fillD's budget ran out before it)
#   gilD      depth: MegaTrain tiered 28/42/56 layers, width 1.5x (the fixed kernel)
#   gilE      tokens: MegaTrain at every point (3B), the fixed kernel (what the device budget leaves)
#   later     host_side again (16 / 32 GB/s links never measured), depth tiered 42/56, width 1.5x: phase
#             host_side, and the gilC-style commands in docs/reproduction.md
set -uo pipefail
phase="${1:?usage: h200_repro.sh sweeps1|context|parity|engine|baselines|baselines3b|tokens|host_side|rest3b|rest7b|zero3tok|fillA|fillB|fillC|fillD|fillE|fillF|gilA|gilB|gilC|gilD|gilE}"
budget="${PHASE_BUDGET_S:-540}"
: "${OUT:?set OUT}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
# the baselines' shared initial weights (12-30 GB per model) stay out of results/ and out of the tarball
export MEGATRAIN_CACHE="${MEGATRAIN_CACHE:-/tmp/init_cache}"
mkdir -p "$OUT/engine"
log="$OUT/$phase.log"
stamp="/tmp/h200_repro_$phase.start"; touch "$stamp"  # CSVs newer than this were written by this phase
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$log"; }

if ! python3 -c "import hydra, deepspeed" 2>/dev/null; then
  [ -f /tmp/site/megatrain-env.sh ] || bash scripts/install_offline.sh wheelhouse >>"$OUT/install.log" 2>&1 \
    || { say "wheelhouse install failed (see install.log)"; }
  # shellcheck disable=SC1091
  source /tmp/site/megatrain-env.sh
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$log"
free -g >>"$log"

left_s() { echo $(( budget - ($(date +%s) - t0) )); }  # seconds left of the phase budget
run() {  # the runner into the committed results/, one line of progress per point in the log
  local left=$(( $(left_s) - 20 ))
  if [ "$left" -lt 30 ]; then say "not started (phase budget ${budget}s spent): $*"; return; fi
  say "runner (time_budget_s=$left): $*"
  python3 -m experiments.run results_dir=results time_budget_s="$left" "$@" >>"$log" 2>&1
  say "runner exit $?"
}
bench() {
  say "engine_bench: $*"
  python3 scripts/engine_bench.py "$@" --out "$OUT/engine" >>"$log" 2>&1
  say "engine_bench exit $?"
}

case "$phase" in
  sweeps1)
    run sweep=size 'only=[megatrain__*,*14b*,*32b*,*72b*,*120b*]' redo=true shared_init=false timeout_s=300
    run sweep=depth 'only=[megatrain__*L28__*,megatrain__*L42__*,megatrain__*L56__*,*L84__*,*L132__*,*L180__*]' \
        redo=true shared_init=false timeout_s=300
    run sweep=width 'only=[megatrain__*w1__*,*w4__*,*w5__*]' shared_init=false timeout_s=300
    run sweep=context 'only=[megatrain__*s1024__*,megatrain__*s8192__*,megatrain__*s32768__*]' steps=2 \
        shared_init=false timeout_s=240
    ;;
  context)
    bench long_context --model qwen2.5-7b --batch 16 --seq 1024 --steps 2 --warmup 1
    bench long_context --model qwen2.5-7b --batch 1 --seq 524288 --steps 1 --warmup 0
    bench long_context --model qwen2.5-7b --batch 1 --seq 262144 --steps 1 --warmup 0
    bench long_context --model qwen2.5-7b --layers 4 --batch 1 --seq 524288 --steps 1 --warmup 0
    say "rollback cost (speculate=always, clipping fires)"
    python3 scripts/tier_bench.py --model qwen2.5-3b --batch 16 --seq 1024 --systems 0 --max-grad-norm 1.0 \
        --speculate always --warmup 1 --steps 3 --out "$OUT/engine" --name optimizer >>"$log" 2>&1
    say "tier_bench exit $?"
    ;;
  parity)
    say "accuracy parity"
    python3 scripts/accuracy_parity.py --cache /tmp/ap_cache --out "$OUT/engine" >>"$log" 2>&1
    say "parity exit $?"
    ;;
  engine)
    say "GPU tests (gradient placement among them)"
    timeout 150 python3 -m pytest -m gpu tests/test_engine_gpu.py -q -x -p no:cacheprovider >>"$log" 2>&1
    say "pytest exit $?"
    hw='sweep.hardware=[A100-80GB,RTX-A6000-48GB,RTX-3090-24GB]'
    run sweep=hardware "$hw" 'sweep.systems=[zero3,gemini]' 'sweep.models=[qwen2.5-14b,qwen2.5-32b]' shared_init=false
    run sweep=hardware "$hw" system=megatrain 'sweep.models=[qwen2.5-7b,qwen2.5-14b,qwen2.5-32b]' \
        'only=[*RTX-3090*,*14b*,*32b*]' redo=true shared_init=false timeout_s=150
    run sweep=ablation model=qwen2.5-7b system=megatrain system.options.gpu_resident=0 \
        'only=[*__full__*,*grads_on_host*]' redo=true shared_init=false steps=2 warmup_steps=1 timeout_s=100
    run sweep=ablation model=qwen2.5-14b system=megatrain \
        'only=[*__full__*,*grads_on_host*,*no_double_buffer*,*no_opt_overlap*]' shared_init=false steps=2 \
        warmup_steps=1 timeout_s=120
    ;;
  baselines)
    run sweep=size 'only=[*qwen2.5-7b*]' shared_init=true steps=2 warmup_steps=1 timeout_s=240
    run sweep=hardware 'sweep.hardware=[A100-80GB]' 'sweep.systems=[zero3,gemini]' shared_init=true \
        steps=2 warmup_steps=1 timeout_s=240
    ;;
  baselines3b)
    run sweep=size 'only=[*72b*,*120b*]' redo=true shared_init=false
    run sweep=width 'only=[*w4__*,*w5__*]' redo=true shared_init=false
    run sweep=size 'only=[*qwen2.5-3b*]' shared_init=true steps=2 warmup_steps=1 timeout_s=200
    run sweep=tokens system=zero3 'only=[*b8__*,*b158__*,*b32__*]' shared_init=true steps=2 warmup_steps=1 \
        timeout_s=150
    ;;
  tokens)
    run sweep=tokens 'sweep.systems=[megatrain,native]' shared_init=false steps=2 warmup_steps=1 timeout_s=90
    run sweep=depth system=megatrain 'only=[*L4__*,*L8__*,*L14__*]' redo=true shared_init=false timeout_s=60
    run sweep=depth system=megatrain '+sweep.variants={pure_streaming:{gpu_resident:"0"}}' \
        'only=[*L4__*,*L14__*,*L28__*,*L56__*,*L8__*,*L42__*]' shared_init=false steps=2 warmup_steps=1 timeout_s=90
    run sweep=tokens system=zero3 'only=[*b8__*,*b158__*,*b32__*]' shared_init=false steps=2 warmup_steps=1 \
        timeout_s=120
    ;;
  host_side)
    # the sweep file pairs the shapes (only=...) and sets shared_init=false; the real host runs first, so the
    # host AdamW extension is compiled on all 16 cores, not inside a cores-4 point
    run sweep=host_side timeout_s=240
    ;;
  rest3b)
    say "GPU tests first: the pin_in_place helper (cb2a9b6) changed every cudaHostRegister site"
    timeout 150 python3 -m pytest -m gpu tests/test_engine_gpu.py tests/test_link.py -q -x -p no:cacheprovider \
        >>"$log" 2>&1
    say "pytest exit $?"
    run sweep=size 'only=[fsdp__*qwen2.5-3b*,native__*qwen2.5-3b*,gemini__*qwen2.5-3b*]' shared_init=true steps=3 \
        warmup_steps=1 timeout_s=240
    run sweep=size 'only=[zero3__*qwen2.5-3b*]' redo=true shared_init=true steps=3 warmup_steps=2 timeout_s=200
    ;;
  rest7b)  # cheapest first: the host_side points (~1.5 min each), then 158K, then Gemini (likely host OOM)
    run sweep=host_side timeout_s=240
    run sweep=tokens system=megatrain 'only=[megatrain__*b158__*]' redo=true shared_init=false steps=2 \
        warmup_steps=1 timeout_s=120
    run sweep=size 'only=[gemini__*qwen2.5-7b*]' shared_init=true steps=2 warmup_steps=1 timeout_s=300
    ;;
  zero3tok)
    run sweep=size 'only=[megatrain__*qwen2.5-14b*]' redo=true shared_init=false timeout_s=150  # was 7140039's engine
    run sweep=tokens system=zero3 'only=[*b8__*,*b158__*,*b32__*]' shared_init=true steps=3 warmup_steps=2 \
        timeout_s=180
    ;;
  fillA)
    say "GPU tests first: the pin_in_place helper (cb2a9b6) changed every cudaHostRegister site"
    timeout 150 python3 -m pytest -m gpu tests/test_engine_gpu.py tests/test_link.py -q -x -p no:cacheprovider \
        >>"$log" 2>&1
    say "pytest exit $?"
    run sweep=size 'only=[native__*qwen2.5-3b*]' shared_init=false timeout_s=90
    run sweep=depth 'only=[native__*L28__*]' shared_init=false timeout_s=90
    run sweep=width 'only=[native__*w1__*,*w1.5__*,*w2__*,*w3__*]' shared_init=false timeout_s=150
    run sweep=context 'only=[native__*s1024__*,native__*s8192__*,native__*s32768__*]' shared_init=false timeout_s=90
    run sweep=context 'only=[megatrain__*s2048__*,megatrain__*s4096__*,megatrain__*s16384__*,megatrain__*s65536__*]' \
        shared_init=false timeout_s=120
    ;;
  fillB)
    run sweep=size 'only=[megatrain__*qwen2.5-14b*]' redo=true shared_init=false timeout_s=150  # was 7140039's engine
    run sweep=size 'only=[zero3__*qwen2.5-3b*]' redo=true shared_init=true steps=3 warmup_steps=2 timeout_s=200
    run sweep=tokens system=zero3 'only=[*b32__*,*b158__*,*b8__*]' shared_init=true steps=3 warmup_steps=2 \
        timeout_s=180
    ;;
  fillC)
    run sweep=context 'only=[megatrain__*s2048__*,megatrain__*s4096__*,megatrain__*s16384__*,megatrain__*s65536__*]' \
        shared_init=false timeout_s=120  # fillA's budget ran out before these
    run sweep=size 'only=[fsdp__*qwen2.5-3b*,gemini__*qwen2.5-3b*]' shared_init=true steps=3 warmup_steps=1 \
        timeout_s=200
    run sweep=host_side timeout_s=240
    run sweep=tokens system=megatrain 'only=[megatrain__*b158__*]' redo=true shared_init=false steps=2 \
        warmup_steps=1 timeout_s=120
    ;;
  fillD)
    say "GPU tests first: the GPU load-wait timer (streams.WaitTimer) is new in every CUDA step"
    timeout 150 python3 -m pytest -m gpu tests/test_engine_gpu.py -q -x -p no:cacheprovider >>"$log" 2>&1
    say "pytest exit $?"
    run sweep=context 'only=[native__*s2048__*,native__*s4096__*,native__*s16384__*,native__*s32768__*]' \
        shared_init=false timeout_s=120
    run sweep=tokens system=zero3 'only=[*b158__*]' shared_init=true steps=3 warmup_steps=2 timeout_s=280
    run sweep=tokens system=megatrain 'only=[megatrain__*b158__*]' redo=true shared_init=false steps=2 \
        warmup_steps=1 timeout_s=120
    ;;
  fillE)
    run sweep=depth 'only=[native__*L42__*,native__*L56__*]' shared_init=false timeout_s=60  # memory verdicts
    run sweep=depth system=megatrain '+sweep.variants={pure_streaming:{gpu_resident:"0"}}' \
        'only=[*L42__*pure*,*L56__*pure*]' shared_init=false steps=2 warmup_steps=1 timeout_s=150
    run sweep=context 'only=[megatrain__*s131072__*,megatrain__*s262144__*,megatrain__*s524288__*]' \
        shared_init=false timeout_s=260
    run sweep=host_side timeout_s=240
    ;;
  fillF)
    run sweep=size 'only=[megatrain__*qwen2.5-14b*]' redo=true shared_init=false timeout_s=150  # with gpu_load_wait_s
    run sweep=size 'only=[gemini__*qwen2.5-7b*]' shared_init=true steps=2 warmup_steps=1 timeout_s=300
    run sweep=host_side timeout_s=240
    ;;
  gilA)
    say "tests first: the host AdamW kernel (rebuilt here with the GIL released), GPU engine tests"
    timeout 200 python3 -m pytest tests/test_host_adamw_kernels.py -q -x -p no:cacheprovider >>"$log" 2>&1
    say "pytest (kernel) exit $?"
    timeout 60 python3 scripts/host_adamw_gil.py --threads 15 2>&1 | tee -a "$log"  # the main thread during updates
    timeout 150 python3 -m pytest -m gpu tests/test_engine_gpu.py -q -x -p no:cacheprovider >>"$log" 2>&1
    say "pytest (GPU) exit $?"
    for args in "--model qwen2.5-3b --batch 16 --systems 0,native" "--model qwen2.5-7b --batch 8 --systems 0" \
                "--model qwen2.5-14b --batch 16 --systems auto"; do
      if [ "$(left_s)" -lt 190 ]; then say "not started (phase budget ${budget}s spent): tier_bench $args"; continue; fi
      say "tier_bench (no clip) $args"
      # shellcheck disable=SC2086
      timeout 170 python3 scripts/tier_bench.py $args --seq 1024 --max-grad-norm 1e9 --warmup 2 --steps 3 \
          --out "$OUT/engine" --name optimizer >>"$log" 2>&1
      say "tier_bench exit $?"
    done
    run sweep=size 'only=[megatrain__*qwen2.5-14b*]' redo=true shared_init=false timeout_s=150
    ;;
  gilB)
    run sweep=ablation model=qwen2.5-14b system=megatrain \
        'only=[*__full__*,*no_double_buffer*,*no_slab_pool*,*ckpt_interval_1*,*no_opt_overlap*,*no_speculation*,*grads_on_host*,*pure_streaming*]' \
        redo=true shared_init=false steps=2 warmup_steps=1 timeout_s=150
    ;;
  gilC)
    run sweep=ablation model=qwen2.5-7b system=megatrain system.options.gpu_resident=0 \
        'only=[*__full__*,*no_double_buffer*,*no_slab_pool*,*ckpt_interval_1*,*no_opt_overlap*,*no_speculation*,*grads_on_host*]' \
        redo=true shared_init=false steps=2 warmup_steps=1 timeout_s=120
    run sweep=tokens system=megatrain 'only=[megatrain__*b158__*]' redo=true shared_init=false steps=2 \
        warmup_steps=1 timeout_s=120
    ;;
  gilD)  # session 2026-12-01g: the tiered depth points and width 1.5x with the fixed kernel
    run sweep=depth 'only=[megatrain__*L28__*,megatrain__*L42__*default*,megatrain__*L56__*default*]' redo=true \
        shared_init=false timeout_s=150
    run sweep=width 'only=[megatrain__*w1.5__*]' redo=true shared_init=false timeout_s=150
    ;;
  gilE)  # the rest of the device budget: the tokens sweep's MegaTrain points (3B) with the fixed kernel
    run sweep=tokens system=megatrain redo=true shared_init=false steps=2 warmup_steps=1 timeout_s=90
    ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
say "done"
# The rows first, as plain files (at most 8 files come back; a tarball that grows too big must not take the
# rows with it), then everything (point folders, engine benchmarks) in one tarball.
for f in $(find results -newer "$stamp" -name results.csv -not -path '*/.init_cache/*' | head -5); do
  cp "$f" "$OUT/$(basename "$(dirname "$f")")_results.csv"
done
tar czf "$OUT/$phase.tgz" --exclude=.init_cache results "$OUT/engine" 2>/dev/null \
  || tar czf "$OUT/$phase.tgz" --exclude=.init_cache results
ls -la "$OUT" >>"$log"

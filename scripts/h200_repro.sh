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
set -uo pipefail
phase="${1:?usage: h200_repro.sh sweeps1|context|parity}"
: "${OUT:?set OUT}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
mkdir -p "$OUT/engine"
log="$OUT/$phase.log"
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

run() {  # the runner into the committed results/, one line of progress per point in the log
  say "runner: $*"
  python3 -m experiments.run results_dir=results "$@" >>"$log" 2>&1
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
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
say "done"
tar czf "$OUT/$phase.tgz" results "$OUT/engine" 2>/dev/null || tar czf "$OUT/$phase.tgz" results
ls -la "$OUT" >>"$log"

#!/usr/bin/env bash
# Device call 1 (session 2026-12-02b): the host kernel's ISA (issue 22/23 regression suspect) measured twice --
# the kernel alone (scripts/adamw_bench.py) and the 14B tiered row -- portable (-mavx2 -mfma) vs -march=native,
# same run; then 14B K=4 (the old rows' shape) and 3B 64x1024 in 8 sequential micro-batches (issue 22).
set -uo pipefail
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a $OUT/call1.log; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=$1 MEGATRAIN_CACHE=/tmp/init_cache PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
[ -f /tmp/site/megatrain-env.sh ] || bash scripts/install_offline.sh wheelhouse > $OUT/install.log 2>&1 || say "install failed"
source /tmp/site/megatrain-env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/call1.log; nproc >> $OUT/call1.log
lscpu | grep -E "Model name|Flags" | cut -c1-400 >> $OUT/call1.log
say "kernel builds (portable, native) in parallel"
python3 -m megatrain.kernels build >> $OUT/call1.log 2>&1 &
MEGATRAIN_HOST_ADAMW_CFLAGS=-march=native python3 -m megatrain.kernels build >> $OUT/call1.log 2>&1 &
wait
say "kernel alone: portable"
python3 scripts/adamw_bench.py --params 1e9 --reps 5 --out $OUT/bench_portable >> $OUT/call1.log 2>&1
say "kernel alone: native"
MEGATRAIN_HOST_ADAMW_CFLAGS=-march=native python3 scripts/adamw_bench.py --params 1e9 --reps 5 --out $OUT/bench_native >> $OUT/call1.log 2>&1
A14="sweep=activations sweep.models=[qwen2.5-14b] sweep.batch_sizes=[16] shared_init=false timeout_s=240"
say "14B 16x1024 K=1 and K=4, portable build"
python3 -m experiments.run $A14 results_dir=/tmp/r1 time_budget_s=300 >> $OUT/call1.log 2>&1; say "runner exit $?"
say "14B 16x1024 K=1, native build"
MEGATRAIN_HOST_ADAMW_CFLAGS=-march=native python3 -m experiments.run $A14 sweep.name=activations_native 'only=[megatrain__qwen2.5-14b__*__b16__default__*]' results_dir=/tmp/r1 time_budget_s=150 >> $OUT/call1.log 2>&1; say "runner exit $?"
left=$(( 570 - ($(date +%s) - t0) ))
say "3B 64x1024, 8 micro-batches (sequential schedule), budget $left s"
python3 -m experiments.run sweep=activations 'sweep.batch_sizes=[64]' micro_batches=8 sweep.name=activations_mb8 'only=[megatrain__qwen2.5-3b__*__default__*,megatrain__qwen2.5-3b__*__recompute_all__*]' results_dir=/tmp/r1 time_budget_s=$left timeout_s=150 >> $OUT/call1.log 2>&1; say "runner exit $?"
tar czf $OUT/r1.tgz -C /tmp r1; say done

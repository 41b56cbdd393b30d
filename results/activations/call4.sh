#!/usr/bin/env bash
# Device call 4 (session 2026-12-04b), first of the session on a fresh machine: install, kernels (today's and
# b765233's own host AdamW, each in its own extension folder), the update path's GPU tests (two fixes of the
# last session unverified), then issue 22's same-run non-regression check at 14B: b765233 (the issue's commit,
# carried as .old/b765233.tgz = `git archive b765233 megatrain experiments baselines scripts pyproject.toml`,
# run with its own runner: sweep=size system=megatrain) and this SHA (sweep=activations), interleaved, same
# settings: 16x1024 (K=1, 4 timed steps after 2 warm-up) and 96x1024 (12 micro-batches, K=4, 3 after 1),
# shared_init=false (each engine initialises on the GPU; a 14B fp32 init cache would not fit the disk).
# Carry: wheelhouse, .old, .gguf/SmolLM2-135M-Instruct.Q4_1.gguf.part0 (for the next call).
# Usage (repo root): bash results/activations/call4.sh <git sha>
set -uo pipefail
source scripts/device_call_env.sh call4 "$1"  # env, say, install
mkdir -p /tmp/gguf && cp .gguf/*.part0 /tmp/gguf/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/call4.log; free -g >> $OUT/call4.log
rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf .old/b765233.tgz -C /tmp/old || { say "no old tree"; exit 3; }
NEW=$PWD OLD=/tmp/old/b765233
say "kernel builds (today's, b765233's, DeepSpeed's cpu_adam)"
python3 -m megatrain.kernels build >> $OUT/call4.log 2>&1 &
(cd $OLD && TORCH_EXTENSIONS_DIR=/tmp/old_ext python3 -c "from megatrain import cpu_adamw; print('b765233 host kernel:', cpu_adamw.name())") >> $OUT/call4.log 2>&1 &
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('deepspeed cpu_adam built')" > $OUT/ds_build.log 2>&1 &
wait
say "GPU tests: update path"
timeout 90 python3 -m pytest -m gpu tests/test_update_path_gpu.py -q -p no:cacheprovider > $OUT/gputests.log 2>&1; say "pytest exit $?"
tail -3 $OUT/gputests.log >> $OUT/call4.log
snap() { tar czf $OUT/r4.tgz -C /tmp r4; }  # after every point: a call cut by its limit still brings its rows back
old() { (cd $OLD && TORCH_EXTENSIONS_DIR=/tmp/old_ext MEGATRAIN_GIT_SHA=b765233 python3 -m experiments.run sweep=size 'sweep.models=[qwen2.5-14b]' system=megatrain shared_init=false post=false results_dir=/tmp/r4/old timeout_s=200 "$@") >> $OUT/call4.log 2>&1; say "b765233 runner exit $?"; snap; }
new() { python3 -m experiments.run sweep=activations 'sweep.models=[qwen2.5-14b]' shared_init=false post=false results_dir=/tmp/r4/new timeout_s=200 "$@" >> $OUT/call4.log 2>&1; say "this SHA runner exit $?"; snap; }
say "14B 16x1024: b765233, then this SHA"
old batch_size=16 steps=4 warmup_steps=2
new 'sweep.batch_sizes=[16]' 'only=[megatrain__qwen2.5-14b__*__b16__default__*]' steps=4 warmup_steps=2
say "14B 96x1024 (12 micro-batches, K=4): b765233, then this SHA"
old batch_size=96 micro_batches=12 system.options.checkpoint_interval=4 steps=3 warmup_steps=1
new 'sweep.batch_sizes=[96]' micro_batches=12 'only=[megatrain__qwen2.5-14b__*__b96__k4__*]' steps=3 warmup_steps=1
say done

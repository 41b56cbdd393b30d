#!/usr/bin/env bash
# The reproduction on the project's H200 node: one phase per device call, each phase one runner sweep
# (or the GPU tests), cut off by PHASE_BUDGET_S (default 540 s; a rerun of the phase resumes where it
# stopped: finished points are skipped). Run from the repo root with the wheelhouse beside it
# (scripts/build_wheelhouse.sh) and $OUT set:
#
#   MEGATRAIN_GIT_SHA=<sha> OUT=<dir> bash scripts/h200_repro.sh <phase> [runner overrides]
#
# Phases: tests, and one per sweep of experiments/conf/sweep/ (engine, size, depth, width, context,
# hardware, host_side, ablation, tokens, baselines, ...): `h200_repro.sh size` runs
# `python -m experiments.run sweep=size results_dir=results time_budget_s=<what is left>` plus any
# overrides given after the phase (e.g. `h200_repro.sh context system=megatrain`). Rows go to the
# committed results/<sweep>/ (the runner refuses a CSV measured on another machine); everything that comes
# back is in $OUT: the phase's CSV, its log, and a tarball of the point folders.
set -uo pipefail
phase="${1:?usage: h200_repro.sh tests|<sweep> [overrides...]}"
shift
budget="${PHASE_BUDGET_S:-540}"
: "${OUT:?set OUT}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
# the baselines' shared initial weights (12-30 GB per model) stay out of results/ and out of the tarball
export MEGATRAIN_CACHE="${MEGATRAIN_CACHE:-/tmp/init_cache}"
mkdir -p "$OUT"
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

if [ "$phase" = tests ]; then
  say "GPU tests"
  timeout $(( budget - 10 )) python3 -m pytest -m gpu -q -p no:cacheprovider >>"$log" 2>&1
  say "tests exit $?"
  exit 0
fi
if [ ! -f "experiments/conf/sweep/$phase.yaml" ]; then
  echo "unknown phase $phase: tests or one of $(ls experiments/conf/sweep | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
  exit 2
fi
say "runner: sweep=$phase $*"
python3 -m experiments.run sweep="$phase" results_dir=results time_budget_s=$(( budget - 40 )) "$@" >>"$log" 2>&1
rc=$?
say "runner exit $rc"
# The rows first, as a plain file (a tarball that grows too big must not take them with it), then the
# sweep's point folders (metrics.jsonl, log.txt, result.json) in one tarball.
cp "results/$phase/results.csv" "$OUT/${phase}_results.csv" 2>/dev/null
tar czf "$OUT/$phase.tgz" --exclude=.init_cache "results/$phase" 2>/dev/null
ls -la "$OUT" >>"$log"
exit "$rc"

# Sourced by a device call script (results/<sweep>/next_call*.sh) as `source scripts/device_call_env.sh NAME SHA`:
# the environment every H200 call uses, `say` (timestamped, into $OUT/NAME.log), the run folder R=/tmp/NAME with
# `snap` (tar it into $OUT/NAME.tgz: a call cut by its limit keeps the rows so far) and `budget S` (seconds left
# until S seconds into the call), and the offline install (scripts/install_offline.sh, once per machine: a warm
# machine keeps /tmp/site).
: "${OUT:?set OUT}"
CALL_NAME=$1
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/$CALL_NAME.log"; }
R=/tmp/$CALL_NAME
mkdir -p "$R"
snap() { tar czf "$OUT/$CALL_NAME.tgz" -C /tmp "$CALL_NAME" 2>/dev/null; }
budget() { echo $(( ${1} - ($(date +%s) - t0) )); }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=$2 MEGATRAIN_CACHE=/tmp/init_cache \
  PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
[ -f /tmp/site/megatrain-env.sh ] || bash scripts/install_offline.sh wheelhouse > "$OUT/install.log" 2>&1 || say "install failed"
# shellcheck disable=SC1091
source /tmp/site/megatrain-env.sh || { say "no install (no wheelhouse carried to a fresh machine?)"; exit 3; }
# build_kernels: the host AdamW extension and DeepSpeed's cpu_adam, in parallel, before any timed run (a fresh
# machine has neither; both are cached for the rest of the machine's life, so a warm machine returns at once).
build_kernels() {
  say "kernel builds (host AdamW, DeepSpeed's cpu_adam)"
  python3 -m megatrain.kernels build >> "$OUT/$CALL_NAME.log" 2>&1 &
  python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('deepspeed cpu_adam built')" \
    >> "$OUT/$CALL_NAME.log" 2>&1 &
  wait
}

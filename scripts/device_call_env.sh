# Sourced by a device call script (results/<sweep>/next_call*.sh) as `source scripts/device_call_env.sh NAME SHA`:
# the environment every H200 call uses, `say` (timestamped, into $OUT/NAME.log), and the offline install
# (scripts/install_offline.sh, once per machine: a warm machine keeps /tmp/site).
: "${OUT:?set OUT}"
CALL_NAME=$1
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/$CALL_NAME.log"; }
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True MEGATRAIN_GIT_SHA=$2 MEGATRAIN_CACHE=/tmp/init_cache \
  PYTHONUNBUFFERED=1 MEGATRAIN_SITE=/tmp/site WHEELHOUSE_SKIP=megatrain
[ -f /tmp/site/megatrain-env.sh ] || bash scripts/install_offline.sh wheelhouse > "$OUT/install.log" 2>&1 || say "install failed"
# shellcheck disable=SC1091
source /tmp/site/megatrain-env.sh || { say "no install (no wheelhouse carried to a fresh machine?)"; exit 3; }

#!/usr/bin/env bash
# Build the wheelhouse for the offline GPU node (CPython 3.12, manylinux x86_64): every dependency of
# megatrain that the node lacks, pinned in scripts/wheelhouse_requirements.txt, plus the project's own
# wheel and a MANIFEST.txt (name, version, role, sha256, size). Run it where PyPI is reachable.
#
#   bash scripts/build_wheelhouse.sh [OUT_DIR]        # default: wheelhouse/ at the repo root (git-ignored)
#
# Idempotent: wheels already in OUT_DIR at the pinned version are kept, wheels of other versions or
# names are removed, the project wheel is always rebuilt. Fails loudly when a required wheel cannot
# be had; ColossalAI (pins tagged [optional]) only warns. Never downloads or resolves torch: every
# pip call is --no-deps, and sdists build in isolated environments that do not need torch.
#
# Environment:
#   PYTHON                          interpreter whose pip is used (default: python3)
#   WHEELHOUSE_PINS                 pin file (default: scripts/wheelhouse_requirements.txt)
#   WHEELHOUSE_NODE_PACKAGES        what the node already has (default: scripts/wheelhouse_node_packages.txt)
#   WHEELHOUSE_NO_BUILD_ISOLATION=1 build sdists with this environment's setuptools instead of isolated ones
#   WHEELHOUSE_MAX_MIB              size above which a warning is printed (default: 20)
# Docs: docs/wheelhouse.md
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PINS="${WHEELHOUSE_PINS:-$HERE/wheelhouse_requirements.txt}"
NODE_PACKAGES="${WHEELHOUSE_NODE_PACKAGES:-$HERE/wheelhouse_node_packages.txt}"
TOOL="$HERE/wheelhouse_tool.py"
OUT="${1:-$ROOT/wheelhouse}"

say()  { printf '==> %s\n' "$*"; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }
die()  { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

[ "$#" -le 1 ] || die "usage: $0 [OUT_DIR]"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=...)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip"
[ -f "$PINS" ] || die "pin file $PINS not found"
[ -f "$NODE_PACKAGES" ] || die "node package list $NODE_PACKAGES not found"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT/MANIFEST.txt"  # written again only when the whole set checks out
WORK="$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# Source builds must not compile anything: DeepSpeed and ColossalAI kernels JIT-compile on the node.
export DS_BUILD_OPS=0 BUILD_EXT=0 CUDA_EXT=0

# Binary wheels: for the node's interpreter and platform, not this machine's.
TARGET_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
              --abi cp312 --abi abi3 --abi none
              --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux2014_x86_64 --platform any)
ISOLATION=()
[ "${WHEELHOUSE_NO_BUILD_ISOLATION:-0}" = 1 ] && ISOLATION=(--no-build-isolation)

say "wheelhouse: $OUT"
say "pins: $PINS"
PIN_LINES="$("$PYTHON" "$TOOL" pins "$PINS")" || die "the pin file does not check out (see above)"

n_cached=0; n_new=0; failed_optional=()
while IFS=$'\t' read -r name version role method; do
  if have="$("$PYTHON" "$TOOL" have "$OUT" "$name" "$version")"; then
    say "$name==$version: already there ($(basename "$have"))"
    n_cached=$((n_cached + 1))
    continue
  fi
  stage="$WORK/$name"; mkdir -p "$stage"; log="$WORK/$name.log"
  if [ "$method" = sdist ]; then
    say "$name==$version: building a py3-none-any wheel from the sdist (no compiled ops)"
    ok=1
    "$PYTHON" -m pip wheel --no-deps --no-binary "$name" ${ISOLATION[@]+"${ISOLATION[@]}"} \
      -w "$stage" "$name==$version" >"$log" 2>&1 || ok=0
    if [ "$ok" = 1 ]; then
      whl="$(ls "$stage"/*.whl 2>/dev/null | head -n1)"
      [ -n "$whl" ] || ok=0
    fi
    if [ "$ok" = 1 ] && ! "$PYTHON" "$TOOL" check-built "$whl" >>"$log" 2>&1; then ok=0; fi
  else
    say "$name==$version: downloading the wheel for CPython 3.12 manylinux x86_64"
    ok=1
    "$PYTHON" -m pip download --no-deps "${TARGET_FLAGS[@]}" -d "$stage" "$name==$version" >"$log" 2>&1 || ok=0
    if [ "$ok" = 1 ]; then
      whl="$(ls "$stage"/*.whl 2>/dev/null | head -n1)"
      [ -n "$whl" ] || ok=0
    fi
  fi
  if [ "$ok" = 0 ]; then
    tail -n 25 "$log" >&2
    if [ "$role" = optional ]; then
      warn "could not get optional $name==$version (log above): the wheelhouse will lack it; Gemini runs will be unavailable on the node"
      failed_optional+=("$name")
      continue
    fi
    die "could not get required $name==$version (log above; full log in $log)"
  fi
  mv -f "$whl" "$OUT/"
  say "  -> $(basename "$whl") ($(du -k "$OUT/$(basename "$whl")" | cut -f1) KiB)"
  n_new=$((n_new + 1))
done <<< "$PIN_LINES"

# The project's own wheel, always rebuilt, from a clean copy of the working tree (tracked and
# untracked-but-not-ignored files), so that a stale build/ directory can never leak into it.
PROJECT="$("$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import re, sys
try:
    import tomllib
    print(tomllib.load(open(sys.argv[1], "rb"))["project"]["name"])
except ImportError:  # Python < 3.11
    print(re.search(r'(?m)^name\s*=\s*"([^"]+)"', open(sys.argv[1]).read()).group(1))
EOF
)"
say "$PROJECT: building the project wheel from $ROOT"
SRC="$WORK/src"; mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) | "$PYTHON" -c '
import os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for rel in filter(None, sys.stdin.buffer.read().decode().split("\0")):
    p = os.path.join(src, rel)
    if os.path.isfile(p):  # skips files deleted from the working tree
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(p, os.path.join(dst, rel))
' "$ROOT" "$SRC"
  SOURCE_DATE_EPOCH="$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || echo 315532800)"
else
  cp -a "$ROOT"/. "$SRC"/
  rm -rf "$SRC/build" "$SRC"/*.egg-info "$SRC/wheelhouse" "$SRC/.git"
  SOURCE_DATE_EPOCH=315532800
fi
export SOURCE_DATE_EPOCH  # reproducible zip timestamps
stage="$WORK/project"; mkdir -p "$stage"; log="$WORK/project.log"
if ! "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$stage" "$SRC" >"$log" 2>&1; then
  say "  (no-build-isolation failed; retrying in an isolated build environment)"
  "$PYTHON" -m pip wheel --no-deps -w "$stage" "$SRC" >>"$log" 2>&1 || { tail -n 25 "$log" >&2; die "could not build the $PROJECT wheel"; }
fi
whl="$(ls "$stage"/*.whl 2>/dev/null | head -n1)"
[ -n "$whl" ] || die "pip built no $PROJECT wheel (log: $log)"
"$PYTHON" "$TOOL" check-built "$whl" || die "the $PROJECT wheel is not pure python"
for old in "$OUT"/*.whl; do
  [ -e "$old" ] || continue
  case "$(basename "$old")" in "${PROJECT//-/_}"-*|"$PROJECT"-*) rm -f "$old" ;; esac
done
mv -f "$whl" "$OUT/"
say "  -> $(basename "$whl")"

say "checking the set (one version each, CPython 3.12 manylinux tags, dependency closure) and writing MANIFEST.txt"
"$PYTHON" "$TOOL" finalize "$OUT" --pins "$PINS" --node "$NODE_PACKAGES" --project "$PROJECT" \
  --max-mib "${WHEELHOUSE_MAX_MIB:-20}" || die "the wheelhouse does not check out (see above)"

say "done: $n_new fetched or built, $n_cached already there, project wheel rebuilt"
if [ "${#failed_optional[@]}" -gt 0 ]; then
  warn "missing optional wheels: ${failed_optional[*]} (Gemini baseline only)"
fi
say "next: copy $OUT to the GPU node with the repo and run: bash scripts/install_offline.sh $(basename "$OUT")"

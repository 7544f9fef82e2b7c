#!/bin/bash
# Mutation testing of Kiln's core modules with cosmic-ray, outside CI's time budget (`make mutation`; about 25 min
# for the block manager on 2 cores, hours for all). Each tools/mutation/<name>.toml mutates one module and runs the
# tests that should kill its mutants. cosmic-ray edits files in place, so it runs on a copy of HEAD, imported as
# `kiln` through PYTHONPATH, never on the checkout. Reports (every surviving mutant with its diff) go to
# build/mutation/<name>.txt; docs/testing.md says why each survivor is harmless or which test now kills it.
#   bash tools/mutation/run.sh [tools/mutation/NAME.toml ...]
set -eu
REPO=$(git rev-parse --show-toplevel)
OUT=${OUT:-$REPO/build/mutation}
BIN=$(dirname "$(command -v python)")
mkdir -p "$OUT"
[ $# -gt 0 ] || set -- "$REPO"/tools/mutation/*.toml
CONFIGS=()
for config in "$@"; do CONFIGS+=("$(realpath "$config")"); done
set -- "${CONFIGS[@]}"
COPY=$(mktemp -d)
trap 'rm -rf "$COPY"' EXIT
mkdir "$COPY/kiln"
git -C "$REPO" archive HEAD | tar -x -C "$COPY/kiln"
export PYTHONPATH=$COPY
cd "$COPY/kiln"
for config in "$@"; do
  name=$(basename "$config" .toml)
  echo "== $name"
  rm -f "$OUT/$name.sqlite"
  "$BIN/cosmic-ray" init "$config" "$OUT/$name.sqlite"
  "$BIN/cosmic-ray" baseline "$config"
  "$BIN/cosmic-ray" exec "$config" "$OUT/$name.sqlite"
  "$BIN/cr-report" --show-diff --surviving-only "$OUT/$name.sqlite" > "$OUT/$name.txt"
  tail -4 "$OUT/$name.txt"
done

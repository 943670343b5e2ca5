#!/usr/bin/env bash
# Writes each commit's source tree (`git archive`, plus a REVISION file with the full hash) into .revisions/NAME/,
# so bench/revisions.py can time several revisions in one GPU run. .revisions/ is ignored by git: carry it along
# with the checkout to the GPU machine.
#
#   scripts/revision-trees.sh [--dir DIR] NAME=COMMIT ...
#   scripts/revision-trees.sh before=COMMIT after=76c366a      # see docs/performance.md for the "before" commit
set -euo pipefail
cd "$(dirname "$0")/.."
root=.revisions
if [ "${1:-}" = "--dir" ]; then
  root=${2:?--dir needs a folder}
  shift 2
fi
(($#)) || { echo "usage: $0 [--dir DIR] NAME=COMMIT ..." >&2; exit 2; }
for pair in "$@"; do
  name=${pair%%=*}
  commit=${pair#*=}
  if [[ $pair != *=* || ! $name =~ ^[A-Za-z0-9_][A-Za-z0-9._-]*$ ]]; then
    echo "not NAME=COMMIT with a plain folder name: $pair" >&2
    exit 2
  fi
  hash=$(git rev-parse --verify --quiet "$commit^{commit}") || { echo "no such commit: $commit" >&2; exit 2; }
  rm -rf "${root:?}/$name"
  mkdir -p "$root/$name"
  git archive "$hash" | tar -x -C "$root/$name"
  echo "$hash" >"$root/$name/REVISION"
  echo "$root/$name: $hash"
done

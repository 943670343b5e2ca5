#!/usr/bin/env bash
# Runs the CPU test suite. Extra arguments go to pytest (e.g. scripts/test.sh tests/test_sizing_bytes.py -x).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONHASHSEED=0
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# One torch thread per process: the suite runs as one pytest worker per core (at most four: the engine tests start
# processes of their own), and threads beyond the cores would only fight. `-n 0` after the command runs it in one
# process (for -x, pdb or a single test).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Spread over workers, pytest reports a missing path as an empty selection (exit 5, below): name it here instead.
for arg in "$@"; do
  path=${arg%%::*}
  if [[ "$arg" != -* && ("$path" == tests* || "$path" == *.py) && ! -e "$path" ]]; then
    echo "no such test path: $path" >&2
    exit 4
  fi
done
python -P -m pytest -q -n auto --maxprocesses=4 "$@"
rc=$?
# pytest exits 5 when a selection collects no test; a filtered run with nothing to do is not a failure.
if [ "$rc" -eq 5 ]; then
  echo "no tests were selected"
  exit 0
fi
exit "$rc"

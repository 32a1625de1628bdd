#!/usr/bin/env bash
# Installs what the tests need and runs the whole CPU test suite.
# Extra arguments are passed to pytest (e.g. `bash scripts/test.sh tests/unit -k registry`).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"

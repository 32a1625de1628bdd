#!/usr/bin/env bash
# Installs what the tests need and runs the whole CPU test suite: the unit tier on every core
# (one pytest-xdist worker each, at most four), then the distributed and end-to-end tiers in one
# process (their torchrun launches use every core themselves).
# Extra arguments are passed to one pytest run instead (e.g. `bash scripts/test.sh tests/unit -k
# registry`; add `-n auto` to spread them over the cores).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

run_pytest() {
  set +e
  python -m pytest "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    return 1
  fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  run_pytest "$@"
  exit $?
fi
rc=0
run_pytest -n auto --maxprocesses 4 tests/unit || rc=$?
run_pytest tests/distributed tests/e2e || rc=$?
exit "$rc"

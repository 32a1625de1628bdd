# Sourced by quickstart.sh and test.sh: use the active virtual environment, or create and
# activate ./.venv, then install the project (editable) with the extras named in $1.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$REPO_ROOT/.venv/bin/python" ]; then
    python3.11 -m venv "$REPO_ROOT/.venv" 2>/dev/null || python3 -m venv "$REPO_ROOT/.venv"
  fi
  # shellcheck disable=SC1091
  source "$REPO_ROOT/.venv/bin/activate"
fi
extras="${1:-}"
stamp="$VIRTUAL_ENV/.megatron-longctx-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ "$REPO_ROOT/setup.py" -nt "$stamp" ]; then
  # The CPU build of torch first, so no requirement can pull a CUDA build.
  python -m pip install --quiet "torch==2.13.0"
  python -m pip install --quiet -e "$REPO_ROOT${extras:+[$extras]}"
  touch "$stamp"
fi
cd "$REPO_ROOT"

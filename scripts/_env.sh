# Sourced by quickstart.sh and test.sh: use the active virtual environment, or create and
# activate ./.venv, then install the project (editable) with the extras named in $1.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$REPO_ROOT/.venv/bin/python" ]; then
    # megatron-core >= 0.17 (the first with megatron.training) ships wheels for CPython 3.12.
    python=""
    for candidate in python3.12 python3 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
      if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
        python="$candidate"
        break
      fi
    done
    if [ -z "$python" ]; then
      echo "error: Python 3.12 not found (megatron-core >= 0.17 needs it): install it, or" \
           "activate a Python 3.12 virtual environment first" >&2
      exit 1
    fi
    "$python" -m venv "$REPO_ROOT/.venv"
  fi
  # shellcheck disable=SC1091
  source "$REPO_ROOT/.venv/bin/activate"
fi
extras="${1:-}"
stamp="$VIRTUAL_ENV/.megatron-longctx-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ "$REPO_ROOT/setup.py" -nt "$stamp" ]; then
  # torch first, unless the environment has one (setup.py asks for torch >= 2.6): 2.13.0, the
  # release the project is tested with. For CPython 3.12 the package registries serve only its
  # CUDA build, which runs on the CPU too (about 4.7 GB with its NVIDIA libraries); a CPU build
  # installed beforehand is kept.
  python -c 'import torch' 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
  python -m pip install --quiet -e "$REPO_ROOT${extras:+[$extras]}"
  touch "$stamp"
fi
if [ -n "${MEGATRON_CORE_VERSION:-}" ]; then
  # A pinned release inside the supported range (CI tests the oldest this way).
  installed=$(python -c 'import importlib.metadata as m; print(m.version("megatron-core"))')
  if [ "$installed" != "$MEGATRON_CORE_VERSION" ]; then
    python -m pip install --quiet --no-deps "megatron-core==$MEGATRON_CORE_VERSION"
  fi
fi
cd "$REPO_ROOT"

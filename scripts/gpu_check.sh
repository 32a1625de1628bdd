#!/usr/bin/env bash
# The GPU check: verdicts, not logs. On a CUDA machine, side by side within 9 minutes: the
# golden tests' GPU set on NCCL (PP = 2 and PP = 4 under every schedule, PP = 2 x TP = 2 with
# sequence parallelism; the ranks share the GPU), the unit tests on CUDA, and every schedule's
# short training run at PP = 2 (fp32, bf16, fp16) and PP = 4 (fp32, bf16), bf16 and fp16 judged
# against fp32 and fp16 required to apply every update. Writes one report, a line per verdict
# with the commit it ran, to benchmarks/results/gpu/verdicts_<commit>.txt (scripts/gpu_check.py
# says what each step runs; scripts/gpu_verdicts.py how each verdict is decided). Exits 1 if a
# verdict failed.
# Usage: bash scripts/gpu_check.sh [--dry-run] [--limit-s S] [--report PATH] [--log-dir DIR]
#   --dry-run: the same plumbing on a machine without CUDA (gloo, tiny sizes).
set -u
cd "$(dirname "$0")/.."
if ! python3 -c 'import sys; from megatron.plugin import registry
sys.exit("elastic" not in registry.schedule_names())'; then
  echo "error: the project's schedules are not registered (they are found through its package" \
       "metadata's entry points): install the project, e.g. pip install -e . in this checkout" >&2
  exit 1
fi
exec python3 scripts/gpu_check.py "$@"

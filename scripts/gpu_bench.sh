#!/usr/bin/env bash
# What one GPU shows without NCCL pipelines (PP = 1, bf16, Megatron-LM's default dropout 0.1),
# each part's JSON and printout under OUT (default benchmarks/results/gpu), cheapest first so a
# time limit cuts the largest:
#   attention_tests.txt   the blockwise attention against full attention over the concatenated
#                         keys, fp32 and bf16, forward and every gradient (tolerances in the tests)
#   memory_32k.*          every schedule on documents up to 32K tokens: bytes saved for backward
#                         against the plan, the allocator's peak, tokens/s side by side
#   offload_trace.*       SPPO's offload and reload copies against compute, from a profiler trace
#   memory_short.*        the same on 32 short documents (up to 4K tokens), where the document
#                         schedules must not lose to Megatron-LM's own schedule (slice counts
#                         their own: a fixed count cuts the longest document however short),
#                         with their units and the simulator's prediction beside; each run's
#                         profiler trace in traces_short/ with how busy it kept the device
#   kernels_32k.*         a model whose kernels dominate the host's work (16 layers x 2048
#                         hidden, 16 heads, bf16) on documents up to 32K tokens, every schedule
#                         at its own slice counts, with a verdict per document schedule: its
#                         tokens/s at least Megatron-LM's 1f1b's (--min-ratio 1.0)
#   kernels_64k.*         the same up to 64K tokens; Megatron-LM's 1f1b holds about 90 GB
#                         there (its activation estimate, 34 bytes per token, layer and hidden
#                         unit, plus 18 bytes a parameter of model state), so it runs on a
#                         device of at least 100 GiB (an H200) and is skipped, saying so, on a
#                         smaller one
#   memory_128k.*         Megatron-LM's schedule, elastic and seq1f1b on documents up to 128K
# helix is not among them: it places layer parts on other stages and needs PP >= 2 (two GPUs);
# on a machine with two, scripts/bench_memory.py --pp 2 runs it beside the others.
# Runs in about 8 minutes on one H200, and about 10 more for the kernels_* parts.
# Usage: bash scripts/gpu_bench.sh [OUT [PART ...]]   (PART: the names above; default all)
set -u
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
shift $(( $# > 0 ? 1 : 0 ))
all=" attention_tests memory_32k offload_trace memory_short kernels_32k kernels_64k memory_128k "
parts=" ${*:-$all} "
for name in $parts; do
  if [[ "$all" != *" $name "* ]]; then
    echo "error: no part named $name: choose from$all" >&2
    exit 2
  fi
done
mkdir -p "$out"
if ! python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "error: no CUDA device visible: run this on a GPU machine" >&2
  exit 1
fi
if ! python3 -c 'import sys; from megatron.plugin import registry
sys.exit("elastic" not in registry.schedule_names())'; then
  echo "error: the project's schedules are not registered (they are found through its package" \
       "metadata's entry points): install the project, e.g. pip install -e . in this checkout" >&2
  exit 1
fi
failed=0
part() {  # part NAME COMMAND...: run, print and keep the output, if NAME was asked for
  local name=$1
  shift
  [[ "$parts" == *" $name "* ]] || return 0
  echo "== $name"
  "$@" 2>&1 | tee "$out/$name.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
}
part attention_tests python3 -m pytest -q -p no:cacheprovider tests/unit/test_context_attention.py \
  tests/unit/test_attention.py tests/unit/test_helix_attention.py
part memory_32k python3 scripts/bench_memory.py --seq-length 32768 --timeout 150 \
  --json "$out/memory_32k.json"
part offload_trace python3 scripts/trace_offload.py --timeout 150 --json "$out/offload_trace.json" \
  --trace "$out/offload_trace.json.gz"
part memory_short python3 scripts/bench_memory.py --seq-length 4096 --global-batch-size 32 \
  --slices auto --predict h100,h200 --timeout 120 --json "$out/memory_short.json" \
  --trace-dir "$out/traces_short"
kernels=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --slices auto
         --schedules 1f1b,elastic,seq1f1b,sppo --min-ratio 1.0 --timeout 240)
part kernels_32k python3 scripts/bench_memory.py "${kernels[@]}" --seq-length 32768 \
  --global-batch-size 4 --json "$out/kernels_32k.json"
gib=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')
if [ "$gib" -ge 100 ]; then
  part kernels_64k python3 scripts/bench_memory.py "${kernels[@]}" --seq-length 65536 \
    --global-batch-size 2 --json "$out/kernels_64k.json"
elif [[ "$parts" == *" kernels_64k "* ]]; then
  echo "== kernels_64k skipped: Megatron-LM's 1f1b needs about 90 GB there; this device has" \
       "$gib GiB" | tee "$out/kernels_64k.txt"
fi
part memory_128k python3 scripts/bench_memory.py --seq-length 131072 --global-batch-size 2 \
  --schedules default,elastic,seq1f1b --slices 16 --timeout 150 --json "$out/memory_128k.json"
exit "$failed"

#!/usr/bin/env bash
# Validates an install on a CUDA machine: versions, the unit tests (the CUDA-only ones run
# here), a short training run of every schedule that fits the GPUs present (NCCL, fp32, bf16
# and fp16; the runs of one schedule side by side, each on its own port, beside the unit tests),
# the same in bf16 with Transformer Engine layers where transformer_engine imports,
# then the golden suite when there are 4 GPUs or more (its layouts use up to 4 ranks, one GPU
# each). Prints a report, with each run's losses (no dropout: the schedules train the
# same documents from the same initialization, so their first losses should agree to about the
# precision's rounding) and, for fp16, the iterations Megatron-LM's loss scaler skipped on
# overflow (its initial scale, 2^32, overflows the first steps: each schedule must scale its
# losses with the optimizer's scaler for the skips to happen and be counted); exits non-zero if
# any step failed.
# Usage: bash scripts/gpu_check.sh   (in an environment with the project installed)
set -u
cd "$(dirname "$0")/.."
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 1 ]; then
  echo "error: no CUDA device visible: run this on a GPU machine" >&2
  exit 1
fi
if ! python3 -c 'import sys; from megatron.plugin import registry
sys.exit("elastic" not in registry.schedule_names())'; then
  echo "error: the project's schedules are not registered (they are found through its package" \
       "metadata's entry points): install the project, e.g. pip install -e . in this checkout" >&2
  exit 1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-LM requires it with tensor parallelism
log="${GPU_CHECK_LOG_DIR:-$(mktemp -d)}"  # where each step's log is kept
mkdir -p "$log"
report=()
failed=0
step() {  # step NAME COMMAND...: run, keep the log and the exit status
  local name=$1
  shift
  timeout "${GPU_CHECK_STEP_TIMEOUT:-900}" "$@" >"$log/$name.log" 2>&1
  echo $? >"$log/$name.rc"
}
collect() {  # collect NAME...: record the results of finished steps
  local name
  for name in "$@"; do
    if [ "$(cat "$log/$name.rc")" = 0 ]; then
      report+=("ok      $name")
    else
      report+=("FAILED  $name (log: $log/$name.log)")
      failed=1
    fi
  done
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "CUDA",
torch.version.cuda, "GPUs", torch.cuda.device_count(), "megatron-core", m.version("megatron-core"))'
# -v names each test as it ends, so a failure is named in the log even when the step's time
# limit stops the run before pytest's summary; four workers where pytest-xdist imports.
unit_args=(-v -rfE -p no:cacheprovider)
python3 -c 'import xdist' 2>/dev/null && unit_args+=(-n 4)
step unit python3 -m pytest "${unit_args[@]}" tests/unit &
unit=$!
pp=$(( gpus >= 2 ? 2 : 1 ))
tiny=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 256
      --max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 8 --lr 1e-3
      --train-iters 6 --lr-warmup-iters 1 --log-interval 1 --eval-interval 1000 --eval-iters 0
      --calculate-per-token-loss --tokenizer-type NullTokenizer --vocab-size 257 --mock-data
      --seed 1234 --hidden-dropout 0 --attention-dropout 0
      --pipeline-model-parallel-size "$pp")
schedules=(default elastic seq1f1b sppo)
[ "$pp" -ge 2 ] && schedules+=(1f1b 1f1b-ir helix)
dtypes=(fp32 bf16 fp16)
for schedule in "${schedules[@]}"; do
  extra=()
  [ "$schedule" = sppo ] && extra=(--sppo-subsequences "$(( pp * 2 ))")
  names=()
  for i in "${!dtypes[@]}"; do
    dtype=${dtypes[$i]}
    precision=()
    [ "$dtype" = bf16 ] && precision=(--bf16)
    [ "$dtype" = fp16 ] && precision=(--fp16)
    names+=("train-$schedule-$dtype")
    step "train-$schedule-$dtype" torchrun --nproc-per-node "$pp" --master-port $(( 29511 + i )) \
      pretrain_gpt_elastic.py "${tiny[@]}" --pipeline-schedule "$schedule" "${extra[@]}" \
      "${precision[@]}" &
  done
  wait $(jobs -p | grep -vx "$unit")
  collect "${names[@]}"
done
# Megatron's Transformer Engine layers (--transformer-impl transformer_engine) under every
# schedule that builds them, in bf16, when transformer_engine imports (NGC containers ship it);
# sppo with every subsequence but the last offloaded whole, so that the activations TE's
# layers save for backward go to host memory and back.
if python3 -c 'import transformer_engine.pytorch' 2>/dev/null; then
  te_schedules=(default elastic seq1f1b sppo)
  [ "$pp" -ge 2 ] && te_schedules+=(1f1b 1f1b-ir interleaved)
  names=()
  for i in "${!te_schedules[@]}"; do
    schedule=${te_schedules[$i]}
    extra=()
    [ "$schedule" = interleaved ] && extra=(--num-layers-per-virtual-pipeline-stage 1)
    [ "$schedule" = sppo ] && extra=(--sppo-subsequences "$(( pp * 2 ))" --sppo-offload 1)
    names+=("train-$schedule-te-bf16")
    step "train-$schedule-te-bf16" torchrun --nproc-per-node "$pp" \
      --master-port $(( 29531 + i )) pretrain_gpt_elastic.py "${tiny[@]}" \
      --pipeline-schedule "$schedule" "${extra[@]}" --bf16 --transformer-impl transformer_engine &
  done
  wait $(jobs -p | grep -vx "$unit")
  collect "${names[@]}"
else
  report+=("skipped --transformer-impl transformer_engine: transformer_engine does not import")
fi
wait "$unit"
collect unit
if [ "$gpus" -ge 4 ]; then
  step golden python3 -m pytest -q -p no:cacheprovider tests/distributed/test_golden_megatron.py
  collect golden
else
  report+=("skipped golden: its layouts need 4 GPUs, $gpus present")
fi
[ "$pp" -ge 2 ] || report+=("skipped 1f1b, 1f1b-ir, helix training: they need 2 GPUs or more")
printf '%s\n' "${report[@]}"
grep -oE "(FAILED|ERROR) tests/[^ ]+" "$log/unit.log" | sort -u
for name in "$log"/train-*.log; do
  [ -f "$name" ] || continue
  printf '%s: ' "$(basename "$name" .log)"
  grep -oE "lm loss: [0-9.E+-]+" "$name" | awk '{printf "%s ", $3}'
  case "$name" in
    *-fp16.log) printf '| skipped: '
                grep -oE "number of skipped iterations: +[0-9]+" "$name" \
                  | awk '{printf "%s ", $NF}' ;;
  esac
  echo
done
exit "$failed"

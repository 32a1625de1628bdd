#!/usr/bin/env bash
# Sets up a virtual environment (unless one is active), installs the project, prepares the
# embedded corpus (UTF-8 bytes and an end-of-document token 256: Megatron-LM's NullTokenizer
# with --vocab-size 257 reads it), and trains a small GPT for a few dozen iterations on 2 CPU
# ranks with pipeline-parallel size 2 under the elastic schedule (long documents split into
# slices, short ones packed). Extra arguments are passed to pretrain_gpt_elastic.py
# (e.g. `bash scripts/quickstart.sh --pipeline-schedule 1f1b` for Megatron's own 1F1B).
# The empty argument names no extras: a sourced script otherwise sees this one's arguments.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" ""
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python scripts/preprocess_data.py --embedded-corpus
run_dir="runs/quickstart"
mkdir -p "$run_dir"
rm -f "$run_dir/metrics.jsonl"
python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-29517}" pretrain_gpt_elastic.py \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 512 \
  --max-position-embeddings 512 --position-embedding-type rope --normalization RMSNorm --swiglu \
  --micro-batch-size 1 --global-batch-size 16 --train-iters 40 \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 4 --weight-decay 0.01 \
  --clip-grad 1.0 --seed 1234 \
  --pipeline-model-parallel-size 2 --pipeline-schedule elastic --elastic-min-slice-tokens 128 \
  --calculate-per-token-loss --tokenizer-type NullTokenizer --vocab-size 257 \
  --log-interval 5 --eval-interval 20 --eval-iters 2 \
  --save "$run_dir/checkpoints" --save-interval 20 \
  --metrics-jsonl "$run_dir/metrics.jsonl" "$@"
echo "metrics: $run_dir/metrics.jsonl, checkpoints: $run_dir/checkpoints"

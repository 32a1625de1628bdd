"""Megatron-LM's FLOP count (``--log-throughput``'s TFLOP/s, the checkpoints'
``num_floating_point_operations_so_far``) over the documents a step really trains on: the hand
formula of Megatron's GPT over the documents' lengths, under data and pipeline parallelism,
with Megatron's defaults (dropout 0.1, Megatron's default loss)."""
import json

import pytest

from harness import NULL_TOKENIZER_256, torchrun
from megatron.plugin import flop_count

WORKER = "tests/e2e/flop_count_worker.py"
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "128", "--micro-batch-size", "1",
         "--global-batch-size", "12", "--train-iters", "1", "--lr", "1e-3", "--seed", "1234",
         *NULL_TOKENIZER_256, "--log-throughput"]
#: Inputs per document: skewed, none longer than --seq-length.
LENGTHS = (64, 3, 17, 40, 1, 9, 5, 64, 30, 2, 50, 11)


def hand_formula(lengths, layers, hidden, ffn, vocab) -> float:
    """Megatron's GPT FLOPs (forward and two backward GEMMs, 2 per multiply-add) over
    documents of ``lengths`` tokens: per token the MLP, the Q/K/V and output projections and
    the logits; per document ``L**2 / 2`` (causal) scores and as many weighted values."""
    tokens = sum(lengths)
    squares = sum(n * n for n in lengths)
    per_token = 3 * 2 * (layers * (2 * hidden * ffn + 4 * hidden * hidden) + hidden * vocab)
    attention = 3 * 2 * layers * hidden * (1 / 2) * 2
    return tokens * per_token + squares * attention


@pytest.mark.skipif(not flop_count.counts_real_lengths(),
                    reason="this megatron-core release refuses --log-throughput (tests/unit/"
                           "test_option_classes.py::test_log_throughput_needs_megatrons_lengths)")
def test_megatron_counts_the_flops_of_the_real_documents(tmp_path):
    layouts = {"dp2_default": ["--pipeline-schedule", "default"],
               "pp2_elastic": ["--pipeline-model-parallel-size", "2",
                               "--pipeline-schedule", "elastic", "--elastic-slices", "2"]}
    lines = [[*MODEL, *flags, "--document-lengths", *map(str, LENGTHS),
              "--out", str(tmp_path / f"{tag}.json")] for tag, flags in layouts.items()]
    with open(tmp_path / "lines.json", "w") as f:
        json.dump(lines, f)
    torchrun(2, WORKER, [str(tmp_path / "lines.json")], timeout=400)
    for tag in layouts:
        with open(tmp_path / f"{tag}.json") as f:
            counted = json.load(f)
        expected = hand_formula(LENGTHS, 4, 32, counted["ffn_hidden_size"],
                                counted["padded_vocab_size"])
        assert counted["ffn_hidden_size"] == 128 and counted["kv_channels"] == 8
        assert counted["flops"] == pytest.approx(expected, rel=1e-12), tag
        # Megatron's count without the lengths: 12 samples of --seq-length tokens.
        assert counted["seq_length_flops"] == pytest.approx(
            hand_formula([64] * 12, 4, 32, 128, counted["padded_vocab_size"]), rel=1e-12)


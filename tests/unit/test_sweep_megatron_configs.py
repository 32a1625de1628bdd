"""``scripts/sweep_megatron_configs.py``: shrinking a Megatron-LM functional-test config, its
command line, and the classification of the start-up refusals (two hand-written configs; no
Megatron-LM checkout)."""
import sys

from harness import NULL_TOKENIZER_256, REPO
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from scripts.sweep_megatron_configs import (  # noqa: E402
    TOKENIZER, advised_drops, chained, check, command_line, outcome, shrink, subjects,
    world_size)

#: A pipeline-parallel config with virtual stages, grouped-query attention and TE, in the
#: shape of ``gpt3_mcore_te_tp2_pp2_...`` (values as YAML loads them).
PIPELINED = {
    "--num-layers": 12, "--hidden-size": 512, "--num-attention-heads": 8,
    "--group-query-attention": True, "--num-query-groups": 2, "--ffn-hidden-size": 1024,
    "--seq-length": 1024, "--max-position-embeddings": 1024,
    "--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
    "--num-layers-per-virtual-pipeline-stage": 3, "--micro-batch-size": 4,
    "--global-batch-size": 30, "--transformer-impl": "transformer_engine",
    "--data-path": "${DATA_PATH}/text_document", "--save": "${CHECKPOINT_SAVE_PATH}",
    "--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": "${DATA_PATH}/bpe/vocab.json",
    "--merge-file": "${DATA_PATH}/bpe/merges.txt", "--split": "949,50,1",
    "--rampup-batch-size": [4, 4, 16], "--exit-interval": "",
    "--bf16": True, "--lr": 0.00015,
}
#: A data-parallel config at TP = PP = 1 that needs nothing but CUDA.
PLAIN = {
    "--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 4,
    "--seq-length": 256, "--max-position-embeddings": 256, "--micro-batch-size": 1,
    "--global-batch-size": 8, "--train-iters": 10, "--lr": 0.001, "--eval-interval": 5,
    "--eval-iters": 1, "--calculate-per-token-loss": True, "--transformer-impl": "local",
    "--tokenizer-type": "NullTokenizer", "--vocab-size": 1000, "--data-path": "$DATA_BLEND",
    "--bf16": True,
}


def test_layers_counted_with_the_embedding_and_loss_still_split_evenly():
    """``gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split``'s shape: 6
    layers, the embedding and the loss counted, over 4 stages of 2 virtual stages each. Shrunk,
    one layer a virtual stage still, the two counted included: 6 layers."""
    config = {"--num-layers": 6, "--pipeline-model-parallel-size": 4,
              "--num-virtual-stages-per-pipeline-rank": 2,
              "--account-for-embedding-in-pipeline-split": True,
              "--account-for-loss-in-pipeline-split": True, "--hidden-size": 512,
              "--num-attention-heads": 8, "--micro-batch-size": 1, "--global-batch-size": 8}
    assert shrink(config, "/sweep")["--num-layers"] == 6
    del config["--account-for-loss-in-pipeline-split"]
    assert shrink(config, "/sweep")["--num-layers"] == 7


def test_sizes_paths_and_tokenizer_are_shrunk_and_nothing_else():
    shrunk = shrink(PIPELINED, "/sweep")
    assert world_size(PIPELINED) == 8  # a node of 8 GPUs: data-parallel size 2
    assert {flag: shrunk[flag] for flag in (
        "--num-layers", "--num-layers-per-virtual-pipeline-stage", "--num-attention-heads",
        "--hidden-size", "--num-query-groups", "--ffn-hidden-size", "--seq-length",
        "--max-position-embeddings", "--global-batch-size")} == {
        "--num-layers": 4, "--num-layers-per-virtual-pipeline-stage": 1,
        "--num-attention-heads": 4, "--hidden-size": 32, "--num-query-groups": 2,
        "--ffn-hidden-size": 128, "--seq-length": 64, "--max-position-embeddings": 64,
        "--global-batch-size": 24}  # 12 layers / (2 stages x 3) = 2 virtual stages
    assert shrunk["--data-path"] == "/sweep/data_path/text_document"
    assert shrunk["--save"] == "/sweep/checkpoint_save_path"
    assert not {"--tokenizer-type", "--vocab-file", "--merge-file"} & set(shrunk)
    unchanged = set(PIPELINED) - set(shrunk) - {"--tokenizer-type", "--vocab-file",
                                                 "--merge-file"}
    assert not unchanged
    for flag in ("--micro-batch-size", "--tensor-model-parallel-size", "--transformer-impl",
                 "--split", "--rampup-batch-size", "--bf16", "--lr", "--group-query-attention"):
        assert shrunk[flag] == PIPELINED[flag]


def test_command_line_is_built_as_megatron_lm_functional_tests_do():
    argv = command_line(shrink(PIPELINED, "/sweep"))
    assert TOKENIZER == NULL_TOKENIZER_256 and argv[-4:] == TOKENIZER
    assert "--bf16" in argv and "--group-query-attention" in argv
    at = argv.index("--rampup-batch-size")
    assert argv[at:at + 4] == ["--rampup-batch-size", "4", "4", "16"]
    assert "--exit-interval" not in argv  # empty value: left out


def test_refusals_are_classified_by_what_a_gpu_machine_would_do():
    plain = command_line(shrink(PLAIN, "/sweep")) + ["--pipeline-schedule", "1f1b"]
    here, gpu = check(plain, world_size(PLAIN), gpu=False), check(plain, 8, gpu=True)
    assert gpu == [] and any("--bf16" in message for message in here)
    assert outcome(here, gpu) == "cuda_only"
    assert outcome([], []) == "starts" and outcome(None, []) == "unparsed"
    pipelined = command_line(shrink(PIPELINED, "/sweep")) + ["--pipeline-schedule", "elastic"]
    refused = check(pipelined, world_size(PIPELINED), gpu=True)
    assert outcome(refused, refused) == "refused"
    stopped = {subject for message in refused for subject in subjects(message)}
    assert {"--rampup-batch-size", "--num-layers-per-virtual-pipeline-stage"} <= stopped
    assert "--pipeline-schedule" not in stopped
    assert check(["--no-such-flag"], 1, gpu=False) is None


def test_subjects_are_the_flags_before_the_reason():
    assert subjects("--a, --b are not supported by pretrain_gpt_elastic.py: drop --c") == [
        "--a", "--b"]
    assert subjects("--x is not supported by --pipeline-schedule elastic: drop --x") == ["--x"]
    assert subjects("Megatron-LM refused the arguments (arguments.py:12): need --y") == [
        "Megatron-LM: need --y"]


def test_following_the_advice_drops_what_a_refusal_names_and_finds_what_it_led_into():
    cpu = ("--bf16 and --fp16 need CUDA (why): drop them on a machine without a GPU (fp32 "
           "trains there)")
    assert advised_drops(cpu) == ["--bf16", "--fp16"]
    companions = ("--overlap-param-gather and --overlap-param-gather-with-optimizer-step "
                  "accepted by Megatron-LM only beside a flag refused above: drop "
                  "--overlap-param-gather and --overlap-param-gather-with-optimizer-step with it")
    assert advised_drops(companions) == ["--overlap-param-gather",
                                         "--overlap-param-gather-with-optimizer-step"]
    assert advised_drops("helix interleaves layer parts itself: drop "
                         "--num-layers-per-virtual-pipeline-stage") == [
        "--num-layers-per-virtual-pipeline-stage"]
    megatron = ("Megatron-LM refused the arguments (arguments.py:991): --overlap-param-gather "
                "only supported with distributed optimizer")
    first = ["--use-distributed-optimizer is not supported by --pipeline-schedule x: drop it"]
    assert chained(first, [megatron]) == [megatron]
    assert chained(first, first) == []

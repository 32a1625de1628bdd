"""Megatron-LM's example launch scripts as clients: the GPT-3 example
(``examples/gpt3/train_gpt3_175b_distributed.sh``) and the Llama-3 8B example's real-data branch
(``examples/llama/train_llama3_8b_h100_fp8.sh``), flag for flag apart from sizes, paths, the
launcher and FP8, on 2 CPU ranks under ``1f1b`` and ``elastic``, Llama-3's also under
``seq1f1b`` (documents cut into chunks of a quarter of the longest one), ``sppo`` (each
document cut into 4 subsequences) and ``helix`` (the loss in the last boundary's backward).

The tokenizers are built here (nothing is downloaded): a byte-level BPE trained on the
project's own sources, saved as a HuggingFace tokenizer directory (Llama-3's
``HuggingFaceTokenizer --tokenizer-model``) and as GPT-2 ``vocab.json``/``merges.txt``
(GPT-3's ``--vocab-file``/``--merge-file``, enough for Megatron's ``GPT2BPETokenizer`` without
the Hugging Face hub: :mod:`megatron.plugin.gpt2_bpe`). Everything runs offline, with an empty
Hugging Face cache, as on an air-gapped cluster. The data is written by
``scripts/preprocess_data.py`` with the same tokenizer flags.

What a CPU run cannot take is refused by name, and each refusal is checked before the flag is
dropped: half precision (CUDA-only in megatron-core) and ``--profile`` without
``--use-pytorch-profiler`` (nsys). Every schedule keeps the distributed optimizer with
``--overlap-grad-reduce`` and ``--overlap-param-gather`` (fp32 on a CPU).
``--rampup-batch-size`` is refused for every schedule (the document batches are of a fixed
size); Llama-3's ``--attention-backend fused`` is kept (on CPU it runs the CPU kernel); its
``--log-throughput`` is kept where megatron-core counts FLOPs over the documents'
lengths (0.19) and refused where it cannot (0.17). The document schedules also refuse
``--grad-reduce-in-bf16`` (no test proves it under them); Llama-3's
``--cross-entropy-loss-fusion`` is kept under each: Megatron's fused cross entropy returns the
logits' gradient in bf16, beyond the golden tests' bound, and this test is its proof (the last
stage computes it per micro-batch, chunk or subsequence, helix's stage 0 per micro-batch in its
last boundary's backward, and it is per token).
The schedules then train the same documents from the same seed (helix, whose stages build
layer parts and so draw other weights from it, from the weights ``1f1b`` starts from, saved at
iteration 0 by ``initial_weights_worker.py``). GPT-3's example leaves
dropout at Megatron's default (0.1): two schedules that pack the same documents into different
rows draw different masks, so the test sets ``--hidden-dropout 0 --attention-dropout 0`` for it
(as Llama-3's example does itself); that dropout trains identically under a schedule is the
business of the resume tests. Llama-3's example minimizes the per-token mean
(``--calculate-per-token-loss``), GPT-3's Megatron's default loss (the mean of the
micro-batches' token means, which ``elastic`` forms by weighting each token as Megatron's
packing does): under every schedule each iteration's loss agrees with ``1f1b``'s to 1e-4, and
its gradient norm to the 3 decimals Megatron logs (one unit of the last apart at most).
"""
import glob
import json
import os
import re
import sys

import pytest
import torch

from harness import REPO, torchrun
from megatron.plugin import flop_count

tokenizers = pytest.importorskip("tokenizers", reason="the BPE tokenizer is built with it")
transformers = pytest.importorskip("transformers", reason="Megatron's HF tokenizers need it")

SCRIPT = "pretrain_gpt_elastic.py"
ITERATIONS = 6


def gpt3(data, vocab, merges, checkpoints, tensorboard):
    """The GPT-3 175B example's flags, its sizes scaled to a 2-layer model on 2 ranks, dropout
    off (see the module's docstring)."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--rampup-batch-size", "4", "4", "16",
        "--train-iters", str(ITERATIONS), "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
        "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", str(ITERATIONS),
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--data-path", data, "--vocab-file", vocab, "--merge-file", merges,
        "--split", "949,50,1", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--log-interval", "1", "--save-interval", str(ITERATIONS), "--eval-interval", "3",
        "--save", checkpoints, "--load", checkpoints, "--eval-iters", "2",
        "--tensorboard-dir", tensorboard,
    ]


def llama3(data, tokenizer, checkpoints, tensorboard, cache):
    """The Llama-3 8B example's flags (real-data branch, FP8 block left out), its sizes scaled
    to a 2-layer model with grouped-query attention on 2 ranks at PP = 2."""
    return [
        "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64",
        "--ffn-hidden-size", "224", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--kv-channels", "16", "--seq-length", "128",
        "--max-position-embeddings", "128", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
        "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-samples", str(8 * ITERATIONS), "--lr-decay-samples", str(8 * ITERATIONS - 4),
        "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
        "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
        "--pipeline-model-parallel-size", "2", "--sequence-parallel",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--data-path", data, "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", tokenizer, "--data-cache-path", cache, "--split", "99,1,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--vocab-size", "600",
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "3",
        "--save-interval", str(ITERATIONS), "--log-throughput", "--profile",
        "--profile-step-start", "2", "--profile-step-end", "4", "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60", "--save", checkpoints, "--load", checkpoints,
        "--tensorboard-dir", tensorboard,
    ]


#: The schedules each example trains under; every other's losses are compared with the first's.
SCHEDULES = {"gpt3": ("1f1b", "elastic"),
             "llama3": ("1f1b", "elastic", "seq1f1b", "sppo", "helix")}
#: Schedules whose run loads the weights the first schedule's run started from (see
#: :func:`initial_weights`).
SAME_WEIGHTS_LOADED = ("helix",)
#: Flags a schedule's run adds: seq1f1b cuts the documents into chunks of a quarter of the
#: longest one's tokens and sppo each document into 4 subsequences, so that the last stage
#: computes the loss (Llama-3's: Megatron's fused cross entropy) per chunk and per subsequence.
SCHEDULE_FLAGS = {"seq1f1b": ["--elastic-slices", "4"], "sppo": ["--sppo-subsequences", "4"]}
CPU_HALF = ("--bf16 and --fp16 need CUDA", torch.cuda.is_available())
#: ``(flag, values it takes, (the refusal naming it, whether it is kept here), schedules)``:
#: a flag dropped where it is refused.
DROPS = {
    "gpt3": [
        ("--fp16", 0, CPU_HALF, SCHEDULES["gpt3"]),
        ("--rampup-batch-size", 3, ("the global batch size (documents) is fixed: drop "
                                    "--rampup-batch-size", False), SCHEDULES["gpt3"]),
    ],
    "llama3": [
        ("--bf16", 0, CPU_HALF, SCHEDULES["llama3"]),
        *[("--grad-reduce-in-bf16", 0, (f"--grad-reduce-in-bf16 is not supported by "
                                        f"--pipeline-schedule {schedule}", False), (schedule,))
          for schedule in SCHEDULES["llama3"][1:]],
        ("--log-throughput", 0, ("--log-throughput: this megatron-core release counts FLOPs",
                                 flop_count.counts_real_lengths()), SCHEDULES["llama3"]),
    ],
}
#: ``(example, schedule or "cpu") -> (flags added, the refusal asking for them)``.
ADDS = {
    ("llama3", "cpu"): (["--use-pytorch-profiler"],
                        "--profile starts and stops CUDA's profiler (for nsys) unless "
                        "--use-pytorch-profiler is given"),
}


def initial_weights(argv, env, directory) -> str:
    """The weights ``argv``'s run starts from (its model at iteration 0, from the same seed;
    no optimizer state, which a first step starts without), saved by
    ``initial_weights_worker.py``, for a schedule that builds other layers on each
    stage and so draws other weights from the same seed (helix: its stages hold layer
    parts)."""
    saved = str(directory / "initial")
    argv = [*drop(drop(argv, "--save", 1), "--load", 1), "--save", saved, "--no-save-optim"]
    torchrun(2, "tests/e2e/initial_weights_worker.py", argv, env=env, timeout=420)
    return saved


def drop(argv, flag, values):
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + values:]


def build_tokenizer(directory):
    """Byte-level BPE over the project's sources: a HuggingFace tokenizer directory and GPT-2
    vocab/merges files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [open(path).read() for path in sorted(glob.glob(os.path.join(REPO, "*", "*.py")))]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = directory / "hf"
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(hf)
    gpt2 = directory / "gpt2"
    gpt2.mkdir()
    bpe.model.save(str(gpt2))
    # Documents of 100 to 1000 characters, enough for GPT-3's --split 949,50,1 to leave the
    # test split some.
    texts = [text[start:start + 100 + 37 * (start % 25)] for text in texts
             for start in range(0, len(text), 400)]
    return hf, gpt2, texts


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    hf, gpt2, texts = build_tokenizer(root)
    env = {"HF_HOME": str(root / "empty-hub-cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    with open(root / "docs.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    data = {}
    for name, flags in (("llama3", ["--tokenizer-type", "HuggingFaceTokenizer",
                                    "--tokenizer-model", str(hf)]),
                        ("gpt3", ["--tokenizer-type", "GPT2BPETokenizer",
                                  "--vocab-file", str(gpt2 / "vocab.json"),
                                  "--merge-file", str(gpt2 / "merges.txt")])):
        import subprocess

        result = subprocess.run(
            [sys.executable, "scripts/preprocess_data.py", "--input", str(root / "docs.jsonl"),
             "--output-prefix", str(root / name), "--append-eod", *flags],
            cwd=REPO, env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        data[name] = str(root / f"{name}_text_document")  # Megatron-LM's tool's name
    return root, hf, gpt2, env, data


def example(workspace, name, schedule):
    root, hf, gpt2, _, data = workspace
    paths = [str(root / f"{name}_{schedule}_{kind}") for kind in ("ckpt", "tb")]
    if name == "gpt3":
        return gpt3(data[name], str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt"), *paths)
    return llama3(data[name], str(hf), *paths, str(root / "cache"))


def parse_refusal(argv, env):
    from megatron.plugin import arguments

    saved = dict(os.environ)
    os.environ.update(env, WORLD_SIZE="2")
    try:
        arguments.parse(argv)
    except (ValueError, AssertionError) as err:
        return str(err)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None


def logged(stdout: str, field: str) -> list[float]:
    """``field``'s value in each of Megatron's iteration log lines."""
    return [float(v) for v in re.findall(
        rf"iteration +\d+/ +\d+ \|.*? {field}: +([0-9.E+-]+|nan|inf)", stdout)]


def losses(stdout: str) -> list[float]:
    return logged(stdout, "lm loss")


@pytest.mark.parametrize("name", ["gpt3", "llama3"])
def test_megatron_example_trains_alike_under_the_schedules(workspace, name):
    env = workspace[3]
    trained, norms, command_lines = {}, {}, {}
    for schedule in SCHEDULES[name]:
        argv = example(workspace, name, schedule) + ["--pipeline-schedule", schedule,
                                                     *SCHEDULE_FLAGS.get(schedule, [])]
        drops = [(flag, values, message) for flag, values, (message, kept), schedules
                 in DROPS[name] if schedule in schedules and not kept]
        adds = [ADDS[key] for key in ((name, schedule), (name, "cpu"))
                if key in ADDS and not (key[1] == "cpu" and torch.cuda.is_available())]
        # Each refusal names what to change; apply exactly the expected changes, one at a time.
        while (refusal := parse_refusal(argv, env)) is not None:
            dropped = next((d for d in drops if d[2] in refusal and d[0] in argv), None)
            added = next((a for a in adds if a[1] in refusal), None)
            assert dropped or added, f"unexpected refusal: {refusal}"
            if dropped:
                drops.remove(dropped)
                argv = drop(argv, dropped[0], dropped[1])
            else:
                adds.remove(added)
                argv += added[0]
        assert not drops and not adds, (drops, adds)
        assert parse_refusal(argv, env) is None
        if schedule in SAME_WEIGHTS_LOADED:
            start = initial_weights(command_lines[SCHEDULES[name][0]], env,
                                    workspace[0] / f"{name}_{schedule}")
            argv = [*drop(argv, "--load", 1), "--load", start, "--no-load-optim"]
        command_lines[schedule] = argv
        result = torchrun(2, SCRIPT, argv, env=env, timeout=420)
        trained[schedule] = losses(result.stdout)
        assert len(trained[schedule]) == ITERATIONS, result.stdout[-3000:]
        # Every iteration stepped the optimizer with a real gradient. (Whether six batches of
        # different documents at the example's learning rate lower the loss depends on the
        # documents, which are the project's own sources: no assertion is made on it.)
        assert all(torch.isfinite(torch.tensor(trained[schedule])))
        norms[schedule] = logged(result.stdout, "grad norm")
        assert len(norms[schedule]) == ITERATIONS, norms[schedule]
        assert all(0 < n < float("inf") for n in norms[schedule]), norms[schedule]
        assert all(lr > 0 for lr in logged(result.stdout, "learning rate"))
        assert logged(result.stdout, "number of skipped iterations") == [0] * ITERATIONS
        if "--log-throughput" in argv:  # kept where Megatron counts the documents' lengths
            assert len(logged(result.stdout, r"throughput per GPU \(TFLOP/s/GPU\)")) \
                == ITERATIONS
        checkpoint = argv[argv.index("--save") + 1]
        with open(os.path.join(checkpoint, "latest_checkpointed_iteration.txt")) as f:
            assert f.read().strip() == str(ITERATIONS)
        if name == "llama3" and not torch.cuda.is_available():  # --use-pytorch-profiler
            assert glob.glob(os.path.join(os.path.dirname(checkpoint), "torch_profile", "*"))
    first, *others = SCHEDULES[name]
    for schedule in others:
        torch.testing.assert_close(torch.tensor(trained[schedule]), torch.tensor(trained[first]),
                                   rtol=1e-4, atol=0, msg=lambda m: f"{schedule}: {m}")
        # The gradients too, beyond what the next iterations' losses show: Megatron logs each
        # iteration's gradient norm to 3 decimals, which agree up to one unit of the last
        # (the rounding of values that are equal to far more digits can differ by one).
        apart = [abs(round(a * 1000) - round(b * 1000))
                 for a, b in zip(norms[schedule], norms[first])]
        assert max(apart) <= 1, (schedule, norms[schedule], norms[first])

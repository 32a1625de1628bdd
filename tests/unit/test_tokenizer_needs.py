"""A tokenizer whose files or package this machine lacks is refused at start-up, naming
--tokenizer-type and the ways on (``megatron.plugin.tokenizer_needs``); one that would build is
left to Megatron."""
import argparse

import pytest
from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer

from harness import TINY_MODEL
from megatron.plugin import arguments, tokenizer_needs


def flags(tokenizer_type=None, vocab_file=None, merge_file=None):
    return argparse.Namespace(tokenizer_type=tokenizer_type, vocab_file=vocab_file,
                              merge_file=merge_file)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No ``wget`` package and an empty download cache; returns the cache's folder."""
    monkeypatch.setattr(megatron_hf_tokenizer, "HAVE_WGET", False)
    monkeypatch.setattr(megatron_hf_tokenizer, "MEGATRON_CACHE", str(tmp_path))
    return tmp_path


def without_transformers(monkeypatch):
    find_spec = tokenizer_needs.importlib.util.find_spec
    monkeypatch.setattr(tokenizer_needs.importlib.util, "find_spec",
                        lambda name: None if name == "transformers" else find_spec(name))


def test_megatrons_default_tokenizer_is_refused_naming_the_flag_and_the_ways_on(offline):
    message = tokenizer_needs.refusal(flags())
    assert message.startswith("no --tokenizer-type (Megatron-LM's default for GPT is "
                              "GPT2BPETokenizer): without --vocab-file and --merge-file "
                              "megatron-core downloads the files with the wget package")
    for way in ("--tokenizer-type NullTokenizer --vocab-size 257 for text written by "
                "scripts/preprocess_data.py --byte-level", "--vocab-file VOCAB --merge-file MERGES",
                "HuggingFaceTokenizer --tokenizer-model PATH", "SentencePieceTokenizer",
                "TikTokenizer"):
        assert way in message, message
    named = tokenizer_needs.refusal(flags("GPT2BPETokenizer", vocab_file="v.json"))
    assert named.startswith("--tokenizer-type GPT2BPETokenizer: without --merge-file ")


def test_what_would_build_is_left_to_megatron(offline, monkeypatch):
    # The files given (megatron.plugin.gpt2_bpe reads them), or in Megatron's cache.
    assert tokenizer_needs.refusal(flags(vocab_file="v.json", merge_file="m.txt")) is None
    for suffix in ("_vocab", "_merges"):
        (offline / f"GPT2BPETokenizer{suffix}").write_text("{}")
    assert tokenizer_needs.refusal(flags()) is None
    # Megatron's download with the wget package; tokenizers of no download and no package.
    monkeypatch.setattr(megatron_hf_tokenizer, "MEGATRON_CACHE", str(offline / "empty"))
    monkeypatch.setattr(megatron_hf_tokenizer, "HAVE_WGET", True)
    assert tokenizer_needs.refusal(flags()) is None
    monkeypatch.setattr(megatron_hf_tokenizer, "HAVE_WGET", False)
    without_transformers(monkeypatch)
    assert tokenizer_needs.refusal(flags("NullTokenizer")) is None
    assert tokenizer_needs.refusal(flags("SentencePieceTokenizer")) is None


def test_a_hugging_face_tokenizer_without_transformers_is_refused(offline, monkeypatch):
    without_transformers(monkeypatch)
    for kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        message = tokenizer_needs.refusal(flags(kind, vocab_file="v", merge_file="m"))
        assert message.startswith(f"--tokenizer-type {kind}: megatron-core builds this "
                                  "tokenizer with Hugging Face's transformers package, which "
                                  "is not installed; pass --tokenizer-type NullTokenizer"), message


def test_the_training_start_up_lists_it_with_the_other_refusals(offline):
    tokenizer = TINY_MODEL.index("--tokenizer-type")
    argv = [*TINY_MODEL[:tokenizer], *TINY_MODEL[tokenizer + 4:], "--multi-latent-attention"]
    with pytest.raises(arguments.Refusals) as refused:
        arguments.check_command_line(argv, training=True)
    text = str(refused.value)
    for named in ("no --tokenizer-type", "--multi-latent-attention is not supported",
                  "--eval-interval is not set"):
        assert named in text, text

"""Pure parts of the elastic runtime: chunk rows, the data-parallel spread, the flags."""
import argparse

import numpy as np
import pytest

from elastic_pipe.chunks import Chunk, Piece
from elastic_pipe.cost_model import CostModel, ParallelConfig
from elastic_pipe.hardware import load_profile
from elastic_pipe.models import ModelConfig
from elastic_pipe.runtime import chunk_row, slices_flag, spread_over_replicas


def test_a_hybrid_chunk_row_carries_true_tokens_positions_and_slice_keys():
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 100, size=n + 1) for n in (20, 6)]
    # The tail slice [12, 20) of document 0 (global id 7) packed with whole document 1 (id 3).
    chunk = Chunk((Piece(0, 1, 12, 20, True), Piece(1, 0, 0, 6, True)))
    batch = {7: documents[0], 3: documents[1]}
    tokens, labels, mask, positions, segments = chunk_row(chunk, batch, [7, 3], multiple=4)
    assert len(tokens) == 16  # 14 tokens padded to a multiple of 4
    np.testing.assert_array_equal(tokens[:8], documents[0][12:20])
    np.testing.assert_array_equal(labels[:8], documents[0][13:21])
    np.testing.assert_array_equal(positions[:8], np.arange(12, 20))
    np.testing.assert_array_equal(tokens[8:14], documents[1][:6])
    np.testing.assert_array_equal(positions[8:14], np.arange(6))
    assert mask.tolist() == [1.0] * 14 + [0.0] * 2
    assert [(s.start, s.stop, s.doc_key, s.slice_index) for s in segments] == [
        (0, 8, 7, 1), (8, 14, None, 0), (14, 16, None, 0)]


def test_documents_are_spread_over_replicas_by_predicted_cost():
    cost = CostModel(ModelConfig("t", 4, 64, 4, 256, 512), load_profile("a800"),
                     ParallelConfig(pp=2, dp=3))
    lengths = [4000, 100, 3000, 50, 2500, 2000, 700, 30, 1200]
    shares = spread_over_replicas(lengths, 3, cost)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    work = [sum(cost.layer_forward(Chunk((Piece(i, 0, 0, lengths[i], True),)))
                for i in share) for share in shares]
    biggest = cost.layer_forward(Chunk((Piece(0, 0, 0, max(lengths), True),)))
    assert max(work) - min(work) <= biggest
    assert spread_over_replicas(lengths, 3, cost) == shares  # deterministic


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("3", 3)])
def test_slices_flag(value, expected):
    assert slices_flag(value) == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_slices_flag_refuses(value):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'auto'"):
        slices_flag(value)


@pytest.mark.parametrize("device,profile", [("NVIDIA A100-SXM4-80GB", "a100"),
                                            ("NVIDIA A800-SXM4-80GB", "a800"),
                                            ("NVIDIA H100 80GB HBM3", "h100"),
                                            ("NVIDIA H20", "h20"),
                                            ("NVIDIA L40S", "a800")])
def test_the_default_profile_matches_the_cuda_device(monkeypatch, device, profile):
    """Each shipped profile is the default on its device (an A100 once got the A800's)."""
    from elastic_pipe import runtime

    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.cuda, "get_device_name", lambda *a: device)
    args = argparse.Namespace(
        elastic_hardware_profile=None, elastic_memory_gb=80.0, elastic_reserved_gb=2.0,
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=2, context_parallel_size=1,
        use_distributed_optimizer=False)
    cost = runtime.cost_model_from_args(args, 512)
    assert cost.hardware.name == load_profile(profile).name

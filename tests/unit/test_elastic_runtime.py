"""Pure parts of the document schedules' runtime: chunk rows, the data-parallel spread, the
job's cost model (:mod:`longctx`) and the elastic flags."""
import argparse
import dataclasses
import json

import numpy as np
import pytest
import torch

from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import ModelConfig
from longctx import job_costs
from longctx.chunk_rows import chunk_row
from longctx.replicas import spread_over_replicas
from elastic_pipe.flags import slices_flag


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


def job_args(**over) -> argparse.Namespace:
    """The Megatron flags :func:`cost_model_from_args` reads, for a tiny FP32 job on CPU."""
    values = dict(
        pipeline_schedule="elastic", hardware_profile=None, num_layers=4, hidden_size=64,
        num_attention_heads=4, hidden_dropout=0.0, num_experts=None, moe_router_topk=2,
        moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False, moe_router_dtype=None, qk_layernorm=False,
        attention_output_gate=False,
        position_embedding_type="learned_absolute", rotary_percent=1.0,
        normalization="LayerNorm", group_query_attention=False, num_query_groups=1,
        ffn_hidden_size=256, params_dtype=torch.float32, swiglu=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=2, context_parallel_size=1,
        use_distributed_optimizer=False, decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False)
    values.update(over)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("device,profile", [("NVIDIA A100-SXM4-80GB", "a100"),
                                            ("NVIDIA A800-SXM4-80GB", "a800"),
                                            ("NVIDIA H100 80GB HBM3", "h100"),
                                            ("NVIDIA H20", "h20"),
                                            ("NVIDIA H200", "h200"),
                                            ("NVIDIA H100 PCIe", "h100"),
                                            ("NVIDIA L40S", "a800")])
def test_the_default_profile_matches_the_cuda_device(monkeypatch, caplog, device, profile):
    """Each shipped profile is the default on its device (an A100 once got the A800's, an H200
    the H20's: names are matched word by word); the log
    says which it is and why."""
    monkeypatch.setattr(job_costs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(job_costs.torch.cuda, "get_device_name", lambda *a: device)
    with caplog.at_level("INFO", logger="longctx.job_costs"):
        cost = job_costs.cost_model_from_args(job_args(), 512, memory_gb=80.0, reserved_gb=2.0)
    assert cost.hardware.name == load_profile(profile).name
    why = "no shipped profile matches" if device == "NVIDIA L40S" else "matched from"
    assert f"hardware profile {profile} (spec-derived, {why} {device})" in caplog.text


@pytest.mark.parametrize("num_layers,flags,layers", [
    (4, {}, (2, 2)),
    (5, {"decoder_first_pipeline_num_layers": 1}, (1, 4)),
    (5, {"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 3}, (2, 3)),
    (5, {"account_for_embedding_in_pipeline_split": True}, (2, 3)),
    (5, {"account_for_loss_in_pipeline_split": True}, (3, 2)),
])
def test_the_planner_prices_each_stage_with_megatrons_layer_map(num_layers, flags, layers):
    """The stages' layer counts are those Megatron builds (``get_num_layers_to_build``): even,
    uneven first or last stages, the embedding or the loss counted as a layer."""
    args = job_args(num_layers=num_layers, **flags)
    assert job_costs.megatron_stage_layers(args) == layers
    cost = job_costs.cost_model_from_args(args, 512, memory_gb=80.0, reserved_gb=2.0)
    assert tuple(cost.layers(stage) for stage in range(2)) == layers


def test_a_layer_map_that_does_not_place_the_model_is_refused():
    cost = job_costs.cost_model_from_args(job_args(), 512, memory_gb=80.0, reserved_gb=2.0)
    with pytest.raises(ValueError, match=r"layers per stage \(1, 2\) do not place 4 layers"):
        CostModel(cost.model, cost.hardware, cost.parallel, (1, 2))


@pytest.mark.parametrize("dtype,name", [(torch.float32, "float32"),
                                        (torch.bfloat16, "bfloat16")])
def test_the_planner_counts_bytes_in_the_runs_dtype_and_says_so(monkeypatch, caplog, dtype, name):
    """The spec-derived profile prices the time; the bytes follow the run's params_dtype (an FP32
    run on CPU stashes twice a BF16 run's), and the log names the profile and the dtype."""
    monkeypatch.setattr(job_costs.torch.cuda, "is_available", lambda: False)
    with caplog.at_level("INFO", logger="longctx.job_costs"):
        cost = job_costs.cost_model_from_args(job_args(params_dtype=dtype, swiglu=True), 512)
    assert (cost.model.dtype, cost.model.gated_mlp) == (name, True)
    # 8h + 3f elements, and the FP32 statistics of the two norms (16 bytes) and the softmax's
    # 4 heads (16 bytes)
    assert cost.full_per_token == cost.model.element_bytes * (8 * 64 + 3 * 256) + 16 + 16
    assert caplog.messages == [f"elastic planner: hardware profile a800 (spec-derived, the "
                               f"default on CPU), activation bytes derived for {name}"]


@pytest.mark.parametrize("cuda", [False, True])
def test_the_planner_reads_the_llama_style_flags(monkeypatch, cuda):
    """``--position-embedding-type rope --rotary-percent 0.5 --normalization RMSNorm
    --group-query-attention --num-query-groups 2`` reach the priced model as Megatron means
    them; the norms are priced as the fused kernels on CUDA, torch's composite on a CPU."""
    monkeypatch.setattr(job_costs.torch.cuda, "is_available", lambda: cuda)
    if cuda:
        monkeypatch.setattr(job_costs.torch.cuda, "get_device_name", lambda: "NVIDIA H100")
    args = job_args(position_embedding_type="rope", rotary_percent=0.5, normalization="RMSNorm",
                    group_query_attention=True, num_query_groups=2)
    model = job_costs.cost_model_from_args(args, 512, memory_gb=80.0).model
    assert (model.rope, model.learned_positions, model.rotary_dim) == (True, False, 8)
    assert (model.normalization, model.fused_norms, model.kv_width) == ("RMSNorm", cuda, 32)
    plain = job_costs.cost_model_from_args(job_args(num_query_groups=2), 512, memory_gb=80.0)
    assert plain.model.query_groups == 4 and plain.model.learned_positions


def test_a_measured_profile_is_honoured_in_its_dtype_only(caplog, tmp_path):
    counted = {"layer": 9000.0, "checkpointed": 256.0, "kv": 512.0, "dkv": 512.0,
               "embedding": 16.0, "head": 2000.0, "hidden_size": 64, "vocab_size": 512,
               "sp": 1, "tp": 1, "dtype": "float32"}
    data = dict(dataclasses.asdict(load_profile("a800")), source="measured",
                activation_coefficients=counted)
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(data))
    with caplog.at_level("INFO", logger="longctx.job_costs"):
        cost = job_costs.cost_model_from_args(job_args(hardware_profile=str(path)), 512)
    assert cost.full_per_token == 9000.0
    assert caplog.messages == [f"elastic planner: hardware profile {path} (measured, "
                               f"--hardware-profile), activation bytes measured in "
                               f"float32"]
    with pytest.raises(ValueError, match="measured activations in float32, not bfloat16"):
        job_costs.cost_model_from_args(
            job_args(hardware_profile=str(path), params_dtype=torch.bfloat16), 512)

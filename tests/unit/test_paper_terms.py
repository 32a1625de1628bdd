"""``scripts/paper_terms.py``'s memory terms against hand calculations: the allocator's
fragmentation as reserved bytes per live byte, NCCL's buffers of Megatron-LM's communicators,
and the memory ledger ``scripts/reproduce_papers.py`` gives Megatron-LM's longest-sequence
rows."""
import sys

import pytest

from harness import REPO
for folder in (REPO, f"{REPO}/scripts"):  # reproduce_papers imports paper_terms by name
    if folder not in sys.path:
        sys.path.insert(0, folder)

import reproduce_papers  # noqa: E402
from scripts.paper_terms import (  # noqa: E402
    MIB, fragmented, megatron_communicators, nccl_buffer_bytes)

from longctx.chunks import Chunk, Piece  # noqa: E402
from longctx.cost_model import CostModel, ParallelConfig  # noqa: E402
from longctx.hardware import load_profile  # noqa: E402
from longctx.models import get_model  # noqa: E402


def test_fragmentation_is_a_share_of_the_reservation():
    """15% of the reservation unused: 0.15 / 0.85 reserved bytes beyond each live byte, so a
    checkpointed 7B layer input at TP 32 (4096 x 2 / 32 = 256 bytes a token) costs 256 / 0.85
    bytes, and TP's two full-sequence buffers 2 x 4096 x 2 / 0.85 a token."""
    a100 = load_profile("a100")
    assert fragmented(a100).allocator_overhead == pytest.approx(0.15 / 0.85)
    assert fragmented(a100, 0.0).allocator_overhead == 0.0
    cost = CostModel(get_model("gpt-7b"), fragmented(a100), ParallelConfig(pp=1, tp=32))
    assert cost.ckpt_per_token == pytest.approx(256 / 0.85)
    chunk = Chunk((Piece(0, 0, 0, 1000, True),))
    assert cost.layer_workspace(chunk) == pytest.approx(1000 * 2 * 4096 * 2 / 0.85)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"fragmentation must be in \[0, 1\)"):
            fragmented(a100, bad)


def test_nccl_buffers_of_megatron_communicators():
    """SP 32 x PP 1: tensor parallelism's communicator and the gradient norm's (same 32 GPUs, a
    communicator of its own), 2 x 688 MiB; SP 64 x PP 2 adds the pipeline's two GPUs, 544 MiB;
    one GPU has none."""
    assert megatron_communicators(32, 1) == {"tensor parallel": 32, "gradient norm": 32}
    assert nccl_buffer_bytes(32, 1) == 2 * 688 * MIB
    assert megatron_communicators(64, 2) == {"tensor parallel": 64, "pipeline send/receive": 2,
                                             "gradient norm": 128}
    assert nccl_buffer_bytes(64, 2) == (688 + 544 + 688) * MIB
    assert nccl_buffer_bytes(2, 1) == 2 * 544 * MIB
    assert nccl_buffer_bytes(1, 1) == 0


def test_megatron_memory_ledger_at_the_papers_length():
    """GPT-7B at SP 32 x PP 1 on 32 A100s at 896K tokens (the SPPO paper's longest for
    Megatron-LM): TP's two full-sequence buffers 2 x 917504 x 4096 x 2 bytes, the loss's BF16
    logits 917504 x 50304 / 32 x 2 beside the FP32 ones (x 4), the model state 18 bytes a
    parameter (one replica: nothing to shard), NCCL's two communicators; the fragmentation at
    15% of the reservation adds 0.15 / 0.85 of everything but the model state and the
    reserved 2 GB."""
    seven = get_model("gpt-7b")
    why, ledger = reproduce_papers.megatron_memory(
        reproduce_papers.testbed("sppo-a100"), seven, 32, (32, 1), 896, 1728.0)
    gb, tokens = 1e9, 917504
    memory = ledger["memory_at_published_gb"]
    assert memory["tp_sp_buffers"] == pytest.approx(2 * tokens * 4096 * 2 / gb)
    assert memory["loss_buffers"] == pytest.approx(tokens * 50304 / 32 * 2 / gb)
    assert memory["fp32_logits"] == pytest.approx(tokens * 50304 / 32 * 4 / gb)
    params = seven.num_layers * seven.params_per_layer() + 2 * 50304 * 4096 + 2 * 4096
    assert memory["model_state"] == pytest.approx(params / 32 * 18 / gb)
    assert memory["nccl_buffers"] == pytest.approx(2 * 688 * MIB / gb)
    assert memory["free"] == pytest.approx(80.0 - memory["peak"])
    live = memory["peak"] - memory["model_state"] - memory["reserved"]
    assert why["size"] == pytest.approx(live * 0.15 / 0.85)
    assert why["simulated_with"] == 1728.0

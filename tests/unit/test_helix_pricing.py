"""HelixPipe's paper-scale pricing against hand calculations."""
import dataclasses

import pytest

from helix.pricing import compare, part_times
from helix.schedule import HelixCosts
from longctx.hardware import load_profile, profile_from_dict
from longctx.models import ModelConfig
from megatron.plugin.pipeline.ir import Action, Kind

MODEL = ModelConfig("m", 8, 1024, 8, 4096, 1000)
SPEC = {
    "name": "hand", "source": "spec-derived", "peak_tflops": 100.0, "matmul_efficiency": 0.5,
    "attention_efficiency": 0.25, "layer_overhead_s": 0.0, "backward_factor": 2.0,
    "hbm_gb": 80.0, "intra_node_gbps": 100.0, "intra_node_latency_s": 1e-5,
    "inter_node_gbps": 25.0, "inter_node_latency_s": 2e-5, "gpus_per_node": 8,
    "node_nic_gbps": 50.0}
HW = profile_from_dict(SPEC)


def test_part_times_by_hand():
    seq, tp, h = 8192, 8, 1024
    parts = part_times(MODEL, HW, seq, tp)
    matmul, attention = 100e12 * 8 * 0.5, 100e12 * 8 * 0.25
    collective = 1e-5 + seq * h * 2 * 7 / 8 / 100e9
    assert parts.qkv == pytest.approx(2 * seq * 3 * h * h / matmul + collective)
    assert parts.attention == pytest.approx(2 * h * seq * seq / attention)
    assert parts.post == pytest.approx(2 * seq * (h * h + 2 * h * 4096) / matmul + 3 * collective)
    # 400 Gb/s a node shared by 8 GPUs: 6.25 GB/s each.
    assert parts.hop == pytest.approx(2e-5 + seq * h * 2 / 8 / 6.25e9)
    assert parts.weight == pytest.approx(2e-5 + 3 * h * h * 2 / 8 / 6.25e9)


def test_named_tensors_take_their_own_transfer_time():
    costs = HelixCosts(1.0, 1.0, 1.0, 4, transfer=0.5, tensor_transfer=(("w", 0.1),))
    send = Action(0, Kind.SEND_F, 0, ".l1", peer=1, tensor="w")
    assert costs.transfer_time(send) == 0.1
    assert costs.transfer_time(Action(0, Kind.SEND_F, 0, ".l1", peer=1, tensor="x")) == 0.5


def test_attention_heavy_sequences_favour_helix():
    """At long sequences attention dominates and helix keeps it out of its bubbles."""
    found = compare(MODEL, HW, 65536, pp=4, tp=8, microbatches=8)
    assert found["helix_bubble"] < found["1f1b_bubble"]
    assert found["speedup_1f1b"] == pytest.approx(found["1f1b_s"] / found["helix_s"])
    best = min(found["1f1b_s"], found["zb1p_s"])
    assert found["speedup"] == pytest.approx(best / found["helix_s"])
    assert found["best_baseline"] == ("zb1p" if found["zb1p_s"] < found["1f1b_s"] else "1f1b")
    assert found["speedup"] > 1


def test_zb1p_bubble_is_eq_3_with_free_transfers():
    """Zero-latency links of 10^9 GB/s (a hop of about 1.3e-10 s): ZB1P beats 1F1B, and each
    stage idles (p - 1)(t_qkv + 3 t_attn + t_post) L / p (eq. (3), backward_factor 2), give or
    take the hops on the critical path (at most one per forward and backward step: 2 (m + p))."""
    free = profile_from_dict({**SPEC, "inter_node_gbps": 1e9, "node_nic_gbps": 1e9,
                              "inter_node_latency_s": 0.0})
    p, m, layers = 4, 8, MODEL.num_layers
    found = compare(MODEL, free, 65536, pp=p, tp=8, microbatches=m)
    assert not found["1f1b_recompute"]
    assert found["zb1p_s"] < found["1f1b_s"] and found["best_baseline"] == "zb1p"
    parts = found["parts_s"]
    work = m * layers / p * 3 * (parts["qkv"] + parts["attention"] + parts["post"])
    eq3 = (p - 1) * (parts["qkv"] + 3 * parts["attention"] + parts["post"]) * layers / p
    hops = 2 * (m + p) * parts["hop"]
    assert parts["hop"] < 2e-10
    assert found["zb1p_s"] - work == pytest.approx(eq3, abs=hops)
    assert found["zb1p_bubble"] * found["zb1p_s"] == pytest.approx(eq3, abs=hops)


def test_1f1b_recomputes_only_when_it_does_not_fit():
    """Stage 0 of 1F1B holds min(p, m) micro-batches' activations: at 64K tokens on 4 stages
    the model's accounting needs about 4.5 GB there, so a 4 GB budget makes the baseline
    recompute every layer (2.6 GB) and a 40 GB one does not."""
    from longctx.chunks import Chunk, Piece
    from longctx.cost_model import CostModel, ParallelConfig

    cost = CostModel(MODEL, HW, ParallelConfig(pp=4, tp=8, memory_gb=40))
    chunk = Chunk((Piece(0, 0, 0, 65536, True),))
    stage0 = cost.static_bytes(0) + 4 * cost.stash_bytes(0, chunk) + cost.layer_workspace(chunk)
    roomy = compare(MODEL, HW, 65536, pp=4, tp=8, microbatches=8, memory_gb=40)
    assert roomy["1f1b_peak_gb"][0] == pytest.approx(stage0 / 1e9)
    assert not roomy["1f1b_recompute"] and roomy["1f1b_fits"]
    tight = compare(MODEL, HW, 65536, pp=4, tp=8, microbatches=8, memory_gb=4)
    assert tight["1f1b_recompute"] and tight["1f1b_fits"]
    assert tight["1f1b_s"] > roomy["1f1b_s"]  # the recomputation costs a forward
    assert tight["zb1p_s"] > roomy["zb1p_s"]  # ZB1P holds 1F1B's memory: it recomputes too
    assert not compare(MODEL, HW, 65536, pp=4, tp=8, microbatches=8,
                       memory_gb=2.5)["1f1b_fits"]


def test_helix_hides_its_transfers_at_the_papers_h20_setting():
    """GPT-7B shape, 128K tokens, 8 stages of 8 H20s (NICs of 100 GB/s a node: a hop of about
    10.8 ms beside about 215 ms of QKV projection and attention), 16 micro-batches, recomputation
    without attention: each stage idles at most Table 2's 8 (p - 1) t_post (HelixPipe's t_pre,
    the input LayerNorm, is not priced) plus the start-up transfers, which nothing runs beside:
    the first fold's inputs into its first attention and its outputs out of it, in the forward
    and again in the backward -- 2 (x + r + w, o + res) hops."""
    h20 = dataclasses.replace(load_profile("h20"), node_nic_gbps=100.0)
    model = ModelConfig("gpt-7b-shape", 32, 4096, 32, 16384, 50304)
    found = compare(model, h20, 131072, pp=8, tp=8, microbatches=16, helix_recompute=True)
    parts = found["parts_s"]
    weight = part_times(model, h20, 131072, 8).weight
    start_up = 2 * ((2 * parts["hop"] + weight) + 2 * parts["hop"])
    assert found["table2_idle_s"] == pytest.approx(8 * 7 * parts["post"])
    assert found["helix_idle_s"] <= found["table2_idle_s"] + start_up

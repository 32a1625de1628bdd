"""``scripts/profile_costs.py``: the NNLS fit and a tiny end-to-end measured profile."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from harness import REPO, python_path
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from scripts.profile_costs import (  # noqa: E402
    design_matrix, efficiency_curve, fit_backward_factor, fit_coefficients, fit_linear,
    flop_time, nnls)

from longctx.chunks import Chunk, Piece  # noqa: E402
from longctx.cost_model import (CostModel, ParallelConfig, layer_saved_per_token,  # noqa: E402
                                mlp_gemm_per_token)
from longctx.hardware import load_profile  # noqa: E402
from longctx.models import ModelConfig  # noqa: E402

TOKENS = [64, 128, 256, 512, 1024] * 3
CONTEXTS = [0] * 5 + [1024] * 5 + [4096] * 5


@pytest.mark.parametrize("truth", [(3e-11, 2e-6, 1e-4), (1e-9, 5e-7, 0.0), (0.0, 4e-6, 2e-5)])
def test_fit_recovers_known_coefficients(truth):
    times = design_matrix(TOKENS, CONTEXTS) @ np.array(truth)
    fitted = fit_coefficients(TOKENS, CONTEXTS, times)
    for got, want in zip(fitted, truth):
        assert got >= 0
        assert abs(got - want) <= 1e-6 * max(abs(want), 1e-30) + (1e-18 if want == 0 else 0)


def test_times_that_do_not_grow_with_the_tokens_are_refused_as_a_fit():
    """Timings of a busy machine can fit to no term that grows with the tokens; such a profile
    prices every chunk alike, and the layer-coefficient loader refuses it too."""
    from longctx.hardware import LayerCoefficients

    times = design_matrix(TOKENS, CONTEXTS) @ np.array([0.0, 0.0, 1e-3])
    with pytest.raises(ValueError, match="do not grow with the tokens.*idle machine"):
        fit_coefficients(TOKENS, CONTEXTS, times)
    with pytest.raises(ValueError, match="alpha1 and alpha2 are 0.*re-measure"):
        LayerCoefficients(0.0, 0.0, 1e-3, hidden_size=64, sp=1, tp=1)


def test_nnls_clamps_a_negative_unconstrained_solution():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([1.0, -1.0, 0.0])
    x = nnls(a, b)
    assert np.all(x >= 0) and x[1] == 0
    np.testing.assert_allclose(x, [0.5, 0.0])  # argmin over x0 of (x0-1)^2 + 1 + x0^2


def test_backward_factor_is_the_mean_ratio():
    assert fit_backward_factor([1.0, 2.0], [2.0, 5.0]) == pytest.approx(2.25)


#: Megatron-LM's Llama-style architecture flags, which the script takes as training does.
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"]


def test_script_writes_a_loadable_measured_profile(tmp_path):
    out = tmp_path / "measured.json"
    result = subprocess.run(
        [sys.executable, "scripts/profile_costs.py", "--num-layers-profiled", "1",
         "--hidden-size", "64", "--num-attention-heads", "4", "--tokens", "64", "128", "256",
         "--contexts", "0", "128", "--repeats", "3", "--base-profile", "a800",
         *LLAMA_FLAGS, "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=python_path(), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS",
                                                                             "1")))
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"fit relative error: max (\S+) mean (\S+)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= float(match.group(2)) >= 0
    assert len(re.findall(r"^\s+\d+\s+\d+\s", result.stdout, re.M)) == 6  # one row per point

    profile = load_profile(str(out))
    assert profile.source == "measured"
    fit = profile.layer_coefficients
    assert fit is not None and (fit.hidden_size, fit.sp, fit.tp) == (64, 1, 1)
    assert min(fit.alpha1, fit.alpha2, fit.beta) >= 0 and fit.alpha2 > 0
    assert profile.backward_factor > 0
    assert "inherited" in profile.notes and "hbm_gb" in profile.notes["inherited"]
    base = load_profile("a800")
    assert profile.hbm_gb == base.hbm_gb and profile.intra_node_gbps == base.intra_node_gbps

    # Activation bytes per token of the fp32 Llama-style layer (hidden 64, 2 key/value heads
    # of 4, Megatron's SwiGLU width 4h x 2/3 rounded down to a multiple of 64: 128) and the embedded corpus's padded vocabulary (257 -> 384): the layer keeps what the
    # cost model prices it (RoPE, the CPU's composite RMSNorm, SwiGLU, the grouped projection,
    # Megatron's default dropout masks), a checkpointed range keeps its input (4h), the dK/dV
    # accumulators are K and V in fp32 (8 h_kv), the embedding keeps the token ids (no
    # position ids under RoPE) and its dropout mask.
    memory = profile.activation_coefficients
    assert memory is not None and (memory.hidden_size, memory.vocab_size) == (64, 384)
    assert memory.dtype == "float32"
    llama = ModelConfig("llama", 1, 64, 4, 128, 384, dtype="float32", gated_mlp=True,
                        hidden_dropout=True, dropout_mask_bytes=4, learned_positions=False,
                        rope=True, normalization="RMSNorm", fused_norms=False,
                        num_query_groups=2)
    assert memory.layer == layer_saved_per_token(llama)
    assert memory.checkpointed == 4 * 64 and memory.dkv == 8 * 32
    assert memory.embedding == 8 + 4 * 64
    assert memory.head > 4 * 384
    assert memory.kv >= 8 * 32

    model = dataclasses.replace(llama, num_layers=2)
    costs = CostModel(model, profile, ParallelConfig(pp=1))
    chunk = Chunk((Piece(0, 1, 128, 256, True),))
    expected = fit.alpha1 * (256 ** 2 - 128 ** 2) + fit.alpha2 * 128 + fit.beta
    assert costs.layer_compute(chunk) == pytest.approx(expected)
    assert costs.layer_backward(chunk) == pytest.approx(profile.backward_factor * expected)
    assert costs.stash_bytes(0, chunk) == pytest.approx(
        128 * (2 * memory.layer + memory.embedding + memory.head))

    # The pipeline's ends were timed: embedding on the first stage, head on the last; with one
    # stage both, forward and backward, on top of the layers. (At these few tokens the split
    # between per-token and per-chunk seconds is noise, so only their sum is checked.)
    ends = profile.end_coefficients
    assert ends is not None and (ends.hidden_size, ends.vocab_size) == (64, 384)
    for pair in (ends.embedding_forward, ends.embedding_backward, ends.head_forward,
                 ends.head_backward):
        assert min(pair) >= 0 and sum(pair) > 0
    # host time measured; a CPU computes the layers itself (not asynchronous)
    assert min(profile.host_layer_forward_s, profile.host_layer_backward_s,
               profile.host_action_s) >= 0 and not profile.host_asynchronous
    assert "measured" in profile.notes["host_action_s"]
    layers = 2 * costs.layer_forward(chunk)
    assert costs.stage_forward(0, chunk) == pytest.approx(
        layers + ends.time(ends.embedding_forward, 128) + ends.time(ends.head_forward, 128)
        + profile.host_action_s)
    assert len(re.findall(r"^(embedding|head)_(forward|backward): ", result.stdout, re.M)) == 4

    # The measured efficiency curve is printed (for a spec-derived profile), ending at 1 at
    # the largest chunk; a CPU has no caching allocator, so its overhead is inherited.
    curve = re.search(r"kernel efficiency .*?: (\{.*\})$", result.stdout, re.M)
    assert curve, result.stdout
    points = json.loads(curve.group(1))["kernel_efficiency"]
    assert [s for s, _ in points] == [64, 128, 256] and points[-1][1] == 1.0
    assert all(0 < e <= 1 for _, e in points)
    assert profile.kernel_efficiency is None
    assert "allocator_overhead" in profile.notes["inherited"]


def test_efficiency_curve_is_the_model_time_over_the_measured_past_beta():
    """Model work s^2 + s; beta 0.5. At 2 tokens 6 units in 2.5 - 0.5 s (3/s), at 4 tokens 20
    units in 1.5 - 0.5 s (20/s): efficiency 0.15 and 1; the C > 0 point is left out."""
    curve = efficiency_curve([2, 4, 4], [0, 0, 8], [2.5, 1.5, 5.0], 0.5, lambda s: s * s + s)
    assert curve == [[2, pytest.approx(0.15)], [4, 1.0]]


def test_flop_time_is_the_cost_models_work():
    """Hidden 2, ffn 8, gated: GEMMs 2 (16 + 32 + 16) = 128 FLOPs a token at efficiency 0.5,
    attention 2 h s^2 = 4 s^2 at 0.25. With 4 experts of width 8, top 2: the MLP's
    multiply-adds are the router's 2 x 4 and 2 x (32 + 16), 2 (16 + 104) = 240 FLOPs."""
    efficiencies = {"attention_efficiency": 0.25, "matmul_efficiency": 0.5}
    gated = ModelConfig("g", 1, 2, 1, 8, 10, gated_mlp=True)
    work = flop_time(2, mlp_gemm_per_token(gated), efficiencies)
    assert work(3) == pytest.approx(4 * 9 / 0.25 + 128 * 3 / 0.5)
    experts = dataclasses.replace(gated, num_experts=4, moe_router_topk=2)
    work = flop_time(2, mlp_gemm_per_token(experts), efficiencies)
    assert work(3) == pytest.approx(4 * 9 / 0.25 + 240 * 3 / 0.5)


def test_linear_fit_recovers_per_token_and_per_call_seconds():
    tokens = [64, 128, 256, 512]
    seconds = [2e-7 * t + 3e-4 for t in tokens]
    assert fit_linear(tokens, seconds) == pytest.approx((2e-7, 3e-4), rel=1e-9)

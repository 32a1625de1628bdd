"""Host time in the cost model (#26): a layer call costs ``max(host, device)`` where the host
only launches (CUDA), the sum on a CPU (already inside a measured fit there), and each stage
forward and backward adds the action's host time; the profile loader checks the figures and
the refit takes the action's host time off before fitting. Expected values by hand."""
import dataclasses

import pytest

from elastic_pipe.refit import chunk_terms, observations, refit
from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import LayerCoefficients, load_profile, profile_from_dict
from longctx.models import ModelConfig

MODEL = ModelConfig("small", 6, 256, 8, 1024, 1000)
#: 32768 tokens: a layer's device time (h200, forward 1.6 ms) above the host figures below.
LONG = Chunk((Piece(0, 0, 0, 32768, True),))
#: 16 tokens: a layer's device time (forward 0.08 ms) far below them.
SHORT = Chunk((Piece(1, 0, 0, 16, True),))
FIT = LayerCoefficients(1e-10, 1e-6, 2e-4, hidden_size=256, sp=1, tp=1)


def cost(pp=2, **host):
    hardware = dataclasses.replace(load_profile("h200"), **host)
    return CostModel(MODEL, hardware, ParallelConfig(pp=pp, memory_gb=141))


def measured_cost(**host):
    hardware = dataclasses.replace(load_profile("h200"), source="measured",
                                   layer_coefficients=FIT, **host)
    return CostModel(MODEL, hardware, ParallelConfig(pp=2, memory_gb=141))


def device_forward(chunk):
    """One layer's forward by eq. 1 with FIT's coefficients, no collectives at sp = tp = 1."""
    q, s = chunk_terms(chunk)
    return 1e-10 * q + 1e-6 * s + 2e-4


def test_without_host_figures_nothing_changes():
    plain, zero = cost(), cost(host_layer_forward_s=0.0, host_action_s=0.0)
    for chunk in (LONG, SHORT):
        assert zero.stage_forward(1, chunk) == plain.stage_forward(1, chunk)
        assert zero.stage_backward(0, chunk) == plain.stage_backward(0, chunk)


def test_on_cuda_a_layer_costs_the_larger_of_host_and_device():
    device = cost()
    host = cost(host_layer_forward_s=1e-3, host_layer_backward_s=2e-3)
    # 16 tokens: host-bound, the host's figure is the layer's time
    assert device.layer_forward(SHORT) < 1e-3
    assert host.layer_forward(SHORT) == 1e-3
    assert host.layer_backward(SHORT) == 2e-3
    # 32768 tokens: device-bound, the host's launches hide under the device's work
    assert device.layer_forward(LONG) > 1e-3 and device.layer_backward(LONG) > 2e-3
    assert host.layer_forward(LONG) == device.layer_forward(LONG)
    assert host.layer_backward(LONG) == device.layer_backward(LONG)


def test_each_action_adds_its_host_time_once():
    plain, host = cost(pp=2), cost(pp=2, host_action_s=5e-3)
    for stage in (0, 1):
        for chunk in (LONG, SHORT):
            assert host.stage_forward(stage, chunk) == \
                pytest.approx(plain.stage_forward(stage, chunk) + 5e-3, rel=1e-12)
            assert host.stage_backward(stage, chunk) == \
                pytest.approx(plain.stage_backward(stage, chunk) + 5e-3, rel=1e-12)
    # a recomputation is priced by its layers only (module doc)
    assert host.stage_time(0, SHORT, checkpointed=2) - plain.stage_time(0, SHORT, 2) == \
        pytest.approx(2 * 5e-3, rel=1e-12)


def test_on_a_cpu_the_host_time_of_a_layer_is_inside_the_measured_fit():
    """A measured synchronous profile: the layer's time is the fit (its beta holds the host's
    per-call work), the action's host time is added; a spec-derived synchronous profile adds
    the layer's host time to the device's (the sum)."""
    measured = measured_cost(host_asynchronous=False, host_layer_forward_s=1e-3,
                             host_layer_backward_s=3e-3, host_action_s=5e-3)
    # 3 layers a stage, no collectives; the ends are the FLOP-derived head's on the last stage
    assert measured.layer_forward(SHORT) == pytest.approx(device_forward(SHORT), rel=1e-12)
    assert measured.stage_forward(0, SHORT) == \
        pytest.approx(3 * device_forward(SHORT) + 5e-3, rel=1e-12)
    spec = cost(host_asynchronous=False, host_layer_forward_s=1e-3, host_layer_backward_s=3e-3)
    plain = cost()
    assert spec.layer_forward(LONG) == pytest.approx(plain.layer_forward(LONG) + 1e-3, rel=1e-12)
    assert spec.layer_backward(SHORT) == \
        pytest.approx(plain.layer_backward(SHORT) + 3e-3, rel=1e-12)


def test_the_loader_reads_and_checks_the_host_figures():
    data = dataclasses.asdict(load_profile("h200"))
    data.update(host_layer_forward_s=2e-4, host_layer_backward_s=4e-4, host_action_s=1e-3,
                host_asynchronous=True)
    data["device_names"] = list(data["device_names"])
    profile = profile_from_dict(data)
    assert (profile.host_layer_forward_s, profile.host_action_s) == (2e-4, 1e-3)
    data["host_action_s"] = -1e-3
    with pytest.raises(ValueError, match="host_action_s must be >= 0"):
        profile_from_dict(data)


def test_shipped_profiles_carry_no_unmeasured_host_time():
    for name in ("a100", "a800", "h100", "h20", "h200"):
        profile = load_profile(name)
        assert (profile.host_layer_forward_s, profile.host_layer_backward_s,
                profile.host_action_s) == (0.0, 0.0, 0.0)
        assert profile.host_asynchronous
        assert "unmeasured" in profile.notes["host_action_s"]


def test_the_refit_takes_the_actions_host_time_off():
    """Stage times = 3 layers of eq. 1 (FIT's coefficients, backward 2x) + the head on the last
    stage + 5 ms of host per action: the refit recovers FIT, not FIT plus the host's share."""
    model = measured_cost(host_action_s=5e-3)
    chunks = [Chunk((Piece(i, 0, 0, s, True),)) for i, s in enumerate((64, 256, 1024, 4096))] \
        + [Chunk((Piece(9, 1, 1024, 2048, True),))]
    seen = []
    for stage in (0, 1):
        times = {unit: (3 * device_forward(c) + model.end_forward(stage, c.tokens) + 5e-3,
                        6 * device_forward(c) + model.end_backward(stage, c.tokens) + 5e-3)
                 for unit, c in enumerate(chunks)}
        seen += observations(stage, chunks, times)
    profile, _ = refit(model, seen)
    fit = profile.layer_coefficients
    assert (fit.alpha1, fit.alpha2, fit.beta) == pytest.approx((1e-10, 1e-6, 2e-4), rel=1e-6)
    assert profile.backward_factor == pytest.approx(2.0, rel=1e-6)
    assert profile.host_action_s == 5e-3

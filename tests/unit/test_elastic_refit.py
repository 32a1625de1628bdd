"""``elastic_pipe.refit``: eq. 1 recovered from measured stage times, collectives and the
pipeline's ends subtracted, too little data refused, and the refitted profile usable by the
cost model."""
import dataclasses
import random

import pytest

from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import EndCoefficients, load_profile
from longctx.models import ModelConfig
from elastic_pipe.refit import Observation, chunk_terms, observations, refit

MODEL = ModelConfig("small", 6, 256, 8, 1024, 1000)
TRUE = dict(alpha1=3e-10, alpha2=2e-6, beta=1.5e-3, backward=1.8)
ENDS = {"embedding_forward": [4e-7, 2e-4], "embedding_backward": [3e-7, 3e-4],
        "head_forward": [9e-7, 5e-4], "head_backward": [1.2e-6, 4e-4],
        "hidden_size": 256, "vocab_size": 1000, "sp": 1, "tp": 1}


def measured(cost: CostModel, chunks, noise=0.0, seed=0) -> list[Observation]:
    """Stage times of ``chunks`` made from ``TRUE`` plus the cost model's collectives and its
    embedding and head times."""
    rng = random.Random(seed)
    seen = []
    for stage in range(cost.pp):
        layers = cost.layers(stage)
        times = {}
        for unit, chunk in enumerate(chunks):
            q, s = chunk_terms(chunk)
            compute = layers * (TRUE["alpha1"] * q + TRUE["alpha2"] * s + TRUE["beta"])
            comm = layers * cost.layer_collectives(chunk)
            jitter = 1 + noise * rng.uniform(-1, 1)
            times[unit] = (jitter * compute + comm + cost.end_forward(stage, s),
                           jitter * TRUE["backward"] * compute + comm + cost.end_backward(stage, s))
        seen.extend(observations(stage, chunks, times))
    return seen


def some_chunks():
    return [Chunk((Piece(0, 0, 0, 2048, False),)), Chunk((Piece(0, 1, 2048, 3072, True),)),
            Chunk((Piece(1, 0, 0, 512, True), Piece(2, 0, 0, 700, True))),
            Chunk((Piece(3, 0, 0, 4096, True),)), Chunk((Piece(4, 0, 0, 1500, True),))]


@pytest.mark.parametrize("sp", [1, 2])
def test_the_coefficients_are_recovered_with_the_collectives_taken_out(sp):
    cost = CostModel(MODEL, load_profile("a800"), ParallelConfig(pp=3, sp=sp, memory_gb=80))
    profile, summary = refit(cost, measured(cost, some_chunks()))
    fit = profile.layer_coefficients
    assert fit.alpha1 == pytest.approx(TRUE["alpha1"], rel=1e-6)
    assert fit.alpha2 == pytest.approx(TRUE["alpha2"], rel=1e-6)
    assert fit.beta == pytest.approx(TRUE["beta"], rel=1e-6)
    assert profile.backward_factor == pytest.approx(TRUE["backward"], rel=1e-6)
    assert (fit.hidden_size, fit.sp, fit.tp) == (256, sp, 1)
    assert profile.source == "measured" and "refit from 15 measured chunks" in summary
    refitted = CostModel(MODEL, profile, cost.parallel)
    chunk = some_chunks()[1]
    q, s = chunk_terms(chunk)
    assert refitted.layer_compute(chunk) == pytest.approx(
        TRUE["alpha1"] * q + TRUE["alpha2"] * s + TRUE["beta"], rel=1e-6)
    assert refitted.layer_collectives(chunk) == cost.layer_collectives(chunk)


def test_noisy_times_give_a_close_fit_and_report_the_error():
    cost = CostModel(MODEL, load_profile("a800"), ParallelConfig(pp=2, sp=1, memory_gb=80))
    chunks = some_chunks() * 4
    profile, summary = refit(cost, measured(cost, chunks, noise=0.03, seed=4))
    refitted = CostModel(MODEL, profile, cost.parallel)
    for chunk in some_chunks():
        q, s = chunk_terms(chunk)
        truth = TRUE["alpha1"] * q + TRUE["alpha2"] * s + TRUE["beta"]
        assert refitted.layer_compute(chunk) == pytest.approx(truth, rel=0.05)
    assert "fit relative error max" in summary


@pytest.mark.parametrize("pp", [1, 4])
def test_too_few_shapes_keep_the_profile(pp):
    """Three chunk shapes are too few however many stages measured them."""
    cost = CostModel(MODEL, load_profile("a800"), ParallelConfig(pp=pp, sp=1, memory_gb=80))
    profile, summary = refit(cost, measured(cost, some_chunks()[:3]))
    assert profile is None
    assert summary == "refit skipped: 3 distinct chunk shapes measured, 4 needed"


def test_two_stages_with_measured_ends_recover_the_layer():
    """With two stages each stage is an end: the ends' measured times are taken out, not
    fitted (a per-token end term would be collinear with alpha2)."""
    profile = dataclasses.replace(load_profile("a800"), source="measured",
                                  end_coefficients=EndCoefficients(**ENDS))
    cost = CostModel(MODEL, profile, ParallelConfig(pp=2, sp=1, memory_gb=80))
    assert cost.end_forward(0, 1000) == pytest.approx(4e-7 * 1000 + 2e-4)
    refitted, _ = refit(cost, measured(cost, some_chunks()))
    fit = refitted.layer_coefficients
    assert (fit.alpha1, fit.alpha2, fit.beta) == pytest.approx(
        (TRUE["alpha1"], TRUE["alpha2"], TRUE["beta"]), rel=1e-6)
    assert refitted.backward_factor == pytest.approx(TRUE["backward"], rel=1e-6)
    assert refitted.end_coefficients == profile.end_coefficients


def test_executor_events_become_one_observation_per_chunk():
    """The runtime's recorder sums each chunk's forward and backward events on this stage;
    transfers and recomputation are left out."""
    from types import SimpleNamespace

    from elastic_pipe.run_costs import Measured
    from megatron.plugin.pipeline.ir import parse
    from megatron.plugin.pipeline.chrome_trace import TraceEvent

    chunks = some_chunks()[:2]
    names = ["1RECV_F0<0", "1F0", "1SEND_B0>0", "1RECV_F1<0", "1F1", "1R1", "1B1", "1B0"]
    planned = SimpleNamespace(schedule=[[], [parse(n) for n in names]],
                              plan=SimpleNamespace(chunks=lambda: chunks))
    durations = {"1RECV_F0<0": 9.0, "1F0": 1.0, "1SEND_B0>0": 9.0, "1RECV_F1<0": 9.0,
                 "1F1": 2.0, "1R1": 9.0, "1B1": 4.0, "1B0": 3.0}
    events = [TraceEvent(1, name, float(i), seconds,
                         "comm" if "SEND" in name or "RECV" in name else "compute")
              for i, (name, seconds) in enumerate(durations.items())]
    measured = Measured()
    measured.record(planned, 1, events)
    assert [(o.stage, o.quadratic, o.tokens, o.forward_s, o.backward_s)
            for o in measured.seen] == [(1, *chunk_terms(chunks[0]), 1.0, 3.0),
                                        (1, *chunk_terms(chunks[1]), 2.0, 4.0)]
    assert measured.due(1) and not measured.due(2)

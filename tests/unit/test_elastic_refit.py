"""``elastic_pipe.refit``: eq. 1 recovered from measured stage times, collectives and the
pipeline's ends subtracted, too little data refused, fits that fail the acceptance bounds
rejected (the profile kept, the reason logged, no exception), and the refitted profile usable
by the cost model."""
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


def a_cost(pp=2):
    return CostModel(MODEL, load_profile("a800"), ParallelConfig(pp=pp, sp=1, memory_gb=80))


def every_time(seen, forward, backward):
    return [dataclasses.replace(o, forward_s=forward(o), backward_s=backward(o)) for o in seen]


def random_times(seed):
    rng = random.Random(seed)
    return lambda o: rng.uniform(1e-3, 1e-1)


@pytest.mark.parametrize("times,reason", [
    (lambda: (lambda o: 0.05, lambda o: 0.1), "the measured forwards do not grow with the chunks"),
    (lambda: (random_times(0), random_times(1)), "mean relative error 0.860 above 0.3"),
    (lambda: (lambda o: 0.0, lambda o: 0.0), "refit skipped: 0 distinct chunk shapes"),
    (lambda: (lambda o: 1e-7, lambda o: 1e-7), "are no longer than the collectives"),
], ids=["equal", "noise", "zero", "below-the-collectives"])
def test_a_degenerate_fit_keeps_the_profile_and_says_why(times, reason):
    """Times that cannot price a chunk (all equal, unrelated to the chunk, zero, or shorter
    than what the cost model takes out of them) give no profile and a reason, no exception."""
    cost = a_cost()
    profile, summary = refit(cost, every_time(measured(cost, some_chunks() * 4), *times()))
    assert profile is None
    assert reason in summary
    assert summary.startswith(("refit rejected, profile kept: ", "refit skipped: "))


def test_a_wild_backward_factor_is_rejected():
    cost = a_cost()
    seen = measured(cost, some_chunks() * 4)
    good, _ = refit(cost, seen)
    assert good.backward_factor == pytest.approx(TRUE["backward"], rel=1e-6)
    wild = every_time(seen, lambda o: o.forward_s, lambda o: 40 * o.backward_s)
    profile, summary = refit(cost, wild)
    assert profile is None
    assert "backward factor 72 outside [0.5, 6.0]" in summary


def test_a_shape_priced_far_off_is_rejected_and_one_stalled_action_is_not():
    """Every measurement of one chunk shape three times the fit's price: rejected, though the
    mean error passes; one action of a shape measured several times stalled ten times over:
    accepted (the shape's median is priced well), the single error reported."""
    cost = a_cost()
    seen = measured(cost, some_chunks() * 4)
    slow = chunk_terms(some_chunks()[3])
    off = every_time(seen, lambda o: o.forward_s * (3 if (o.quadratic, o.tokens) == slow else 1),
                     lambda o: o.backward_s)
    profile, summary = refit(cost, off)
    assert profile is None
    assert "chunks of 4096 tokens priced at 0.46 times their measured forwards" in summary
    assert "mean 0.187" in summary
    stalled = list(seen)
    stalled[0] = dataclasses.replace(stalled[0], forward_s=10 * stalled[0].forward_s)
    profile, summary = refit(cost, stalled)
    assert profile is not None, summary
    assert "fit relative error max 0.900" in summary


def test_a_noisy_fit_is_accepted_within_the_mean_error_bound_and_rejected_beyond():
    cost = a_cost()
    chunks = some_chunks() * 4
    profile, summary = refit(cost, measured(cost, chunks, noise=0.5, seed=1))
    assert profile is not None, summary
    profile, summary = refit(cost, measured(cost, chunks, noise=0.8, seed=1))
    assert profile is None
    assert "mean relative error 0.534 above 0.3" in summary


def test_the_refit_collective_keeps_the_profile_and_logs_once(tmp_path, monkeypatch, caplog):
    """``refit_cost_model`` with observations that fit nothing: no exception, the job's cost
    model not replaced, one warning with the reason, and the refit counted as tried (``auto``
    tries again at the next window, tests/unit/test_unit_fixed_cost.py)."""
    import torch.distributed as dist

    from elastic_pipe import run_costs

    cost = a_cost()
    measured_now = run_costs.Measured()
    measured_now.record_observations(every_time(measured(cost, some_chunks()),
                                                lambda o: 0.05, lambda o: 0.1))
    replaced = []
    monkeypatch.setattr(run_costs, "MEASURED", measured_now)
    monkeypatch.setattr(run_costs, "elastic_cost_model", lambda args, model: cost)
    monkeypatch.setattr(run_costs, "replace_job_cost_model", lambda *a: replaced.append(a))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        with caplog.at_level("INFO", logger="elastic_pipe.refit"):
            summary = run_costs.refit_cost_model("elastic", None, None)
    finally:
        dist.destroy_process_group()
    assert "do not grow with the chunks" in summary
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"elastic: {summary}")]
    assert replaced == []
    assert (measured_now.attempts, measured_now.fitted, measured_now.seen) == (1, False, [])

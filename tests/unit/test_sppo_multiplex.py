"""Multiplexed partitioning: Left-SP / Steady / Right-SP schedule is valid and fills bubbles."""
import pytest

from megatron.plugin.pipeline.ir import Kind
from megatron.plugin.pipeline.simulator import simulate

from longctx.hardware import load_profile
from longctx.models import get_model

from sppo_offload.multiplex import (MultiplexCosts, compare, min_tokens, multiplexed_schedule,
                                   pieces, share_bounds)
from sppo_offload.solver import SPPO, SolverConfig, solve


@pytest.mark.parametrize("pp,n", [(p, n) for p in (2, 3, 4) for n in (4, 6, 8)])
def test_schedule_is_valid_and_shares_sit_on_idle_stages(pp, n):
    schedule = multiplexed_schedule(pp, n, lambda a: a.part is None and a.unit < n - 1)
    simulate(schedule)
    for stage, row in enumerate(schedule):
        shares = [a.part for a in row if a.kind is Kind.FORWARD and a.part]
        # stage h helps every block k <= h in warm-up and backs each of them in cool-down
        assert shares == [f".mux{k}" for k in range(stage + 1)]
        backs = [a.part for a in row if a.kind is Kind.BACKWARD and a.part]
        assert backs == [f".mux{k}" for k in range(stage, -1, -1)]
        steady = [(a.kind, a.unit) for a in row if a.is_compute() and a.part is None]
        assert steady == [(Kind.FORWARD, j) for j in range(1, n)] + \
            [(Kind.BACKWARD, j) for j in range(n - 1, 0, -1)]


def test_needs_a_pipeline():
    with pytest.raises(ValueError, match="pp >= 2"):
        multiplexed_schedule(1, 4)


@pytest.mark.parametrize("n,memory_gb", [(8, 120), (16, 80)])
def test_multiplexing_shortens_the_simulated_iteration(n, memory_gb):
    model, hardware = get_model("gpt-7b"), load_profile("a100")
    plan = solve(SPPO, 524288, model, hardware,
                 SolverConfig(gpus=16, memory_gb=memory_gb, subsequences=n, layout=(8, 2)))
    assert plan.layout.pp == 2
    plain, multiplexed = compare(plan)
    assert plain.iteration_time == pytest.approx(plan.iteration_time_s)
    assert multiplexed.iteration_time < plain.iteration_time
    assert multiplexed.bubble_ratio < plain.bubble_ratio
    # the helpers pay for borrowing the weights: a share costs more than its slice of work
    costs = MultiplexCosts(plan.costs.cost, plan.lengths, plan.alphas,
                           hardware.host_gbps_per_gpu)
    pp = plan.layout.pp
    share = next(a for a in multiplexed_schedule(pp, n)[pp - 1]
                 if a.kind is Kind.FORWARD and a.part == ".mux0")
    assert costs.duration(share) > plan.costs.cost.stage_forward(0, costs.chunks[0]) / pp


@pytest.mark.parametrize("pp,tokens", [(2, 2), (2, 17), (3, 6), (4, 12), (4, 37), (5, 101)])
def test_pieces_reshard_between_neighbours_and_cover_every_token(pp, tokens):
    assert tokens >= min_tokens(pp)
    for block in range(pp - 1):
        found = pieces(tokens, pp, block)
        # in token order, covering u0 exactly once, each a non-empty overlap
        assert [(start, stop) for *_, start, stop in found] == \
            list(zip([0] + [stop for *_, stop in found[:-1]], [stop for *_, stop in found]))
        assert found[-1][3] == tokens and all(start < stop for *_, start, stop in found)
        new = dict(zip(range(block + 1, pp), share_bounds(tokens, pp, block + 1)))
        for source, target, start, stop in found:
            assert target in (source, source + 1)  # what the IR's transfers assume
            assert new[target][0] <= start < stop <= new[target][1]
        sent = {(s, t) for s, t, *_ in found if s != t}
        assert sent == {(s, s + 1) for s in range(block, pp - 1)}

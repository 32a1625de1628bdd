"""The CPU twin of Megatron's RNG tracker: named states are CPU generator states, seeded by
Megatron's own ``model_parallel_cuda_manual_seed``, so a fork draws a rank's own stream."""
import pytest
import torch
from megatron.core.tensor_parallel import random as tp_random

from megatron.plugin import cpu_compat

SEED = 1234


@pytest.fixture
def tracker():
    installed = cpu_compat.install(force=True)
    tp_random.get_cuda_rng_tracker().reset()
    yield tp_random.get_cuda_rng_tracker()
    tp_random.get_cuda_rng_tracker().reset()
    if installed:
        cpu_compat.uninstall()


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_fork_draws_the_tensor_parallel_ranks_seeded_stream(tracker, tp_rank):
    torch.manual_seed(SEED)
    tp_random.model_parallel_cuda_manual_seed(SEED, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(5)
    with tracker.fork():
        second = torch.rand(5)
    # Megatron's model-parallel seed (seed + 2718 + tp_rank); the stream continues across forks.
    expected = torch.rand(10, generator=torch.Generator().manual_seed(SEED + 2718 + tp_rank))
    torch.testing.assert_close(torch.cat([first, second]), expected, rtol=0, atol=0)
    # The default generator is where the block found it.
    assert torch.equal(torch.get_rng_state(), before)


def test_nested_forks_continue_the_outer_stream(tracker):
    tp_random.model_parallel_cuda_manual_seed(SEED, tp_rank=0, ep_rank=0, etp_rank=0)
    with tracker.fork():
        a = torch.rand(3)
        with tracker.fork(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME):
            torch.rand(7)
        b = torch.rand(3)
    expected = torch.rand(6, generator=torch.Generator().manual_seed(SEED + 2718))
    torch.testing.assert_close(torch.cat([a, b]), expected, rtol=0, atol=0)


def test_recomputation_replays_a_fork_from_the_saved_states(tracker):
    """Activation checkpointing saves the tracker's states and restores them to recompute:
    the replayed fork draws the same numbers."""
    tp_random.model_parallel_cuda_manual_seed(SEED, tp_rank=1, ep_rank=0, etp_rank=0)
    saved = tracker.get_states()
    with tracker.fork():
        drawn = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        replayed = torch.rand(4)
    assert torch.equal(drawn, replayed)


def test_a_state_never_added_is_refused_as_on_cuda(tracker):
    with pytest.raises(Exception, match="model-parallel-rng is not added"):
        with tracker.fork():
            pass

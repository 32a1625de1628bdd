"""Fixtures shared by unit tests that build Megatron's own layers."""
import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """Megatron's process groups on one CPU rank, with the CPU compatibility layer (the
    router moves its weights to the current device, the layers fork the RNG tracker)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    from megatron.plugin import cpu_compat

    installed = cpu_compat.install(force=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel()
    tp_random.model_parallel_cuda_manual_seed(1234)
    yield
    tp_random.get_cuda_rng_tracker().reset()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if installed:
        cpu_compat.uninstall()

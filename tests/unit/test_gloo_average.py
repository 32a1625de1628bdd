"""NCCL's ``ReduceOp.AVG`` on gloo (``megatron.plugin.cpu_compat``): Megatron's DDP buffer module
averages with the all-reduce and reduce-scatter it calls, synchronously, asynchronously and in
its coalescing managers, on two gloo ranks, equal to the sum over the ranks divided by two in
each dtype."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
DTYPES = (torch.float32, torch.bfloat16)


def rank_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s 8 values (each rank builds every rank's, for the reference)."""
    return torch.randn(8, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def expected_average(dtype: torch.dtype) -> torch.Tensor:
    total = rank_input(0, dtype)
    for rank in range(1, WORLD):
        total = total + rank_input(rank, dtype)
    return total / WORLD


def check_rank(rank: int, rendezvous: str) -> None:
    from torch.distributed import _coalescing_manager

    from megatron.plugin import cpu_compat

    cpu_compat.install(force=True)
    from megatron.core.distributed import param_and_grad_buffer as buffers

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=WORLD)
    avg = dist.ReduceOp.AVG
    try:
        for dtype in DTYPES:
            expected = expected_average(dtype)
            shard = expected.chunk(WORLD)[rank]
            for async_op in (False, True):
                tensor = rank_input(rank, dtype)
                handle = buffers.torch.distributed.all_reduce(tensor, op=avg, async_op=async_op)
                if async_op:
                    handle.wait()
                torch.testing.assert_close(tensor, expected, rtol=0, atol=0)

                source, output = rank_input(rank, dtype), torch.empty_like(shard)
                handle = buffers.dist_reduce_scatter_func(output, source, op=avg,
                                                          async_op=async_op)
                if async_op:
                    handle.wait()
                torch.testing.assert_close(output, shard, rtol=0, atol=0)
                torch.testing.assert_close(source, rank_input(rank, dtype), rtol=0, atol=0)

                # Megatron's buckets: a coalesced group of collectives, one handle for all.
                first, second = rank_input(rank, dtype), 2 * rank_input(rank, dtype)
                with _coalescing_manager(None, async_ops=async_op) as manager:
                    for tensor in (first, second):
                        buffers.torch.distributed.all_reduce(tensor, op=avg, async_op=async_op)
                if async_op:
                    manager.wait()
                torch.testing.assert_close(first, expected, rtol=0, atol=0)
                torch.testing.assert_close(second, 2 * expected, rtol=0, atol=0)

                outputs = [torch.empty_like(shard), torch.empty_like(shard)]
                with _coalescing_manager(None, async_ops=async_op) as manager:
                    for output, scale in zip(outputs, (1, 2)):
                        buffers.dist_reduce_scatter_func(output, scale * rank_input(rank, dtype),
                                                         op=avg, async_op=async_op)
                if async_op:
                    manager.wait()
                torch.testing.assert_close(outputs[0], shard, rtol=0, atol=0)
                torch.testing.assert_close(outputs[1], 2 * shard, rtol=0, atol=0)

            # SUM is torch's own.
            tensor = rank_input(rank, dtype)
            buffers.torch.distributed.all_reduce(tensor)
            torch.testing.assert_close(tensor, expected * WORLD, rtol=0, atol=0)
        hits = cpu_compat.HITS["megatron.core.distributed.param_and_grad_buffer"]
        # per dtype and mode: 1 + 2 coalesced all-reduces, 1 + 2 reduce-scatters.
        assert hits["all_reduce.AVG"] == hits["reduce_scatter_tensor.AVG"] == 3 * 2 * len(DTYPES)
    finally:
        dist.destroy_process_group()
        cpu_compat.uninstall()


@pytest.mark.timeout(120)
def test_average_on_gloo_is_the_sum_over_the_ranks_divided(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(check_rank, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD)

"""``--grad-reduce-in-bf16`` with ``--bf16``: Megatron's DDP keeps each parameter's gradient
buffer (``main_grad``), the sum of the micro-batches' gradients and the data-parallel reduction
in bf16 instead of fp32 (``validate_args`` turns ``accumulate_allreduce_grads_in_fp32`` off,
``get_megatron_ddp_config`` passes it as ``grad_reduce_in_fp32``). Megatron's 1F1B accumulates a
step's micro-batches with gradient sync off for all but the last (``no_sync``), as here.

``--bf16`` is refused at start-up without CUDA (megatron-core's mixed-precision optimizer wraps
CUDA tensors only), so the flags are parsed as on a CUDA machine; Megatron's DDP and its bf16
buffers themselves run on the CPU."""
import pytest
import torch

from harness import TINY_MODEL
from megatron.plugin import arguments, model

#: Micro-batches whose gradients differ in scale: later ones round away in a bf16 sum.
SCALES = (1.0, 3e-3, 1e-3)


def _parsed(monkeypatch, *flags):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with monkeypatch.context() as cuda:
        cuda.setattr("torch.cuda.is_available", lambda: True)
        return arguments.parse([*TINY_MODEL, "--pipeline-model-parallel-size", "1",
                                "--pipeline-schedule", "1f1b", "--bf16", *flags])


def _ddp_config(args):
    """Megatron-LM's DDP config from ``args``: ``get_megatron_ddp_config`` (megatron-core 0.18
    on); megatron-core 0.17 builds it inside ``get_model`` the same way (the fields ``args``
    has, ``grad_reduce_in_fp32`` from ``accumulate_allreduce_grads_in_fp32``)."""
    try:
        from megatron.training.training import get_megatron_ddp_config
    except ImportError:
        import dataclasses

        from megatron.core.distributed import DistributedDataParallelConfig

        fields = {f.name: getattr(args, f.name)
                  for f in dataclasses.fields(DistributedDataParallelConfig)
                  if hasattr(args, f.name)}
        return DistributedDataParallelConfig(
            **{**fields, "grad_reduce_in_fp32": args.accumulate_allreduce_grads_in_fp32})
    return get_megatron_ddp_config(args)


def _step(args, inputs):
    """``main_grad`` of a bf16 linear under Megatron's DDP from ``args`` after one step over
    ``inputs`` (gradient sync off but for the last), and each backward's gradient of it."""
    from megatron.core.distributed import DistributedDataParallel

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    ddp = DistributedDataParallel(model.model_config(args), _ddp_config(args),
                                  linear)
    each = []
    ddp.module.weight.register_hook(lambda grad: each.append(grad.clone()))
    with ddp.no_sync():
        for x in inputs[:-1]:
            ddp(x).sum().backward()
    ddp(inputs[-1]).sum().backward()
    ddp.finish_grad_sync()
    assert len(each) == len(inputs)
    return ddp.module.weight.main_grad, each


def _sum(grads, dtype):
    """The gradients added one after another into a buffer of ``dtype``, as DDP's hook does."""
    total = torch.zeros_like(grads[0], dtype=dtype)
    for grad in grads:
        total.add_(grad)
    return total


def test_grad_reduce_in_bf16_sums_the_micro_batches_in_bf16(one_rank, monkeypatch):
    torch.manual_seed(1)
    inputs = [torch.randn(5, 16, dtype=torch.bfloat16) * scale for scale in SCALES]
    in_bf16, each = _step(_parsed(monkeypatch, "--grad-reduce-in-bf16"), inputs)
    in_fp32, each_fp32 = _step(_parsed(monkeypatch), inputs)
    assert all(map(torch.equal, each, each_fp32))  # the same gradients, summed two ways
    # Megatron's meaning: the bf16 buffer, summed in bf16 (and fp32 without the flag).
    assert in_bf16.dtype == torch.bfloat16 and in_fp32.dtype == torch.float32
    torch.testing.assert_close(in_bf16, _sum(each, torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(in_fp32, _sum(each_fp32, torch.float32), rtol=0, atol=0)
    # The option changes the numbers: the small micro-batches' gradients round away in bf16.
    assert not torch.equal(in_bf16.float(), in_fp32), "the bf16 sum equals the fp32 one"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))

"""Megatron's fused weight-gradient accumulation where the project runs its linears on other
tensors than the parameters: under the project's saved-tensor hooks a fused linear hands
Megatron's DDP no gradient (its weight comes back from autograd as a new object, without the
attribute that says the gradient is in ``main_grad``), and on SPPO's multiplexing helpers' borrowed
weight copies it has no ``main_grad`` to add into. So the model config turns the fusion off
under ``--overlap-grad-reduce`` (whose DDP hook asserts a gradient) and ``--sppo-multiplex``
(:func:`megatron.plugin.model.model_config`). Apex's CUDA kernel is replaced by the same sum on
the CPU."""
import types

import pytest
import torch
from megatron.core.tensor_parallel import layers

from harness import TINY_MODEL
from megatron.plugin import arguments, model
from megatron.plugin.layers.memory import SavedTensorMeter


def _accumulate(x, grad_output, main_grad):
    main_grad.add_(grad_output.reshape(-1, grad_output.shape[-1]).t()
                   @ x.reshape(-1, x.shape[-1]))


@pytest.fixture
def apex_kernel(monkeypatch):
    kernel = types.SimpleNamespace(wgrad_gemm_accum_fp32=_accumulate)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", kernel, raising=False)


def _fused_linear(x, weight):
    return layers.linear_with_grad_accumulation_and_async_allreduce(
        x * 1, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
        sequence_parallel=False)


def test_a_fused_linear_under_the_meter_adds_into_main_grad_and_returns_no_gradient(
        apex_kernel):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    weight.main_grad = torch.zeros(4, 3)
    weight.grad_added_to_main_grad = False  # what Megatron's DDP sets on every parameter
    x = torch.randn(2, 1, 3, requires_grad=True)
    with SavedTensorMeter().active():
        y = _fused_linear(x, weight)
    y.sum().backward()
    expected = torch.ones(2, 4).t() @ x.detach().reshape(2, 3)
    torch.testing.assert_close(weight.main_grad, expected)
    assert weight.grad is None
    assert weight.grad_added_to_main_grad is False


def test_a_fused_linear_on_a_borrowed_weight_copy_fails_in_its_backward(apex_kernel):
    torch.manual_seed(0)
    borrowed = torch.randn(4, 3).requires_grad_(True)  # a helper's copy: no main_grad
    y = _fused_linear(torch.randn(2, 1, 3, requires_grad=True), borrowed)
    with pytest.raises(AttributeError):
        y.sum().backward()


@pytest.mark.parametrize("flags,fused", [(["--overlap-grad-reduce"], False),
                                         (["--sppo-multiplex"], False), ([], True)])
def test_the_overlapped_reduction_and_multiplexing_unfuse_the_accumulation(flags, fused,
                                                                           monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = arguments.parse([*TINY_MODEL, "--pipeline-model-parallel-size", "2",
                            "--pipeline-schedule", "sppo", *flags])
    args.gradient_accumulation_fusion = True  # Megatron-LM's default where apex's kernel is
    assert model.model_config(args).gradient_accumulation_fusion is fused

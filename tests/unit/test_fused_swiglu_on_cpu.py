"""Megatron's fused SwiGLU on the CPU (``megatron.plugin.cpu_compat``): run as written, with no
``torch.compile``, and with the gradients of Megatron's unfused SwiGLU."""
import copy

import torch
import torch._dynamo.utils
import torch.nn.functional as F

from megatron.plugin import cpu_compat

MODULE = "megatron.core.fusions.fused_bias_swiglu"


def _mlp(fused: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               ffn_hidden_size=24, gated_linear_unit=True,
                               activation_func=F.silu, bias_activation_fusion=fused,
                               add_bias_linear=True, params_dtype=torch.float64,
                               use_cpu_initialization=True)
    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                     linear_fc2=RowParallelLinear))


def test_the_fused_swiglu_runs_uncompiled_with_the_unfused_gradients(one_rank):
    """Megatron's MLP with its fused bias-SwiGLU (``--swiglu``'s default) compiles nothing on
    the CPU (torch.compile's frame counter stays put; without the layer's eager rebinding the
    first call compiles the forward and the backward) and goes through the fused functions;
    its output and gradients equal Megatron's unfused SwiGLU's with the same weights
    (float64)."""
    torch.manual_seed(0)
    fused = _mlp(fused=True)
    unfused = _mlp(fused=False)
    unfused.load_state_dict(copy.deepcopy(fused.state_dict()))
    hidden = torch.randn(5, 3, 16, dtype=torch.float64)
    frames = sum(torch._dynamo.utils.counters["frames"].values())
    calls = dict(cpu_compat.HITS[MODULE])

    outputs = []
    for mlp in (fused, unfused):
        x = hidden.clone().requires_grad_()
        out, bias = mlp(x)
        (out + bias).pow(2).sum().backward()
        outputs.append((out, x.grad, [p.grad for p in mlp.parameters()]))

    assert sum(torch._dynamo.utils.counters["frames"].values()) == frames
    hits = cpu_compat.HITS[MODULE]
    assert hits["eager bias_swiglu"] > calls.get("eager bias_swiglu", 0)
    assert hits["eager bias_swiglu_back"] > calls.get("eager bias_swiglu_back", 0)
    (out, grad, params), (ref_out, ref_grad, ref_params) = outputs
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(grad, ref_grad)
    assert all(p.abs().sum() > 0 for p in ref_params)
    torch.testing.assert_close(params, ref_params)


def test_uninstall_gives_megatron_back_its_compiled_functions():
    from megatron.core.fusions import fused_bias_swiglu

    installed = cpu_compat.install(force=True)
    assert not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")
    if installed:
        cpu_compat.uninstall()
        assert hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")

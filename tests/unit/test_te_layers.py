"""``--transformer-impl transformer_engine``: the layer spec it chooses (Megatron's TE GPT layer
with the document attention as core attention; read from the spec's module classes, nothing
instantiated, as Transformer Engine is not installed here), its checkpoint names against
Megatron-LM's TE layers, and its start-up refusals."""
import argparse
import dataclasses
import functools

import pytest
from megatron.core.extensions import transformer_engine as te_extension
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from harness import TINY_MODEL
from megatron.plugin import arguments, model
from megatron.plugin.layers import te_layers
from megatron.plugin.layers.attention import DocumentAttention, RopeSettings


@pytest.fixture
def te_importable(monkeypatch):
    """Megatron's TE spec as on a machine with Transformer Engine: megatron-core leaves its
    ``TESpecProvider`` unset when ``transformer_engine`` does not import."""
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", TESpecProvider)


def modules(spec, prefix=""):
    """``path -> module`` of every submodule a layer spec names (a class, or a builder; without
    Transformer Engine megatron-core's TE classes are stand-ins, compared by identity)."""
    if isinstance(spec, ModuleSpec):
        found = {prefix.rstrip("."): spec.module} if prefix else {}
        return {**found, **(modules(spec.submodules, prefix) if spec.submodules else {})}
    if isinstance(spec, functools.partial):  # megatron-core 0.19's MLP builder
        found = {prefix.rstrip("."): spec.func}
        return {**found, **modules(spec.keywords.get("submodules"), prefix)}
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        found = {}
        for field in dataclasses.fields(spec):
            found.update(modules(getattr(spec, field.name), f"{prefix}{field.name}."))
        return found
    return {prefix.rstrip("."): spec} if callable(spec) else {}


def test_the_te_spec_is_megatrons_with_the_document_attention(te_importable):
    rope = RopeSettings(rotary_base=10000, rotary_percent=1.0)
    block = te_layers.document_te_layer_spec(3, rope)
    assert len(block.layer_specs) == 3 and block.layer_norm is te_extension.TENorm
    ours = modules(block.layer_specs[0])
    megatrons = modules(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec())
    attention = "self_attention.core_attention"
    assert megatrons[attention] is te_extension.TEDotProductAttention
    assert ours[attention] is DocumentAttention
    core = block.layer_specs[0].submodules.self_attention.submodules.core_attention
    assert core.params == {"rope": rope}
    assert {path: cls for path, cls in ours.items() if path != attention} == {
        path: cls for path, cls in megatrons.items() if path != attention}
    # TE's fused layers stay: the norms live inside the QKV and first MLP projections.
    assert ours["self_attention.linear_qkv"] is te_extension.TELayerNormColumnParallelLinear
    assert ours["mlp.linear_fc1"] is te_extension.TELayerNormColumnParallelLinear
    assert ours["self_attention.linear_proj"] is te_extension.TERowParallelLinear
    assert ours["mlp.linear_fc2"] is te_extension.TERowParallelLinear
    assert ours.get("input_layernorm", IdentityOp) is IdentityOp
    assert ours.get("pre_mlp_layernorm", IdentityOp) is IdentityOp


def test_the_model_takes_the_spec_of_transformer_impl(te_importable):
    def spec(impl):
        args = argparse.Namespace(transformer_impl=impl, normalization="LayerNorm",
                                  qk_layernorm=False, num_experts=None)
        return model.layer_spec(args, 2, None).layer_specs[0]

    te = modules(spec("transformer_engine"))
    local = modules(spec("local"))
    assert te["self_attention.linear_qkv"] is te_extension.TELayerNormColumnParallelLinear
    assert te["self_attention.core_attention"] is DocumentAttention
    assert local["self_attention.core_attention"] is DocumentAttention
    assert local["self_attention.linear_qkv"] is not te["self_attention.linear_qkv"]


def test_qk_layernorm_builds_the_te_layers_q_and_k_norms(te_importable):
    """``--qk-layernorm`` under TE: the Q and K norms of Megatron's TE spec built with it (the
    self-attention applies them before the core attention, which stays the document one)."""
    args = argparse.Namespace(transformer_impl="transformer_engine", normalization="RMSNorm",
                              qk_layernorm=True, num_experts=None)
    ours = modules(model.layer_spec(args, 1, None).layer_specs[0])
    megatrons = modules(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        qk_layernorm=True))
    for norm in ("self_attention.q_layernorm", "self_attention.k_layernorm"):
        assert ours[norm] is megatrons[norm] and ours[norm] is not IdentityOp, norm
    assert ours["self_attention.core_attention"] is DocumentAttention


def test_moe_layers_with_te_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(te_layers, "missing", lambda: None)
    argv = [*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "elastic",
            "--transformer-impl", "transformer_engine", "--num-experts", "4",
            "--disable-bias-linear"]
    with pytest.raises(arguments.Refusals, match="--num-experts with --transformer-impl "
                                                 "transformer_engine.*pass --transformer-impl "
                                                 "local with MoE layers"):
        arguments.check_command_line(argv)


def test_local_checkpoints_use_the_te_layers_parameter_names(te_importable):
    """Megatron's local layer saves its separate norms under the names of the TE layer's fused
    ones (its ``sharded_state_dict_keys_map``): each target is a TE submodule holding a norm,
    and every other parameter-holding submodule has the same path in both specs."""
    local_spec = gpt_layer_specs.get_gpt_layer_local_spec()
    te = modules(te_layers.document_te_layer_spec(1).layer_specs[0])
    local = modules(local_spec)
    renamed = local_spec.submodules.sharded_state_dict_keys_map
    assert set(renamed) == {"input_layernorm.", "pre_mlp_layernorm."}
    for target in renamed.values():
        owner = target.rsplit(".", 1)[0]
        assert te[owner] is te_extension.TELayerNormColumnParallelLinear, target
    with_parameters = {"self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2"}
    assert with_parameters <= set(local) and with_parameters <= set(te)


def test_te_is_refused_on_cpu_naming_what_is_missing(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "elastic",
            "--transformer-impl", "transformer_engine"]
    monkeypatch.setattr(te_layers, "missing", lambda: "CUDA and the transformer_engine package")
    with pytest.raises(arguments.Refusals, match="needs CUDA and the transformer_engine "
                                                 "package, which this machine lacks"):
        arguments.check_command_line(argv)
    monkeypatch.setattr(te_layers, "missing", lambda: None)
    arguments.check_command_line(argv)
    helix = [*argv[:-4], "--pipeline-schedule", "helix", "--transformer-impl", "transformer_engine"]
    with pytest.raises(arguments.Refusals, match="fuses the input norm into the QKV projection"):
        arguments.check_command_line(helix)


def test_te_under_sppo_is_refused_only_with_multiplexing(monkeypatch):
    """Plain sppo (subsequences, offloading) takes TE layers where CUDA and TE are present;
    ``--sppo-multiplex`` is refused with them by name, in the same start-up as the refusal of
    a machine without CUDA."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "sppo",
            "--sppo-subsequences", "2", "--sppo-offload", "1",
            "--transformer-impl", "transformer_engine"]
    monkeypatch.setattr(te_layers, "missing", lambda: None)
    assert arguments.check_command_line(argv).transformer_impl == "transformer_engine"
    with pytest.raises(arguments.Refusals) as refused:
        arguments.check_command_line([*argv, "--sppo-multiplex"])
    assert len(refused.value.messages) == 1
    assert refused.value.messages[0].startswith(
        "--sppo-multiplex with --transformer-impl transformer_engine")
    assert "Drop --sppo-multiplex" in refused.value.messages[0]
    assert "pass --transformer-impl local" in refused.value.messages[0]
    monkeypatch.setattr(te_layers, "missing", lambda: "CUDA")
    with pytest.raises(arguments.Refusals) as refused:
        arguments.check_command_line([*argv, "--sppo-multiplex"])
    assert sorted(message.split(":")[0] for message in refused.value.messages) == [
        "--sppo-multiplex with --transformer-impl transformer_engine",
        "--transformer-impl transformer_engine needs CUDA, which this machine lacks"]
    with pytest.raises(arguments.Refusals, match="needs CUDA, which this machine lacks"):
        arguments.check_command_line(argv)


@pytest.mark.parametrize("impl,disabled", [("transformer_engine", True), ("local", False)])
def test_te_layers_are_told_no_first_micro_batch(impl, disabled, monkeypatch):
    """Under TE the config turns off the first-micro-batch hint (``is_first_microbatch``): with
    it, TE's first backward of a run would overwrite ``main_grad``, and sppo runs that forward's
    backward last (:func:`megatron.plugin.model.model_config`). The local layers do not read
    the field."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(te_layers, "missing", lambda: None)
    args = arguments.parse([*TINY_MODEL, "--pipeline-model-parallel-size", "2",
                            "--pipeline-schedule", "sppo", "--transformer-impl", impl])
    assert model.model_config(args).disable_parameter_transpose_cache is disabled


def test_missing_names_cuda_and_the_package(monkeypatch):
    monkeypatch.setattr(te_extension, "HAVE_TE", False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert te_layers.missing() == "CUDA and the transformer_engine package"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert te_layers.missing() == "the transformer_engine package"
    monkeypatch.setattr(te_extension, "HAVE_TE", True)
    assert te_layers.missing() is None

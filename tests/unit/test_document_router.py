"""The auxiliary load-balancing loss per document (``megatron.plugin.layers.document_router``)
against Megatron's own router: with one document per Megatron micro-batch and no padding, the
gradients and the logged value are Megatron's, however the documents are packed, padded and
sliced; a backward before the forwards of all of a document's slices fails loudly."""
import pytest
import torch

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.layers.layout import PackedDocuments, Segment
from megatron.plugin.pipeline.extension import run_backward

H, EXPERTS, TOPK, COEFF = 32, 4, 2, 0.01
#: Three documents; the second is cut into slices of 8 and 6 tokens.
LENGTHS = (9, 14, 6)


def layers(per_token: bool):
    """Megatron's MoE layer and the same weights with the per-document router."""
    import torch.nn.functional as F
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.plugin.layers.attention import document_layer_spec

    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, activation_func=F.gelu,
        bias_activation_fusion=False, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=32, moe_aux_loss_coeff=COEFF,
        moe_router_load_balancing_type="aux_loss", calculate_per_token_loss=per_token)

    def build(per_document):
        spec = document_layer_spec(1, num_experts=EXPERTS, per_document_aux=per_document)
        return build_module(spec.layer_specs[0], config=config, layer_number=1).train()

    megatron_layer = build(False)
    document_layer = build(True)
    document_layer.load_state_dict(megatron_layer.state_dict())
    return megatron_layer, document_layer


def layout(segments, **kwargs) -> PackedDocuments:
    tokens = segments[-1].stop
    return PackedDocuments(segments=(tuple(segments),),
                           position_ids=torch.arange(tokens).unsqueeze(0), **kwargs)


def tracked() -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()


def clear_tracker() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def grads(layer) -> dict:
    grads = {name: p.main_grad.clone() if getattr(p, "main_grad", None) is not None
             else p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    return grads


@pytest.fixture
def batch_of_three():
    """Megatron's micro-batch calculator for a global batch of the three documents (one
    replica, micro-batches of one document)."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    init_num_microbatches_calculator(0, None, len(LENGTHS), 1, 1)
    yield
    destroy_num_microbatches_calculator()


@pytest.mark.parametrize("per_token", [True, False])
def test_one_document_per_micro_batch_is_megatrons_switch_loss(one_rank, batch_of_three,
                                                                per_token):
    """Megatron: each document its own micro-batch (its router's Switch loss over the call,
    scaled by the call's tokens under the per-token loss, by one over the three micro-batches
    under the default loss). Per document: two calls, the first holding document 0 whole, the
    first slice of document 1 and three padding tokens, run once without autograd (as a
    checkpointed forward) and again with it; the second the last slice of document 1 and
    document 2 whole. The same outputs' gradients give the same parameter gradients and the
    same logged value."""
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    torch.manual_seed(0)
    megatron_layer, document_layer = layers(per_token)
    docs = [torch.randn(n, 1, H) for n in LENGTHS]
    out_grads = [torch.randn(n, 1, H) for n in LENGTHS]

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1) / (1 if per_token else len(LENGTHS)))
    clear_tracker()
    expected = megatron_step(megatron_layer, docs, out_grads)
    expected_log = tracked()

    clear_tracker()
    store, pad = KVStore(), torch.zeros(3, 1, H)
    first = layout([Segment(0, 9), Segment(9, 17, "doc1", 0, 14), Segment(17, 20, padding=True)],
                   kv_store=store, record_kv=True)
    second = layout([Segment(0, 6, "doc1", 1, 14), Segment(6, 12)], kv_store=store,
                    record_kv=True)
    x_first = torch.cat([docs[0], docs[1][:8], pad])
    x_second = torch.cat([docs[1][8:], docs[2]])
    with torch.no_grad():
        document_layer(hidden_states=x_first, attention_mask=None, packed_seq_params=first)
    out_first, _ = document_layer(hidden_states=x_first, attention_mask=None,
                                  packed_seq_params=first)
    out_second, _ = document_layer(hidden_states=x_second, attention_mask=None,
                                   packed_seq_params=second)
    run_backward([out_second], [torch.cat([out_grads[1][8:], out_grads[2]])])
    tensors, context_grads = store.backward_targets("doc1", 0)
    run_backward([out_first, *tensors],
                 [torch.cat([out_grads[0], out_grads[1][:8], torch.zeros(3, 1, H)]),
                  *context_grads])
    got = grads(document_layer)
    torch.testing.assert_close(tracked(), expected_log, rtol=1e-5, atol=0)
    for name, value in expected.items():
        # fp32 sums in another order (the golden tests' bounds)
        assert (got[name] - value).norm() <= 1e-5 * value.norm(), name
        torch.testing.assert_close(got[name], value, rtol=1e-4,
                                   atol=1e-6 * float(value.abs().max()), msg=name)
    assert not document_layer.mlp.router._store
    megatron_layer.config.moe_aux_loss_coeff = 0.0
    plain = megatron_step(megatron_layer, docs, out_grads)["mlp.router.weight"]
    router = expected["mlp.router.weight"]
    assert (router - plain).norm() > 1e-3 * router.norm(), \
        "the auxiliary loss must move the router's gradient"


def megatron_step(layer, docs, out_grads) -> dict:
    """Megatron's gradients with each document its own call."""
    for x, g in zip(docs, out_grads):
        out, _ = layer(hidden_states=x, attention_mask=None,
                       packed_seq_params=layout([Segment(0, len(x))]))
        (out * g).sum().backward()
    return grads(layer)


def test_a_backward_before_all_slices_forwards_fails_loudly(one_rank, batch_of_three):
    _, document_layer = layers(per_token=True)
    first = layout([Segment(0, 8, "doc1", 0, 14)], kv_store=KVStore(), record_kv=True)
    out, _ = document_layer(hidden_states=torch.randn(8, 1, H), attention_mask=None,
                            packed_seq_params=first)
    with pytest.raises(RuntimeError, match="came before the forwards of all its slices"):
        out.sum().backward()


@pytest.mark.parametrize("schedule", ["elastic", "seq1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("tight", [False, True])
def test_every_slice_forward_runs_before_the_documents_first_backward(schedule, pp, tight):
    """The order the per-document loss needs (a split document's counts are complete at its
    first backward) in every rank's actions of the lowered plans, at PP = 2 and 4, with a
    roomy budget and one tight enough to checkpoint layers: on every stage, every forward of
    a chunk holding a slice of a document comes before every backward of such a chunk."""
    from elastic_pipe.planning import plan_schedule
    from elastic_pipe.lowering import lower
    from elastic_pipe.scheduler import SchedulerConfig
    from elastic_pipe.sequence_processor import ChunkingConfig
    from longctx.chunk_rows import is_split
    from longctx.cost_model import ParallelConfig
    from longctx.hardware import load_profile
    from longctx.models import ModelConfig
    from megatron.plugin.pipeline.ir import Kind

    lengths = (3000, 120, 64, 900, 40, 2200, 300, 16, 700, 50, 1800, 90)
    config = SchedulerConfig(chunking=ChunkingConfig(min_slice_tokens=256, slice_counts=(3,)),
                             workers=1)
    memory_gb = {2: 0.04, 4: 0.02}[pp] if tight else 16.0
    plan = plan_schedule(lengths, schedule, ModelConfig("tiny", 8, 64, 4, 256, 512),
                         load_profile("a800"),
                         ParallelConfig(pp=pp, memory_gb=memory_gb, reserved_gb=0), config)
    assert (sum(map(sum, plan.ckpt_table())) > 0) == tight
    holders: dict[int, set] = {}
    for unit, chunk in enumerate(plan.chunks()):
        for piece in chunk.pieces:
            if is_split(piece):
                holders.setdefault(piece.doc, set()).add(unit)
    assert holders, "the batch must split a document"
    for actions in lower(plan, pp):
        for doc, units in holders.items():
            forwards = [i for i, a in enumerate(actions)
                        if a.kind is Kind.FORWARD and a.unit in units]
            backwards = [i for i, a in enumerate(actions)
                         if a.kind is Kind.BACKWARD and a.unit in units]
            assert len(forwards) == len(backwards) == len(units)
            assert max(forwards) < min(backwards), (schedule, pp, doc)

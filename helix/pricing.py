"""HelixPipe, 1F1B and ZB1P priced from a hardware profile, for simulated comparisons at
paper scale.

The layout is the paper's: one node per pipeline stage, tensor parallelism with sequence
parallelism (TP = SP = the node's GPUs) inside it, ``microbatches`` full-length sequences of
``seq`` tokens, one per micro-batch. Per layer and sequence, with ``e`` bytes per element:

- ``t_qkv``: the QKV projection, ``2 s 3h^2`` FLOPs, plus one all-gather of the ``[s, h]``
  activations inside the node; ``t_attn``: causal flash attention, ``2 h s^2`` FLOPs;
  ``t_post``: the output projection and the MLP, ``2 s (h^2 + h w + h f)`` FLOPs (``w`` the
  MLP's first width: ``f``, or ``2f`` gated; a mixture of experts' MLP is priced as the cost
  model prices it, :func:`longctx.cost_model.mlp_gemm_per_token`), plus one
  all-gather and two reduce-scatters. GEMMs run at ``peak x matmul_efficiency``, attention at
  ``peak x attention_efficiency``, over the ``tp`` GPUs of the stage; a collective is
  ``latency + s h e (tp-1)/tp / intra_node bandwidth``.
- Helix's parts are priced where its runtime runs them (:mod:`helix.model`, the paper's
  Section 4.2): the pre-attention part is the input LayerNorm (not priced: ``t_pre = 0``), which
  ships the normed input, the residual and the QKV weight to the attention's stage; that stage
  gathers the input and projects Q, K, V before attending, so helix's attention part costs
  ``t_qkv + t_attn`` and is not recomputed with the boundaries. Table 2's bubble of the
  two-fold schedule with recomputation, ``8 (p - 1)(t_pre + t_post)`` a loop of ``2p``
  micro-batches, is reported beside the simulated idle time (``helix_idle_s``: the most any
  stage idles) as ``table2_idle_s``.
- Transfers between stages cross nodes at the profile's ``cross_node_gbps`` (the node's NICs
  shared by its GPUs, which all send their shard at once): an activation-sized tensor (``x``,
  ``r``, ``o``, ``res``, a 1F1B hop) is ``s h e / tp`` bytes a GPU, the shipped QKV weight ``w``
  ``3 h^2 e / tp`` and its bias ``wb`` ``3 h e / tp``. Transfers posted together on one link
  share it (the simulator's rule).
- 1F1B: the stage's ``L / p`` layers of one micro-batch are one forward, backward
  ``backward_factor`` times it; with recomputation every layer is recomputed (one more forward
  before each backward), as Megatron's full recomputation does. Whether 1F1B needs it is
  decided by memory: stage ``s`` holds ``min(p - s, m)`` micro-batches' activations (the cost
  model's accounting for TP + SP, the last stage's logits included) on top of its model state
  and a running layer's workspace; when a stage exceeds ``memory_gb`` without recomputation
  the baseline recomputes (``1f1b_recompute`` says which), and when it exceeds it even then
  the result says so (``1f1b_fits``).
- ZB1P (:func:`~megatron.plugin.pipeline.schedule_zb1p.zb1p`, the zero-bubble ZB-H1): the same
  forward; the backward split into ``B``, the attention's backward (``backward_factor x
  t_attn``, attention has no weights) plus half of the GEMM parts' backward, and ``W``, the
  other half: the GEMM parts' backward (``backward_factor x (t_qkv + t_post)``) is split evenly
  between input and weight gradients. It holds the memory 1F1B holds (the zero-bubble paper's
  claim for ZB-H1), so it recomputes exactly when 1F1B does, before the ``B``. Its sends are
  eager (asynchronous, as the zero-bubble implementation posts them; 1F1B replays the same
  either way). With free transfers and ``m >= p`` its per-stage idle time is
  ``(p - 1)(F + B - W)``, HelixPipe's eq. (3) ``(p - 1)(t_qkv + 3 t_attn + t_post) L / p`` at
  ``backward_factor = 2``.

Helix's own memory does not enter :func:`compare` (the comparison assumes that it fits, as it
did in the paper's runs with recomputation without attention). :func:`helix_peaks` gives it
beside :func:`one_f_one_b_peaks`: each stage's planned activation peak in the two-fold
schedule (:func:`helix.memory.planned_peaks` over :func:`helix.memory.model_shape`, the bytes
helix's runtime keeps) on top of the model state 1F1B's stage of the same index holds (the
choice: helix places a layer's parts cyclically, so each stage holds about ``L / p`` layers'
weights as 1F1B's does; the embedding and head are charged where 1F1B has them).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.plugin.pipeline.passes import add_communication, add_recomputation
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.schedule_zb1p import zb1p
from megatron.plugin.pipeline.simulator import UniformCosts, simulate

from longctx.chunks import Chunk, Piece
from longctx.cost_model import GB, CostModel, ParallelConfig, mlp_gemm_per_token
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig

from helix.schedule import HelixCosts, planned_helix


@dataclass(frozen=True)
class PartTimes:
    """Forward seconds of one layer's parts for one sequence, and transfer seconds."""

    qkv: float
    attention: float
    post: float
    hop: float
    """One activation-sized tensor between two stages."""
    weight: float
    """The QKV weight shipped to a foreign attention."""
    bias: float


def part_times(model: ModelConfig, hardware: HardwareProfile, seq: int, tp: int) -> PartTimes:
    """:class:`PartTimes` of ``model`` on a stage of ``tp`` GPUs (module doc)."""
    h, e = model.hidden_size, model.element_bytes
    peak = hardware.peak_tflops * 1e12 * tp
    matmul, attention = peak * hardware.matmul_efficiency, peak * hardware.attention_efficiency
    collective = hardware.intra_node_latency_s + seq * h * e * (tp - 1) / tp \
        / (hardware.intra_node_gbps * GB)
    network = hardware.cross_node_gbps * GB
    return PartTimes(
        qkv=2 * seq * 3 * h * h / matmul + collective,
        attention=2 * h * seq * seq / attention,
        post=2 * seq * (h * h + mlp_gemm_per_token(model)) / matmul + 3 * collective,
        hop=hardware.inter_node_latency_s + seq * h * e / tp / network,
        weight=hardware.inter_node_latency_s + 3 * h * h * e / tp / network,
        bias=hardware.inter_node_latency_s + 3 * h * e / tp / network)


def one_f_one_b_peaks(model: ModelConfig, hardware: HardwareProfile, seq: int, pp: int,
                      tp: int, microbatches: int, memory_gb: float,
                      recompute: bool) -> list[float]:
    """Peak bytes of each 1F1B stage (module doc)."""
    cost = CostModel(model, hardware, ParallelConfig(pp=pp, tp=tp, memory_gb=memory_gb))
    chunk = Chunk((Piece(0, 0, 0, seq, True),))
    peaks = []
    for stage in range(pp):
        kept = cost.stash_bytes(stage, chunk, cost.layers(stage) if recompute else 0,
                                per_layer=True)
        rebuilt = cost.layer_saving(chunk) if recompute else 0.0
        peaks.append(cost.static_bytes(stage) + min(pp - stage, microbatches) * kept
                     + rebuilt + cost.stage_workspace(stage, chunk))
    return peaks


def helix_peaks(model: ModelConfig, hardware: HardwareProfile, seq: int, pp: int, tp: int,
                microbatches: int, recompute: bool, folds: int = 2) -> list[float]:
    """Peak bytes of each helix stage (module doc); ``recompute``: recomputation without
    attention."""
    from helix.memory import model_shape, planned_peaks

    cost = CostModel(model, hardware, ParallelConfig(pp=pp, tp=tp))
    activations = planned_peaks(model_shape(model, seq, tp, recompute), pp, model.num_layers,
                                microbatches, folds, recompute)
    return [cost.static_bytes(stage) + kept for stage, kept in enumerate(activations)]


def compare(model: ModelConfig, hardware: HardwareProfile, seq: int, pp: int, tp: int,
            microbatches: int, helix_recompute: bool = False,
            memory_gb: float | None = None) -> dict:
    """Simulated iteration time of helix (two folds), 1F1B and ZB1P (recomputing only when
    1F1B does not fit ``memory_gb``, default the profile's). ``speedup`` is helix over the
    faster baseline (``best_baseline``: ``"1f1b"`` or ``"zb1p"``), ``speedup_1f1b`` helix
    over 1F1B."""
    memory_gb = hardware.hbm_gb if memory_gb is None else memory_gb
    peaks = one_f_one_b_peaks(model, hardware, seq, pp, tp, microbatches, memory_gb, False)
    recompute_1f1b = max(peaks) > memory_gb * GB
    if recompute_1f1b:
        peaks = one_f_one_b_peaks(model, hardware, seq, pp, tp, microbatches, memory_gb, True)
    parts = part_times(model, hardware, seq, tp)
    layers = model.num_layers
    helix = simulate(
        planned_helix(pp, layers, microbatches, 2, helix_recompute),
        HelixCosts(0.0, parts.qkv + parts.attention, parts.post, layers,
                   backward=hardware.backward_factor, transfer=parts.hop,
                   tensor_transfer=(("w", parts.weight), ("wb", parts.bias))),
        trace=False, eager_sends=True)
    stage = layers / pp * (parts.qkv + parts.attention + parts.post)
    schedule = one_f_one_b(pp, microbatches)
    if recompute_1f1b:
        schedule = add_recomputation(schedule, lambda action: True)
    baseline = simulate(add_communication(schedule, num_stages=pp),
                        UniformCosts(forward=stage, backward=hardware.backward_factor * stage,
                                     recompute=stage, transfer=parts.hop), trace=False)
    gemm_backward = layers / pp * hardware.backward_factor * (parts.qkv + parts.post)
    split = zb1p(pp, microbatches)
    if recompute_1f1b:
        split = add_recomputation(split, lambda action: True)
    zero_bubble = simulate(
        add_communication(split, num_stages=pp),
        UniformCosts(forward=stage,
                     backward=layers / pp * hardware.backward_factor * parts.attention
                     + gemm_backward / 2,
                     weight=gemm_backward / 2, recompute=stage, transfer=parts.hop),
        trace=False, eager_sends=True)
    best = min((baseline.iteration_time, "1f1b"), (zero_bubble.iteration_time, "zb1p"))
    loops = -(-microbatches // (2 * pp))
    return {"parts_s": {"qkv": parts.qkv, "attention": parts.attention, "post": parts.post,
                        "hop": parts.hop},
            "1f1b_s": baseline.iteration_time, "1f1b_bubble": baseline.bubble_ratio,
            "1f1b_recompute": recompute_1f1b, "1f1b_peak_gb": [p / GB for p in peaks],
            "1f1b_fits": max(peaks) <= memory_gb * GB,
            "zb1p_s": zero_bubble.iteration_time, "zb1p_bubble": zero_bubble.bubble_ratio,
            "helix_s": helix.iteration_time, "helix_bubble": helix.bubble_ratio,
            "helix_idle_s": max(helix.idle),
            "table2_idle_s": loops * (8 if helix_recompute else 6) * (pp - 1) * parts.post,
            "best_baseline": best[1], "speedup": best[0] / helix.iteration_time,
            "speedup_1f1b": baseline.iteration_time / helix.iteration_time}

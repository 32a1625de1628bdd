"""The sizes of what the reproduction table's simulated baselines leave out or hold differently
from the papers' systems, computed from the same cost model (for ``reproduce_papers.py``).

- **ZeRO-3's exposed traffic** (InfiniPipe's "ZeRO", L358 and Fig. 9: the gathers and
  scatters of ZeRO-3 that are not overlapped). The cost model takes DeepSpeed's and FlexSP's
  ZeRO-3 traffic as hidden behind compute. Here it is priced as DeepSpeed runs it: for every
  micro-batch and layer, the layer's weights are all-gathered over all the job's GPUs before its
  forward, again before its backward and once more before a recomputed forward, and its
  gradients reduce-scattered after its backward (ZeRO-3 partitions the gradients of every
  micro-batch), each a ring over the job's GPUs in the model's dtype priced by
  :mod:`longctx.collectives`. DeepSpeed prefetches the next layer's gather while a layer
  computes, so what is exposed is the part of a layer's traffic that exceeds the layer's own
  forward, backward and recomputation: ``max(0, traffic - compute)`` per layer and
  micro-batch. Embedding and output-layer gathers are left out (the choice: they are once a
  micro-batch against ``L`` layers). InfiniPipe itself runs ZeRO-3 (its FSDP) over each
  stage's SP group inside a node (L133, L331, L358); the same pricing over that group gives
  its exposed traffic stage by stage (the choice: the paper does not say whether its FSDP
  reduce-scatters every micro-batch's gradients, so as DeepSpeed does).
- **All-to-all seconds** of a plan: each micro-batch's Ulysses all-to-alls on each stage, in
  its forward, backward and recomputed forwards (the cost model's layer collectives).
- **NCCL's NVLink bandwidth** (InfiniPipe's Table 3 at Ulysses SP 8, whose all-to-alls stay
  inside a node). The profiles price NVLink at its line rate a direction (the A800's 400 GB/s
  both ways: eight NVLink 3 links of 25 GB/s a direction, 200 GB/s). NCCL's kernels move the
  data with the SMs' stores, 128 bytes of payload a packet, and a link of 25 GB/s line rate
  carries about 20 GB/s of them (NCCL's maintainer on A100's NVLink 3, NVIDIA/nccl-tests#149;
  the same ~20% protocol overhead on NVLink 4, 370 of 450 GB/s, "observed as BusBw when running
  non-allreduce operations", NVIDIA/nccl-tests#212). nccl-tests' all-to-all bus bandwidth is
  its algorithm bandwidth times ``(n - 1) / n`` (NVIDIA/nccl-tests#130), the per-GPU rate
  :mod:`longctx.collectives` divides a rank's NVLink bytes by, so inside a node NVLink is priced
  at 20 / 25 of its line rate: 160 GB/s on the A800. The choices: the large-message figure (the
  rows' all-to-alls move 40-200 MB a GPU); A100's further cap ("other bottlenecks on the GPUs",
  ~230 of the 240 GB/s its twelve links carry, #149) is not applied, being a per-GPU limit
  above the A800's 160 GB/s. The shipped profiles keep the line rate.
- **The caching allocator's fragmentation** (the SPPO rows' Megatron-LM, which like every
  PyTorch program allocates through it): device bytes reserved beyond the live ones. GMLake
  (Guo et al., ASPLOS 2024, arXiv 2401.08156, abstract) measures it on A100-80GB GPUs over eight
  LLMs trained with recomputation, offloading and distributed training: stitching the
  fragments cuts 15% of the reserved memory on average (up to 33%), so PyTorch's allocator
  leaves at least that share of its reservation unused. The mean is priced, as the fraction
  ``f`` of reserved memory: ``f / (1 - f)`` reserved bytes per live byte (the profile's
  ``allocator_overhead``) on every activation, buffer and workspace byte; model state is
  allocated once and is left out. The choice: the mean, not the maximum, of the workloads
  GMLake measured; none of them is the papers' (Megatron-LM's full recomputation at 0.5-2M
  tokens).
- **NCCL's buffers** of the communicators Megatron-LM runs collectives on in a layout (for
  the rows' detail). NCCL keeps a buffer per channel for each ring or tree connection (NCCL's
  documentation, ``NCCL_BUFFSIZE``: 4 MiB a buffer by default; NVIDIA/nccl#1450: each channel
  its own buffer for collectives, one shared buffer for send/receive), more memory per
  communicator, linear in its channels, and for a ring two connections whatever its size
  (NVIDIA/nccl#864, the maintainers' answer). Measured on A100s over NVLink
  (NVIDIA/nccl#964): 544 MiB for a communicator of two GPUs and 688 MiB for one of more, once
  it has run an all-reduce; the rows take those figures for inter-node groups too (the choice:
  no figure is published for them). Megatron-LM's communicators that carry collectives or
  transfers every iteration: tensor parallelism's (``sp`` > 1), the pipeline's send/receive
  (``pp`` > 1) and the model-parallel group's gradient-norm all-reduce (``sp pp`` > 1; with
  one data-parallel replica, as Table 4's layouts, the data-parallel group has one GPU). The
  cost model's ``reserved_gb`` (2 GB) already stands for them, with the CUDA context: the
  detail shows the two side by side.
- **Megatron-LM's memory under full recomputation, term by term** (the SPPO rows' longest
  sequences): what the simulated ``megatron_recompute`` holds on a stage at its peak (a
  layer's recomputation inside the backward) beside what megatron-core 0.19.2
  (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``, TP
  with sequence parallelism, the unfused vocab-parallel cross entropy that is its default)
  holds at each of its peaks, the sizes from the same per-token figures
  (:func:`megatron_recompute_ledger`, each term with its source line). megatron-core's
  moments: *a layer's backward* (every layer's checkpointed input, ``random.py:618``; the
  rebuilt layer with its output and the two boundary gradients, ``random.py:647-657``; the
  global buffer's re-gathered input, ``layers.py:614``, beside the full-sequence input
  gradient, ``layers.py:627``; the loss's FP32 softmax is gone by then: the cross entropy's
  backward turns it into the logits' gradient in place, ``cross_entropy.py:190-210``, which the
  output layer's backward consumes); *the loss's backward* on the last stage (the FP32
  softmax-turned-gradient beside its BF16 cast, ``cross_entropy.py:25``'s ``.float()`` undone,
  and the global buffer, allocated since the forward's first gather, ``layers.py:570``,
  ``parallel_state.get_global_memory_buffer``); and *the output layer's backward* (the BF16
  logits' gradient, the re-gathered input and the full-sequence input gradient). The
  simulation charges the FP32 logits until the stage's backward ends and TP's two buffers
  with every layer: the difference is what it over-counts.
- **Megatron-LM's exposed TP + SP collectives** (the SPPO speed rows): a plan's layer
  collectives, forward, backward and recomputed forwards, in seconds an iteration
  (:func:`plan_collectives_s`); the cost model puts them between dependent kernels, unhidden.
"""
from __future__ import annotations

import dataclasses

from longctx import collectives
from longctx.cost_model import CostModel
from longctx.hardware import HardwareProfile

GMLAKE_FRAGMENTATION = 0.15
"""Share of the caching allocator's reserved memory left unused, GMLake's A100-80GB mean
(module doc)."""
NCCL_COMMUNICATOR_MIB = {2: 544, 3: 688}
"""MiB one NCCL communicator holds once it has run a collective, by its GPUs (two; three or
more), NVIDIA/nccl#964 on A100s over NVLink (module doc)."""
MIB = 1 << 20
NVLINK_LINE_GBPS = 25.0
"""GB/s one NVLink 3 or 4 link carries a direction at its line rate (module doc)."""
NCCL_NVLINK_GBPS = 20.0
"""GB/s of payload NCCL's SM-driven transfers reach on such a link, NVIDIA/nccl-tests#149
(module doc)."""


def zero3_layer_traffic_s(cost: CostModel, gpus: int) -> tuple[float, float]:
    """(one all-gather, one reduce-scatter) of a layer's weights over ``gpus`` GPUs, seconds."""
    model, hardware = cost.model, cost.hardware
    nbytes = model.params_per_layer() * model.element_bytes / cost.parallel.tp
    ring = collectives.ring_per_byte(hardware, gpus, gpus) * nbytes + \
        collectives.latency(hardware, gpus)
    return ring, ring


def zero3_exposed_s(plan, cost: CostModel, gpus: int, stage: int = 0) -> float:
    """ZeRO-3 traffic over ``gpus`` GPUs of ``stage`` of ``plan``
    (:class:`elastic_pipe.plan_types.Plan`) not hidden behind its layers' compute, seconds an
    iteration (module doc)."""
    gather, scatter = zero3_layer_traffic_s(cost, gpus)
    layers = cost.layers(stage)
    exposed = 0.0
    for chunk, checkpointed in zip(plan.chunks(), plan.ckpt_table()[stage]):
        work = cost.layer_forward(chunk) + cost.layer_backward(chunk)
        plain = max(0.0, 2 * gather + scatter - work)
        again = max(0.0, 3 * gather + scatter - work - cost.layer_forward(chunk))
        exposed += (layers - checkpointed) * plain + checkpointed * again
    return exposed


def stage_collectives_s(cost: CostModel, stage: int, chunk, checkpointed: int) -> float:
    """Seconds of ``stage``'s layer collectives for ``chunk``: every layer's forward and
    backward, and the forwards of its ``checkpointed`` recomputed layers (the backward's are
    what it takes beyond ``backward_factor`` times the forward's compute)."""
    forward = cost.layer_collectives(chunk)
    backward = cost.layer_backward(chunk) - \
        cost.hardware.backward_factor * cost.layer_compute(chunk)
    return cost.layers(stage) * (forward + backward) + checkpointed * forward


def all_to_all_s(plan, cost: CostModel) -> list[float]:
    """Per stage, the seconds of a plan's all-to-alls an iteration (module doc)."""
    table = plan.ckpt_table()
    return [sum(stage_collectives_s(cost, stage, chunk, checkpointed)
                for chunk, checkpointed in zip(plan.chunks(), table[stage]))
            for stage in range(cost.pp)]


def flexsp_terms(plan, gpus: int) -> dict[str, float]:
    """A FlexSP plan's (:class:`elastic_pipe.flexsp.FlexSPPlan`) simulated seconds (``s``),
    its exposed ZeRO-3 seconds (``zero3_s``: each step's slowest group with its exposed traffic
    priced in, less its slowest without) and all-to-all seconds (``a2a_s``: those of the group
    that sets each step's time with the traffic priced in). ZeRO-3 spans all ``gpus``."""
    seconds = zero3 = a2a = 0.0
    for step in plan.steps:
        groups = [(group.simulated_time_s(), zero3_exposed_s(group.plan, group.cost, gpus),
                   all_to_all_s(group.plan, group.cost)[0])
                  for group in step if group.plan is not None]
        plain = max(time for time, _, _ in groups)
        slowest = max(groups, key=lambda g: g[0] + g[1])
        seconds += plain
        zero3 += slowest[0] + slowest[1] - plain
        a2a += slowest[2]
    return {"s": seconds, "zero3_s": zero3, "a2a_s": a2a}


def nccl_nvlink(hardware: HardwareProfile) -> HardwareProfile:
    """``hardware`` with NVLink at the rate NCCL reaches on it, ``NCCL_NVLINK_GBPS /
    NVLINK_LINE_GBPS`` of the line rate (module doc)."""
    rate = hardware.intra_node_gbps * NCCL_NVLINK_GBPS / NVLINK_LINE_GBPS
    return dataclasses.replace(hardware, intra_node_gbps=rate)


def fragmented(hardware: HardwareProfile,
               fraction: float = GMLAKE_FRAGMENTATION) -> HardwareProfile:
    """``hardware`` with the allocator leaving ``fraction`` of its reservation unused: an
    ``allocator_overhead`` of ``fraction / (1 - fraction)`` reserved bytes per live byte."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fragmentation must be in [0, 1), got {fraction}")
    return dataclasses.replace(hardware, allocator_overhead=fraction / (1 - fraction))


def megatron_communicators(sp: int, pp: int) -> dict[str, int]:
    """GPUs of each communicator Megatron-LM runs collectives or transfers on every iteration
    at tensor + sequence parallelism ``sp`` and ``pp`` stages, one replica (module doc)."""
    groups = {"tensor parallel": sp, "pipeline send/receive": pp, "gradient norm": sp * pp}
    return {name: ranks for name, ranks in groups.items() if ranks > 1}


def nccl_buffer_bytes(sp: int, pp: int) -> float:
    """Device bytes of NCCL's buffers on one GPU of that layout (module doc)."""
    return sum(NCCL_COMMUNICATOR_MIB[min(ranks, 3)] * MIB
               for ranks in megatron_communicators(sp, pp).values())


def plan_collectives_s(plan) -> float:
    """Seconds of the slowest stage's layer collectives an iteration of an
    :class:`sppo_offload.solver.MethodPlan`: forward, backward and recomputed forwards of every
    subsequence (module doc)."""
    from sppo_offload.costs import subsequence_chunks

    cost = plan.costs.cost
    chunks = subsequence_chunks(plan.lengths)
    return max(sum(stage_collectives_s(cost, stage, chunk, plan.checkpointed[stage])
                   for chunk in chunks) for stage in range(cost.pp))


def megatron_recompute_ledger(cost: CostModel, tokens: int, stage: int) -> dict:
    """Bytes one GPU of ``stage`` holds for one ``tokens``-long sequence under Megatron-LM's
    full recomputation, term by term: ``simulated`` (the simulator's peak, a layer's
    recomputation within the stage's backward) and ``megatron_core`` (megatron-core's largest
    moment: a layer's backward, the loss's backward or the output layer's; module doc), each
    ``{term: bytes}``, the moment named; ``over_counted`` their peaks' difference."""
    from longctx.chunks import Chunk, Piece

    chunk = Chunk((Piece(0, 0, 0, tokens, True),))
    last, first = stage == cost.pp - 1, stage == 0
    layers = cost.layers(stage)
    h, e = cost.model.hidden_size, cost.model.element_bytes
    p = cost.parallel
    shared = {"model state": cost.static_bytes(stage) - p.reserved_gb * 1e9,
              "reserved (CUDA context, NCCL)": p.reserved_gb * 1e9,
              "checkpointed layer inputs": layers * cost.ckpt_per_token * tokens}
    if first:
        shared["embedding's ids and dropout mask"] = cost.embedding_per_token * tokens
    head = cost.head_extra_per_token * tokens if last else 0.0
    fp32_logits = cost.logits_per_token * tokens if last else 0.0
    remat = {"one layer rematerialised": cost.layer_saving(chunk),
             "the rebuilt output and two boundary gradients": cost.recompute_boundary(chunk)}
    full = e * tokens * h / (p.sp * p.cp) * cost.allocator if p.tp > 1 else 0.0
    simulated = dict(shared, **remat)
    if last:
        simulated.update({"FP32 logits (kept to the stage's backward end)": fp32_logits,
                          "final norm, output-layer input, loss targets": head})
    simulated["workspace (TP + SP's two buffers, or the loss's BF16 logits)"] = \
        cost.stage_workspace(stage, chunk)
    moments = {"a layer's backward": dict(shared, **remat, **{
        "global buffer: the re-gathered input (layers.py:614)": full,
        "full-sequence input gradient (layers.py:627)": full})}
    if last:
        bf16 = cost.loss_workspace(chunk)
        moments["the loss's backward"] = dict(shared, **{
            "final norm, output-layer input, loss targets": head,
            "FP32 softmax turned gradient (cross_entropy.py:181, 190)": fp32_logits,
            "its BF16 cast (cross_entropy.py:25 undone)": bf16,
            "global buffer, held since the forward (layers.py:570)": full})
        moments["the output layer's backward"] = dict(shared, **{
            "final norm, output-layer input, loss targets": head,
            "BF16 logits' gradient": bf16,
            "global buffer: the re-gathered input (layers.py:614)": full,
            "full-sequence input gradient (layers.py:627)": full})
    moment, held = max(moments.items(), key=lambda item: sum(item[1].values()))
    return {"simulated": simulated, "megatron_core": held, "megatron_core_moment": moment,
            "over_counted": sum(simulated.values()) - sum(held.values())}

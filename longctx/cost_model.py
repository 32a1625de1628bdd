"""InfiniPipe's cost model (paper eq. 1-11): time and memory of a chunk on a pipeline stage.

Time (seconds, per GPU; every GPU of a stage's sequence-parallel group does the same work):

- forward compute of one layer on chunk ``{C, S}``:
  ``sum over pieces (alpha1 * ((c+s)^2 - c^2) + alpha2 * s) + beta`` where a piece of ``s``
  tokens attends causally to ``c`` context tokens (eq. 1). Derived from FLOPs unless the profile
  is measured: causal attention does ``4h`` FLOPs per (query, key) pair and a slice has
  ``((c+s)^2 - c^2) / 2`` pairs, so ``alpha1 = 2h / (sp tp peak attention_efficiency)``; the
  GEMMs do ``2 (4h^2 + 2hf)`` FLOPs per token (``2 (4h^2 + 3hf)`` with a gated MLP), so
  ``alpha2 = that / (sp tp peak matmul_efficiency)`` (a mixture-of-experts layer's GEMMs: see
  below); ``beta`` is the profile's fixed per-layer
  overhead. A spec-derived profile's ``kernel_efficiency`` curve divides the FLOP-derived
  compute of a chunk (``beta`` excluded) by the efficiency at the chunk's tokens per GPU
  (``tokens / sp``: Ulysses splits every GEMM's tokens, TP with sequence parallelism gathers
  them back): short chunks run below the large-chunk throughput. The planners balance chunks by
  :meth:`CostModel.piece_work`, which leaves it out (it is not a sum over pieces); chunk times
  include it.
- backward compute = ``backward_factor`` x forward compute;
- collectives (eq. 2-3): Ulysses moves Q, K, V and the attention output with four all-to-alls per
  layer and direction, each of ``bytes = tokens h e / (sp tp)`` a GPU (``e``: bytes of an
  element of the model's dtype, see Memory); tensor parallelism with sequence parallelism adds
  two all-gathers and two reduce-scatters per layer and direction, rings over a buffer of
  ``bytes = tokens h e / sp`` (each GPU gathers, or scatters, the layer's whole activation, not
  a ``1/tp`` share of it). Each is ``latency + bytes x`` its seconds per byte as NCCL runs it
  (:mod:`longctx.collectives`): within a node ``(n-1)/n / intra_node_gbps`` for both; an
  all-to-all that spans nodes sends only its cross-node share ``(n-g)/n`` through the NICs
  (``g`` of its ``n`` ranks on a node, the rest over NVLink at the same time), a ring crosses
  each node's NICs once, the node's NICs shared by the rings of its GPUs. A pipeline hop that
  spans nodes runs at the profile's ``cross_node_gbps`` (the node's NICs shared by its GPUs,
  which cross at once).
  Collectives are not overlapped with compute (they sit between dependent kernels);
- Megatron-LM's context parallelism (``cp``, ring attention, for the baselines): every GPU of
  the ring holds ``1/cp`` of each chunk's tokens (causal work balanced, as Megatron's zigzag
  split does), so compute and activations divide by ``cp`` too; per layer the ring passes the
  K/V of ``tokens / cp`` tokens ``cp - 1`` times (``2 h e / (tp cp)`` bytes a token, each
  step ``latency + bytes x`` a point-to-point ring step's seconds per byte over the group
  ``tp x cp`` spans, :mod:`longctx.collectives`), overlapped with the
  layer's attention: only what exceeds it is exposed; the backward passes K/V and their
  gradients, twice the bytes, against ``backward_factor`` times the attention;
- recomputing a checkpointed layer costs one more forward of it, collectives included (eq. 11);
- host time (the profile's ``host_*`` fields): a layer call costs the host
  ``host_layer_forward_s`` (``host_layer_backward_s`` for its backward), and every forward or
  backward action of a unit on a stage ``host_action_s`` outside its layers (the executor's
  Python: dispatch, extension hooks, plan bookkeeping, Megatron's ``forward_step`` /
  ``backward_step``). How host and device time combine (the choice made here): where the host
  only launches (``host_asynchronous``, CUDA) it runs ahead of the device, so a layer call
  costs ``max(host, device)`` -- a short chunk whose kernels finish faster than the host
  launches them is host-bound; on a CPU the host does the work itself, so a layer costs the
  sum -- which a measured layer fit already is (its ``beta`` holds the per-call host work, timed
  on the same thread), so under a measured synchronous profile the layer's host term is not
  added a second time, under a spec-derived one it is. The action's own host time is serial in
  both (the host does it between the launches of two actions, and the next action's kernels
  wait for it): each stage forward and stage backward adds ``host_action_s``; a recomputation
  (an action of its own in the executor) is priced by its layers only, as the CP-SAT
  checkpointing prices it per layer, an under-count of one ``host_action_s`` per recomputed
  unit. The planners' balancing
  term :meth:`CostModel.piece_work` leaves host time out (the per-unit terms count it);
- the last stage also runs the output layer (``2 h V`` FLOPs per token forward) and keeps the
  logits; the embedding lookup of stage 0 is free -- unless the profile is measured with
  ``end_coefficients``: then the first stage adds the embedding's and the last stage the final
  norm's, output layer's and loss's measured ``seconds per token x tokens + seconds per chunk``,
  forward and backward each (on a CPU the head is not negligible next to a small layer).

Memory (bytes per GPU; Korthikanti et al.'s accounting with flash attention, so no ``s^2``
term, in elements of the model's dtype, ``e`` bytes each: 2 for BF16 and FP16, 4 for FP32 --
the run's ``params_dtype``, whichever profile prices the time), per token and layer, divided by
``sp tp``:

- not checkpointed, GPT's layer (LayerNorm, learned positions, one key/value head per
  head): ``(8h + 2f) e`` (Korthikanti et al.'s ``34h`` bytes for ``f = 4h`` in BF16 are these
  ``32h`` and the two 1-byte dropout masks): the two norms' inputs and outputs, the QKV
  projection's output (Q, K and V are views of it), the attention output (one tensor with the
  projection's input), the MLP's activations before and after GeLU; a gated MLP keeps its
  ``2f`` wide first projection, ``(8h + 3f) e``. Beside them, FP32 statistics: the two norms'
  mean and reciprocal deviation, ``2 x 8`` bytes, and the attention's log-sum-exp per head,
  ``4 a`` bytes (what the blockwise and flash kernels keep for their backward). Hidden
  dropout adds two masks, ``2h m`` (``m``: 1 byte on CUDA, ``e`` on a CPU,
  :attr:`~longctx.models.ModelConfig.dropout_mask_bytes`);
- Llama-style layers change these terms (:func:`attention_saved_per_token`,
  :func:`norm_saved`, :func:`query_key_saved`):

  - ``--normalization RMSNorm``: each norm keeps one FP32 statistic, ``4`` bytes, instead of
    two; torch's composite RMSNorm of a CPU (no fused kernel there) keeps instead an FP32
    copy of its input (the input itself in FP32), that statistic and the FP32 normalized
    input, ``8h + 4`` bytes in place of the norm's input and statistics;
  - ``--group-query-attention --num-query-groups g``: the QKV projection's output is
    ``h + 2 h_kv`` wide (``h_kv = g h / a``), kept whole because the values are views of it;
    megatron-core's ``get_query_key_value_tensors`` reshapes the queries out of the grouped
    layout, a copy (``h e`` more) for ``1 < g < a`` that the attention keeps;
  - ``--position-embedding-type rope``: each of the queries' and keys' rotations keeps its
    ``cos_`` and ``sin_`` (``[tokens, rotary dim]`` in the model's dtype) and makes a new
    tensor that the attention keeps, ``(h + h_kv) e`` beside the projection's output; no
    position ids in the embedding;
  - ``--qk-layernorm``: the Q and K norms keep their statistics per head (per group for the
    keys) and, as above, what their kind keeps of the input; their output is a new tensor
    the attention (or RoPE, which keeps only its tables) receives;

  This is what the saved-tensor meter counts on the project's layer and a one-layer model to
  the byte for every combination of these flags (``tests/unit/test_layer_costs.py``); the
  fused norms of CUDA are priced as their kernels keep (input and FP32 statistics);
- with ``--attention-output-gate`` the gate's product keeps both its operands, the
  attention output and the gate, ``2h e`` (the meter counts ``2h e`` in FP32 and BF16), and
  the QKV projection does ``h^2`` more multiply-adds per token;
- a mixture-of-experts layer (Megatron's ``MoELayer`` of the local spec: dropless top-``k``
  routing over ``E`` experts of inner width ``F``, first projection ``w_e`` = ``2F`` gated or
  ``F``, the ``allgather`` token dispatcher that Megatron-LM defaults to, with nothing to
  gather at TP = EP = 1, and ``SequentialMLP`` experts) keeps, instead of the dense MLP's
  ``f + w``, per token (counted with the saved-tensor meter on one layer,
  ``scripts/profile_costs.py --num-experts``, to the byte in FP32):

  - ``k h e``: the permuted copy of the token for each of its ``k`` experts (``permute``'s
    ``index_select``, megatron-core ``moe/moe_utils.py``), the experts' ``linear_fc1`` input;
  - ``k (w_e + F) e``, plus ``k F e`` without a gate: each expert's first-projection output and
    its ``linear_fc2`` input (the activation scaled by the routing probability, ``mlp.py``'s
    ``per_token_scale``); without a gate the GeLU output the scaling multiplies is kept too,
    with one (Megatron's default fused SwiGLU, ``weighted_bias_swiglu``) it is not;
  - the router, its logits and probabilities in ``r`` bytes an element (the model's ``e``;
    ``--moe-router-dtype`` sets 4 or 8): the softmax over the top-k logits, computed and kept
    in FP32 ``4k`` bytes (``topk_routing_with_score_function``), their per-expert copy
    ``k r``, the ``[tokens, E]`` probabilities ``masked_select`` keeps ``E r``, the routing
    map ``E`` bytes (bool), the top-k expert indices and the sorted token indices of the
    permutation ``16 k`` bytes (int64; the unpermutation's ``scatter_add`` shares the
    second);
  - a shared expert of inner width ``S`` (``--moe-shared-expert-intermediate-size``), first
    projection ``w_s`` = ``2S`` gated or ``S``: what a dense MLP of that width keeps,
    ``(w_s + S) e`` (its input is the router's), and with ``--moe-shared-expert-gate`` its
    output ``h e``, which the gate multiplies, and the gate's sigmoid ``e``;

  the router's input is the pre-MLP norm output the dense accounting already counts among its
  ``8h``. Its GEMMs do ``2 (4h^2 + h E + k (h w_e + h F) + h w_s + h S)`` FLOPs per token
  (``alpha2``; ``+ h`` with the gate): each token passes through ``k`` experts and the shared
  one, plus the router's ``h x E`` projection;
- checkpointed: the layer input ``h e``; a piece with later slices also keeps its K/V
  ``2 h_kv e`` (later slices attend to them and a recomputation must not rebuild them);
- dK/dV accumulator of a piece with later slices: ``2 h_kv`` FP32 elements. It is charged
  from the piece's forward to its backward -- the simulator's stash model releases memory
  only at a backward -- which over-estimates the peak by at most that buffer between the forward and the backward of
  the document's last slice (conservative, the same number for the solver and the simulator);
- Megatron-LM's full recomputation (the baselines' ``per_layer_recompute``) rebuilds one layer
  at a time inside the backward (megatron-core ``tensor_parallel/random.py``,
  ``CheckpointFunction.backward``): beside the rebuilt layer's saved tensors it holds the
  rebuilt output (``outputs = ctx.run_function(*detached_inputs)``), the gradient arriving at
  it (``torch.autograd.backward(outputs, args)``) and the input's gradient it makes
  (``inp.grad``), ``3 h e`` per token (:meth:`CostModel.recompute_boundary`; the gradients
  flowing between layers are not counted otherwise, for any schedule);
- this project's runtime checkpoints a stage's leading ``k`` layers as one range
  (:mod:`megatron.plugin.pipeline.layer_checkpoint`): it keeps the range's input once, ``h e``
  per token, and its ``RECOMPUTE`` rebuilds the whole range before the chunk's backward, so
  checkpointing ``k >= 1`` layers saves ``k`` layers' saving above and the inputs of the
  range's other ``k - 1`` layers (:meth:`CostModel.checkpoint_saving`), and the transient of
  the recomputation is that same difference: the rebuilt first layer's input is the kept one.
  Megatron-LM's full recomputation (the baselines, ``per_layer``) keeps every checkpointed
  layer's input instead, ``k`` of them;
- first stage, the embedding (:func:`embedding_saved_per_token`): the int64 token ids and,
  with learned absolute positions (Megatron-LM's default), the int64 position ids, ``16``
  bytes per token of the whole sequence of a tensor-parallel group (both lookups run on it
  before sequence parallelism scatters), and the embedding dropout's mask, ``h m``, under
  hidden dropout;
- last stage: FP32 logits, ``4 V / tp`` bytes per local token, and the head around them
  (:func:`head_saved_per_token`): the final norm's input and statistics and the output
  layer's input, ``2h e + 8``, and the loss's int64 targets, bool target mask and FP32 loss
  mask, ``13`` bytes per token of the whole sequence of a tensor-parallel group;
- a measured profile's ``activation_coefficients`` replace these per-token figures (layer,
  checkpointed input, K/V, dK/dV, embedding, head) with the bytes the profiler counted on the
  real layer and model with the training loop's meter (``scripts/profile_costs.py``); they
  were counted in one dtype, and the cost model refuses them for a model of another;
- every per-token activation figure above (derived or measured) is multiplied by
  ``1 + allocator_overhead`` of the profile: the device bytes the caching allocator holds per
  live byte (fragmentation). Offloading frees and copies live bytes, so SPPO's copy times
  divide it back out;
- workspace, what a running stage holds beyond its stash (the simulator adds it on top of the
  stash while a forward, backward or recomputation runs; the elastic planner's budget sets
  aside the batch's largest on each stage), as Megatron-LM's layers allocate it, through the
  same caching allocator as the activations (times ``1 + allocator_overhead`` too):

  - *TP + SP full-sequence buffers*, ``2 e`` bytes per token of ``[tokens / (sp cp), h]``
    when ``tp > 1``: a column-parallel linear all-gathers its input into a full-sequence
    buffer before its GEMM, and its backward (megatron-core
    ``tensor_parallel/layers.py``, ``LinearWithGradAccumulationAndAsyncCommunication.backward``)
    all-gathers it again for the weight gradient (``total_input``) while it holds the
    full-sequence input gradient ``grad_output @ weight`` (``grad_input``) that it then
    reduce-scatters: two full ``[tokens, h]`` buffers at once, the backward's being the larger
    of the two directions and the one charged. The gathers go into megatron-core's global
    memory buffer (``parallel_state.get_global_memory_buffer``, kept for the whole run at the
    largest size asked for), one of the two while a layer runs. While the loss's backward
    runs it is held beside the loss buffers too, which the larger-of rule below does not
    charge: the model under-counts that moment by up to ``e`` bytes per token of
    ``[tokens / (sp cp), h]`` (and over-counts the layers' backwards after it by the FP32
    logits, which megatron-core frees once the loss's backward is done);
  - *loss buffers* on the last stage, ``e V / (sp tp cp)`` bytes per token when the model's
    dtype is below FP32: the output layer's logits in the model's dtype live beside the FP32
    copy the vocab-parallel cross entropy makes of them (megatron-core
    ``tensor_parallel/cross_entropy.py``, ``calculate_logits_max``: ``.float()``) and keeps for
    its backward (the FP32 logits above), and the backward's logits gradient in the model's
    dtype beside the FP32 one; in FP32 the copy is the tensor itself;
- model state per stage (eq. 10): weights in the model's dtype (``e`` bytes/param), FP32 main
  gradients (4), Adam moments (8) and, below FP32, FP32 master weights (4) -- moments and
  master weights sharded over the ``dp x sp x cp`` replicas when the distributed optimizer is
  on, and with ``zero3`` (DeepSpeed ZeRO-3, for the baselines) the weights and gradients too,
  their gathers taken as overlapped with compute as DeepSpeed prefetches them --
  all split over ``tp``; stage 0 holds the embedding, the last stage the (untied) output layer;
  plus ``reserved_gb`` of runtime overhead.

Layers per stage: ``L // pp``, the remainder going one each to the last stages (stage 0 holds
the most in-flight chunks in 1F1B, so it gets the fewest layers).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from longctx.chunks import Chunk
from longctx import collectives
from longctx.hardware import HardwareProfile
from longctx.models import ModelConfig

SIGNATURE_CACHE_SIZE = 1 << 14
"""Chunk signatures whose costs a cost model keeps (least recently used first out): a long
run keeps meeting new signatures, and an unbounded cache grew with them."""


GB = 1e9


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of the job and the memory budget of one GPU."""

    pp: int
    """Pipeline stages d."""
    sp: int = 1
    """Ulysses sequence-parallel degree (inside a stage, splits the tokens of every chunk)."""
    tp: int = 1
    """Tensor-parallel degree (with Megatron sequence parallelism)."""
    dp: int = 1
    """Data-parallel replicas (each runs its own global batch share; shards optimizer states)."""
    cp: int = 1
    """Megatron-LM context parallelism: a ring-attention group splitting every chunk's tokens
    (priced for the baselines; the project's schedules use Ulysses ``sp``)."""
    zero3: bool = False
    """Shard weights and gradients as well as the optimizer over the replicas (ZeRO-3)."""
    memory_gb: float = 80.0
    """Device memory per GPU, GB (10^9 bytes)."""
    reserved_gb: float = 2.0
    """Runtime overhead that is never available to the planner (CUDA context, NCCL buffers,
    allocator fragmentation), GB."""
    distributed_optimizer: bool = True
    """Shard FP32 master weights and Adam moments over the dp x sp x cp replicas."""

    def __post_init__(self):
        for name in ("pp", "sp", "tp", "dp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {self.memory_gb}")
        if not 0 <= self.reserved_gb < self.memory_gb:
            raise ValueError(f"reserved_gb must be in [0, memory_gb), got {self.reserved_gb}")
        if self.sp > 1 and self.cp > 1:
            raise ValueError("Ulysses sp and ring-attention cp together are not priced; use one")


class CostModel:
    """Time and memory of chunks on stages for one model, profile and layout."""

    def __init__(self, model: ModelConfig, hardware: HardwareProfile, parallel: ParallelConfig,
                 layers: tuple[int, ...] | None = None):
        """``layers``: transformer layers per stage (the job's layer map, Megatron's uneven
        splits included); by default :func:`stage_layers`."""
        if model.num_heads % (parallel.sp * parallel.tp):
            raise ValueError(f"{model.name}: {model.num_heads} heads are not divisible by "
                             f"sp x tp = {parallel.sp * parallel.tp}; choose sp and tp whose "
                             f"product divides the head count")
        if model.num_layers < parallel.pp:
            raise ValueError(f"{model.name} has {model.num_layers} layers, fewer than pp="
                             f"{parallel.pp} stages; lower --pp")
        self.model, self.hardware, self.parallel = model, hardware, parallel
        if parallel.cp > 1 and any((hardware.layer_coefficients, hardware.activation_coefficients,
                                    hardware.end_coefficients)):
            raise ValueError(f"profile {hardware.name} was measured without context "
                             f"parallelism; price cp > 1 with a spec-derived profile")
        h = model.hidden_size
        shard = parallel.sp * parallel.tp * parallel.cp
        self._set_layer_times(shard)
        self.head_per_token = 2 * h * model.vocab_size / (shard * peak_flops(hardware))
        self.ends = hardware.end_coefficients
        if self.ends is not None:
            shape = (self.ends.hidden_size, self.ends.vocab_size, self.ends.sp, self.ends.tp)
            if shape != (h, model.vocab_size, parallel.sp, parallel.tp):
                raise ValueError(
                    f"profile {hardware.name} timed the embedding and head for hidden, vocab, "
                    f"sp, tp {shape}, not {(h, model.vocab_size, parallel.sp, parallel.tp)}; "
                    f"profile this model and layout or drop end_coefficients")
        self._set_activation_bytes(shard)
        self.curved = hardware.layer_coefficients is None and \
            hardware.kernel_efficiency is not None
        self._set_communication(shard)
        self.linear_per_token = self.alpha2 + self.comm_per_token
        self.chunk_constant = self.beta + self.comm_latency
        self._layers = stage_layers(model.num_layers, parallel.pp) if layers is None \
            else tuple(layers)
        if len(self._layers) != parallel.pp or sum(self._layers) != model.num_layers:
            raise ValueError(f"layers per stage {self._layers} do not place {model.num_layers} "
                             f"layers on pp={parallel.pp} stages")
        self.signature_cache = lru_cache(maxsize=SIGNATURE_CACHE_SIZE)(self._chunk_costs)
        self._set_host_times()

    def _set_host_times(self) -> None:
        """Host seconds per layer call and per action, and whether they overlap the device
        (module doc)."""
        hardware = self.hardware
        self.host_overlaps = hardware.host_asynchronous
        in_fit = not self.host_overlaps and hardware.layer_coefficients is not None
        self.host_layer = (0.0, 0.0) if in_fit else (hardware.host_layer_forward_s,
                                                      hardware.host_layer_backward_s)
        self.host_action = hardware.host_action_s

    def _with_host(self, device: float, host: float) -> float:
        """One layer call's time from its device and host seconds (module doc)."""
        return max(device, host) if self.host_overlaps else device + host

    def _set_layer_times(self, shard: int) -> None:
        """Eq. 1's per-layer coefficients: the profile's fit, or derived from the spec."""
        model, hardware, parallel = self.model, self.hardware, self.parallel
        h = model.hidden_size
        fit = hardware.layer_coefficients
        if fit is not None:
            if (fit.hidden_size, fit.sp, fit.tp) != (h, parallel.sp, parallel.tp):
                raise ValueError(
                    f"profile {hardware.name} was fitted for hidden {fit.hidden_size}, sp "
                    f"{fit.sp}, tp {fit.tp}, not hidden {h}, sp {parallel.sp}, tp "
                    f"{parallel.tp}; profile this layout or use a spec-derived profile")
            if fit.mlp != model.mlp_label:
                raise ValueError(
                    f"profile {hardware.name} was fitted on a layer with a {fit.mlp} MLP, not "
                    f"{model.mlp_label}; profile this model (scripts/profile_costs.py "
                    f"--num-experts ...) or use a spec-derived profile")
            self.alpha1, self.alpha2, self.beta = fit.alpha1, fit.alpha2, fit.beta
        else:
            peak = hardware.peak_tflops * 1e12
            self.alpha1 = 2 * h / (shard * peak * hardware.attention_efficiency)
            gemm_flops = 2 * (attention_gemm_per_token(model) + mlp_gemm_per_token(model))
            self.alpha2 = gemm_flops / (shard * peak * hardware.matmul_efficiency)
            self.beta = hardware.layer_overhead_s

    def _set_activation_bytes(self, shard: int) -> None:
        """Bytes a token keeps per layer and at the ends: the profile's measurement, or
        Korthikanti et al.'s accounting (module doc); times the allocator's overhead."""
        model, hardware, parallel = self.model, self.hardware, self.parallel
        h, e = model.hidden_size, model.element_bytes
        measured = hardware.activation_coefficients
        if measured is not None:
            shape = (measured.hidden_size, measured.vocab_size, measured.sp, measured.tp)
            if shape != (h, model.vocab_size, parallel.sp, parallel.tp):
                raise ValueError(
                    f"profile {hardware.name} measured activations for hidden, vocab, sp, tp "
                    f"{shape}, not {(h, model.vocab_size, parallel.sp, parallel.tp)}; profile "
                    f"this model and layout or drop activation_coefficients")
            if measured.mlp != model.mlp_label:
                raise ValueError(
                    f"profile {hardware.name} measured activations of a layer with a "
                    f"{measured.mlp} MLP, not {model.mlp_label}; profile this model "
                    f"(scripts/profile_costs.py --num-experts ...) or drop "
                    f"activation_coefficients")
            if measured.dtype != model.dtype:
                raise ValueError(
                    f"profile {hardware.name} measured activations in {measured.dtype}, not "
                    f"{model.dtype}; profile in the run's precision or drop "
                    f"activation_coefficients")
            self.full_per_token, self.ckpt_per_token = measured.layer, measured.checkpointed
            self.kv_per_token, self.dkv_per_token = measured.kv, measured.dkv
            self.embedding_per_token, self.logits_per_token = measured.embedding, measured.head
            # the measured head is the whole of it: logits, norm, output-layer input, loss
            self.head_extra_per_token = 0.0
        else:
            self.full_per_token = layer_saved_per_token(model) / shard
            self.ckpt_per_token = e * h / shard
            self.kv_per_token = e * 2 * model.kv_width / shard
            # Context dK/dV accumulate in fp32 (megatron.plugin.layers.kv_store).
            self.dkv_per_token = max(e, 4) * 2 * model.kv_width / shard
            self.embedding_per_token = embedding_saved_per_token(model, parallel)
            self.logits_per_token = 4 * model.vocab_size / shard
            self.head_extra_per_token = head_saved_per_token(model, parallel)
        self.allocator = 1.0 + hardware.allocator_overhead
        for name in ("full_per_token", "ckpt_per_token", "kv_per_token", "dkv_per_token",
                     "embedding_per_token", "logits_per_token", "head_extra_per_token"):
            setattr(self, name, getattr(self, name) * self.allocator)

    def _set_communication(self, shard: int) -> None:
        """Per-layer collective seconds (Ulysses, TP) and context parallelism's ring step."""
        hardware, parallel = self.hardware, self.parallel
        h, e = self.model.hidden_size, self.model.element_bytes
        self.comm_latency = self.comm_per_token = 0.0
        # Ulysses moves each GPU's tokens / sp of its h / tp channels; TP's all-gathers and
        # reduce-scatters move the whole [tokens / (sp cp), h] activation of the layer.
        for degree, span, per_token, per_byte in (
                (parallel.sp, parallel.tp * parallel.sp, e * h / shard,
                 collectives.all_to_all_per_byte),
                (parallel.tp, parallel.tp, e * h / (parallel.sp * parallel.cp),
                 collectives.ring_per_byte)):
            if degree > 1:
                self.comm_latency += 4 * collectives.latency(hardware, span)
                self.comm_per_token += 4 * per_token * per_byte(hardware, degree, span)
        self.ring_step = (0.0, 0.0)
        if parallel.cp > 1:
            span = parallel.tp * parallel.cp
            self.ring_step = (collectives.latency(hardware, span),
                              2 * e * h / (parallel.tp * parallel.cp)
                              * collectives.ring_step_per_byte(hardware, parallel.cp, span))

    # -- layout -----------------------------------------------------------------------------

    def layers(self, stage: int) -> int:
        """Transformer layers of ``stage``."""
        return self._layers[stage]

    @property
    def pp(self) -> int:
        return self.parallel.pp

    def _link(self, group_span: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a group whose ranks span ``group_span`` GPUs."""
        hw = self.hardware
        if group_span <= hw.gpus_per_node:
            return hw.intra_node_gbps * GB, hw.intra_node_latency_s
        return hw.cross_node_gbps * GB, hw.inter_node_latency_s

    # -- time -------------------------------------------------------------------------------

    def layer_compute(self, chunk: Chunk) -> float:
        """Forward compute of one layer on ``chunk`` (eq. 1), seconds."""
        return self._costs(chunk)[0]

    def layer_collectives(self, chunk: Chunk) -> float:
        """Ulysses all-to-alls and TP/SP collectives of one layer's forward (eq. 2-3), and the
        ring's exposed share under context parallelism."""
        return self._costs(chunk)[1]

    def layer_forward(self, chunk: Chunk) -> float:
        """Forward of one layer: compute plus collectives, combined with the host's time of
        the call (module doc); also the recompute time (eq. 11)."""
        compute, comm = self._costs(chunk)[:2]
        return self._with_host(compute + comm, self.host_layer[0])

    def layer_backward(self, chunk: Chunk) -> float:
        device = self.hardware.backward_factor * self.layer_compute(chunk) + self._costs(chunk)[4]
        return self._with_host(device, self.host_layer[1])

    def end_forward(self, stage: int, tokens: int) -> float:
        """Forward work of ``stage`` outside its layers on a chunk of ``tokens`` tokens: the
        embedding on the first stage, the head (final norm, output layer, loss) on the last."""
        if self.ends is None:
            return self.head_per_token * tokens if stage == self.pp - 1 else 0.0
        time = 0.0
        if stage == 0:
            time += self.ends.time(self.ends.embedding_forward, tokens)
        if stage == self.pp - 1:
            time += self.ends.time(self.ends.head_forward, tokens)
        return time

    def end_backward(self, stage: int, tokens: int) -> float:
        """Backward counterpart of :meth:`end_forward`."""
        if self.ends is None:
            return self.hardware.backward_factor * self.end_forward(stage, tokens)
        time = 0.0
        if stage == 0:
            time += self.ends.time(self.ends.embedding_backward, tokens)
        if stage == self.pp - 1:
            time += self.ends.time(self.ends.head_backward, tokens)
        return time

    def stage_forward(self, stage: int, chunk: Chunk) -> float:
        """The forward action of ``chunk`` on ``stage``: its layers, its ends and the action's
        host time."""
        return self.layers(stage) * self.layer_forward(chunk) + \
            self.end_forward(stage, chunk.tokens) + self.host_action

    def stage_backward(self, stage: int, chunk: Chunk) -> float:
        """Backward counterpart of :meth:`stage_forward`."""
        return self.layers(stage) * self.layer_backward(chunk) + \
            self.end_backward(stage, chunk.tokens) + self.host_action

    def stage_time(self, stage: int, chunk: Chunk, checkpointed: int = 0) -> float:
        """Forward + backward + recomputation of ``checkpointed`` layers of ``stage``."""
        return (self.stage_forward(stage, chunk) + self.stage_backward(stage, chunk)
                + checkpointed * self.layer_forward(chunk))

    def p2p_time(self, chunk: Chunk) -> float:
        """Sending one chunk's activations (or their gradients) to the next stage."""
        p = self.parallel
        bandwidth, latency = self._link(p.tp * p.sp * p.cp * p.dp * p.pp)
        return latency + self.model.element_bytes * chunk.tokens * self.model.hidden_size \
            / (p.sp * p.tp * p.cp) / bandwidth

    # -- memory -----------------------------------------------------------------------------

    def layer_activation(self, chunk: Chunk) -> float:
        """Bytes one non-checkpointed layer stashes for ``chunk`` (dK/dV buffers included)."""
        return self._costs(chunk)[2]

    def layer_saving(self, chunk: Chunk) -> float:
        """Bytes saved by checkpointing one layer that keeps its input (and K/V); also the
        transient of recomputing it."""
        return self._costs(chunk)[3]

    def checkpoint_saving(self, chunk: Chunk, checkpointed: int, per_layer: bool = False) -> float:
        """Bytes a stage's stash of ``chunk`` loses when its leading ``checkpointed`` layers
        are checkpointed; also the transient of their recomputation. The runtime's range keeps
        only its own input, so every layer after its first saves its input too; with
        ``per_layer`` (Megatron-LM's full recomputation) each checkpointed layer keeps its
        input (module doc)."""
        saving = checkpointed * self.layer_saving(chunk)
        if per_layer or checkpointed < 2:
            return saving
        return saving + (checkpointed - 1) * self.ckpt_per_token * chunk.tokens

    def recompute_boundary(self, chunk: Chunk) -> float:
        """Bytes Megatron-LM's per-layer recomputation holds beside the rebuilt layer's saved
        tensors: the rebuilt layer's output, the gradient arriving at that output and the
        gradient of the layer's input it computes, each ``[tokens / (sp tp cp), h]`` (module
        doc)."""
        return 3 * self.ckpt_per_token * chunk.tokens

    def layer_workspace(self, chunk: Chunk) -> float:
        """Bytes a running layer holds beyond its stash: TP + SP's two full-sequence buffers
        (module doc)."""
        p = self.parallel
        if p.tp == 1:
            return 0.0
        return 2 * self.model.element_bytes * chunk.tokens * self.model.hidden_size \
            / (p.sp * p.cp) * self.allocator

    def loss_workspace(self, chunk: Chunk) -> float:
        """Bytes the last stage's loss holds beyond its FP32 logits (module doc)."""
        m, p = self.model, self.parallel
        if m.element_bytes >= 4:
            return 0.0
        return m.element_bytes * m.vocab_size * chunk.tokens / (p.sp * p.tp * p.cp) * self.allocator

    def stage_workspace(self, stage: int, chunk: Chunk) -> float:
        """Bytes ``stage`` holds beyond its stash while it runs ``chunk``: the larger of a
        layer's and, on the last stage, the loss's (they do not run at once)."""
        if stage == self.pp - 1:
            return max(self.layer_workspace(chunk), self.loss_workspace(chunk))
        return self.layer_workspace(chunk)

    def stash_bytes(self, stage: int, chunk: Chunk, checkpointed: int = 0,
                    per_layer: bool = False) -> float:
        """Bytes ``stage`` keeps for ``chunk`` between its forward and its backward, its leading
        ``checkpointed`` layers checkpointed as this project's runtime does, or with
        ``per_layer`` as Megatron-LM does (:meth:`checkpoint_saving`)."""
        full = self.layers(stage) * self.layer_activation(chunk) + self.head_bytes(stage, chunk)
        if stage == 0:
            full += self.embedding_per_token * chunk.tokens
        return full - self.checkpoint_saving(chunk, checkpointed, per_layer)

    def head_bytes(self, stage: int, chunk: Chunk) -> float:
        """Bytes the head keeps for ``chunk`` on ``stage`` (the last: FP32 logits, the final
        norm's and the output layer's inputs, the loss's tensors; 0 elsewhere): part of
        :meth:`stash_bytes`, and the first a backward frees."""
        if stage != self.pp - 1:
            return 0.0
        return (self.logits_per_token + self.head_extra_per_token) * chunk.tokens

    def gradient_sum_bytes(self, stage: int, chunk: Chunk) -> float:
        """Bytes of the dK/dV sums ``stage`` keeps for ``chunk``'s slices that are not their
        document's last: created by the first backward of a later slice, freed by the chunk's
        own backward. :meth:`stash_bytes` counts them from the forward on (the planners' bound);
        the simulator places them where they are created (:meth:`longctx.chunk_costs.ChunkCosts.gradient_sums`)."""
        return self.layers(stage) * self.dkv_per_token * sum(
            piece.tokens for piece in chunk.pieces if not piece.final)

    def static_bytes(self, stage: int) -> float:
        """Model state of ``stage`` plus the reserved runtime overhead (eq. 10)."""
        p, m = self.parallel, self.model
        params = self.layers(stage) * m.params_per_layer()
        if stage == 0:
            params += m.vocab_size * m.hidden_size
        if stage == self.pp - 1:
            params += m.vocab_size * m.hidden_size + 2 * m.hidden_size
        params /= p.tp
        replicas = p.dp * p.sp * p.cp
        optimizer = 8 + (4 if m.element_bytes < 4 else 0)
        if p.distributed_optimizer or p.zero3:
            optimizer /= replicas
        state = m.element_bytes + 4
        if p.zero3:
            state /= replicas
        return params * (state + optimizer) + p.reserved_gb * GB

    def activation_budget(self, stage: int) -> float:
        """Bytes left for activations on ``stage``."""
        return self.parallel.memory_gb * GB - self.static_bytes(stage)

    # -- per-chunk quantities, memoised by signature ------------------------------------------

    def _costs(self, chunk: Chunk) -> tuple[float, float, float, float, float]:
        return self.signature_cache(chunk.signature)

    def piece_work(self, context: int, tokens: int) -> float:
        """Forward seconds of one layer that grow with a piece (chunk constant excluded)."""
        return self.alpha1 * ((context + tokens) ** 2 - context * context) + \
            self.linear_per_token * tokens

    def _chunk_costs(self, signature: tuple) -> tuple[float, float, float, float, float]:
        """(forward compute, forward collectives, stash per layer, saving per layer, backward
        collectives) of a signature."""
        tokens = sum(s for _, s, _ in signature)
        work = sum(self.alpha1 * ((c + s) ** 2 - c * c) + self.alpha2 * s
                   for c, s, _ in signature)
        if self.curved:
            work /= self.hardware.efficiency(tokens / (self.parallel.sp * self.parallel.cp))
        compute = self.beta + work
        comm = back = self.comm_latency + self.comm_per_token * tokens
        if self.parallel.cp > 1:
            attention = sum(self.alpha1 * ((c + s) ** 2 - c * c) for c, s, _ in signature)
            latency, per_token = self.ring_step
            ring = (self.parallel.cp - 1) * (latency + per_token * tokens)
            comm += max(0.0, ring - attention)
            back += max(0.0, 2 * ring - self.hardware.backward_factor * attention)
        stash = saving = 0.0
        for _, s, final in signature:
            stash += s * (self.full_per_token + (0 if final else self.dkv_per_token))
            saving += s * (self.full_per_token - self.ckpt_per_token
                           - (0 if final else self.kv_per_token))
        return compute, comm, stash, saving, back

def attention_gemm_per_token(model: ModelConfig) -> int:
    """Multiply-adds per token of one layer's attention projections: ``4h^2`` (QKV and the
    output projection), ``5h^2`` with the attention output gate's rows."""
    h = model.hidden_size
    return (5 if model.attention_output_gate else 4) * h * h


def mlp_gemm_per_token(model: ModelConfig) -> int:
    """Multiply-adds per token of one layer's MLP: ``h w + h f`` dense; a mixture of experts
    runs each token through ``k`` experts of ``h w_e + h F``, the router's ``h E`` and a shared
    expert's ``h w_s + h S`` (its gate's ``h``) (module doc)."""
    h = model.hidden_size
    if not model.num_experts:
        return h * model.mlp_width + h * model.ffn_hidden_size
    return h * model.num_experts + model.moe_router_topk * h * (model.expert_width
                                                                + model.expert_ffn) \
        + h * (model.shared_width + model.shared_ffn) \
        + (h if model.moe_shared_expert_gate else 0)


NORM_STATISTICS = 8
"""Bytes LayerNorm keeps per row beyond its input: its FP32 mean and reciprocal deviation."""

RMS_STATISTICS = 4
"""Bytes RMSNorm keeps per row beyond its input: its FP32 reciprocal deviation."""

INDEX_BYTES = 8
"""Bytes of one int64 token id, position id or target index."""


def norm_saved(model: ModelConfig, width: int, rows: int, input_counted: bool) -> int:
    """Bytes one norm over ``rows`` rows of ``width`` channels in all (a token's ``h``, or
    its heads' queries) keeps for its backward (``SequenceParallelNorm``, megatron-core's
    ``q_layernorm`` / ``k_layernorm``): LayerNorm its input and FP32 mean and reciprocal
    deviation per row; a fused RMSNorm its input and reciprocal deviation; torch's composite
    RMSNorm (a CPU's, ``fused_norms`` off) the FP32 copy of its input (the input itself in
    FP32), the reciprocal deviation and the FP32 normalized input (``x * rstd``, which the
    weight's product keeps). ``input_counted``: the input's storage is already counted (a
    view of the QKV projection's output); an FP32 copy of it is not that storage."""
    e = model.element_bytes
    if model.normalization == "LayerNorm":
        return (0 if input_counted else width * e) + rows * NORM_STATISTICS
    if model.fused_norms:
        return (0 if input_counted else width * e) + rows * RMS_STATISTICS
    copy = 0 if input_counted and e == 4 else 4 * width
    return copy + rows * RMS_STATISTICS + 4 * width


def query_key_saved(model: ModelConfig, width: int, rows: int, copied: bool) -> int:
    """Bytes the queries (``width = h``, ``rows`` heads) or the keys (``kv_width``, one row a
    group) keep beyond the QKV projection's output they are views of, on their way through
    megatron-core's ``get_query_key_value_tensors`` (``copied``: grouped queries, which its
    reshape copies out of the grouped layout), the Q/K norm (:func:`norm_saved`, a new
    tensor out), RoPE (``_apply_rotary_pos_emb_bshd``: its ``cos_`` and ``sin_``,
    ``[tokens, rotary dim]`` each in the model's dtype, a new tensor out) and the attention,
    which keeps what reaches it. The reshape copies the queries of ``1 < groups < heads``
    only: with one group per head, or a single group, it is a view."""
    e, fresh, kept = model.element_bytes, copied, 0
    if model.qk_layernorm:
        kept += norm_saved(model, width, rows, input_counted=not fresh)
        fresh = True
    if model.rope:
        kept += 2 * model.rotary_dim * e
        fresh = True
    return kept + (width * e if fresh else 0)


def attention_saved_per_token(model: ModelConfig) -> int:
    """Bytes one token leaves saved in one layer's attention block (module doc): the input
    norm (:func:`norm_saved`) and its output (``linear_qkv``'s input), the QKV projection's
    output ``(h + 2 kv_width) e`` (the values are views of it, so it stays whole), the queries
    and keys beyond it (:func:`query_key_saved`), the attention's output (also
    ``linear_proj``'s input) and its FP32 log-sum-exp per head."""
    h, e, heads = model.hidden_size, model.element_bytes, model.num_heads
    grouped = 1 < model.query_groups < heads
    return (norm_saved(model, h, 1, input_counted=False) + h * e
            + (h + 2 * model.kv_width) * e
            + query_key_saved(model, h, heads, copied=grouped)
            + query_key_saved(model, model.kv_width, model.query_groups, copied=False)
            + h * e + 4 * heads)


def layer_saved_per_token(model: ModelConfig) -> int:
    """Bytes one token leaves saved in one layer (not sharded; module doc): the attention
    block (:func:`attention_saved_per_token`), the pre-MLP norm and its output (``linear_fc1``'s
    input), the MLP (:func:`mlp_saved_per_token`), the attention output gate's two operands
    ``2h e`` and the two hidden-dropout masks when that dropout is on."""
    h, e = model.hidden_size, model.element_bytes
    masks = 2 * h * model.dropout_mask_bytes if model.hidden_dropout else 0
    gate = 2 * h * e if model.attention_output_gate else 0
    return (attention_saved_per_token(model) + norm_saved(model, h, 1, input_counted=False)
            + h * e + gate + mlp_saved_per_token(model) + masks)


def embedding_saved_per_token(model: ModelConfig, parallel: ParallelConfig) -> float:
    """Bytes the embedding of the first stage keeps per token (on one GPU): the int64 token
    ids and, with learned positions, the position ids (looked up on the whole sequence of a
    tensor-parallel group), and the embedding dropout's mask (Megatron's ``--hidden-dropout``)
    on the GPU's share of the output."""
    ids = INDEX_BYTES * (2 if model.learned_positions else 1) / (parallel.sp * parallel.cp)
    mask = model.hidden_size * model.dropout_mask_bytes if model.hidden_dropout else 0
    return ids + mask / (parallel.sp * parallel.tp * parallel.cp)


def head_saved_per_token(model: ModelConfig, parallel: ParallelConfig) -> float:
    """Bytes the last stage's head keeps per token (on one GPU) beside the FP32 logits: the
    final norm's input and statistics and the output layer's input (the norm's output), on the
    GPU's share of the sequence; the vocab-parallel cross entropy's int64 targets and bool
    target mask and the loss function's FP32 loss mask, on the whole sequence of a
    tensor-parallel group (the output layer gathers it)."""
    norm = norm_saved(model, model.hidden_size, 1, input_counted=False) \
        + model.hidden_size * model.element_bytes
    loss = INDEX_BYTES + 1 + 4
    return norm / (parallel.sp * parallel.tp * parallel.cp) + loss / (parallel.sp * parallel.cp)


def qk_norm_saved_per_token(model: ModelConfig) -> int:
    """Bytes one token's Q and K norms (``--qk-layernorm``) add to its layer: what
    :func:`layer_saved_per_token` counts with them less what it counts without them."""
    if not model.qk_layernorm:
        return 0
    return layer_saved_per_token(model) - layer_saved_per_token(
        dataclasses.replace(model, qk_layernorm=False))


def mlp_saved_per_token(model: ModelConfig) -> int:
    """Bytes one token leaves saved for the backward in one layer's MLP beyond its input:
    ``(f + w) e`` dense; a mixture of experts' permuted copies, expert intermediates and router
    tensors (module doc)."""
    e, k = model.element_bytes, model.moe_router_topk
    if not model.num_experts:
        return e * (model.ffn_hidden_size + model.mlp_width)
    f, experts = model.expert_ffn, model.num_experts
    intermediates = model.expert_width + f + (0 if model.gated_mlp else f)
    router = 4 * k + model.router_bytes * (k + experts) + experts + 16 * k
    shared = model.shared_width + model.shared_ffn \
        + (model.hidden_size + 1 if model.moe_shared_expert_gate else 0)
    return e * k * (model.hidden_size + intermediates) + router + e * shared


def peak_flops(hardware: HardwareProfile) -> float:
    """Achievable GEMM FLOP/s of one GPU."""
    return hardware.peak_tflops * 1e12 * hardware.matmul_efficiency


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage: ``L // pp`` each, the remainder one each on the last stages."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if stage >= pp - extra else 0) for stage in range(pp))

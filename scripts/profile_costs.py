"""Measure one transformer layer and write a *measured* hardware profile for the elastic planner.

    python scripts/profile_costs.py --num-layers-profiled 1 --hidden-size 256 \
        --num-attention-heads 8 [--ffn-hidden-size F] --tokens 512 1024 2048 \
        --contexts 0 2048 --repeats 3 --base-profile a800 --output PROFILE.json \
        [--num-experts E --moe-router-topk K --moe-ffn-hidden-size F
         --moe-shared-expert-intermediate-size S --moe-shared-expert-gate
         --moe-router-dtype fp32] \
        [--position-embedding-type rope --rotary-percent P --normalization RMSNorm --swiglu
         --group-query-attention --num-query-groups G --qk-layernorm --disable-bias-linear]

What is measured and how (every choice made here):

- The layer is a real Megatron ``TransformerLayer`` built from the project's spec
  (:func:`megatron.plugin.layers.attention.document_layer_spec`, core attention
  :class:`~megatron.plugin.layers.attention.DocumentAttention`) with the ``TransformerConfig`` that
  :func:`megatron.plugin.model.model_config` builds from the training flags (parsed by
  Megatron-LM's own parser, so the defaults -- LayerNorm, GeLU, biases, learned-absolute
  positions, FP32 on CPU -- are those of a training run with the same model flags; the
  architecture flags -- RoPE, RMSNorm, SwiGLU, grouped-query attention, Q/K norms, no biases --
  are the training run's, taken as it takes them). Dropout is
  ``--attention-dropout`` / ``--hidden-dropout`` (Megatron's 0.1 unless
  given): profile with the job's values, because on CPU SDPA's fused causal kernel does not
  take dropout, so attention dropout > 0 times the math kernel, many times slower at long
  sequences. ``--num-layers-profiled N`` builds N layers run back to back; the times
  are divided by N, so the result is per layer. ``--num-experts`` builds Megatron's
  mixture-of-experts layer instead of the dense MLP (the training run's ``--num-experts``,
  ``--moe-router-topk``, ``--moe-ffn-hidden-size``, shared-expert and router flags, with
  ``--disable-bias-linear``, which the
  training script requires with experts); the fit and the activation bytes are stamped with
  the layer's MLP (``mlp``: ``"dense"`` or the experts' shape) and the cost model prices no
  other MLP with them.
- Process groups and seeds: Megatron-LM's start-up on one process
  (:func:`megatron.plugin.launch.initialize`, which applies ``cpu_compat`` on a machine
  without CUDA). TP = SP = 1, so the fit is stamped ``sp=1, tp=1``.
- Grid point ``(s, C)``: one document with a packed row of ``s`` tokens (micro-batch 1). For
  ``C = 0`` it is slice 0 with no context. For ``C > 0`` slice 0 of ``C`` tokens is first run
  forward with grad enabled and ``record_kv=True`` into a :class:`KVStore` (not timed), then the
  timed work is slice 1 (``slice_index=1``, positions ``C..C+s-1``) attending to that context;
  its backward therefore also produces the dK/dV of the context (the store's leaves require
  grad), as in training. The timed slice does not record its own K/V (it is the last slice).
- Timing: wall clock (``time.perf_counter``; ``torch.cuda.synchronize`` around it on CUDA) of
  the forward (graph built, training mode) and, separately, of ``torch.autograd.backward`` with
  a fixed random output gradient. One untimed warm-up forward+backward per grid point, then
  ``--repeats`` timed ones; the median of each is kept. Parameter gradients are dropped between
  repeats. Threads: ``torch.set_num_threads(OMP_NUM_THREADS)`` when that variable is set,
  otherwise torch's default.
- Fit of eq. 1 for one piece: ``forward(s, C) = alpha1 ((C+s)^2 - C^2) + alpha2 s + beta``.
  Least squares on *relative* residuals (each row divided by its measured time), because the
  grid spans orders of magnitude and the planner compares chunk times by ratio; columns are
  scaled to unit norm before solving. Non-negativity is exact NNLS for three unknowns: every
  subset of the coefficients is solved unconstrained (the others fixed at 0) and the feasible
  (all >= 0) solution with the lowest residual is kept -- that is the constrained optimum,
  since the optimum is the unconstrained optimum of its own support. No scipy is needed.
- ``backward_factor``: the least-squares slope through the origin of backward against forward
  time, weighted like the fit (``sum(b/f) / n``, the mean per-point ratio, which is the same
  thing on relative residuals).
- Ends of the pipeline: a one-layer ``GPTModel`` of the same flags runs one training
  micro-batch (``forward_step`` and its loss, forward and backward) per ``--tokens`` count;
  hooks stamp the clock where the decoder starts and where the final norm starts (forward), and
  gradient hooks where the gradient of those two tensors is complete (backward), which cuts
  out the embedding (first stage) and the head -- final norm, output layer, loss (last stage).
  Each of the four is fitted as ``seconds per token x tokens + seconds per chunk`` (NNLS on
  relative residuals) into ``end_coefficients``.
- Kernel efficiency: at the ``C = 0`` points, how much more time than the FLOP-derived model
  the layer takes at ``s`` tokens than at the largest ``s``: the model's work is the cost
  model's, ``2 h s^2 / attention_efficiency + 2 (4h^2 + h w + h f) s / matmul_efficiency``
  with the base profile's efficiencies (``w`` the MLP's first width, ``2f`` when gated), the
  measured time has the fit's ``beta`` taken off (the cost model adds the per-chunk constant
  beside the curve), and their ratio at ``s`` over the ratio at the largest ``s``, capped at 1,
  is the ``kernel_efficiency`` curve, printed as a JSON line for a spec-derived profile of
  this machine (a measured profile does not take it: its fit prices the chunk size itself).
- Allocator overhead (CUDA only): the caching allocator's reserved bytes over the allocated
  bytes at their peaks, minus 1, over the whole grid: written as ``allocator_overhead``. On a
  CPU there is no caching allocator to measure and the base profile's figure is inherited.
- Host time (:mod:`longctx.cost_model` says how it combines with the device's):
  ``host_layer_forward_s`` / ``host_layer_backward_s`` are the median time of the layers'
  forward / backward on a slice of ``HOST_TOKENS`` tokens, per layer, with the clock stopped
  when the host returns (before waiting for the device: on CUDA the launches, on a CPU the
  whole, tiny, work). ``host_action_s`` is the executor's own work per action: one-stage 1F1B
  of ``HOST_UNITS`` units run by the pipeline executor over a one-weight stand-in model with
  Megatron's ``forward_step``/``backward_step``, less the stand-in's forwards and backwards
  timed alone, divided by the actions (median of ``--repeats`` after a warm-up); the
  schedules' extension hooks (document chunks, offloading) are not in it.
  ``host_asynchronous`` is true on CUDA.
- Report: per grid point the measured forward/backward, the fitted forward and its relative
  error; then the max and mean relative error (printed as ``fit relative error: max ... mean``).
- Output JSON: every field of ``--base-profile`` (a shipped profile name or a JSON path), then
  ``name`` and ``machine`` = the machine description (host, processor, torch threads),
  ``source = "measured"``, ``backward_factor`` = the fitted ratio, ``layer_coefficients`` =
  the fit with ``hidden_size``, ``sp = 1``, ``tp = 1``, ``activation_coefficients`` (with the
  ``dtype`` they were counted in: the cost model refuses them for a run of another),
  ``end_coefficients``, and ``notes`` recording what was measured and which fields are
  inherited from the base profile (not measured: peak/efficiencies, ``layer_overhead_s``,
  memory, bandwidths, latencies, ``gpus_per_node``). With these coefficients present the cost
  model prices layers, embedding and head from the measurements; the inherited figures only
  price the collectives and transfers.

Only ``main`` prints; the other functions return values.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from longctx.cost_model import mlp_gemm_per_token
from longctx.fitting import nnls

MEASURED_FIELDS = ("name", "machine", "source", "backward_factor", "layer_coefficients",
                   "activation_coefficients", "end_coefficients", "host_layer_forward_s",
                   "host_layer_backward_s", "host_action_s", "host_asynchronous", "notes")
#: Tokens of the slice the host's per-layer-call time is taken on (device work negligible).
HOST_TOKENS = 8
#: Units of the no-op executor run that times the host's per-action work.
HOST_UNITS = 64
#: Measured where the device allows it (see :func:`allocator_overhead`).
ALLOCATOR_FIELD = "allocator_overhead"


# ------------------------------------------------------------------------------------- fitting
def design_matrix(tokens, contexts) -> np.ndarray:
    """Rows ``[(C+s)^2 - C^2, s, 1]`` of eq. 1 for one piece of ``s`` tokens after ``C``."""
    s = np.asarray(tokens, dtype=np.float64)
    c = np.asarray(contexts, dtype=np.float64)
    return np.stack([(c + s) ** 2 - c * c, s, np.ones_like(s)], axis=1)


def fit_coefficients(tokens, contexts, forward_s) -> tuple[float, float, float]:
    """``(alpha1, alpha2, beta) >= 0`` of eq. 1 minimising the relative residuals; a fit in which
    no term grows with the tokens (times of a busy machine) is refused."""
    y = np.asarray(forward_s, dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("forward times must be positive")
    a = design_matrix(tokens, contexts) / y[:, None]
    alpha1, alpha2, beta = nnls(a, np.ones_like(y))
    if alpha1 <= 0 and alpha2 <= 0:
        raise ValueError(
            "the measured forward times do not grow with the tokens (alpha1 and alpha2 both fit "
            "to 0): the machine was busy while profiling or the grid is too small; profile on "
            "an idle machine, with more --repeats or larger --tokens")
    return float(alpha1), float(alpha2), float(beta)


def predict(coefficients, tokens, contexts) -> np.ndarray:
    return design_matrix(tokens, contexts) @ np.asarray(coefficients, dtype=np.float64)


def efficiency_curve(tokens, contexts, forward_s, beta: float, work) -> list[list[float]]:
    """``[[s, efficiency], ...]`` from the ``C = 0`` points (module doc), ``s`` ascending;
    ``work(s)``: the FLOP-derived time of ``s`` tokens, in any unit."""
    rates = {}
    for s, c, t in zip(tokens, contexts, forward_s):
        if c == 0 and t > beta:
            rates[s] = work(s) / (t - beta)
    if len(rates) < 2:
        return []
    best = rates[max(rates)]
    return [[s, min(1.0, rates[s] / best)] for s in sorted(rates)]


def flop_time(hidden: int, mlp: int, base: dict):
    """The cost model's FLOP-derived layer time of ``s`` tokens with ``base``'s efficiencies
    (relative: the peak is left out); ``mlp``: the MLP's multiply-adds per token
    (:func:`longctx.cost_model.mlp_gemm_per_token`)."""
    gemm = 2 * (4 * hidden * hidden + mlp)
    return lambda s: (2 * hidden * s * s / base["attention_efficiency"]
                      + gemm * s / base["matmul_efficiency"])


def allocator_overhead(device) -> float | None:
    """Reserved over allocated peak bytes minus 1 on CUDA; ``None`` elsewhere, and where the
    ratio is 2 or more (a profile takes less than 1; said on stderr). The peaks include the
    layers' weights, which the allocator packs well, so this is a lower bound of the overhead
    on activations alone."""
    import torch

    if device.type != "cuda" or not torch.cuda.max_memory_allocated(device):
        return None
    value = max(0.0, torch.cuda.max_memory_reserved(device)
                / torch.cuda.max_memory_allocated(device) - 1.0)
    if value >= 1.0:
        print(f"warning: the allocator reserved {1 + value:.2f}x the bytes allocated; not "
              f"written as allocator_overhead (a profile takes less than 1)", file=sys.stderr)
        return None
    return value


def fit_backward_factor(forward_s, backward_s) -> float:
    """Mean of backward/forward (least squares through the origin on relative residuals)."""
    f = np.asarray(forward_s, dtype=np.float64)
    b = np.asarray(backward_s, dtype=np.float64)
    return float(np.mean(b / f))


# ------------------------------------------------------------------------------------ measuring
def build_layers(args):
    """Megatron start-up on one process (parser, process groups, seeds; CPU compatibility
    without CUDA) and ``args.num_layers_profiled`` Megatron layers."""
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from megatron.plugin import launch
    from megatron.plugin.layers.attention import RopeSettings, document_layer_spec
    from megatron.plugin.model import model_config

    # the longest slice with its context, and the one-layer model's longest batch
    longest = max(max(args.tokens) + max(args.contexts), 4 * min(args.tokens))
    flags = ["--num-layers", str(args.num_layers_profiled), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(args.num_attention_heads),
             "--seq-length", str(longest), "--max-position-embeddings", str(longest),
             "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
             "--lr", "1e-4", "--seed", str(args.seed), "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(args.vocab_size),
             "--attention-dropout", str(args.attention_dropout),
             "--hidden-dropout", str(args.hidden_dropout)]
    if args.ffn_hidden_size is not None:
        flags += ["--ffn-hidden-size", str(args.ffn_hidden_size)]
    flags += architecture_flags(args)
    if args.num_experts is not None:
        flags += ["--num-experts", str(args.num_experts), "--moe-router-topk",
                  str(args.moe_router_topk)]
        if not args.disable_bias_linear:
            flags.append("--disable-bias-linear")
        if args.moe_ffn_hidden_size is not None:
            flags += ["--moe-ffn-hidden-size", str(args.moe_ffn_hidden_size)]
        if args.moe_shared_expert_intermediate_size is not None:
            flags += ["--moe-shared-expert-intermediate-size",
                      str(args.moe_shared_expert_intermediate_size)]
        if args.moe_shared_expert_gate:
            flags += ["--moe-shared-expert-gate"]
        if args.moe_router_dtype is not None:
            flags += ["--moe-router-dtype", args.moe_router_dtype]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(29500 + os.getpid() % 20000))):
        os.environ.setdefault(name, value)
    train_args = launch.initialize(flags)
    config = model_config(train_args)
    rope = None
    if train_args.position_embedding_type == "rope":
        rope = RopeSettings(rotary_base=train_args.rotary_base,
                            rotary_percent=train_args.rotary_percent)
    spec = document_layer_spec(args.num_layers_profiled, train_args.normalization, rope,
                               qk_layernorm=train_args.qk_layernorm,
                               num_experts=train_args.num_experts)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    layers = [build_module(layer_spec, config=config, layer_number=i + 1).to(device).train()
              for i, layer_spec in enumerate(spec.layer_specs)]
    return layers, config, train_args, device


def architecture_flags(args) -> list[str]:
    """The training flags of the layer's architecture that ``args`` gives (as the job's)."""
    flags = ["--normalization", args.normalization,
             "--position-embedding-type", args.position_embedding_type,
             "--rotary-percent", str(args.rotary_percent)]
    if args.group_query_attention:
        flags += ["--num-query-groups", str(args.num_query_groups)]
    for name in ("group_query_attention", "swiglu", "qk_layernorm", "disable_bias_linear"):
        if getattr(args, name):
            flags.append("--" + name.replace("_", "-"))
    return flags


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _run(layers, x, layout):
    for layer in layers:
        x, _ = layer(x, attention_mask=None, packed_seq_params=layout)
    return x


def measure_point(layers, hidden, tokens, context, repeats, device, dtype, seed=0,
                  host_only=False):
    """Median ``(forward_s, backward_s)`` per layer on slice ``(tokens, context)``; with
    ``host_only`` the clock stops when the host has issued the work, before waiting for the
    device (the same on a CPU)."""
    import torch

    from megatron.plugin.layers.layout import PackedDocuments, Segment
    from megatron.plugin.layers.kv_store import KVStore

    g = torch.Generator().manual_seed(seed)
    store = KVStore()
    if context > 0:
        first = torch.randn(context, 1, hidden, generator=g, dtype=dtype).to(device)
        record = PackedDocuments(segments=((Segment(0, context, "doc", 0),),),
                                 position_ids=torch.arange(context).unsqueeze(0),
                                 kv_store=store, record_kv=True)
        _run(layers, first.requires_grad_(), record)
    x = torch.randn(tokens, 1, hidden, generator=g, dtype=dtype).to(device)
    grad = torch.randn(tokens, 1, hidden, generator=g, dtype=dtype).to(device)
    layout = PackedDocuments(
        segments=((Segment(0, tokens, "doc", 1 if context else 0),),),
        position_ids=torch.arange(context, context + tokens).unsqueeze(0),
        kv_store=store, record_kv=False)
    forwards, backwards = [], []
    for step in range(repeats + 1):  # step 0 is the warm-up
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        _sync(device)
        start = time.perf_counter()
        out = _run(layers, inp, layout)
        issued = time.perf_counter()
        _sync(device)
        middle = time.perf_counter()
        torch.autograd.backward(out, grad)
        issued_back = time.perf_counter()
        _sync(device)
        end = time.perf_counter()
        if step:
            forwards.append((issued if host_only else middle) - start)
            backwards.append((issued_back if host_only else end) - middle)
    store.clear()
    n = len(layers)
    return statistics.median(forwards) / n, statistics.median(backwards) / n


def host_layer_times(layers, hidden, repeats, device, dtype, seed=0):
    """Host ``(forward_s, backward_s)`` of one layer call: the layers on a slice of
    :data:`HOST_TOKENS` tokens, whose device work is negligible beside the launches, timed up
    to the host's return (:func:`measure_point` with ``host_only``)."""
    return measure_point(layers, hidden, HOST_TOKENS, 0, repeats, device, dtype, seed=seed,
                         host_only=True)


def host_action_time(device, units: int, repeats: int) -> float:
    """Host seconds of one forward or backward action outside its layers: the executor
    (:func:`megatron.plugin.pipeline.executor.run_schedule`) runs ``units`` forwards and
    backwards of a one-stage 1F1B over a one-weight stand-in model, the median of
    ``repeats`` runs after a warm-up; the stand-in's own forward and backward, timed alone the
    same number of times, are taken off. No extension runs (a schedule's hooks add to it)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from megatron.plugin.pipeline import executor
    from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
    from megatron.plugin.pipeline.stage_context import StageContext

    class Stage(torch.nn.Linear):
        """A one-weight stand-in for a pipeline stage: what the executor needs of a model."""

        def set_input_tensor(self, tensor):
            """Megatron's ``forward_step`` hands it the received input (none here)."""

    stage = Stage(1, 1, bias=False).to(device)
    stage.config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    x = torch.ones(1, 1, device=device)

    def loss_func(output):
        return output.sum(), {}

    def step(data_iterator, model):
        return model(x), loss_func

    actions = one_f_one_b(1, units)[0]
    groups = ProcessGroupCollection.use_mpu_process_groups()
    pp_group = parallel_state.get_pipeline_model_parallel_group()

    def run_executor():
        ctx = StageContext(forward_step_func=step, data_iterator=None, model=stage,
                           num_microbatches=units, shape_of=None, pp_group=pp_group,
                           pg_collection=groups, is_first_stage=True, is_last_stage=True)
        executor.run_schedule(list(actions), ctx)

    def run_model():
        for _ in range(units):
            stage(x).sum().backward()

    seconds = []
    for run in (run_executor, run_model):
        times = []
        for step_index in range(repeats + 1):  # step 0 is the warm-up
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            if step_index:
                times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return max(0.0, seconds[0] - seconds[1]) / (2 * units)


def one_layer_model(config, device):
    """A one-layer ``GPTModel`` of the profiled flags (embedding, layer, head), in training
    mode (the training script's model provider)."""
    import dataclasses

    from megatron.plugin.model import model_provider

    model = model_provider(config=dataclasses.replace(config, num_layers=1))
    return model.to(device).train()


def activation_coefficients(args, config, layers, device) -> dict:
    """Activation bytes per token, counted by the training loop's saved-tensor meter on the real
    layer and a one-layer ``GPTModel`` of the same flags (see the module docstring).

    Every quantity is measured at ``s`` and ``2 s`` tokens (``s`` = the smallest grid point) and
    taken as the slope, which drops per-call constants such as the loss scalar.
    """
    import torch

    from megatron.plugin.batches import forward_step, micro_batch, pack_row
    from megatron.plugin.layers.kv_store import KVStore
    from megatron.plugin.layers.memory import SavedTensorMeter
    from megatron.plugin.pipeline.layer_checkpoint import LeadingLayers

    model = one_layer_model(config, device)
    leading = LeadingLayers(model)
    generator = torch.Generator().manual_seed(args.seed)

    def counted(run) -> int:
        meter = SavedTensorMeter()
        with meter.active():
            kept = run()
            return meter.current, kept

    def batch(tokens: int, slice_index: int = 0, offset: int = 0):
        doc = torch.randint(0, args.vocab_size, (tokens + 1,), generator=generator).numpy()
        return micro_batch([pack_row([doc], slices=[("doc", slice_index, offset)])])

    def model_bytes(tokens: int, checkpointed: int = 0, record: bool = False) -> int:
        def run():
            store = KVStore()
            with leading.armed(checkpointed):
                output, loss = forward_step(iter([batch(tokens)]), model, store, record)
            return output, loss(output), store, leading.take()
        return counted(run)[0]

    def embedding_bytes(tokens: int) -> int:
        def run():
            data = batch(tokens)
            return model.embedding(input_ids=data.tokens.to(device),
                                   position_ids=data.position_ids.to(device))
        return counted(run)[0]

    def layer_bytes(tokens: int) -> int:
        dtype = next(layers[0].parameters()).dtype
        x = torch.randn(tokens, 1, args.hidden_size, generator=generator).to(device, dtype)
        return counted(lambda: _run(layers[:1], x.requires_grad_(), None))[0]

    def dkv_bytes(tokens: int) -> int:
        """Bytes the dK/dV accumulators of a first slice add once a later slice's backward
        has run (one layer)."""
        meter = SavedTensorMeter()
        store = KVStore()
        with meter.active():
            # the first slice's graph (``first``) stays alive across both counts
            first, _ = forward_step(iter([batch(tokens)]), model, store, True)
            before = meter.current
            later, loss = forward_step(iter([batch(8, 1, tokens)]), model, store, False)
            torch.autograd.backward(loss(later)[0])
            return meter.current - before

    def slope(measure) -> float:
        s = min(args.tokens)
        return (measure(2 * s) - measure(s)) / s

    layer = slope(layer_bytes)
    full = slope(model_bytes)
    embedding = slope(embedding_bytes)
    checkpointed = slope(lambda t: model_bytes(t, checkpointed=1))
    kv = slope(lambda t: model_bytes(t, checkpointed=1, record=True)) - checkpointed
    return dict(layer=layer, checkpointed=layer - (full - checkpointed), kv=kv,
                dkv=slope(dkv_bytes),
                embedding=embedding, head=full - embedding - layer,
                hidden_size=args.hidden_size, vocab_size=model.vocab_size, sp=1, tp=1,
                dtype=str(config.params_dtype).removeprefix("torch."),
                mlp=layer_model(args, config).mlp_label)


def layer_model(args, config):
    """The cost model's shape of the profiled layer (its MLP: dense or the experts)."""
    from longctx.models import ModelConfig

    return ModelConfig("profiled", 1, args.hidden_size, args.num_attention_heads,
                       config.ffn_hidden_size, args.vocab_size,
                       gated_mlp=config.gated_linear_unit,
                       num_experts=config.num_moe_experts or 0,
                       moe_router_topk=config.moe_router_topk,
                       moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                       moe_shared_expert_intermediate_size=(
                           config.moe_shared_expert_intermediate_size),
                       moe_shared_expert_gate=config.moe_shared_expert_gate,
                       moe_router_dtype=config.moe_router_dtype)


def end_times(args, config, device) -> dict[str, list[float]]:
    """Median seconds of the embedding and of the head (final norm, output layer, loss), forward
    and backward, at each ``--tokens`` count: one training micro-batch (``forward_step`` and
    its loss) through a one-layer ``GPTModel`` of the job's flags, cut at the decoder's input
    and at the final norm's input by hooks that stamp the clock (forward) and by gradient hooks
    on those two tensors (backward)."""
    import torch

    from megatron.plugin.batches import forward_step, micro_batch, pack_row

    model = one_layer_model(config, device)
    generator = torch.Generator().manual_seed(args.seed)
    clock: dict[str, float] = {}

    def stamp(name):
        _sync(device)
        clock[name] = time.perf_counter()

    def entering(name):
        def hook(module, inputs, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else inputs[0]
            stamp(name)
            hidden.register_hook(lambda grad: stamp(f"{name} grad"))
        return hook

    handles = [model.decoder.register_forward_pre_hook(entering("decoder"), with_kwargs=True),
               model.decoder.final_layernorm.register_forward_pre_hook(entering("head"),
                                                                        with_kwargs=True)]
    times = {key: [] for key in ("embedding_forward", "embedding_backward", "head_forward",
                                 "head_backward")}
    for tokens in args.tokens:
        doc = torch.randint(0, args.vocab_size, (tokens + 1,), generator=generator).numpy()
        batch = micro_batch([pack_row([doc])])
        runs = []
        for step in range(args.repeats + 1):  # step 0 is the warm-up
            model.zero_grad(set_to_none=True)
            stamp("start")
            output, loss_func = forward_step(iter([batch]), model)
            loss = loss_func(output)[0]
            stamp("loss")
            loss.backward()
            stamp("end")
            if step:
                runs.append((clock["decoder"] - clock["start"],
                             clock["end"] - clock["decoder grad"],
                             clock["loss"] - clock["head"],
                             clock["head grad"] - clock["loss"]))
        for key, values in zip(times, zip(*runs)):
            times[key].append(statistics.median(values))
    for handle in handles:
        handle.remove()
    return times, model.vocab_size


def fit_linear(tokens, seconds) -> tuple[float, float]:
    """``(seconds per token, seconds per call) >= 0`` minimising the relative residuals."""
    y = np.asarray(seconds, dtype=np.float64)
    a = np.stack([np.asarray(tokens, dtype=np.float64), np.ones_like(y)], axis=1)
    per_token, constant = nnls(a / y[:, None], np.ones_like(y))
    return float(per_token), float(constant)


def machine_description(threads: int, device) -> str:
    import torch

    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(0)
    else:
        hardware = platform.processor() or platform.machine() or "unknown CPU"
    return f"{platform.node()} {hardware} (torch {torch.__version__}, {threads} threads)"


def base_profile_dict(name_or_path: str) -> dict:
    from longctx.hardware import load_profile

    profile = load_profile(name_or_path)
    return dataclasses.asdict(profile)


def build_profile(base: dict, base_name: str, description: str, coefficients, backward_factor,
                  hidden_size: int, grid: str, fit_error: tuple[float, float],
                  activations: dict, ends: dict, host: dict, overhead: float | None = None,
                  mlp: str = "dense") -> dict:
    """The measured profile's JSON object (see the module docstring)."""
    alpha1, alpha2, beta = coefficients
    data = dict(base)
    data.pop("kernel_efficiency", None)  # the fit prices the chunk size itself
    measured = MEASURED_FIELDS
    if overhead is not None:
        data[ALLOCATOR_FIELD] = overhead
        measured += (ALLOCATOR_FIELD,)
    data.update(
        name=description,
        machine=description,
        source="measured",
        backward_factor=backward_factor,
        layer_coefficients=dict(alpha1=alpha1, alpha2=alpha2, beta=beta,
                                hidden_size=hidden_size, sp=1, tp=1, mlp=mlp),
        activation_coefficients=activations,
        end_coefficients=ends,
        **host,
    )
    inherited = [key for key in base if key not in measured and key != "kernel_efficiency"]
    notes = {
        "measured": (f"wall-clock forward and backward of one Megatron transformer layer "
                     f"(document_layer_spec, DocumentAttention) on {description}, {grid}; "
                     f"{datetime.date.today().isoformat()}"),
        "layer_coefficients": (f"NNLS fit of eq. 1 (alpha1 ((C+s)^2-C^2) + alpha2 s + beta) on "
                               f"relative residuals; fit relative error max {fit_error[0]:.4f} "
                               f"mean {fit_error[1]:.4f}; hidden {hidden_size}, sp 1, tp 1, "
                               f"{mlp} MLP"),
        "backward_factor": "measured: mean of backward/forward time over the grid",
        "activation_coefficients": ("measured: bytes per token counted by the training loop's "
                                    "saved-tensor meter (slope between two token counts)"),
        "end_coefficients": ("measured: embedding and head (final norm, output layer, loss) "
                             "forward and backward of a one-layer GPTModel, cut by hooks, "
                             "median per token count; NNLS fit of seconds per token and per "
                             "chunk"),
        "host_layer_forward_s": (f"measured: host time of one layer's forward call on "
                                 f"{HOST_TOKENS} tokens, timed up to the host's return "
                                 f"(median)"),
        "host_layer_backward_s": "measured: the same for the layer's backward",
        "host_action_s": (f"measured: the executor's run of a one-stage 1F1B of {HOST_UNITS} "
                          f"units over a one-weight stand-in model, less the stand-in's own "
                          f"forwards and backwards, per action (median); no extension hooks"),
        "host_asynchronous": ("the device runs launched work while the host goes on (CUDA)"
                              if host["host_asynchronous"] else
                              "a CPU: the host computes the layers itself"),
        **({ALLOCATOR_FIELD: "measured: CUDA caching allocator's peak reserved over peak "
                             "allocated bytes over the grid, minus 1"} if overhead is not None
           else {}),
        "inherited": (f"copied from base profile {base_name!r}, NOT measured: "
                      f"{', '.join(inherited)}"),
    }
    for key, text in (base.get("notes") or {}).items():
        if key not in measured and key != "kernel_efficiency":
            notes[key] = f"inherited from {base_name} (not measured): {text}"
    data["notes"] = notes
    return data


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers-profiled", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--num-attention-heads", type=int, required=True)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="as the job's flag: a mixture-of-experts layer (default: dense)")
    parser.add_argument("--moe-router-topk", type=int, default=2,
                        help="as the job's flag (Megatron's default 2)")
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                        help="as the job's flag (default: the ffn width)")
    parser.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                        help="as the job's flag (default: no shared expert)")
    parser.add_argument("--moe-shared-expert-gate", action="store_true",
                        help="as the job's flag")
    parser.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                        help="as the job's flag (default: the model's dtype)")
    parser.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"),
                        default="LayerNorm", help="as the job's flag")
    parser.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                        default="learned_absolute", help="as the job's flag")
    parser.add_argument("--rotary-percent", type=float, default=1.0,
                        help="as the job's flag (with --position-embedding-type rope)")
    parser.add_argument("--swiglu", action="store_true", help="as the job's flag")
    parser.add_argument("--group-query-attention", action="store_true",
                        help="as the job's flag, with --num-query-groups")
    parser.add_argument("--num-query-groups", type=int, default=1,
                        help="as the job's flag (read with --group-query-attention)")
    parser.add_argument("--qk-layernorm", action="store_true", help="as the job's flag")
    parser.add_argument("--disable-bias-linear", action="store_true",
                        help="as the job's flag (implied by --num-experts)")
    parser.add_argument("--tokens", type=int, nargs="+", required=True,
                        help="slice lengths s of the grid")
    parser.add_argument("--contexts", type=int, nargs="+", default=[0],
                        help="context lengths C (K/V of earlier slices) of the grid")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-dropout", type=float, default=0.1,
                        help="as the job's flag (Megatron's default 0.1)")
    parser.add_argument("--hidden-dropout", type=float, default=0.1,
                        help="as the job's flag (Megatron's default 0.1)")
    parser.add_argument("--vocab-size", type=int, default=257,
                        help="tokenizer vocabulary before Megatron's padding (the embedded "
                             "corpus: 257); the head's activation bytes depend on it")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--base-profile", default="a800",
                        help="shipped profile name or JSON path the unmeasured fields come from")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if args.num_layers_profiled < 1 or args.repeats < 1:
        parser.error("--num-layers-profiled and --repeats must be >= 1")
    if args.num_experts is not None and not 1 <= args.moe_router_topk <= args.num_experts:
        parser.error("--num-experts must be >= 1 and --moe-router-topk in [1, --num-experts]")
    if args.num_experts is None and (args.moe_ffn_hidden_size is not None
                                     or args.moe_shared_expert_intermediate_size is not None
                                     or args.moe_router_dtype is not None):
        parser.error("--moe-ffn-hidden-size, --moe-shared-expert-intermediate-size and "
                     "--moe-router-dtype shape the experts: give --num-experts too")
    if args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size is None:
        parser.error("--moe-shared-expert-gate gates the shared expert: give "
                     "--moe-shared-expert-intermediate-size too")
    if min(args.tokens) < 1 or min(args.contexts) < 0:
        parser.error("--tokens must be >= 1 and --contexts >= 0")
    if len(args.tokens) * len(args.contexts) < 3 or len(set(args.tokens)) < 2:
        parser.error("the grid needs at least 3 points and 2 distinct --tokens to fit 3 "
                     "coefficients")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    threads = torch.get_num_threads()
    try:
        base = base_profile_dict(args.base_profile)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    layers, config, _, device = build_layers(args)
    description = machine_description(threads, device)
    print(f"profiling {args.num_layers_profiled} layer(s), hidden {args.hidden_size}, "
          f"heads {args.num_attention_heads}, ffn {config.ffn_hidden_size} on {description}")
    points = [(s, c) for c in args.contexts for s in args.tokens]
    forwards, backwards = [], []
    for s, c in points:
        f, b = measure_point(layers, args.hidden_size, s, c, args.repeats, device,
                             config.params_dtype, seed=args.seed)
        forwards.append(f)
        backwards.append(b)
    tokens = [s for s, _ in points]
    contexts = [c for _, c in points]
    try:
        coefficients = fit_coefficients(tokens, contexts, forwards)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    factor = fit_backward_factor(forwards, backwards)
    fitted = predict(coefficients, tokens, contexts)
    errors = np.abs(fitted - np.asarray(forwards)) / np.asarray(forwards)
    print(f"{'tokens':>7} {'context':>8} {'fwd ms':>10} {'bwd ms':>10} {'fit ms':>10} "
          f"{'rel err':>8}")
    for (s, c), f, b, p, e in zip(points, forwards, backwards, fitted, errors):
        print(f"{s:>7} {c:>8} {f * 1e3:>10.3f} {b * 1e3:>10.3f} {p * 1e3:>10.3f} {e:>8.4f}")
    alpha1, alpha2, beta = coefficients
    print(f"alpha1 {alpha1:.6e} s  alpha2 {alpha2:.6e} s  beta {beta:.6e} s  "
          f"backward_factor {factor:.4f}")
    fit_error = (float(errors.max()), float(errors.mean()))
    print(f"fit relative error: max {fit_error[0]:.4f} mean {fit_error[1]:.4f}")
    shape = layer_model(args, config)
    curve = efficiency_curve(tokens, contexts, forwards, beta, flop_time(
        args.hidden_size, mlp_gemm_per_token(shape), base))
    if curve:
        print("kernel efficiency (FLOP rate over the largest chunk's; for a spec-derived "
              "profile of this machine): " + json.dumps(
                  {"kernel_efficiency": [[s, round(e, 4)] for s, e in curve]}))
    overhead = allocator_overhead(device)
    grid = (f"tokens {args.tokens} x contexts {args.contexts}, median of {args.repeats} after a "
            f"warm-up, {args.num_layers_profiled} layer(s), ffn {config.ffn_hidden_size}, "
            f"{shape.mlp_label} MLP, {str(config.params_dtype).replace('torch.', '')}")
    activations = activation_coefficients(args, config, layers, device)
    print("activation bytes per token: " + ", ".join(
        f"{key} {activations[key]:.1f}"
        for key in ("layer", "checkpointed", "kv", "dkv", "embedding", "head")))
    measured_ends, vocab = end_times(args, config, device)
    ends = dict(hidden_size=args.hidden_size, vocab_size=vocab, sp=1, tp=1)
    for key, seconds in measured_ends.items():
        ends[key] = fit_linear(args.tokens, seconds)
        print(f"{key}: {ends[key][0] * 1e6:.4f} us per token + {ends[key][1] * 1e3:.3f} ms "
              f"(measured ms: {', '.join(f'{t * 1e3:.2f}' for t in seconds)})")
    host_forward, host_backward = host_layer_times(
        layers, args.hidden_size, args.repeats, device, config.params_dtype, seed=args.seed)
    host = dict(host_layer_forward_s=host_forward, host_layer_backward_s=host_backward,
                host_action_s=host_action_time(device, HOST_UNITS, args.repeats),
                host_asynchronous=device.type == "cuda")
    print(f"host per layer call: forward {host_forward * 1e3:.3f} ms, backward "
          f"{host_backward * 1e3:.3f} ms; per action outside the layers "
          f"{host['host_action_s'] * 1e3:.3f} ms")
    data = build_profile(base, args.base_profile, description, coefficients, factor,
                         args.hidden_size, grid, fit_error, activations, ends, host, overhead,
                         shape.mlp_label)
    from longctx.hardware import profile_from_dict

    profile_from_dict(data)  # refuse to write a profile the loader would reject
    Path(args.output).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.output}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

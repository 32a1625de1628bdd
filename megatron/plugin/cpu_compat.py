"""CPU compatibility layer for megatron-core 0.17 to 0.19.

megatron-core hard-codes CUDA in a handful of places (token counters and autocast in the
pipeline schedules, shape tensors, receive buffers and ``synchronize`` in the p2p code, DDP grad
buffers, the optimizer's scale tensors, gradient clipping, sequence-parallel gather buffers,
the tied-embedding all-reduce, the checkpoint writer's synchronisation). On a machine without CUDA
those spots fail, so the real ``GPTModel``, Megatron DDP, Megatron's optimizer and Megatron's own
1F1B and interleaved schedules could not run under gloo.

Choice: rather than editing megatron-core or monkey-patching ``torch`` globally, each affected
megatron-core module gets its own module-level name ``torch`` rebound to a :class:`_CpuTorch`
proxy. The proxy forwards every attribute to the real ``torch`` except:

* tensor factories (``zeros``, ``ones``, ``empty``, ``tensor``, ``full``, ``arange``) whose
  ``device`` names CUDA: the device becomes the CPU;
* ``torch.autocast("cuda", ...)``: becomes CPU autocast;
* ``torch.cuda``: a shim whose ``current_device()`` answers the CPU device, whose
  ``synchronize``/``empty_cache`` do nothing and whose streams are no-op contexts.

Two spots are not reachable through a module's ``torch`` name: a method that calls
``tensor.cuda()`` (the tied-embedding all-reduce in ``LanguageModule``), wrapped so that
``Tensor.cuda`` is the identity for the duration of that call only (:data:`_METHODS`); and a
function that asserts CUDA tensors (gradient clipping), replaced by a device-agnostic twin with
the same arithmetic (:data:`_FUNCTIONS`).

The distributed optimizer sorts each parameter by its tensor type's name, and accepts only
CUDA ones (``torch.cuda.FloatTensor`` ...): while it builds its parameter shards
(:data:`_TYPE_NAMED_METHODS`), ``Tensor.type()`` names a CPU tensor's type as its CUDA twin.

Megatron's DDP averages the gradients in its collectives under ``--ddp-average-in-collective``
(``ReduceOp.AVG``), which older torch releases' gloo lacks: a patched module's
``torch.distributed`` is a proxy too (:class:`_Distributed`), whose ``all_reduce`` computes a
gloo group's AVG of a floating-point tensor as NCCL does, and so does the DDP buffer's
reduce-scatter (:func:`_averaging_reduce_scatter`); every other collective is torch's. With
several distributed optimizer instances megatron-core's DDP creates a communication stream
(``torch.cuda.Stream``), a stand-in here like every stream.

Megatron's fused SwiGLU (``--swiglu`` with its default ``--bias-swiglu-fusion``) wraps its
forward and backward functions in ``torch.compile``, which on the CPU compiles C++ kernels with
the host compiler at the first call of every new shape: tens of seconds, silent, in the first
iterations. On the CPU those functions run as written (:data:`_EAGER`): the same autograd
function, the same saved tensor (its input), the same formula, no compilation.

Spots that need no patch here: the rotary embedding's ``inv_freq`` (the project's attention
builds Megatron's ``RotaryEmbedding`` with ``use_cpu_initialization``) and asynchronous
checkpoint saving (not used). Every listed patch is exercised by the golden tests.

The patch is scoped (only the modules listed in :data:`PATCHED_MODULES`), limited to the
supported megatron-core version, installed only when CUDA is absent, and reversible
(:func:`uninstall`). Every redirected call is counted in :data:`HITS` per module, so tests can
prove that each patched spot is exercised.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import types

import torch

logger = logging.getLogger(__name__)

#: The releases whose CUDA spots are listed below (the golden tests run the oldest and newest).
SUPPORTED_MEGATRON_CORE = ("0.17.", "0.18.", "0.19.")

#: megatron-core modules whose global name ``torch`` is rebound, and why.
PATCHED_MODULES = {
    "megatron.core.pipeline_parallel.schedules": "token counters and autocast",
    "megatron.core.pipeline_parallel.p2p_communication": "shape/receive buffers, synchronize",
    "megatron.core.distributed.param_and_grad_buffer": "grad buffers, communication stream, "
                                                       "averaging collectives on gloo",
    "megatron.core.distributed.distributed_data_parallel": "distributed optimizer instances' "
                                                           "communication stream",
    "megatron.core.optimizer.optimizer": "loss-scale tensors",
    "megatron.core.optimizer.clip_grads": "grad-norm tensors",
    "megatron.core.utils": "l2-norm result tensor, global memory buffer",
    "megatron.core.tensor_parallel.layers": "sequence-parallel gather buffers",
    "megatron.core.tensor_parallel.mappings": "all-gather / reduce-scatter buffers",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "synchronize before save",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "consistency-check tensors",
    "megatron.core.tensor_parallel.random": "RNG tracker seeding (device generator states)",
    "megatron.core.transformer.moe.router": "MoE router weights moved to the device",
    "megatron.core.transformer.moe.token_dispatcher": "all-to-all dispatcher's copy stream",
    "megatron.core.timers": "synchronize around timed spans",
    "megatron.core.rerun_state_machine": "RNG states saved for a rerun",
    "megatron.training.initialize": "device count and selection, seeds",
    "megatron.training.training": "start-time and flag tensors, model placement, DDP stream",
    "megatron.training.checkpointing": "RNG state of the device generator",
    "megatron.training.utils": "0.17: reductions of step statistics over model parallelism",
    "megatron.training.utils.common_utils": "0.18+: reductions of step statistics",
}

#: ``HITS[module][what]``: how many calls the proxy redirected from CUDA to the CPU.
HITS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")
_originals: dict[str, object] = {}


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: waits are no-ops, usable as a context; the event it
    records is the stream itself, whose ``synchronize`` returns at once (the CPU's work is done
    when the call returns)."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def wait_stream(self, other):
        del other

    def synchronize(self):
        return None

    def record_event(self, event=None):
        del event
        return self


class _CudaShim:
    """``torch.cuda`` as seen by a patched module on a machine without CUDA."""

    def __init__(self, module_name: str):
        self._module = module_name

    def current_device(self):
        HITS[self._module]["cuda.current_device"] += 1
        return torch.device("cpu")

    def synchronize(self, *args, **kwargs):
        HITS[self._module]["cuda.synchronize"] += 1

    def empty_cache(self):
        HITS[self._module]["cuda.empty_cache"] += 1

    def is_available(self):
        return False

    def Stream(self, *args, **kwargs):  # noqa: N802 - mirrors torch.cuda.Stream
        HITS[self._module]["cuda.Stream"] += 1
        return _NullStream()

    def default_stream(self, *args, **kwargs):
        HITS[self._module]["cuda.default_stream"] += 1
        return _NullStream()

    def device_count(self):
        HITS[self._module]["cuda.device_count"] += 1
        return 1

    def set_device(self, device):
        del device
        HITS[self._module]["cuda.set_device"] += 1

    def get_rng_state(self, *args, **kwargs):
        HITS[self._module]["cuda.get_rng_state"] += 1
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, *args, **kwargs):
        HITS[self._module]["cuda.set_rng_state"] += 1

    def manual_seed(self, seed):
        del seed
        HITS[self._module]["cuda.manual_seed"] += 1

    def current_stream(self, *args, **kwargs):
        HITS[self._module]["cuda.current_stream"] += 1
        return _NullStream()

    def stream(self, stream):
        del stream
        HITS[self._module]["cuda.stream"] += 1
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _averages_on_gloo(op, tensor, group) -> bool:
    """Whether a reduction is ``ReduceOp.AVG`` of a floating-point tensor over a gloo group."""
    return (op == torch.distributed.ReduceOp.AVG and tensor.is_floating_point()
            and torch.distributed.get_backend(group) == "gloo")


def _average_factor(group, module_name: str, collective: str) -> float:
    """``1 / size`` of ``group``: NCCL's ``ReduceOp.AVG`` of a floating-point tensor sums each
    rank's value multiplied by it in the tensor's dtype (NCCL's PreMulSum), and so do the twins
    here, through a SUM that gloo runs in every supported torch (older releases' gloo has no
    AVG, newer ones divide a sum afterwards; a division after an asynchronous or coalesced
    collective would have to wait for it). At a power-of-two size both orders give the same
    bits."""
    HITS[module_name][f"{collective}.AVG"] += 1
    return 1.0 / torch.distributed.get_world_size(group)


class _Distributed(types.ModuleType):
    """``torch.distributed`` as seen by a patched module on a machine without CUDA:
    ``all_reduce`` with ``ReduceOp.AVG`` of a floating-point tensor over a gloo group premultiplies
    the tensor in place and sums it (:func:`_average_factor`), synchronously or not, inside
    Megatron's coalescing managers too; everything else is ``torch.distributed``'s."""

    def __init__(self, module_name: str):
        super().__init__("torch.distributed")
        self._module = module_name

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if _averages_on_gloo(op, tensor, group):
            with torch.no_grad():
                tensor.mul_(_average_factor(group, self._module, "all_reduce"))
            op = torch.distributed.ReduceOp.SUM
        return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _averaging_reduce_scatter(reduce_scatter):
    """``param_and_grad_buffer``'s reduce-scatter (``dist_reduce_scatter_func``, bound from
    ``torch.distributed`` when the module is imported), whose ``ReduceOp.AVG`` of a
    floating-point input over a gloo group scatters the sum of premultiplied copies of the
    inputs (:func:`_average_factor`; the input is left as it was, as NCCL leaves it)."""
    module_name = "megatron.core.distributed.param_and_grad_buffer"

    def scatter(output, source, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if _averages_on_gloo(op, source, group):
            with torch.no_grad():
                source = source * _average_factor(group, module_name, "reduce_scatter_tensor")
            op = torch.distributed.ReduceOp.SUM
        return reduce_scatter(output, source, op=op, group=group, async_op=async_op)

    return scatter


class _CpuTorch(types.ModuleType):
    """A per-module stand-in for ``torch`` that sends CUDA requests to the CPU."""

    def __init__(self, module_name: str):
        super().__init__("torch")
        self._module = module_name
        self.cuda = _CudaShim(module_name)
        self.distributed = _Distributed(module_name)

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            return self._factory(name, attr)
        return attr

    def _factory(self, name, fn):
        module = self._module

        def create(*args, **kwargs):
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
                HITS[module][name] += 1
            return fn(*args, **kwargs)

        return create

    def autocast(self, device_type="cuda", *args, **kwargs):
        if device_type == "cuda":
            HITS[self._module]["autocast"] += 1
            device_type = "cpu"
        return torch.autocast(device_type, *args, **kwargs)


def megatron_core_version() -> str:
    """The installed distribution's version (``package_info`` appends the git hash of the
    working directory's repository to it)."""
    return importlib.metadata.version("megatron-core")


def install(force: bool = False) -> bool:
    """Install the proxies when CUDA is absent (or ``force``). Returns whether installed.

    Idempotent. Raises ``RuntimeError`` on an unsupported megatron-core version, because the
    list of patched spots is only known to be complete for the supported releases.
    """
    if torch.cuda.is_available() and not force:
        return False
    version = megatron_core_version()
    if not version.startswith(SUPPORTED_MEGATRON_CORE):
        raise RuntimeError(
            f"The CPU compatibility layer supports megatron-core {SUPPORTED_MEGATRON_CORE}, "
            f"found {version}: install megatron-core>=0.17.0,<0.20 or run on a CUDA machine."
        )
    for name in installed_modules():
        if name in _originals:
            continue
        module = importlib.import_module(name)
        _originals[name] = module.torch
        module.torch = _CpuTorch(name)
    _replace_functions()
    _run_eagerly()
    _wrap_methods()
    _name_types_as_cuda()
    _patch_rng_tracker()
    logger.debug("CPU compatibility layer installed for %d modules", len(_originals))
    return True


def uninstall() -> None:
    """Restore the real ``torch`` in every patched module."""
    for name, original in _originals.items():
        module_name, _, attr = name.partition(":")
        owner = importlib.import_module(module_name)
        path = (attr or "torch").split(".")
        for part in path[:-1]:
            owner = getattr(owner, part)
        setattr(owner, path[-1], original)
    _originals.clear()


def installed() -> bool:
    return bool(_originals)


def installed_modules() -> list[str]:
    """The modules of :data:`PATCHED_MODULES` that the installed release has as modules.

    Some moved between releases (``megatron.training.utils`` is a module in 0.17 and a
    package from 0.18 on, its functions in ``utils.common_utils``); each release gets the
    names it has, and the golden tests check that each of those is exercised.
    """
    names = []
    for name in PATCHED_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:  # its parent is a module, not a package, in this release
            continue
        if hasattr(importlib.import_module(name), "__path__"):
            continue  # a package: its functions live in a submodule listed on its own
        names.append(name)
    return names


def patched_modules() -> set[str]:
    """Every megatron module touched by the layer (proxies, twins, wrappers, RNG fork)."""
    owners = {name.partition(":")[0]
              for name in (*_FUNCTIONS, *_WRAPPED, *_METHODS, *_TYPE_NAMED_METHODS, *_EAGER)}
    return set(installed_modules()) | owners | {"megatron.core.tensor_parallel.random"}


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Device-agnostic twin of ``clip_grad_by_total_norm_fp32`` (which asserts CUDA tensors).

    Same arithmetic: every fp32 gradient is scaled in place by ``max_norm / (total_norm + 1e-6)``
    when that coefficient is below one.
    """
    HITS["megatron.core.optimizer.optimizer"]["clip_grad_by_total_norm_fp32"] += 1
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


def _get_device_rng_state(*args, **kwargs) -> torch.Tensor:
    """CPU twin of ``_get_cuda_rng_state`` (activation recomputation saves RNG states).

    There is no device generator without CUDA: the state is an empty tensor. The CPU
    generator, which drives dropout on the CPU, is saved and restored by the caller
    (``_get_all_rng_states`` / ``_set_all_rng_states``) already.
    """
    del args, kwargs
    HITS["megatron.core.tensor_parallel.random"]["get_cuda_rng_state"] += 1
    return torch.empty(0, dtype=torch.uint8)


def _set_device_rng_state(new_state, *args, **kwargs) -> None:
    """CPU twin of ``_set_cuda_rng_state``: nothing to restore (see the getter)."""
    del new_state, args, kwargs
    HITS["megatron.core.tensor_parallel.random"]["set_cuda_rng_state"] += 1


def _no_fusion_warmup(*args, **kwargs) -> None:
    """CPU twin of ``set_jit_fusion_options``: the warm-up compiles CUDA fusion kernels on
    random CUDA tensors; on the CPU there is nothing to compile, and its draws would move the
    CPU generator that initialises the weights."""
    del args, kwargs
    HITS["megatron.training.training"]["set_jit_fusion_options"] += 1


def _no_device_arch() -> int:
    """CPU twin of ``get_device_arch_version`` (which queries CUDA device 0): Megatron's argument
    validation asks it whether tensor or context parallelism needs
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (below Blackwell's 10). Without a device there are no
    CUDA connections to order: answer 10, the first architecture without that requirement."""
    HITS["megatron.training.arguments"]["get_device_arch_version"] += 1
    return 10


def _host_values(tensor, as_numpy: bool = False, record_stream: bool = False):
    """CPU twin of ``maybe_move_tensor_to_cpu`` (the all-to-all dispatcher's copy of its token
    counts to the host, which copies CUDA tensors only): a CPU tensor is on the host already,
    and is returned as a NumPy array where asked (the split sizes of the all-to-all, which
    the collective takes as a sequence of numbers, not as a tensor)."""
    del record_stream
    HITS["megatron.core.transformer.moe.token_dispatcher"]["maybe_move_tensor_to_cpu"] += 1
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


#: ``"module:function"`` -> CPU twin, rebound in that module's namespace.
_FUNCTIONS = {
    "megatron.training.arguments:get_device_arch_version": _no_device_arch,
    "megatron.training.training:set_jit_fusion_options": _no_fusion_warmup,
    "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32": _clip_grad_by_total_norm,
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": _get_device_rng_state,
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": _set_device_rng_state,
    "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu": _host_values,
}


def _allow_no_cuda(initialize_megatron):
    """``initialize_megatron`` asserts CUDA unless told ``allow_no_cuda``."""

    def initialize(*args, **kwargs):
        HITS["megatron.training.training"]["initialize_megatron"] += 1
        return initialize_megatron(*args, **dict(kwargs, allow_no_cuda=True))

    return initialize


def _models_stay_on_the_cpu(get_model):
    """``get_model`` moves every model chunk with ``Module.cuda``: identity during the call."""

    def build(*args, **kwargs):
        with _cuda_is_identity("megatron.training.training"):
            return get_model(*args, **kwargs)

    return build


#: ``"module:function"`` -> wrapper factory, applied to the function in that module.
_WRAPPED = {
    "megatron.training.training:initialize_megatron": _allow_no_cuda,
    "megatron.training.training:get_model": _models_stay_on_the_cpu,
    "megatron.core.distributed.param_and_grad_buffer:dist_reduce_scatter_func":
        _averaging_reduce_scatter,
}


def _replace_functions() -> None:
    replacements = {**_FUNCTIONS, **{name: None for name in _WRAPPED}}
    for name, replacement in replacements.items():
        if name in _originals:
            continue
        module_name, _, attr = name.partition(":")
        module = importlib.import_module(module_name)
        _originals[name] = getattr(module, attr)
        if replacement is None:
            replacement = _WRAPPED[name](_originals[name])
        setattr(module, attr, replacement)


#: megatron-core modules whose ``torch.compile``'d functions run as written on the CPU.
_EAGER = {
    "megatron.core.fusions.fused_bias_swiglu": "Megatron's fused SwiGLU (forward, backward)",
}


def _run_eagerly() -> None:
    """Rebind each compiled function of the :data:`_EAGER` modules to the function it compiles
    (``torch.compile`` keeps it as ``_torchdynamo_orig_callable``); callers inside the module
    look the names up at call time, so they call the uncompiled function."""
    for module_name in _EAGER:
        module = importlib.import_module(module_name)
        for attr, value in list(vars(module).items()):
            original = getattr(value, "_torchdynamo_orig_callable", None)
            name = f"{module_name}:{attr}"
            if original is None or name in _originals:
                continue
            _originals[name] = value

            def eager(*args, _function=original, _module=module_name, _attr=attr, **kwargs):
                HITS[_module][f"eager {_attr}"] += 1
                return _function(*args, **kwargs)

            setattr(module, attr, eager)


#: ``"module:Class.method"`` during which ``Tensor.cuda`` returns the tensor itself.
_METHODS = {
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.setup_embeddings_and_output_layer": "tied-embedding all-reduce",
}


@contextlib.contextmanager
def _cuda_is_identity(module_name: str):
    """``Tensor.cuda`` and ``Module.cuda`` return their object unchanged, for the duration."""
    originals = torch.Tensor.cuda, torch.nn.Module.cuda

    def stay(obj, *args, **kwargs):
        del args, kwargs
        kind = "Tensor" if isinstance(obj, torch.Tensor) else "Module"
        HITS[module_name][f"{kind}.cuda"] += 1
        return obj

    torch.Tensor.cuda = torch.nn.Module.cuda = stay
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda = originals


def _class_attribute(name: str) -> tuple[str, type, str]:
    """``(module name, class, attribute name)`` of ``"module:Class.attribute"``."""
    module_name, _, attr = name.partition(":")
    class_name, _, attribute = attr.partition(".")
    return module_name, getattr(importlib.import_module(module_name), class_name), attribute


def _wrap_methods() -> None:
    for name in _METHODS:
        if name in _originals:
            continue
        module_name, cls, method_name = _class_attribute(name)
        method = getattr(cls, method_name)
        _originals[name] = method

        def wrapped(*args, _method=method, _module=module_name, **kwargs):
            with _cuda_is_identity(_module):
                return _method(*args, **kwargs)

        setattr(cls, method_name, wrapped)


#: ``"module:Class.classmethod"`` during which ``Tensor.type()`` names CUDA types.
_TYPE_NAMED_METHODS = {
    "megatron.core.optimizer.distrib_optimizer:"
    "DistributedOptimizer._build_model_and_main_param_groups": "fp32 / fp16 parameter shards",
}


@contextlib.contextmanager
def _types_named_as_cuda(module_name: str):
    """``Tensor.type()`` (without a target type) answers ``torch.cuda.FloatTensor`` for a CPU
    ``torch.FloatTensor`` (and so on), for the duration; with a target it converts as ever."""
    original = torch.Tensor.type

    def named(tensor, *args, **kwargs):
        name = original(tensor, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        HITS[module_name]["Tensor.type"] += 1
        return "torch.cuda." + name[len("torch."):]

    torch.Tensor.type = named
    try:
        yield
    finally:
        torch.Tensor.type = original


def _name_types_as_cuda() -> None:
    for name in _TYPE_NAMED_METHODS:
        if name in _originals:
            continue
        module_name, cls, method_name = _class_attribute(name)
        original = cls.__dict__[method_name]
        _originals[name] = original

        def wrapped(klass, *args, _function=original.__func__, _module=module_name, **kwargs):
            with _types_named_as_cuda(_module):
                return _function(klass, *args, **kwargs)

        setattr(cls, method_name, classmethod(wrapped))


def _tracker_add(self, name, seed):
    """CPU twin of ``CudaRNGStatesTracker.add``: the named state is a CPU generator state
    seeded with ``seed`` (on the CPU, dropout draws from the CPU generator)."""
    HITS["megatron.core.tensor_parallel.random"]["tracker.add"] += 1
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    generator = torch.Generator()
    generator.manual_seed(seed)
    self.states_[name] = generator.get_state()


@contextlib.contextmanager
def _tracker_fork(self, name="model-parallel-rng"):
    """CPU twin of ``CudaRNGStatesTracker.fork``: the block draws from the named CPU
    generator state, which then advances, and the CPU generator continues where it was.

    Nesting follows Megatron's: a fork inside a fork leaves the outer state where the inner
    one found it. Without this twin every tensor-parallel rank would draw the same attention
    dropout masks on the CPU (Megatron forks so that each rank's heads get their own)."""
    HITS["megatron.core.tensor_parallel.random"]["tracker.fork"] += 1
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    outer_state, outer_name = torch.get_rng_state(), self._current_state_name
    if outer_name != "default-rng":
        self.states_[outer_name] = outer_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current state name {self._current_state_name} is not the same "
                            f"as the desired state name {name}.")
        self.states_[name] = torch.get_rng_state()
        if outer_name != "default-rng":
            outer_state = self.states_[outer_name]
        torch.set_rng_state(outer_state)
        self._current_state_name = outer_name


#: ``"module:Class.method"`` -> CPU twin, set on the class.
_TRACKER_METHODS = {
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add": _tracker_add,
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork": _tracker_fork,
}


def _patch_rng_tracker() -> None:
    """Megatron's RNG tracker keeps CUDA generator states; on the CPU its states are CPU
    generator states (:func:`_tracker_add`, :func:`_tracker_fork`), so the model-parallel
    seeding of ``model_parallel_cuda_manual_seed`` (``seed + 2718 + tp_rank``) gives each
    tensor-parallel rank its own dropout stream, as on CUDA."""
    for name, twin in _TRACKER_METHODS.items():
        if name in _originals:
            continue
        _, cls, method = _class_attribute(name)
        _originals[name] = cls.__dict__[method]
        setattr(cls, method, twin)

"""Hardware profiles: the figures the cost model is derived from, loaded from JSON.

A profile is either ``"source": "spec-derived"`` (the shipped ``profiles/*.json``, whose
``notes`` say which public figure or stated assumption each number comes from, and whose
``device_names`` say which CUDA devices they are the default for) or ``"source": "measured"`` (written by the profiler on a
real machine). A measured profile may add ``layer_coefficients`` -- the fitted per-layer
``alpha1``, ``alpha2`` and ``beta`` of eq. 1 together with the model shape and layout they were
fitted for -- which then replace the coefficients derived from FLOPs; every profile carries the
hardware figures (bandwidths, latencies, memory) because the collectives (and, unless measured,
the output layer) are priced from them. It may also add ``activation_coefficients``: the
activation bytes per token the profiler counted with the training loop's meter in one dtype,
which replace the cost model's derived accounting for models of that dtype, and
``end_coefficients``: the measured time of the embedding (first stage) and of the final norm,
output layer and loss (last stage) per token and per chunk, which replace the FLOP-derived
output layer and the free embedding.
``host_link_gbps`` (optional) is what offloading planners (SPPO) copy activations to host
memory at.

Physical terms beyond one GPU's figures (each optional, each neutral when absent, each with its
source in ``notes``; the shipped profiles describe one vendor reference node, and a cluster that
differs -- the papers' testbeds do -- says so in a profile of its own):

- ``node_nic_gbps``: the network bandwidth of a node's NICs together. In a symmetric layout
  every GPU of a node crosses nodes at the same moment (all stages send at once, every rank of
  a cross-node all-to-all sends at once), so a GPU gets ``node_nic_gbps / gpus_per_node``, and
  never more than its own ``inter_node_gbps`` (:attr:`HardwareProfile.cross_node_gbps`).
- ``gpus_per_host_link``: GPUs whose host copies share one host link (the uplink of their PCIe
  switch); SPPO's GPUs offload at once, so each gets ``host_link_gbps / gpus_per_host_link``
  (:attr:`HardwareProfile.host_gbps_per_gpu`).
- ``allocator_overhead``: device bytes the caching allocator holds beyond the live activations
  and workspace buffers (fragmentation), as a fraction of them: the cost model charges
  ``1 + allocator_overhead`` device bytes per activation or workspace byte.
- ``kernel_efficiency``: ``[[tokens, fraction], ...]``, the share of the large-chunk compute
  throughput a layer reaches on a chunk of ``tokens`` tokens per GPU (short chunks leave the
  GEMM and attention kernels below their peak). Interpolated linearly in ``log2(tokens)``,
  held at the first and last point (:meth:`HardwareProfile.efficiency`). It scales the
  FLOP-derived layer time only: a measured profile's fit prices the chunk size itself (its
  per-chunk ``beta`` and its per-token ``alpha2`` were fitted on the machine's own small and
  large chunks), so the two are refused together. ``scripts/profile_costs.py`` prints the curve
  it measures, to put into a spec-derived profile of the same machine.
- Host time (:mod:`longctx.cost_model` says how it combines with device
  time): ``host_layer_forward_s`` and ``host_layer_backward_s``, the host's seconds per layer
  call (the Python of the module's forward, autograd's bookkeeping and the kernel launches of
  one layer, on a chunk whatever its size); ``host_action_s``, the host's seconds per forward
  or backward action of a unit on a stage outside its layers (the executor's dispatch,
  extension hooks, plan bookkeeping, Megatron's ``forward_step``/``backward_step`` wrappers);
  ``host_asynchronous``, whether the device runs what the host launched while the host goes on
  (CUDA: true) or the host computes it itself (CPU: false). ``scripts/profile_costs.py``
  measures the first three; the shipped profiles keep 0 where no measurement is cited.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from longctx.models import DTYPE_BYTES

SOURCES = ("spec-derived", "measured")


@dataclass(frozen=True)
class LayerCoefficients:
    """Fitted per-layer forward-time coefficients of eq. 1 (seconds), for one shape and layout."""

    alpha1: float
    """Seconds per unit of ``(C+s)^2 - C^2`` (the causal attention term)."""
    alpha2: float
    """Seconds per token (the linear layers and element-wise work)."""
    beta: float
    """Seconds per chunk (kernel launches and other fixed work)."""
    hidden_size: int
    """Model width the fit was made for; the cost model refuses another."""
    sp: int
    """Ulysses degree the fit was made for."""
    tp: int
    """Tensor-parallel degree the fit was made for."""
    mlp: str = "dense"
    """The MLP of the layer fitted (:attr:`longctx.models.ModelConfig.mlp_label`): dense, or
    the mixture-of-experts shape; the cost model refuses another."""

    def __post_init__(self):
        if min(self.alpha1, self.alpha2, self.beta) < 0:
            raise ValueError(f"layer_coefficients must be non-negative: {self}")
        if self.alpha1 == self.alpha2 == 0:
            raise ValueError(f"layer_coefficients: alpha1 and alpha2 are 0, so no chunk costs "
                             f"more than another: re-measure the profile with "
                             f"scripts/profile_costs.py on an idle machine: {self}")
        if min(self.hidden_size, self.sp, self.tp) < 1:
            raise ValueError(f"layer_coefficients: hidden_size, sp and tp must be >= 1: {self}")


@dataclass(frozen=True)
class ActivationCoefficients:
    """Measured activation bytes per token (what the training loop's saved-tensor meter counts),
    for one model shape, vocabulary, element type and layout."""

    layer: float
    """Bytes a layer stashes per token when it is not checkpointed."""
    checkpointed: float
    """Bytes per token a checkpointed layer keeps (the input of the recomputed range)."""
    kv: float
    """Bytes per token a checkpointed layer keeps for later slices (its K/V in the store)."""
    dkv: float
    """Bytes per token and layer of the dK/dV accumulators of a piece with later slices."""
    embedding: float
    """Bytes per token the first stage's embedding adds."""
    head: float
    """Bytes per token the last stage's final norm, output layer and loss add."""
    hidden_size: int
    vocab_size: int
    """Padded vocabulary the head was measured with; the cost model refuses another."""
    sp: int
    tp: int
    dtype: str
    """Element type of the profiled weights and activations (a key of
    :data:`~longctx.models.DTYPE_BYTES`); the cost model refuses another."""
    mlp: str = "dense"
    """The MLP of the layer counted (:attr:`longctx.models.ModelConfig.mlp_label`); the cost
    model refuses another."""

    def __post_init__(self):
        values = (self.layer, self.checkpointed, self.kv, self.dkv, self.embedding, self.head)
        if min(values) < 0:
            raise ValueError(f"activation_coefficients must be non-negative: {self}")
        if min(self.hidden_size, self.vocab_size, self.sp, self.tp) < 1:
            raise ValueError(f"activation_coefficients: hidden_size, vocab_size, sp and tp "
                             f"must be >= 1: {self}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"activation_coefficients: dtype must be one of "
                             f"{', '.join(DTYPE_BYTES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class EndCoefficients:
    """Measured time of the work at the pipeline's two ends, as ``(seconds per token, seconds
    per chunk)`` pairs, for one model shape, vocabulary and layout: the first stage's embedding
    and the last stage's final norm, output layer and loss, forward and backward."""

    embedding_forward: tuple[float, float]
    embedding_backward: tuple[float, float]
    head_forward: tuple[float, float]
    head_backward: tuple[float, float]
    hidden_size: int
    vocab_size: int
    """Padded vocabulary the head was timed with; the cost model refuses another."""
    sp: int
    tp: int

    def __post_init__(self):
        for name in ("embedding_forward", "embedding_backward", "head_forward", "head_backward"):
            pair = tuple(float(v) for v in getattr(self, name))
            if len(pair) != 2 or min(pair) < 0:
                raise ValueError(f"end_coefficients.{name} must be two non-negative numbers "
                                 f"(seconds per token, seconds per chunk), got {pair}")
            object.__setattr__(self, name, pair)
        if min(self.hidden_size, self.vocab_size, self.sp, self.tp) < 1:
            raise ValueError(f"end_coefficients: hidden_size, vocab_size, sp and tp must be "
                             f">= 1: {self}")

    @staticmethod
    def time(pair: tuple[float, float], tokens: int) -> float:
        """Seconds of ``tokens`` tokens in one chunk under ``pair``."""
        return pair[0] * tokens + pair[1]


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU type and its interconnect."""

    name: str
    """Label used in reports."""
    source: str
    """``"spec-derived"`` or ``"measured"``."""
    peak_tflops: float
    """Dense BF16 tensor-core peak of one GPU, TFLOPS."""
    matmul_efficiency: float
    """Fraction of the peak that the layer's GEMMs reach, in (0, 1]."""
    attention_efficiency: float
    """Fraction of the peak that fused (flash) attention reaches, in (0, 1]."""
    layer_overhead_s: float
    """Fixed seconds per layer per chunk (eq. 1's beta when no fit is given)."""
    backward_factor: float
    """Backward time over forward time of the same work."""
    hbm_gb: float
    """Device memory per GPU, GB (10^9 bytes); the default memory budget."""
    intra_node_gbps: float
    """NVLink bandwidth per GPU and direction, GB/s."""
    intra_node_latency_s: float
    """Start-up time of one collective or transfer inside a node, seconds."""
    inter_node_gbps: float
    """Network (InfiniBand) bandwidth per GPU and direction, GB/s."""
    inter_node_latency_s: float
    """Start-up time of one transfer between nodes, seconds."""
    gpus_per_node: int
    """GPUs sharing one NVLink domain."""
    notes: dict = field(default_factory=dict, compare=False)
    """Where each figure comes from (free text per field)."""
    layer_coefficients: LayerCoefficients | None = None
    """Fitted coefficients (measured profiles only); ``None`` derives them from FLOPs."""
    activation_coefficients: ActivationCoefficients | None = None
    """Measured activation bytes; replace the cost model's derived accounting when present."""
    end_coefficients: EndCoefficients | None = None
    """Measured embedding and head times; ``None`` prices the output layer from FLOPs and the
    embedding lookup as free."""
    machine: str | None = field(default=None, compare=False)
    """Description of the machine a measured profile was taken on."""
    device_names: tuple[str, ...] = field(default=(), compare=False)
    """Words of a CUDA device name this profile is the default for (:func:`profile_for_device`)."""
    host_link_gbps: float | None = None
    """Host<->device bandwidth per GPU and direction (PCIe), GB/s: what offloading activations
    to host memory runs at (SPPO). ``None`` where the profile does not say."""
    node_nic_gbps: float | None = None
    """Network bandwidth of one node's NICs together, per direction, GB/s; shared by the
    node's GPUs (module doc). ``None``: every GPU has ``inter_node_gbps`` to itself."""
    gpus_per_host_link: int = 1
    """GPUs sharing one host link (PCIe switch uplink); they copy at once (module doc)."""
    allocator_overhead: float = 0.0
    """Allocator-held device bytes per live activation byte beyond it, in [0, 1)."""
    kernel_efficiency: tuple[tuple[int, float], ...] | None = None
    """Share of large-chunk compute throughput by tokens per GPU (module doc); ``None``: 1."""
    host_layer_forward_s: float = 0.0
    """Host seconds of one layer's forward call (module doc)."""
    host_layer_backward_s: float = 0.0
    """Host seconds of one layer's backward (module doc)."""
    host_action_s: float = 0.0
    """Host seconds of one forward or backward action outside its layers (module doc)."""
    host_asynchronous: bool = True
    """The device runs launched work while the host goes on (CUDA); false on a CPU."""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"profile {self.name}: source must be one of {SOURCES}, "
                             f"got {self.source!r}")
        for name in ("peak_tflops", "hbm_gb", "intra_node_gbps", "inter_node_gbps",
                     "backward_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name}: {name} must be > 0, "
                                 f"got {getattr(self, name)}")
        for name in ("matmul_efficiency", "attention_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"profile {self.name}: {name} must be in (0, 1], "
                                 f"got {getattr(self, name)}")
        for name in ("layer_overhead_s", "intra_node_latency_s", "inter_node_latency_s",
                     "host_layer_forward_s", "host_layer_backward_s", "host_action_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name}: {name} must be >= 0, "
                                 f"got {getattr(self, name)}")
        if self.host_link_gbps is not None and self.host_link_gbps <= 0:
            raise ValueError(f"profile {self.name}: host_link_gbps must be > 0, "
                             f"got {self.host_link_gbps}")
        if self.gpus_per_node < 1:
            raise ValueError(f"profile {self.name}: gpus_per_node must be >= 1")
        if self.node_nic_gbps is not None and self.node_nic_gbps <= 0:
            raise ValueError(f"profile {self.name}: node_nic_gbps must be > 0, "
                             f"got {self.node_nic_gbps}")
        if not 1 <= self.gpus_per_host_link <= self.gpus_per_node:
            raise ValueError(f"profile {self.name}: gpus_per_host_link must be in [1, "
                             f"gpus_per_node={self.gpus_per_node}], got "
                             f"{self.gpus_per_host_link}")
        if not 0 <= self.allocator_overhead < 1:
            raise ValueError(f"profile {self.name}: allocator_overhead must be in [0, 1), "
                             f"got {self.allocator_overhead}")
        if self.kernel_efficiency is not None:
            object.__setattr__(self, "kernel_efficiency", _curve(self.name,
                                                                 self.kernel_efficiency))
            if self.layer_coefficients is not None:
                raise ValueError(f"profile {self.name}: kernel_efficiency scales FLOP-derived "
                                 f"layer times; a measured fit (layer_coefficients) prices the "
                                 f"chunk size itself: drop one of them")
        for name in ("layer_coefficients", "activation_coefficients", "end_coefficients"):
            if getattr(self, name) is not None and self.source != "measured":
                raise ValueError(f"profile {self.name}: {name} belong to a 'measured' "
                                 f"profile; set source to 'measured' or drop them")


    @property
    def cross_node_gbps(self) -> float:
        """Bandwidth per GPU and direction between nodes when the whole node crosses at once."""
        if self.node_nic_gbps is None:
            return self.inter_node_gbps
        return min(self.inter_node_gbps, self.node_nic_gbps / self.gpus_per_node)

    @property
    def host_gbps_per_gpu(self) -> float | None:
        """Host link bandwidth per GPU when the GPUs behind one link copy at once."""
        if self.host_link_gbps is None:
            return None
        return self.host_link_gbps / self.gpus_per_host_link

    def efficiency(self, tokens: float) -> float:
        """:attr:`kernel_efficiency` at ``tokens`` tokens per GPU (1 without a curve)."""
        curve = self.kernel_efficiency
        if curve is None:
            return 1.0
        if tokens <= curve[0][0]:
            return curve[0][1]
        for (t0, e0), (t1, e1) in zip(curve, curve[1:]):
            if tokens <= t1:
                share = (math.log2(tokens) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
                return e0 + share * (e1 - e0)
        return curve[-1][1]


def _curve(name: str, points) -> tuple[tuple[int, float], ...]:
    """``kernel_efficiency`` as sorted ``(tokens, fraction)`` pairs, checked."""
    try:
        curve = tuple((int(t), float(e)) for t, e in points)
    except (TypeError, ValueError):
        raise ValueError(f"profile {name}: kernel_efficiency must be [[tokens, fraction], ...], "
                         f"got {points!r}") from None
    if not curve:
        raise ValueError(f"profile {name}: kernel_efficiency needs at least one point")
    tokens = [t for t, _ in curve]
    if tokens[0] < 1 or any(b <= a for a, b in zip(tokens, tokens[1:])):
        raise ValueError(f"profile {name}: kernel_efficiency token counts must be >= 1 and "
                         f"strictly increasing, got {tokens}")
    if any(not 0 < e <= 1 for _, e in curve):
        raise ValueError(f"profile {name}: kernel_efficiency fractions must be in (0, 1], "
                         f"got {[e for _, e in curve]}")
    return curve


def builtin_profiles() -> list[str]:
    """Names of the shipped profiles."""
    folder = resources.files("longctx") / "profiles"
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".json"))


def profile_for_device(device_name: str) -> str | None:
    """The shipped profile whose ``device_names`` holds a word of ``device_name`` (words split at
    spaces and hyphens, so ``NVIDIA A100-SXM4-80GB`` is an A100 and ``NVIDIA H200`` no H20), or
    ``None``."""
    words = set(re.split(r"[\s\-_]+", device_name.upper()))
    for name in builtin_profiles():
        if words & {word.upper() for word in load_profile(name).device_names}:
            return name
    return None


def profiles_help() -> str:
    """The shipped profiles' names for a flag's help, ``a100|a800|...``."""
    return "|".join(builtin_profiles())


def profile_from_dict(data: dict) -> HardwareProfile:
    """Build a profile from its JSON object; unknown or missing keys raise ``ValueError``."""
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown profile keys {unknown}; valid: {sorted(known)}")
    data = dict(data)
    try:
        for name, kind in (("layer_coefficients", LayerCoefficients),
                           ("activation_coefficients", ActivationCoefficients),
                           ("end_coefficients", EndCoefficients)):
            if data.get(name) is not None:
                data[name] = kind(**data[name])
        data["device_names"] = tuple(data.get("device_names", ()))
        return HardwareProfile(**data)
    except TypeError as error:
        raise ValueError(f"incomplete profile {data.get('name')!r}: {error}") from None


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (:func:`builtin_profiles`) or any profile JSON by path."""
    if name_or_path.endswith(".json") or Path(name_or_path).is_file():
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"hardware profile file {name_or_path!r} does not exist")
        return profile_from_dict(json.loads(path.read_text()))
    if name_or_path not in builtin_profiles():
        raise ValueError(f"unknown hardware {name_or_path!r}; valid: "
                         f"{', '.join(builtin_profiles())} (or a profile .json path)")
    text = (resources.files("longctx") / "profiles" / f"{name_or_path}.json").read_text()
    return profile_from_dict(json.loads(text))

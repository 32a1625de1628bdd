"""Hardware profiles: the figures the cost model is derived from, loaded from JSON.

A profile is either ``"source": "spec-derived"`` (the shipped ``profiles/a100.json``,
``a800.json``, ``h100.json``, ``h20.json``, whose ``notes`` say which public figure or stated
assumption each number comes from) or ``"source": "measured"`` (written by the profiler on a
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
"""
from __future__ import annotations

import json
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

    def __post_init__(self):
        if min(self.alpha1, self.alpha2, self.beta) < 0:
            raise ValueError(f"layer_coefficients must be non-negative: {self}")
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
    host_link_gbps: float | None = None
    """Host<->device bandwidth per GPU and direction (PCIe), GB/s: what offloading activations
    to host memory runs at (SPPO). ``None`` where the profile does not say."""

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
        for name in ("layer_overhead_s", "intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name}: {name} must be >= 0, "
                                 f"got {getattr(self, name)}")
        if self.host_link_gbps is not None and self.host_link_gbps <= 0:
            raise ValueError(f"profile {self.name}: host_link_gbps must be > 0, "
                             f"got {self.host_link_gbps}")
        if self.gpus_per_node < 1:
            raise ValueError(f"profile {self.name}: gpus_per_node must be >= 1")
        for name in ("layer_coefficients", "activation_coefficients", "end_coefficients"):
            if getattr(self, name) is not None and self.source != "measured":
                raise ValueError(f"profile {self.name}: {name} belong to a 'measured' "
                                 f"profile; set source to 'measured' or drop them")


def builtin_profiles() -> list[str]:
    """Names of the shipped profiles."""
    folder = resources.files("longctx") / "profiles"
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".json"))


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
        return HardwareProfile(**data)
    except TypeError as error:
        raise ValueError(f"incomplete profile {data.get('name')!r}: {error}") from None


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (``a100``, ``a800``, ``h100``, ``h20``) or any profile JSON by
    path."""
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

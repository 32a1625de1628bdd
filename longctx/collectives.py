"""Seconds per byte of a collective as NCCL runs it, on a group that may span nodes.

A group of ``n`` ranks is laid out as the parallel layouts place it: its ranks ``stride``
GPUs apart (``span = n x stride`` GPUs in all, counted from a node's first GPU), so a node
holds ``g = n`` of them when the span fits in a node and ``g = max(1, gpus_per_node //
stride)`` otherwise; the node's other GPUs belong to ``gpus_per_node / g`` sibling groups
that run the same collective at the same moment (every layout here is symmetric). Bandwidths
per GPU and direction: NVLink ``intra_node_gbps``; between nodes
:attr:`~longctx.hardware.HardwareProfile.cross_node_gbps`, a GPU's share of the node's NICs
when all of its GPUs cross at once.

- **All-to-all** of ``B`` bytes a rank (``B / n`` to each rank, itself included): a rank sends
  ``(g - 1) B / n`` over NVLink and ``(n - g) B / n`` through the NICs. NCCL posts every
  peer's send at once, so the two run side by side and the slower one decides:
  ``max((g - 1) B / (n intra), (n - g) B / (n cross))``. All GPUs of a node send across
  nodes at once, so ``cross`` is the per-GPU share.
- **Ring all-gather / reduce-scatter** of a ``B``-byte buffer (each rank ends with, or starts
  from, all ``B``): ``n - 1`` steps, in each of which every rank passes ``B / n`` bytes to its
  ring neighbour at once. The ring visits a node's ``g`` ranks one after the other, so it
  crosses each node's NICs once (one link out, one in), and NCCL spreads that link's bytes
  over its channels and with them over all of the node's NICs, which the node's
  ``gpus_per_node / g`` sibling rings share: the crossing link runs at ``g x cross``. A step
  ends when its slowest link has passed its ``B / n`` bytes, so
  ``time = (n - 1) B / (n min(intra, g cross))`` for a ring that spans nodes and
  ``(n - 1) B / (n intra)`` within one. **All-reduce** is a reduce-scatter then an
  all-gather, twice that.
- **Point-to-point ring step** (ring attention's K/V pass): every rank sends ``B`` to its
  neighbour at once, the crossing one through the node's NICs shared as above:
  ``B / min(intra, g cross)``.

Latency is not part of these figures: the callers add the profile's latency once per
collective (NCCL pipelines a ring's steps in chunks, and the profiles state one latency per
operation), ``inter_node_latency_s`` when the group spans nodes.
"""
from __future__ import annotations

from longctx.hardware import HardwareProfile

GB = 1e9


def ranks_per_node(hardware: HardwareProfile, size: int, span: int) -> int:
    """Ranks of a ``size``-rank group spread over ``span`` GPUs that share one node."""
    node = hardware.gpus_per_node
    if span <= node:
        return size
    return max(1, min(size, node * size // span))


def spans_nodes(hardware: HardwareProfile, span: int) -> bool:
    return span > hardware.gpus_per_node


def latency(hardware: HardwareProfile, span: int) -> float:
    """The latency of one collective over a group spread over ``span`` GPUs."""
    if spans_nodes(hardware, span):
        return hardware.inter_node_latency_s
    return hardware.intra_node_latency_s


def all_to_all_per_byte(hardware: HardwareProfile, size: int, span: int) -> float:
    """Seconds per byte each rank holds of an all-to-all over ``size`` ranks (module doc)."""
    if size <= 1:
        return 0.0
    local = ranks_per_node(hardware, size, span)
    intra = (local - 1) / size / (hardware.intra_node_gbps * GB)
    cross = (size - local) / size / (hardware.cross_node_gbps * GB)
    return max(intra, cross)


def _ring_link(hardware: HardwareProfile, size: int, span: int) -> float:
    """Bytes per second of a ring's slowest link."""
    intra = hardware.intra_node_gbps * GB
    if not spans_nodes(hardware, span):
        return intra
    local = ranks_per_node(hardware, size, span)
    return min(intra, local * hardware.cross_node_gbps * GB)


def ring_per_byte(hardware: HardwareProfile, size: int, span: int) -> float:
    """Seconds per byte of the buffer of a ring all-gather or reduce-scatter (module doc)."""
    if size <= 1:
        return 0.0
    return (size - 1) / size / _ring_link(hardware, size, span)


def all_reduce_per_byte(hardware: HardwareProfile, size: int, span: int) -> float:
    """Seconds per byte of a ring all-reduce: a reduce-scatter and an all-gather."""
    return 2 * ring_per_byte(hardware, size, span)


def ring_step_per_byte(hardware: HardwareProfile, size: int, span: int) -> float:
    """Seconds per byte each rank sends in one step of a point-to-point ring (module doc)."""
    if size <= 1:
        return 0.0
    return 1.0 / _ring_link(hardware, size, span)

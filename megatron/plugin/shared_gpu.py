"""Several ranks on one GPU, opt-in: ``LONGCTX_SHARE_GPU=1`` in every rank's environment.

For a test machine with fewer GPUs than ranks (a lent machine has one). NCCL refuses two ranks on
one GPU ("Duplicate GPU detected") only when their host hash and their bus id both match, and
``NCCL_HOSTID`` replaces the host hash: with a host id of its own per rank, each rank is a
one-GPU host, and NCCL connects the ranks through its socket transport over the loopback
interface. Before torch.distributed initialises (:func:`megatron.plugin.launch` start-up),
:func:`apply` sets, in this process's environment:

* ``LOCAL_RANK`` to the local rank modulo the device count (Megatron-LM selects the device from
  it: ``torch.cuda.set_device(args.local_rank)``);
* ``NCCL_HOSTID`` to ``<host name>-rank<local rank>``;
* ``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``, ``NCCL_NET=Socket``, ``NCCL_MNNVL_ENABLE=0``
  (sockets over the loopback interface: one machine only);
* ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron-LM's tensor parallelism needs it on Hopper).

The ranks time-slice the GPU: such runs prove correctness, hangs and per-rank memory, never
speed, bubbles or overlap. So the planners' default memory budget (the device's memory:
``--elastic-memory-gb``, ``--sppo-memory-gb`` unset) is the device's memory divided by the ranks
that share it (:func:`ranks_per_device`); a budget given on the command line is one rank's, as
given. ``--elastic-refit-interval K`` is refused while sharing (it refits the cost model to
measured times, which time-slicing makes meaningless); its default, ``auto``, times nothing
then. Helix plans without a memory budget.

Off (the default) nothing here changes anything. On a machine without CUDA the switch is
refused: the ranks of a CPU run share the processor without it.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Mapping, MutableMapping

log = logging.getLogger(__name__)

SWITCH = "LONGCTX_SHARE_GPU"

#: NCCL's socket transport over the loopback interface, and the connections TP needs.
SOCKET_SETTINGS = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
                   "NCCL_MNNVL_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}

#: The local rank as the launcher gave it (``LOCAL_RANK`` is rewritten by :func:`apply`).
LAUNCHED_LOCAL_RANK = "LONGCTX_LAUNCHED_LOCAL_RANK"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the switch is on (``1``); any value but ``0``, ``1`` or unset is refused."""
    value = environ.get(SWITCH, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH}={value!r}: set it to 1 to let several ranks share a GPU, "
                         f"or unset it")
    return value == "1"


def ranks_per_device(local_rank: int, local_world_size: int, device_count: int) -> int:
    """How many of the ``local_world_size`` ranks share ``local_rank``'s device (rank ``r`` on
    device ``r % device_count``)."""
    device = local_rank % device_count
    return len(range(device, local_world_size, device_count))


def environment(local_rank: int, device_count: int, host: str) -> dict[str, str]:
    """The variables :func:`apply` sets for ``local_rank`` (as launched)."""
    if device_count < 1:
        raise ValueError(f"{SWITCH}=1 lets several ranks share a GPU, and this machine has "
                         f"none: unset {SWITCH} (the ranks of a CPU run share the processor "
                         f"without it)")
    return {"LOCAL_RANK": str(local_rank % device_count),
            "NCCL_HOSTID": f"{host}-rank{local_rank}", **SOCKET_SETTINGS}


def _launched_local_rank(environ: Mapping[str, str]) -> int:
    return int(environ.get(LAUNCHED_LOCAL_RANK, environ.get("LOCAL_RANK", "0")))


def apply(environ: MutableMapping[str, str] = os.environ, device_count: int | None = None) -> None:
    """With the switch on, set :func:`environment` in ``environ`` (idempotent: a second call
    in the same process, after a reset, sets the same values); off, nothing."""
    if not enabled(environ):
        return
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    local_rank = _launched_local_rank(environ)
    environ[LAUNCHED_LOCAL_RANK] = str(local_rank)
    environ.update(environment(local_rank, device_count, socket.gethostname()))
    if local_rank == 0:
        sharing = ranks_per_device(0, int(environ.get("LOCAL_WORLD_SIZE", "1")), device_count)
        log.info("%s=1: %d rank(s) share device 0 through NCCL's socket transport (host id "
                 "per rank); correctness and memory only, never speed", SWITCH, sharing)


def budget_divisor(environ: Mapping[str, str] = os.environ,
                   device_count: int | None = None) -> int:
    """The number the device's memory is divided by for one rank's default budget: the ranks
    sharing this rank's device with the switch on, else 1."""
    if not enabled(environ):
        return 1
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    if device_count < 1:
        return 1
    return ranks_per_device(_launched_local_rank(environ),
                            int(environ.get("LOCAL_WORLD_SIZE", "1")), device_count)


def refit_refusal(args) -> str | None:
    """``--elastic-refit-interval K`` (``K > 0``) while sharing: its refits fit the cost model
    to measured times, which time-slicing makes meaningless (``auto`` is off then)."""
    interval = getattr(args, "elastic_refit_interval", 0)
    if enabled() and isinstance(interval, int) and interval > 0:
        return (f"--elastic-refit-interval {args.elastic_refit_interval} with {SWITCH}=1: the "
                f"ranks time-slice one GPU, so the times it refits the cost model to mean "
                f"nothing; drop --elastic-refit-interval, or unset {SWITCH} (one GPU per rank)")
    return None

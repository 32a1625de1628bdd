"""Which rank to look at when a wait times out.

A rank that stops (``SIGSTOP``, a frozen node, a process swapped out) makes its peers wait:
in the executor's transfers until ``--pipeline-timeout-s`` (the error names the operation and
the peer stage), in Megatron-LM's schedules and in every collective until
``--distributed-timeout-minutes`` (gloo and NCCL name the operation, not the peer). Either way
the ranks that report the timeout are the healthy ones.

:class:`Heartbeat` tells them apart: a thread of every rank counts up a key of its own in the
rendezvous store (torchrun's agent store, which outlives the workers) every ``interval_s``
seconds, whatever the main thread is doing; a rank waiting in a collective keeps counting, a
stopped process does not. On a timeout, :func:`frozen_ranks` reads every rank's count twice,
a few intervals apart, and the error log names the ranks whose count did not move, once for
all the ranks that timed out alike.
Counts, not clocks: nodes' clocks need not agree.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from megatron.plugin import error_once

log = logging.getLogger(__name__)

#: Errors that mean a wait ran out: the executor's ``TransferTimeout`` (a ``TimeoutError``) and
#: the backends' own (gloo: "Timed out waiting ...", NCCL's watchdog: "... timeout ...").
TIMEOUT_WORDS = ("timed out", "timeout")


def is_timeout(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or (
        isinstance(error, RuntimeError) and any(w in str(error).lower() for w in TIMEOUT_WORDS))


class Heartbeat:
    """Counts ``heartbeat/<rank>`` up in ``store`` every ``interval_s`` seconds (daemon
    thread) until :meth:`stop`."""

    def __init__(self, store, rank: int, world_size: int, interval_s: float = 2.0):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="longctx-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        count = 0
        while not self._stopped.is_set():
            try:
                self.store.set(f"heartbeat/{self.rank}", str(count))
            except Exception:  # noqa: BLE001 -- the store went away: the job is ending
                return
            count += 1
            self._stopped.wait(self.interval_s)

    def counts(self) -> dict[int, int | None]:
        found = {}
        for rank in range(self.world_size):
            key = f"heartbeat/{rank}"
            found[rank] = int(self.store.get(key)) if self.store.check([key]) else None
        return found

    def frozen_ranks(self) -> list[int]:
        """Ranks whose count did not move over three intervals (none: every process runs)."""
        before = self.counts()
        time.sleep(3 * self.interval_s)
        after = self.counts()
        return [rank for rank in range(self.world_size)
                if rank != self.rank and (after[rank] is None or after[rank] == before[rank])]

    def stop(self) -> None:
        self._stopped.set()


def start(store, interval_s: float = 2.0) -> Heartbeat | None:
    """A heartbeat in ``store`` (torchrun's agent store, under a prefix of this attempt:
    restarts count afresh); ``None`` without one (no store that outlives the workers)."""
    if store is None:
        return None
    return Heartbeat(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), interval_s)


def report(heartbeat: Heartbeat | None, error: BaseException) -> None:
    """Log which ranks to look at after ``error``, a timeout of this rank: once for the ranks
    that time out alike (:mod:`megatron.plugin.error_once`, in the heartbeat's store)."""
    if heartbeat is None:
        log.error("rank %s: a wait timed out (%s); run under torchrun to have the stopped "
                  "rank named", os.environ.get("RANK", "?"), error)
        return
    frozen = ", ".join(map(str, heartbeat.frozen_ranks()))
    if frozen:
        message = (f"timed out waiting; rank(s) {frozen} stopped answering (their process is "
                   f"stopped, frozen or gone): look at rank(s) {frozen}")
    else:
        message = ("timed out waiting, and every rank's process still runs: a rank is slower "
                   "than the timeout allows or waits elsewhere (raise "
                   "--distributed-timeout-minutes / --pipeline-timeout-s if it is only slow)")
    error_once.report(message, heartbeat.rank, heartbeat.world_size, heartbeat.store, log.error)

"""Deadlines for transfers whose waits do not block the host (NCCL).

On NCCL, :meth:`~megatron.plugin.pipeline.p2p.Posted.wait` makes the compute stream wait for a
batch (``work.wait()`` without a timeout: no host synchronisation) and hands the batch to a
:class:`TransferWatchdog`: a daemon thread that polls each watched batch's works
(``is_completed``, which never blocks) and, when one is still incomplete at its deadline,
reports it by name -- rank, action, peer stage, seconds waited: the message a host wait's
:class:`~megatron.plugin.pipeline.p2p.TransferTimeout` carries -- and ends the process (the
default ``on_timeout``: the main thread may be blocked in the device by then, where no exception
reaches it; torchrun then stops the job, as NCCL's own watchdog does on a collective timeout).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

#: Exit status of a process the watchdog ends.
TIMEOUT_EXIT = 124


def end_process(message: str) -> None:
    """Log ``message`` as the error it is and end the process with :data:`TIMEOUT_EXIT`."""
    log.error(message)
    logging.shutdown()
    os._exit(TIMEOUT_EXIT)


@dataclass
class _Watched:
    describe: Callable[[float], str]
    works: list
    started: float
    deadline: float


@dataclass
class TransferWatchdog:
    """Watches batches of works until they complete or their deadline passes."""

    on_timeout: Callable[[str], None] = end_process
    poll_s: float = 0.2
    _watched: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def watch(self, works: list, timeout_s: float, describe: Callable[[float], str]) -> None:
        """Watch ``works`` for ``timeout_s`` seconds; ``describe(waited_s)`` names them in the
        report."""
        now = time.monotonic()
        with self._lock:
            self._watched.append(_Watched(describe, list(works), now, now + timeout_s))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="p2p-watchdog",
                                                daemon=True)
                self._thread.start()

    def pending(self) -> int:
        """Batches still watched."""
        with self._lock:
            return len(self._watched)

    def check(self) -> None:
        """Drop completed batches; report the first one past its deadline."""
        now = time.monotonic()
        with self._lock:
            self._watched = [w for w in self._watched
                             if not all(work.is_completed() for work in w.works)]
            late = next((w for w in self._watched if now >= w.deadline), None)
            if late is not None:
                self._watched.remove(late)
        if late is not None:
            self.on_timeout(late.describe(now - late.started))

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            self.check()

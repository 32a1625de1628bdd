"""An error that many ranks hit, printed once with the ranks it happened on.

A start-up refusal, a missing data file or a plan that does not fit is found by every rank at
once; printed by each, a job on a thousand GPUs prints it a thousand times. The ranks that fail
with the same message meet in a store they all reach (torchrun's agent store, which outlives
the workers): each one that fails writes its rank under the message's digest and counts itself
in. The first to count in prints, once every rank has counted in or :data:`SETTLE_S` seconds
have passed, one line naming the ranks counted by then (``error on all 8 ranks: ...``,
``error on ranks 0-3, 6 (5 of 8): ...``); the others wait until it has printed (a rank that
exits first would have torchrun stop the printing one) and print nothing. A rank that counts in
after the line was printed, or that waits in vain for it, prints its own line.

Without a store (not under torchrun) each process prints its own, named by its rank when
``RANK`` says one.
"""
from __future__ import annotations

import datetime
import hashlib
import time
from typing import Callable, Sequence

#: Seconds the first rank to fail waits for the others with the same error before it prints.
SETTLE_S = 3.0
#: Seconds the other ranks wait for that line beyond :data:`SETTLE_S`.
GRACE_S = 10.0


def ranks_text(ranks: Sequence[int], world_size: int) -> str:
    """``all 8 ranks``, ``rank 3 of 8`` or ``ranks 0-3, 6 (5 of 8)``."""
    ranks = sorted(set(ranks))
    if len(ranks) == world_size:
        return f"all {world_size} ranks"
    if len(ranks) == 1:
        return f"rank {ranks[0]} of {world_size}"
    runs, start = [], ranks[0]
    for previous, rank in zip(ranks, ranks[1:] + [None]):
        if rank != previous + 1:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
            start = rank
    return f"ranks {', '.join(runs)} ({len(ranks)} of {world_size})"


def error_line(message: str, ranks: Sequence[int], world_size: int) -> str:
    """The printed line: ``error on <ranks_text>: message`` (``error: message`` alone)."""
    if world_size == 1:
        return f"error: {message}"
    return f"error on {ranks_text(ranks, world_size)}: {message}"


def report(message: str, rank: int, world_size: int, store, write: Callable[[str], None],
           settle_s: float = SETTLE_S, grace_s: float = GRACE_S,
           poll_s: float = 0.05) -> None:
    """``write`` the line of ``message`` once for every rank of ``world_size`` that reports it
    within ``settle_s`` (see the module docstring); ``store`` is a ``torch.distributed`` store
    every rank reaches (``None``: this rank writes its own line)."""
    if store is None or world_size == 1:
        write(error_line(message, [rank], world_size))
        return
    key = "error/" + hashlib.sha256(message.encode()).hexdigest()[:16]
    store.set(f"{key}/rank/{rank}", "1")
    if store.add(f"{key}/count", 1) == 1:
        deadline = time.monotonic() + settle_s
        while store.add(f"{key}/count", 0) < world_size and time.monotonic() < deadline:
            time.sleep(poll_s)
        ranks = [r for r in range(world_size) if store.check([f"{key}/rank/{r}"])]
        write(error_line(message, ranks, world_size))
        store.set(f"{key}/printed", ",".join(map(str, ranks)))
        return
    try:
        store.wait([f"{key}/printed"], datetime.timedelta(seconds=settle_s + grace_s))
    except RuntimeError:  # the first rank did not print: it was stopped meanwhile
        write(error_line(message, [rank], world_size))
        return
    if str(rank) not in store.get(f"{key}/printed").decode().split(","):
        write(error_line(message, [rank], world_size))

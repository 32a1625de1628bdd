"""SIGKILL every process that carries a mark in its environment: what a launch leaves behind
(workers that changed their session or parent) is found by the variable all of them inherit."""
from __future__ import annotations

import contextlib
import os
import signal


def kill_marked(variable: str, mark: str) -> None:
    """SIGKILL every process whose environment holds ``variable=mark``."""
    entry = f"{variable}={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)

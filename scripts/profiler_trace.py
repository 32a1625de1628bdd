"""Readers of a torch-profiler Chrome trace (what Megatron-LM's ``--profile
--use-pytorch-profiler`` writes): how busy the device was, and how much of each copy between
device and host ran while a kernel ran on another stream. Pure functions of the trace's
``traceEvents`` (complete events, times in microseconds)."""

COPY_NAMES = {"DtoH": "offload (device to host)", "HtoD": "reload (host to device)"}

TRACED_STEP = 2
"""The training iteration traced by default (0-based: the third)."""


def profile_flags(step: int = TRACED_STEP) -> list[str]:
    """Megatron-LM's flags that trace training iteration ``step`` (0-based; run at least
    ``step + 2``). Megatron writes the trace to
    ``<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz``; without ``--tensorboard-dir``
    that is ``torch_profile/`` in the working directory."""
    return ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(step),
            "--profile-step-end", str(step + 1)]


def _complete(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _covered(start: float, end: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def copy_overlap(trace: dict) -> dict:
    """Per copy direction (``DtoH``, ``HtoD``): count, bytes, microseconds, microseconds during
    which a kernel ran on another stream, and microseconds whose host side was pinned, from a
    torch-profiler Chrome trace."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels: dict[object, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            kernels.setdefault(e["args"].get("stream"), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    unions = {stream: _union(spans) for stream, spans in kernels.items()}
    totals = {}
    for e in events:
        if e.get("cat") != "gpu_memcpy":
            continue
        direction = next((d for d in COPY_NAMES if d in e["name"]), None)
        if direction is None:
            continue
        start, dur = float(e["ts"]), float(e["dur"])
        stream = e["args"].get("stream")
        others = _union([span for s, u in unions.items() if s != stream for span in u])
        row = totals.setdefault(direction, {"copies": 0, "bytes": 0, "us": 0.0,
                                            "overlapped_us": 0.0, "pinned_us": 0.0})
        row["copies"] += 1
        row["bytes"] += int(e["args"].get("bytes", 0))
        row["us"] += dur
        row["overlapped_us"] += _covered(start, start + dur, others)
        if "Pinned" in e["name"]:
            row["pinned_us"] += dur
    for row in totals.values():
        row["overlapped_fraction"] = row["overlapped_us"] / row["us"] if row["us"] else 0.0
        row["pinned_fraction"] = row["pinned_us"] / row["us"] if row["us"] else 0.0
        row["gb_per_s"] = row["bytes"] / (row["us"] * 1e3) if row["us"] else 0.0
    return totals


def device_busy(trace: dict) -> dict:
    """``{"span_us", "busy_us", "busy_fraction"}``: the time from the first to the last
    kernel or copy on the device, and the part of it during which at least one ran (a host-
    bound run leaves the device idle between launches)."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in _complete(trace)
             if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not spans:
        return {"span_us": 0.0, "busy_us": 0.0, "busy_fraction": 0.0}
    union = _union(spans)
    span = union[-1][1] - union[0][0]
    busy = sum(end - start for start, end in union)
    return {"span_us": span, "busy_us": busy, "busy_fraction": busy / span if span else 0.0}


def host_allocations(trace: dict) -> dict:
    """``{"calls", "us", "step_us"}``: the pinned host allocations (``cudaHostAlloc``: each one
    pins new pages and stalls the host thread that launches the kernels) in a torch-profiler
    Chrome trace, and the longest traced step (``ProfilerStep#N``) they fall in."""
    events = _complete(trace)
    allocs = [float(e["dur"]) for e in events if e.get("name") == "cudaHostAlloc"]
    steps = [float(e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
    return {"calls": len(allocs), "us": sum(allocs), "step_us": max(steps, default=0.0)}

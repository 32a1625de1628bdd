"""``scripts/profiler_trace.py``: how busy the device was and the copy/compute overlap, read from a profiler trace."""
import os
import sys

import pytest

from harness import REPO
SCRIPTS = os.path.join(REPO, "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

from profiler_trace import copy_overlap, device_busy, host_allocations, profile_flags  # noqa: E402


def _event(cat, name, ts, dur, stream, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, **args}}


def test_copies_count_only_the_time_kernels_run_on_other_streams():
    trace = {"traceEvents": [
        _event("kernel", "gemm", 0, 100, 7),
        _event("kernel", "gemm", 50, 100, 7),  # overlaps the first: one busy span 0..150
        _event("kernel", "softmax", 300, 50, 7),
        _event("kernel", "side", 120, 80, 20),  # on the copy stream: not compute overlap
        # 100..200 on stream 20: 50 us under the compute stream's 0..150
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 100, 100, 20, bytes=1000),
        # 280..380: 50 us under 300..350
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 280, 100, 20, bytes=4000),
        # the same stream as compute: serialised, no overlap; pageable host memory
        _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 400, 20, 7, bytes=10),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 10, 7, bytes=10),
        {"ph": "M", "name": "process_name"},
    ]}
    totals = copy_overlap(trace)
    assert set(totals) == {"DtoH", "HtoD"}
    assert totals["DtoH"]["copies"] == 1 and totals["DtoH"]["bytes"] == 1000
    assert totals["DtoH"]["overlapped_fraction"] == pytest.approx(0.5)
    assert totals["DtoH"]["pinned_fraction"] == 1.0
    assert totals["HtoD"]["copies"] == 2 and totals["HtoD"]["us"] == 120
    assert totals["HtoD"]["overlapped_us"] == pytest.approx(50)
    assert totals["HtoD"]["pinned_fraction"] == pytest.approx(100 / 120)
    assert totals["DtoH"]["gb_per_s"] == pytest.approx(1000 / 100e3)


def test_a_trace_without_copies_reports_none():
    assert copy_overlap({"traceEvents": [_event("kernel", "gemm", 0, 10, 7)]}) == {}


def test_the_device_is_busy_where_kernels_or_copies_run():
    trace = {"traceEvents": [
        _event("kernel", "gemm", 0, 100, 7),
        _event("kernel", "gemm", 50, 100, 7),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 140, 20, 20, bytes=8),
        _event("cpu_op", "aten::mm", 0, 400, 0),  # host time does not count
        _event("kernel", "softmax", 300, 100, 7),  # idle 160..300
    ]}
    busy = device_busy(trace)
    assert busy["span_us"] == 400 and busy["busy_us"] == 260
    assert busy["busy_fraction"] == pytest.approx(260 / 400)
    assert device_busy({"traceEvents": []})["busy_fraction"] == 0.0


def test_host_allocations_are_the_pinning_calls_within_the_traced_step():
    trace = {"traceEvents": [
        _event("cpu_op", "ProfilerStep#2", 0, 5000, 0),
        _event("cuda_runtime", "cudaHostAlloc", 10, 700, 0),
        _event("cuda_runtime", "cudaHostAlloc", 900, 300, 0),
        _event("cuda_runtime", "cudaMalloc", 1300, 50, 0),
        _event("cpu_op", "aten::empty", 5, 710, 0),
    ]}
    assert host_allocations(trace) == {"calls": 2, "us": 1000.0, "step_us": 5000.0}
    assert host_allocations({"traceEvents": []}) == {"calls": 0, "us": 0.0, "step_us": 0.0}


def test_profile_flags_trace_the_step_asked():
    """Megatron-LM's profiler traces iterations [start, end): one, the step asked (0-based)."""
    assert profile_flags() == ["--profile", "--use-pytorch-profiler", "--profile-step-start",
                               "2", "--profile-step-end", "3"]
    assert profile_flags(4)[-4:] == ["--profile-step-start", "4", "--profile-step-end", "5"]

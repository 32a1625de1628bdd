"""The benchmarks' verdicts and workloads, on made-up figures (no benchmark runs here):
``bench_memory.py --min-ratio`` (``scripts/gpu_bench.sh``'s kernels_* parts),
``bench_schedules.py --sweep``'s targets, ``bench_host.py``'s goal per workload, the lengths of
the workloads they draw, and ``gpu_bench.sh``'s part selection."""
import os
import subprocess
import sys

import numpy as np
import pytest

from harness import REPO

SCRIPTS = os.path.join(REPO, "scripts")


@pytest.fixture(scope="module")
def scripts():
    """``bench_memory``, ``_sweep``, ``bench_host`` and ``_workloads`` imported from scripts/."""
    sys.path.insert(0, SCRIPTS)
    try:
        import _sweep
        import _workloads
        import bench_host
        import bench_memory
    finally:
        sys.path.remove(SCRIPTS)
    return bench_memory, _sweep, bench_host, _workloads


def test_min_ratio_verdicts_pass_fail_and_failed_runs(scripts):
    bench_memory = scripts[0]
    results = {"1f1b": {"tokens_per_s": 100.0, "num_microbatches": 2},
               "elastic": {"tokens_per_s": 100.0, "num_microbatches": 4},
               "seq1f1b": {"tokens_per_s": 99.0, "num_microbatches": 8},
               "sppo": {"error": "exit 1"}}
    lines = bench_memory.verdicts(results, 1.0)
    assert [line.split(":")[0] for line in lines] == ["verdict PASS", "verdict FAIL",
                                                       "verdict FAIL"]
    assert "elastic x1.000" in lines[0] and "4 / 2 units" in lines[0]
    assert "seq1f1b x0.990" in lines[1] and "sppo did not run" in lines[2]
    assert bench_memory.verdicts({**results, "1f1b": {"error": "timed out"}}, 1.0) == \
        ["verdict FAIL: 1f1b (the baseline) did not run: timed out"]


def sweep_run(ratios: dict) -> dict:
    """A pp run of one workload with ``{schedule: tokens/s}``, ratios added."""
    return {"workloads": {"github-like": {name: {"tokens_per_s": speed}
                                          for name, speed in ratios.items()}}}


def test_sweep_verdicts(scripts):
    _sweep = scripts[1]
    runs = {"pp1": sweep_run({"1f1b": 100.0, "elastic": 98.0, "seq1f1b": 96.0}),
            "pp2": sweep_run({"1f1b": 100.0, "elastic": 120.0, "seq1f1b": 110.0})}
    for run in runs.values():
        _sweep.add_ratios(run["workloads"])
    found = {v["target"]: v["passed"] for v in _sweep.verdicts(runs)}
    assert found == {
        "pp1 github-like: every document schedule >= 0.97x 1f1b tokens/s": False,  # seq1f1b
        "pp2 github-like: every document schedule >= 0.97x 1f1b tokens/s": True,
        "pp2 github-like: elastic >= 1.15x 1f1b tokens/s": True,
        "pp2 github-like: elastic >= 1.1x seq1f1b tokens/s": False}  # 1.09
    del runs["pp2"]
    assert [v["passed"] for v in _sweep.verdicts(runs)][-2:] == [None, None]


def test_host_goal_per_workload(scripts):
    bench_host = scripts[2]
    results = {name: {"operator_calls_per_1k_tokens": calls, "host_s_per_1k_tokens": 1.0,
                      "operator_calls_per_unit": per_unit}
               for name, calls, per_unit in (("1f1b", 300, 1000), ("elastic", 330, 1200),
                                             ("seq1f1b", 331, 1000))}
    verdict = bench_host.compare(results)
    assert not verdict["passed"]
    assert verdict["above_goal"] == {"seq1f1b": pytest.approx(331 / 300)}
    assert bench_host.compare(results, "operator_calls_per_unit")["above_goal"] == \
        {"elastic": pytest.approx(1.2)}
    del results["seq1f1b"]
    assert bench_host.compare(results)["passed"]


def test_workload_lengths(scripts):
    _workloads = scripts[3]
    rng = np.random.default_rng(0)
    assert set(_workloads.long(2048, rng)) == {3 * 2048 + 1}
    short = _workloads.short(2048, rng)
    assert short.max() <= 1024 and np.median(short) < 512
    with pytest.raises(SystemExit, match="unknown workload medium: choose from corpus, short"):
        _workloads.check_names(["short", "medium"])


def test_gpu_bench_refuses_an_unknown_part(tmp_path):
    done = subprocess.run(["bash", "scripts/gpu_bench.sh", str(tmp_path), "kernels_32k",
                           "kernels_128k"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2
    assert "no part named kernels_128k: choose from attention_tests" in done.stderr

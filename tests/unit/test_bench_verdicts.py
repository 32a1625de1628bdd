"""The benchmarks' verdicts, on made-up figures (no benchmark runs here):
``bench_memory.py --min-ratio`` (``scripts/gpu_bench.sh``'s kernels_* parts), and
``gpu_bench.sh``'s part selection."""
import os
import subprocess
import sys

import pytest

from harness import REPO

SCRIPTS = os.path.join(REPO, "scripts")


@pytest.fixture(scope="module")
def scripts():
    """``bench_memory`` imported from scripts/."""
    sys.path.insert(0, SCRIPTS)
    try:
        import bench_memory
    finally:
        sys.path.remove(SCRIPTS)
    return (bench_memory,)


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


def test_gpu_bench_refuses_an_unknown_part(tmp_path):
    done = subprocess.run(["bash", "scripts/gpu_bench.sh", str(tmp_path), "kernels_32k",
                           "kernels_128k"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2
    assert "no part named kernels_128k: choose from attention_tests" in done.stderr

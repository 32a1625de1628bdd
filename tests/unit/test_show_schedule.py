"""``scripts/show_schedule.py``: grid, bubble ratio, JSON, Gantt and trace outputs."""
import json
import os
import subprocess
import sys

from harness import REPO, python_path


def show(*args):
    return subprocess.run([sys.executable, "scripts/show_schedule.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=python_path()))


def test_prints_grid_and_writes_outputs(tmp_path):
    out = tmp_path / "s.json"
    png = tmp_path / "s.png"
    trace = tmp_path / "t.json"
    result = show("--schedule", "1f1b", "--pp", "4", "--microbatches", "6", "--json", str(out),
                  "--gantt", str(png), "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    assert "step | rank 0" in result.stdout and "3RECV_F5<2" in result.stdout
    assert "bubble ratio 0.3333" in result.stdout  # (p-1)/(m+p-1) = 3/9
    summary = json.loads(out.read_text())
    assert summary["schedule"] == "1f1b" and summary["pp"] == 4 and summary["microbatches"] == 6
    assert summary["iteration_time"] == 27.0
    assert summary["peak_memory_units"] == [4.0, 3.0, 2.0, 1.0]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len([e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]) == 48


def test_unknown_schedule_lists_valid_names():
    result = show("--schedule", "nope", "--pp", "2", "--microbatches", "2")
    assert result.returncode == 2
    assert "unknown pipeline schedule 'nope'; valid names: default, 1f1b" in result.stderr
    result = show("--schedule", "interleaved", "--pp", "2", "--microbatches", "2")
    assert result.returncode == 2
    assert "schedule 'interleaved' has no IR builder; schedules with one: 1f1b, 1f1b-ir" \
        in result.stderr


def test_helix_grid_and_the_one_fold_bubble(tmp_path):
    """Helix with one fold, one loop of p micro-batches: every stage idles exactly
    3 (p - 1)(t_pre + t_post) = 27 units at p = 4 (HelixPipe's naive FILO bubble), whatever the
    attention costs."""
    out = tmp_path / "h.json"
    result = show("--schedule", "helix", "--pp", "4", "--microbatches", "4", "--num-layers",
                  "8", "--helix-folds", "1", "--attention-cost", "5", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "ATTN_F" in result.stdout and "SEND_F" in result.stdout
    summary = json.loads(out.read_text())
    assert summary["idle"] == [27.0] * 4


def test_helix_refuses_layers_that_do_not_divide():
    result = show("--schedule", "helix", "--pp", "3", "--microbatches", "6", "--num-layers", "4")
    assert result.returncode == 2
    assert "layers divisible by pp" in result.stderr


def test_elastic_from_a_lengths_file(tmp_path):
    """elastic plans its units from the documents: one length a line, priced in seconds."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("3000\n120\n64\n900\n40\n2200\n300\n16\n700\n50\n")
    out = tmp_path / "e.json"
    result = show("--schedule", "elastic", "--pp", "2", "--lengths", str(lengths),
                  "--model", "custom", "--num-layers", "4", "--hidden-size", "64",
                  "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--vocab-size",
                  "512", "--sp", "1", "--memory-gb", "16", "--workers", "1",
                  "--solver-time-limit", "0.05", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "schedule elastic: pp=2 microbatches=" in result.stdout
    assert " s, bubble ratio " in result.stdout and "peak bytes per stage" in result.stdout
    assert json.loads(out.read_text())["iteration_time"] > 0


def test_zb1p_and_flags_of_other_schedules():
    result = show("--schedule", "zb1p", "--pp", "4", "--microbatches", "8")
    assert result.returncode == 0, result.stderr
    assert "iteration time 27 units" in result.stdout  # 3m + p - 1, B = W = 1
    result = show("--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--offload")
    assert result.returncode == 2
    assert "--offload is a drawing flag of sppo and would do nothing for 1f1b" in result.stderr

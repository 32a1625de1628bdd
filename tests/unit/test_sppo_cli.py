"""``python -m sppo_offload.plan`` prints the summary and writes the documented JSON."""
import json

from sppo_offload.plan import main

FIELDS = ("sp", "pp", "dp", "num_subsequences", "lengths", "alphas", "iteration_time_s",
          "tokens_per_s", "peak_memory_gb", "largest_seq_length", "checkpointed_layers")


def test_cli_json_fields(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["--seq-length", "524288", "--model", "gpt-7b", "--hardware", "a100",
                 "--gpus", "16", "--memory-gb", "80", "--granularity", "131072",
                 "--json", str(out), "--gantt", str(tmp_path / "g.png")])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["hardware_source"] == "spec-derived" and result["gpus"] == 16
    assert set(result["methods"]) == {"sppo", "megatron_recompute", "seq1f1b"}
    for name, entry in result["methods"].items():
        for field in FIELDS:
            assert field in entry, (name, field)
        assert sum(entry["lengths"]) == 524288
        assert max(entry["peak_memory_gb"]) <= 80
        assert entry["largest_seq_length"] >= 524288
        assert entry["sp"] * entry["pp"] * entry["dp"] == 16
    sppo = result["methods"]["sppo"]
    assert len(sppo["alphas"]) == sppo["pp"]
    assert all(len(row) == sppo["num_subsequences"] for row in sppo["alphas"])
    assert "multiplexed_iteration_time_s" in sppo or sppo["pp"] == 1
    if sppo["pp"] > 1:
        # Said to fit exactly when its simulated peak is within the budget.
        assert sppo["multiplexed_fits"] == (max(sppo["multiplexed_peak_memory_gb"]) <= 80)
    text = capsys.readouterr().out
    assert "sppo / megatron_recompute throughput" in text and "simulated" in text
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_errors(capsys):
    assert main(["--seq-length", "1024", "--model", "gpt-1t"]) == 2
    assert "gpt-65b" in capsys.readouterr().err
    assert main(["--seq-length", "1024", "--sppo-offload", "2"]) == 2
    assert "ratio must be in [0, 1]" in capsys.readouterr().err
    assert main(["--seq-length", "1024", "--sppo-subsequences", "many"]) == 2
    assert "takes a count or auto" in capsys.readouterr().err


def test_cli_reports_oom_with_the_budget(capsys):
    assert main(["--seq-length", "2097152", "--gpus", "8", "--granularity", "262144"]) == 0
    text = capsys.readouterr().out
    assert "OOM" in text and "cannot fit even fully offloaded" in text


def test_cli_host_memory_cap_is_reported_and_honoured(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--seq-length", "196608", "--gpus", "8", "--granularity", "196608",
            "--json", str(out)]
    assert main([*args, "--host-memory-gb", "78"]) == 0
    capped = json.loads(out.read_text())
    assert capped["host_memory_gb"] == 78
    assert "host memory 78 GB each" in capsys.readouterr().out
    assert 0 < max(capped["methods"]["sppo"]["host_memory_gb"]) <= 78
    assert main(args) == 0
    free = json.loads(out.read_text())
    assert free["host_memory_gb"] is None
    assert max(free["methods"]["sppo"]["host_memory_gb"]) > 78
    assert main([*args, "--host-memory-gb", "40"]) == 0
    assert "the smallest host budget that fits is" in capsys.readouterr().out
    assert main([*args, "--host-memory-gb", "0"]) == 2
    assert "host_memory_gb must be > 0" in capsys.readouterr().err

"""``python -m elastic_pipe.plan`` writes the documented JSON and refuses bad input."""
import json

from elastic_pipe.plan import main
from elastic_pipe.workloads import read_lengths, sample


def test_cli_json_fields_and_baselines(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [70000, 3000, 200, 9000, 15000, 40, 1200,
                                                  5000, 800, 22000] * 3))
    out = tmp_path / "plan.json"
    code = main(["--lengths", str(lengths), "--global-batch-size", "24", "--seed", "3",
                 "--seq-length", "32768", "--model", "gpt-7b", "--hardware", "h100",
                 "--pp", "4", "--sp", "8", "--solver-time-limit", "0.05", "--workers", "1",
                 "--json", str(out), "--trace", str(tmp_path / "t.json")])
    assert code == 0
    result = json.loads(out.read_text())
    for field in ("schedule", "iteration_time_s", "bubble_ratio", "recompute_time_s",
                  "peak_memory_gb", "memory_capacity_gb", "solve_time_s", "num_chunks",
                  "num_pipelines", "truncated", "fallbacks", "baselines"):
        assert field in result, field
    drawn = sample(read_lengths(str(lengths)), 24, 3)
    assert result["truncated"] == sum(n > 32768 for n in drawn)
    assert len(result["peak_memory_gb"]) == 4
    assert max(result["peak_memory_gb"]) <= result["memory_capacity_gb"]
    assert set(result["baselines"]) == {"seq1f1b", "1f1b_packed", "elastic_full_ckpt",
                                        "elastic_no_grouping"}
    for name, baseline in result["baselines"].items():
        assert baseline.get("oom") or baseline["iteration_time_s"] > 0, name
    assert "0F0" in result["schedule"]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert "simulated iteration" in capsys.readouterr().out


def test_cli_unknown_names_and_empty_file(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n200\n")
    assert main(["--lengths", str(lengths), "--model", "gpt-1t"]) == 2
    assert "valid: gpt-13b, gpt-30b, gpt-65b, gpt-7b" in capsys.readouterr().err
    assert main(["--lengths", str(lengths), "--hardware", "v100"]) == 2
    assert "valid: a100, a800, h100, h20" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert main(["--lengths", str(tmp_path / "empty.txt")]) == 2
    assert "no document lengths" in capsys.readouterr().err

"""``python -m elastic_pipe.plan`` and ``scripts/show_schedule.py`` plan a batch read from a
file, a Megatron dataset or the embedded corpus, write the documented JSON and refuse bad
input, naming every missing flag at once."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from harness import REPO, python_path

from megatron.plugin import registry
from megatron.plugin.corpus import embedded_corpus, write_dataset
from megatron.plugin.drawing import DrawCommand
from elastic_pipe.plan import main
from elastic_pipe.workloads import read_lengths, sample

#: A model small enough to plan in a moment, with 4 heads: Ulysses at the old ``--sp 8``
#: default cannot split it.
SMALL_MODEL = ["--model", "custom", "--num-layers", "4", "--hidden-size", "64",
               "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--vocab-size", "257",
               "--memory-gb", "16", "--workers", "1", "--solver-time-limit", "0.05"]


def run(*command):
    """A command in a process of its own, as a user runs it (the dataset's memory map lives
    and dies there)."""
    return subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=python_path()))


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


def test_cli_plans_a_megatron_dataset(tmp_path):
    """The lengths are read from the dataset's index: the one document over the context is the
    one truncated."""
    prefix = tmp_path / "docs_text_document"
    write_dataset(prefix, [np.arange(n) % 256 for n in (900, 40, 5000, 300, 1200, 70)], 257)
    out = tmp_path / "plan.json"
    result = run("-m", "elastic_pipe.plan", "--data-path", str(prefix), "--seq-length", "4096",
                 "--pp", "2", *SMALL_MODEL, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["truncated"] == 1
    assert "simulated iteration" in result.stdout


def test_show_schedule_draws_the_embedded_corpus():
    """show_schedule's path in this process (a read through a closed memory map ends it)."""
    command = DrawCommand(registry.drawables())
    args = command.parse(["--schedule", "elastic", "--pp", "2", "--data-path", embedded_corpus(),
                          "--global-batch-size", "16", "--seq-length", "8192", *SMALL_MODEL])
    built = command.build(registry.drawable("elastic"), args)
    assert len(built.schedule) == 2 and all(built.schedule)


def test_a_damaged_dataset_is_named(tmp_path, capsys):
    prefix = tmp_path / "docs"
    write_dataset(prefix, [np.arange(50)], 257)
    os.remove(f"{prefix}.bin")
    assert main(["--data-path", str(prefix)]) == 2
    assert f"--data-path {prefix}: {prefix}.bin not found" in capsys.readouterr().err
    write_dataset(prefix, [np.arange(50)], 257)
    with open(f"{prefix}.idx", "r+b") as index:
        index.truncate(12)
    assert main(["--data-path", str(prefix)]) == 2
    assert f"{prefix}.idx cannot be read" in capsys.readouterr().err


def test_every_missing_flag_is_named_at_once(capsys):
    assert main(["--workload", "github-like", "--model", "custom", "--hidden-size", "64"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: missing --global-batch-size (the documents --workload draws); --num-layers "
        "--num-attention-heads --ffn-hidden-size --vocab-size (the shape of --model custom)")
    assert main([]) == 2
    assert "missing --lengths FILE, --data-path PREFIX or --workload NAME (the batch)" \
        in capsys.readouterr().err
    command = DrawCommand(registry.drawables())
    for name, expected in (("elastic", "elastic needs --pp; --lengths FILE, --data-path PREFIX "
                                       "or --workload NAME (the batch)"),
                           ("1f1b", "1f1b needs --pp; --microbatches")):
        with pytest.raises(ValueError) as error:
            command.build(registry.drawable(name), command.parse(["--schedule", name]))
        assert str(error.value) == expected

"""README.md's GPU table is what ``scripts/gpu_table.py`` makes of the committed reports; the
table and the start-up warnings (:mod:`megatron.plugin.gpu_proofs`) read verdict lines."""
import argparse

from megatron.plugin import gpu_proofs
from scripts import gpu_table


def test_readme_holds_the_table_of_the_committed_reports():
    assert gpu_table.readme_table(gpu_table.README.read_text()) == gpu_table.table(), \
        "README.md's GPU table is stale: python scripts/gpu_table.py --write"


def write_report(folder, *lines):
    (folder / "verdicts_abc.txt").write_text("\n".join(["commit abc", "device H100", *lines]))


def test_cells_from_verdicts_and_exit_codes(tmp_path):
    write_report(tmp_path, "PASS  train/helix/pp2/bf16  losses within 5e-03 of fp32",
                 "FAIL  train/helix/pp4/bf16  losses ...", "SKIP  train/sppo/pp4/fp16  not started",
                 "PASS  golden/1f1b-ir/pp2tp2/fp32  2 test(s) of pp2_tp2_sp_ir passed")
    (tmp_path / "gpu_check_9.txt").write_text("ok      train-elastic-fp16\nFAILED  unit (log)\n")
    cells = gpu_table.cells(tmp_path)
    assert cells == {("helix", "pp2", "bf16"): "pass", ("helix", "pp4", "bf16"): "FAIL",
                     ("1f1b-ir", "pp2tp2", "fp32"): "pass",
                     ("elastic", "pp1", "fp16"): "ran, no update"}
    row = next(line for line in gpu_table.table(tmp_path).splitlines() if "`helix`" in line)
    assert row.split(" | ")[5] == "pass" and row.split(" | ")[8] == "FAIL"


def run(schedule="elastic", **flags):
    return argparse.Namespace(**{"pipeline_schedule": schedule, "bf16": False, "fp16": False,
                                 "transformer_impl": "local", **flags})


def test_options_unproven_on_gpus_warn_until_a_report_passes(tmp_path):
    assert gpu_proofs.warnings(run(), tmp_path) == []
    [line] = gpu_proofs.warnings(run(bf16=True), tmp_path)
    assert line.startswith("warning: --bf16 under --pipeline-schedule elastic is unproven")
    write_report(tmp_path, "PASS  train/elastic/pp4/bf16  losses within 5e-03 of fp32",
                 "FAIL  train/1f1b/pp2/fp16  fp16 skipped iterations")
    assert gpu_proofs.warnings(run(bf16=True), tmp_path) == []
    assert len(gpu_proofs.warnings(run("default", fp16=True), tmp_path)) == 1
    te = run(transformer_impl="transformer_engine", bf16=True)
    [line] = gpu_proofs.warnings(te, tmp_path)
    assert "transformer_engine" in line
    write_report(tmp_path, "PASS  train/elastic/pp2/bf16-te  losses within 5e-03 of fp32")
    assert [line.split()[1] for line in gpu_proofs.warnings(te, tmp_path)] == ["--bf16"]

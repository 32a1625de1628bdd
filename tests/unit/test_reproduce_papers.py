"""scripts/reproduce_papers.py: its fast sections run, every row's ratio is its two numbers',
and a row that disagrees carries its computed term and the verdict the band gives it
(tests/unit/test_reproduction_table.py checks the committed table the same way)."""
import json
import os
import subprocess
import sys

from harness import REPO, python_path
BAND = 0.15


def test_table3_and_helixpipe_rows(tmp_path):
    out, table = tmp_path / "rows.json", tmp_path / "rows.md"
    result = subprocess.run(
        [sys.executable, "scripts/reproduce_papers.py", "--only", "table3", "helixpipe",
         "--json", str(out), "--markdown", str(table)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=python_path()))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("SIMULATED")
    report = json.loads(out.read_text())
    assert report["simulated"] is True
    rows = report["rows"]
    assert len(rows) == 3 + 15 + 12  # Table 3's shares and seconds, helix's rows
    bounded = [row for row in rows if row["published"] is None]
    assert len(bounded) == 6  # helix at 32K: the paper's text gives bounds only
    for row in rows:
        assert row["simulated"] > 0
        assert row["profile"] in report["testbeds"]
        if row in bounded:
            op, value = row["published_bound"].split()
            assert row["simulated_over_published"] is None
            off = row["simulated"] > (1 + BAND) * float(value) if op == "<=" else \
                row["simulated"] < (1 - BAND) * float(value)
        else:
            assert row["published"] > 0
            assert row["simulated_over_published"] == row["simulated"] / row["published"]
            off = abs(row["simulated_over_published"] - 1) > BAND
        assert (row["verdict"] != "agrees") if off else \
            (row["verdict"] == "agrees" and row["why"] is None)
        if row["why"] is not None:
            assert row["why"]["name"] and row["why"]["unit"] and row["why"]["source"]
    assert report["summary"]["band"] == BAND
    # the network each paper states is the testbed's (HelixPipe L231: 4 x 100 Gb/s a node)
    assert report["testbeds"]["helixpipe-a800"]["overrides"] == {"node_nic_gbps": 50.0}
    assert table.read_text().count("\n") == 2 + len(rows)


def test_the_flexsp_rows_term_is_flexsp_recomputing_every_layer():
    """Two cells by hand: the term's size is the most extra seconds recomputing costs FlexSP
    (3 s, the 13B cell), the row's number with it the largest ratio over the cells (13 / 10;
    FlexSP over DeepSpeed: 30 / 24); a cell without FlexSP prices nothing."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import reproduce_papers
    finally:
        sys.path.remove(os.path.join(REPO, "scripts"))
    cells = [{"model": "gpt-13b", "context": 49152, "elastic_s": 10.0, "flexsp_s": 10.0,
              "flexsp_recompute_s": 13.0, "deepspeed_s": 15.0},
             {"model": "gpt-30b", "context": 98304, "elastic_s": 20.0, "flexsp_s": 22.0,
              "flexsp_recompute_s": 24.0, "deepspeed_s": 30.0}]
    why = reproduce_papers.recompute_term(cells)
    assert why["size"] == 3.0 and why["unit"].endswith("(gpt-13b, 48K)")
    assert why["simulated_with"] == 13.0 / 10.0
    over = reproduce_papers.recompute_term(cells, lambda cell, flexsp: cell["deepspeed_s"] / flexsp)
    assert over["simulated_with"] == 30.0 / 24.0
    assert reproduce_papers.recompute_term([dict(cells[0], flexsp_s=None)]) is None

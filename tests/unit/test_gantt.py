"""Gantt pictures people read: the time axis names its unit, a paper-scale plan draws a bounded
number of patches that keep every rank's busy time, a window zooms, and
``scripts/show_trace.py`` turns a ``--trace-dir`` into a PNG with the plan beside it."""
import importlib.util
import os
import subprocess
import sys

import pytest

from harness import REPO, python_path
from megatron.plugin.pipeline.chrome_trace import TraceEvent, write_chrome_trace
from megatron.plugin.pipeline.gantt import Panel, bars, figure
from megatron.plugin.pipeline.ir import parse
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import UniformCosts, simulate
from megatron.plugin.pipeline.trace_dir import measured_name, plan_name


def _timeline(pp: int, microbatches: int, seconds_per_unit: float = 1.0):
    """A 1F1B timeline whose forward takes ``seconds_per_unit`` seconds."""
    schedule = add_communication(one_f_one_b(pp, microbatches), num_stages=pp)
    costs = UniformCosts(forward=seconds_per_unit, backward=2 * seconds_per_unit)
    return [e for e in simulate(schedule, costs).events if e.category != "comm"]


@pytest.fixture(scope="module")
def large():
    """Far more actions per rank than the 20 bars the tests allow."""
    return _timeline(4, 300, seconds_per_unit=1e-3)


def _close(fig):
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.parametrize("unit, label", [("s", "time (seconds)"), ("units", "time (units)")])
def test_the_time_axis_names_its_unit(unit, label):
    fig = figure(_timeline(2, 3), time_unit=unit)
    assert fig.axes[0].get_xlabel() == label
    _close(fig)


def test_a_small_plan_draws_one_bar_per_action():
    events = _timeline(4, 6)
    drawn = bars(events, (0.0, 27.0), max_bars=80)
    assert sorted((b.row, b.start, b.width) for b in drawn) == \
        sorted((e.rank, e.start, e.duration) for e in events)
    assert sorted(b.label for b in drawn if b.kind == "F" and b.row == 0) == \
        [str(unit) for unit in range(6)]


def test_a_large_plan_draws_bounded_shares_that_keep_each_ranks_busy_time(large):
    events = large
    end = max(e.start + e.duration for e in events)
    drawn = bars(events, (0.0, end), max_bars=20)
    assert len(drawn) <= 4 * 20 * 2  # ranks x slots x kinds (F, B)
    assert len(drawn) < len(events) / 10
    for rank in range(4):
        for kind in ("F", "B"):
            busy = sum(e.duration for e in events
                       if e.rank == rank and parse(e.name).kind.value == kind)
            shares = sum(b.width * b.height / 0.8 for b in drawn
                         if round(b.row) == rank and b.kind == kind)
            assert shares == pytest.approx(busy, rel=1e-9)
    fig = figure(events, max_bars=20)
    assert "each column is a" in fig.axes[0].get_title()
    assert len(fig.axes[0].patches) == len(drawn)
    _close(fig)


def test_a_window_zooms_back_to_one_bar_per_action(large):
    events = large
    fig = figure(events, window=(0.5, 0.52), max_bars=20)
    ax = fig.axes[0]
    assert ax.get_xlim() == (0.5, 0.52)
    assert "each column" not in ax.get_title()
    inside = [e for e in events if e.start < 0.52 and e.start + e.duration > 0.5]
    assert 4 < len(inside) <= 4 * 20
    assert len(ax.patches) == len(inside)
    _close(fig)
    with pytest.raises(ValueError, match="0 <= START < END"):
        figure(events, window=(2.0, 1.0))


def _show_trace():
    spec = importlib.util.spec_from_file_location(
        "show_trace", os.path.join(REPO, "scripts", "show_trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace_dir(tmp_path, plan: bool):
    """Two calls of a 2-rank run; the second with its plan."""
    events = _timeline(2, 3, seconds_per_unit=0.01)
    for call in (1, 2):
        for rank in (0, 1):
            write_chrome_trace([e for e in events if e.rank == rank],
                               str(tmp_path / measured_name(call, rank)))
    if plan:
        write_chrome_trace([TraceEvent(e.rank, e.name, e.start * 2, e.duration * 2)
                            for e in events], str(tmp_path / plan_name(2, 0)))
    return tmp_path


def test_show_trace_draws_the_last_call_beside_its_plan(tmp_path):
    show_trace = _show_trace()
    args = show_trace._parser().parse_args(["--trace-dir", str(_trace_dir(tmp_path, True)),
                                            "--out", "unused.png"])
    number, panels = show_trace.panels(args)
    assert number == 2
    predicted, measured = panels
    assert predicted.row_names == ["stage 0", "stage 1"]
    assert measured.row_names == ["rank 0", "rank 1"]
    assert max(e.start + e.duration for e in predicted.events) == pytest.approx(
        2 * max(e.start + e.duration for e in measured.events))
    fig = figure(panels)
    assert [ax.get_xlabel() for ax in fig.axes] == ["", "time (seconds)"]
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim()
    _close(fig)
    fig = figure(panels, shared_axis=False)
    assert [ax.get_xlabel() for ax in fig.axes] == ["time (seconds)"] * 2
    assert fig.axes[0].get_xlim()[1] == pytest.approx(2 * fig.axes[1].get_xlim()[1])
    _close(fig)
    args.call = 1
    assert [p.title.split(" ")[0] for p in show_trace.panels(args)[1]] == ["measured"]


def test_show_trace_writes_a_png_and_refuses_an_empty_directory(tmp_path):
    (tmp_path / "run").mkdir()
    traces = _trace_dir(tmp_path / "run", False)
    env = dict(os.environ, PYTHONPATH=python_path())
    png = tmp_path / "run.png"
    result = subprocess.run([sys.executable, "scripts/show_trace.py", "--trace-dir", str(traces),
                             "--out", str(png)], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    result = subprocess.run([sys.executable, "scripts/show_trace.py", "--trace-dir",
                             str(tmp_path / "empty"), "--out", str(png)], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "holds no call_<n>_rank<r>.json: run training with --trace-dir" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_panel_names_its_rows():
    fig = figure([Panel(_timeline(2, 2), "p", ["stage 0", "stage 1"])])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["stage 0", "stage 1"]
    _close(fig)

"""The schedule contract (``ScheduleSpec``) is enough: a schedule from a module outside the
source tree (``tests/schedules/gpipe.py``), registered through the registry's environment
variable, is drawn by ``scripts/show_schedule.py``, priced by the simulator and validated
(it is trained to the reference gradients in ``tests/distributed/test_golden_megatron.py``,
layout ``pp2_gpipe_outside``); every registered schedule but Megatron's ``interleaved`` (and
``default``, Megatron's choice) is drawn through the flags its spec declares, and the
simulate-only ``zb1p`` too while ``--pipeline-schedule`` refuses it; every schedule's IR
builder, and the lowering of an elastic plan, matches its golden files.

Regenerate the golden files after an intended change with
``REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_schedule_contract.py``.
"""
import importlib
import os
import subprocess
import sys

import pytest

from harness import assert_matches_golden, python_path
from megatron.plugin import arguments, registry
from megatron.plugin.drawing import DrawCommand
from megatron.plugin.pipeline import catalog
from megatron.plugin.schedule_spec import ScheduleSpec
from megatron.plugin.pipeline.ir import format_schedule
from megatron.plugin.pipeline.simulator import dry_run, simulate

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(os.path.dirname(__file__), "golden_schedules")
OUTSIDE = {"LONGCTX_SCHEDULES": "tests.schedules.gpipe:SPEC"}


@pytest.fixture
def gpipe(monkeypatch):
    monkeypatch.syspath_prepend(REPO)
    spec = importlib.import_module("tests.schedules.gpipe").SPEC
    registry.register(spec)
    yield spec
    registry._SPECS.pop(spec.name)


def test_outside_schedule_is_drawn_by_show_schedule(tmp_path):
    png = tmp_path / "gpipe.png"
    result = subprocess.run(
        [sys.executable, "scripts/show_schedule.py", "--schedule", "gpipe", "--pp", "2",
         "--microbatches", "4", "--gantt", str(png)], cwd=REPO, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, PYTHONPATH=python_path(), **OUTSIDE))
    assert result.returncode == 0, result.stderr
    # GPipe: (m + p - 1) (forward + backward) = 5 x 3 units, bubble (p - 1) / (m + p - 1).
    assert "schedule gpipe: pp=2 microbatches=4 iteration time 15 units, bubble ratio " \
           "0.2000" in result.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_outside_schedule_is_priced_validated_and_accepted_by_the_parser(gpipe, monkeypatch):
    built = registry.build_ir("gpipe")(4, 8, catalog.Options())
    result = simulate(built.schedule, built.costs)
    assert result.iteration_time == (8 + 4 - 1) * 3
    assert result.peak_memory == [8.0] * 4  # every forward stashed before the first backward
    dry_run(built.schedule)
    assert "gpipe" in registry.schedule_names() and not registry.is_megatron("gpipe")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = arguments.parse(
        ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
         "--pipeline-model-parallel-size", "2", "--calculate-per-token-loss",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--pipeline-schedule", "gpipe"])
    assert registry.get_schedule(args.pipeline_schedule) is gpipe.forward_backward


def test_spec_in_the_environment_must_name_a_schedule_spec(monkeypatch):
    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.setenv(registry.ENVIRONMENT, "tests.schedules.gpipe")
    with pytest.raises(ValueError, match="is not MODULE:ATTRIBUTE"):
        registry.schedule_names()
    monkeypatch.setattr(registry, "_DISCOVERED", False)
    monkeypatch.syspath_prepend(REPO)
    monkeypatch.setenv(registry.ENVIRONMENT, "tests.schedules.gpipe:gpipe")
    with pytest.raises(TypeError, match="not a ScheduleSpec"):
        registry.schedule_names()


def draw(name, *flags):
    """What ``scripts/show_schedule.py --schedule NAME FLAGS`` builds."""
    command = DrawCommand(registry.drawables())
    return command.build(registry.drawable(name), command.parse(["--schedule", name, *flags]))


#: (schedule, pp, units, drawing flags, golden file): the IR of every drawable project schedule
#: (``1f1b-ir`` draws Megatron's 1F1B: the file of ``tests/unit/test_schedule_1f1b.py``).
GOLDEN_CASES = [
    ("1f1b-ir", 4, 9, [], "1f1b_pp4_m9"),
    ("helix", 2, 4, [], "helix_pp2_m4"),
    ("helix", 2, 3, ["--num-layers", "4", "--recompute"], "helix_pp2_m3_l4_recompute"),
    ("helix", 4, 8, ["--helix-folds", "1"], "helix_pp4_m8_folds1"),
    ("sppo", 2, 4, [], "sppo_pp2_m4"),
    ("sppo", 4, 6, ["--offload"], "sppo_pp4_m6_offload"),
]


@pytest.mark.parametrize("name,pp,units,flags,golden", GOLDEN_CASES)
def test_ir_builder_matches_golden_file(name, pp, units, flags, golden):
    built = draw(name, "--pp", str(pp), "--microbatches", str(units), *flags)
    dry_run(built.schedule, eager_sends=built.eager_sends)
    text = format_schedule(built.schedule) + "\n"
    path = os.path.join(GOLDEN, f"{golden}.txt")
    assert_matches_golden(path, text)


#: A batch for the schedules that plan their own units (``draw_units=False``): ten documents,
#: a tiny model on two stages, one solver worker.
BATCH = ["3000", "120", "64", "900", "40", "2200", "300", "16", "700", "50"]
TINY = ["--model", "custom", "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--vocab-size", "512",
        "--sp", "1", "--memory-gb", "16", "--workers", "1", "--solver-time-limit", "0.05"]


def test_every_registered_schedule_but_interleaved_is_drawn(tmp_path):
    """Megatron's ``interleaved`` (virtual stages) has no IR builder, ``default`` is whichever
    Megatron picks; every other schedule is drawn with its spec's own flags."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(BATCH) + "\n")
    names = [name for name in registry.schedule_names() if name not in ("default",
                                                                         "interleaved")]
    assert set(names) >= {"1f1b", "1f1b-ir", "elastic", "helix", "seq1f1b", "sppo"}
    for name in names:
        if registry.drawable(name).draw_units:
            built = draw(name, "--pp", "2", "--microbatches", "4")
        else:
            built = draw(name, "--pp", "2", "--lengths", str(lengths), *TINY)
        dry_run(built.schedule, eager_sends=built.eager_sends)
        assert simulate(built.schedule, built.costs, eager_sends=built.eager_sends) \
            .iteration_time > 0, name
    with pytest.raises(ValueError, match="schedule 'interleaved' has no IR builder"):
        registry.build_ir("interleaved")


def test_zb1p_is_drawn_but_not_trained(monkeypatch):
    """ZB1P is simulate-only (the executor refuses its W actions): drawn at the zero-bubble
    closed form 3m + p - 1 (B = W = half the backward), refused by ``--pipeline-schedule``."""
    built = draw("zb1p", "--pp", "4", "--microbatches", "8")
    assert simulate(built.schedule, built.costs, eager_sends=True).iteration_time == 3 * 8 + 3
    assert "zb1p" in registry.drawable_names() and "zb1p" not in registry.schedule_names()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb1p'"):
        arguments.parse(["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads",
                         "4", "--seq-length", "64", "--max-position-embeddings", "64",
                         "--micro-batch-size", "1", "--global-batch-size", "8",
                         "--train-iters", "1", "--lr", "1e-3",
                         "--pipeline-model-parallel-size", "2", "--calculate-per-token-loss",
                         "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
                         "--pipeline-schedule", "zb1p"])
    with pytest.raises(ValueError, match="invalid schedule name 'zb1p'"):
        registry.register(ScheduleSpec("zb1p", run=print))


def test_a_drawing_flag_declared_twice_is_refused_at_registration():
    def folds(parser):
        parser.add_argument("--helix-folds", type=int, default=2)

    registry.specs()
    with pytest.raises(ValueError, match="--helix-folds.*already a flag of helix"):
        registry.register(ScheduleSpec("folds", run=print, build_ir=catalog.one_f_one_b_ir,
                                       draw_arguments=(folds,)))
    with pytest.raises(ValueError, match="--pp.*already a flag of show_schedule itself"):
        registry.register(ScheduleSpec("pp", run=print, build_ir=catalog.one_f_one_b_ir,
                                       draw_arguments=(lambda p: p.add_argument("--pp"),)))
    assert "folds" not in registry.schedule_names() and "pp" not in registry.schedule_names()


def test_elastic_lowering_matches_golden_file():
    """``elastic`` has no ``build_ir``: its IR is the lowering of a batch's plan. A fixed batch
    (two documents cut into slices, hybrid chunks, short documents packed) with a budget that
    needs no checkpointing, so the plan is the chunking's and not a solver's choice."""
    from elastic_pipe.lowering import lower
    from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
    from elastic_pipe.sequence_processor import ChunkingConfig
    from longctx.cost_model import CostModel, ParallelConfig
    from longctx.hardware import load_profile
    from longctx.models import ModelConfig

    cost = CostModel(ModelConfig("tiny", 4, 64, 4, 256, 512), load_profile("a800"),
                     ParallelConfig(pp=2, memory_gb=16.0))
    config = SchedulerConfig(chunking=ChunkingConfig(min_slice_tokens=256, slice_counts=(3,)),
                             workers=1)
    plan = plan_elastic([3000, 120, 64, 900, 40, 2200, 300, 16, 700, 50], cost, config)
    assert {piece.slice for chunk in plan.chunks() for piece in chunk.pieces} == {0, 1, 2}
    assert plan.ckpt_table() == [[0] * 5, [0] * 5]
    schedule = lower(plan, 2)
    dry_run(schedule)
    text = format_schedule(schedule) + "\n"
    path = os.path.join(GOLDEN, "elastic_pp2_m5_split.txt")
    assert_matches_golden(path, text)

"""Every registered schedule x every Megatron option that changes what a schedule must do
(recomputation, micro-batch size): either accepted, with the golden layout that proves it is
honoured with Megatron's meaning, or refused at start-up naming the flag. A schedule registered
later falls into the refusal column until a golden layout is named for it here."""
import importlib.util
import os

import pytest

from megatron.plugin import arguments, registry

OPTIONS = {
    "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"],
    "full-block": ["--recompute-granularity", "full", "--recompute-method", "block",
                   "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
    "micro-batch-size-2": ["--micro-batch-size", "2"],
}

#: (schedule, option) -> golden layout (tests/distributed/test_golden_megatron.py) that trains
#: it to the single-process reference. ``default`` picks Megatron's 1F1B at this layout.
HONOURED = {
    ("default", "full-uniform"): "pp2_full_recompute",
    ("default", "full-block"): "pp2_block_recompute_mbs2",
    ("default", "selective"): "pp2_selective_recompute",
    ("default", "micro-batch-size-2"): "pp2_block_recompute_mbs2",
    ("1f1b", "full-uniform"): "pp2_full_recompute",
    ("1f1b", "full-block"): "pp2_block_recompute_mbs2",
    ("1f1b", "selective"): "pp2_selective_recompute",
    ("1f1b", "micro-batch-size-2"): "pp2_block_recompute_mbs2",
    ("interleaved", "full-uniform"): "pp2_vp2_interleaved_uniform_recompute_mbs2",
    ("interleaved", "full-block"): "pp2_vp2_interleaved_block_recompute",
    ("interleaved", "selective"): "pp2_vp2_interleaved_selective_recompute",
    ("interleaved", "micro-batch-size-2"): "pp2_vp2_interleaved_uniform_recompute_mbs2",
    ("1f1b-ir", "full-uniform"): "pp2_ir_uniform_recompute_mbs2",
    ("1f1b-ir", "full-block"): "pp2_ir_block_recompute",
    ("1f1b-ir", "selective"): "pp2_ir_selective_recompute",
    ("1f1b-ir", "micro-batch-size-2"): "pp2_ir_uniform_recompute_mbs2",
    ("helix", "micro-batch-size-2"): "pp2_helix_mbs2",
}

#: The flag a refusal must name, per option.
FLAG = {"full-uniform": "--recompute-granularity", "full-block": "--recompute-granularity",
        "selective": "--recompute-granularity", "micro-batch-size-2": "--micro-batch-size"}

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "2"]


def _layout_flags(schedule):
    if schedule == "interleaved":
        return ["--num-layers-per-virtual-pipeline-stage", "1"]
    return []


def _golden_layouts():
    path = os.path.join(os.path.dirname(__file__), "..", "distributed",
                        "test_golden_megatron.py")
    spec = importlib.util.spec_from_file_location("golden_layouts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {tag: flags for _, layouts in module.VARIANTS.values()
            for tag, (_, flags) in layouts.items()}


CELLS = [(schedule, option) for schedule in registry.schedule_names() for option in OPTIONS]


@pytest.mark.parametrize("schedule,option", CELLS)
def test_option_is_honoured_or_refused_by_name(schedule, option, capsys):
    argv = [*BASE, *_layout_flags(schedule), "--pipeline-schedule", schedule, *OPTIONS[option]]
    if (schedule, option) in HONOURED:
        args = arguments.parse_args(argv)
        assert args.pipeline_schedule == schedule
        return
    with pytest.raises(SystemExit) as exit_info:
        arguments.parse_args(argv)
    assert exit_info.value.code == 2
    assert FLAG[option] in capsys.readouterr().err


def test_every_honoured_pair_has_its_golden_layout():
    layouts = _golden_layouts()
    for (schedule, option), tag in HONOURED.items():
        assert tag in layouts, (schedule, option, tag)
        flags = layouts[tag]
        schedule_flag = flags[flags.index("--pipeline-schedule") + 1]
        assert schedule_flag == ("1f1b" if schedule == "default" else schedule), tag
        text = " ".join(flags)
        assert " ".join(OPTIONS[option]) in text, (tag, option)

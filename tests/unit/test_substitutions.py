"""Start-up says, once and from rank 0, what runs where an accepted option value names
something else (:mod:`megatron.plugin.substitutions`): one line for each substitution, none
where the option names what runs, the schedules' own records only under their schedule."""
import argparse
import functools
import logging
import os

import pytest

from harness import TINY_MODEL
from megatron.plugin import arguments, launch, registry, substitutions
from megatron.plugin.substitutions import PREFIX


@functools.lru_cache(maxsize=None)
def _parsed(world: int, flags: tuple):
    """Megatron-LM's validated arguments of the tiny model at PP=2 with ``flags``."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        return arguments.parse([*_without(TINY_MODEL, flags), "--pipeline-model-parallel-size",
                                "2", *flags])
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


def _without(model, flags) -> list:
    """``model``'s flags (each with its value, if it takes one) less those ``flags`` give."""
    again = {flag for flag in flags if flag.startswith("--")}
    kept, i = [], 0
    while i < len(model):
        end = i + 2 if i + 1 < len(model) and not model[i + 1].startswith("--") else i + 1
        if model[i] not in again:
            kept += model[i:end]
        i = end
    return kept


def _args(world, flags):
    """``flags`` parsed; ``--bf16`` (refused without CUDA at parsing) is set on the parsed
    arguments instead, as a machine with CUDA would parse it."""
    args = _parsed(world, tuple(flag for flag in flags if flag != "--bf16"))
    if "--bf16" in flags:
        args = argparse.Namespace(**{**vars(args), "bf16": True})  # _parsed's is cached
    return args


def _lines(world, flags, cuda):
    args = _args(world, flags)
    spec = registry.spec(args.pipeline_schedule)
    return substitutions.lines(args, spec.substitutions if spec else (), cuda=cuda)


CP2 = ["--context-parallel-size", "2"]
MOE = ["--num-experts", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", "1"]

#: ``(world size, flags, CUDA present, the line's start)``: each substitution, and its line.
SAID = {
    "cp_comm_default": (4, CP2, False,
                        "--cp-comm-type p2p with --context-parallel-size 2: the document "
                        "attention exchanges Q, K and V by Ulysses all-to-all"),
    "cp_comm_per_layer_under_elastic": (
        4, [*CP2, "--cp-comm-type", "p2p", "a2a", "a2a", "p2p", "--pipeline-schedule",
            "elastic"], True, "--cp-comm-type p2p a2a a2a p2p with --context-parallel-size 2"),
    "flash_on_cpu": (2, ["--attention-backend", "flash"], False,
                     "--attention-backend flash on a machine without CUDA: the attention runs "
                     "torch's fused CPU flash kernel, not flash-attn's CUDA kernel"),
    "fused_on_cpu_with_dropout": (
        2, ["--attention-backend", "fused", "--attention-dropout", "0.1"], False,
        "--attention-backend fused on a machine without CUDA: the attention runs the "
        "matrix-product kernel while training"),
    "fused_on_cuda": (2, ["--attention-backend", "fused"], True,
                      "--attention-backend fused: the document attention runs torch's "
                      "memory-efficient CUDA kernel, not Transformer Engine's"),
    "empty_cache_on_cpu": (2, ["--empty-unused-memory-level", "1"], False,
                           "--empty-unused-memory-level 1 on a machine without CUDA: there is "
                           "no caching allocator to empty, nothing runs"),
    "memory_report_on_cpu": (2, ["--log-memory-interval", "2", "--log-interval", "1"], False,
                             "--log-memory-interval 2 on a machine without CUDA"),
    "grad_reduce_in_bf16": (2, ["--grad-reduce-in-bf16"], True,
                            "--grad-reduce-in-bf16 without --bf16: Megatron-LM reads it only "
                            "under --bf16, nothing runs"),
    "layer_scaling": (2, ["--apply-query-key-layer-scaling"], True,
                      "--apply-query-key-layer-scaling: the document attention's kernels "
                      "compute the scores and their softmax in fp32"),
    "half_softmax_unfused": (2, ["--attention-backend", "unfused", "--bf16"], True,
                             "--attention-backend unfused under --bf16 without "
                             "--attention-softmax-in-fp32: the document attention computes the "
                             "softmax in fp32"),
    "recompute_as_plan_elastic": (2, ["--pipeline-schedule", "elastic", *FULL], False,
                                  "--recompute-granularity full --recompute-method block "
                                  "--recompute-num-layers 1 under --pipeline-schedule elastic: "
                                  "the plan recomputes the layers Megatron's method names"),
    "recompute_as_plan_sppo": (2, ["--pipeline-schedule", "sppo", "--sppo-offload", "off",
                                   *FULL], True, "--recompute-granularity full --recompute-method "
                                                 "block --recompute-num-layers 1 under "
                                                 "--pipeline-schedule sppo"),
    "sppo_offload_on_cpu": (2, ["--pipeline-schedule", "sppo"], False,
                            "--sppo-offload auto on a machine without CUDA: the activations "
                            "already live in host memory"),
}

#: ``(world size, flags, CUDA present)``: the same options at values that name what runs (or
#: on a device where they do), and the schedules whose records do not apply.
SILENT = {
    "cp_comm_a2a": (4, [*CP2, "--cp-comm-type", "a2a"], False),
    "cp_comm_a2a_per_layer": (4, [*CP2, "--cp-comm-type", "a2a", "a2a", "a2a", "a2a"], True),
    "cp_comm_without_cp": (2, ["--cp-comm-type", "p2p"], False),
    "flash_on_cuda": (2, ["--attention-backend", "flash"], True),
    "unfused_on_cpu": (2, ["--attention-backend", "unfused"], False),
    "unfused_softmax_in_fp32": (2, ["--attention-backend", "unfused", "--bf16",
                                    "--attention-softmax-in-fp32"], True),
    "empty_cache_on_cuda": (2, ["--empty-unused-memory-level", "1"], True),
    "memory_report_on_cuda": (2, ["--log-memory-interval", "2", "--log-interval", "1"], True),
    "aux_loss_per_micro_batch": (2, ["--pipeline-schedule", "1f1b", *MOE], False),
    "aux_loss_off": (2, ["--pipeline-schedule", "elastic", "--num-experts", "2",
                         "--disable-bias-linear"], False),
    "recompute_under_megatron": (2, ["--pipeline-schedule", "1f1b", *FULL], False),
    "sppo_offload_off": (2, ["--pipeline-schedule", "sppo", "--sppo-offload", "off"], False),
    "sppo_offload_on_cuda": (2, ["--pipeline-schedule", "sppo"], True),
    "helix_default_dropout": (2, ["--pipeline-schedule", "helix", "--hidden-dropout", "0.1",
                                  "--attention-dropout", "0.1"], False),
    "defaults": (2, [], False),
}


@pytest.mark.parametrize("case", sorted(SAID))
def test_each_substitution_is_said_in_one_line(case):
    world, flags, cuda, start = SAID[case]
    lines = _lines(world, flags, cuda)
    assert len(lines) == 1, lines
    assert lines[0].startswith(PREFIX + start), lines[0]


@pytest.mark.parametrize("case", sorted(SILENT))
def test_nothing_is_said_where_the_option_names_what_runs(case):
    world, flags, cuda = SILENT[case]
    assert _lines(world, flags, cuda) == []


def test_every_record_has_a_case_that_says_it():
    """A record added to the core or to a schedule without a case here fails."""
    records = set(substitutions.CORE)
    for spec in registry.specs():
        records |= set(spec.substitutions)
    said = set()
    for world, flags, cuda, _ in SAID.values():
        args = _args(world, flags)
        spec = registry.spec(args.pipeline_schedule)
        said |= {record for record in (*substitutions.CORE, *(spec.substitutions if spec else ()))
                 if record.device in (None, "cuda" if cuda else "cpu") and record.applies(args)}
    assert records == said


def test_start_up_says_each_line_once_from_rank_zero(caplog):
    """Two substitutions at once, each said once; a per-layer value that names the ring on
    several layers is still one line; the other ranks say nothing."""
    args = _parsed(4, (*CP2, "--cp-comm-type", "p2p", "a2a", "p2p", "a2a",
                       "--apply-query-key-layer-scaling"))
    expected = arguments.substitution_lines(args)
    assert len(expected) == 2
    with caplog.at_level(logging.INFO, logger=launch.__name__):
        launch.announce(args)
    said = [record.getMessage() for record in caplog.records]
    for line in expected:
        assert said.count(line) == 1
    caplog.clear()
    other = argparse.Namespace(**{**vars(args), "rank": 1})
    with caplog.at_level(logging.INFO, logger=launch.__name__):
        launch.announce(other)
    assert caplog.records == []


def test_a_record_names_its_device():
    with pytest.raises(ValueError, match="device 'gpu'"):
        substitutions.Substitution("--x", bool, str, device="gpu")

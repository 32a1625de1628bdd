"""The contract between a pipeline schedule and Megatron-LM's training loop.

A schedule is one :class:`ScheduleSpec`, registered under its name
(:mod:`megatron.plugin.registry`). The training loop asks of it, in this order (every field but
the name and one way to run is optional):

1. ``argument_groups``: functions ``add(parser)`` that add its flags, each one group of
   Megatron-LM's parser; schedules may share a group (``--hardware-profile`` of
   :mod:`longctx.job_costs`), which is added once. Each flag is classified in
   :mod:`megatron.plugin.option_classes` or honoured in its ``proofs`` (9.; an unclassified one
   is refused when set); one of a group that the selected schedule does not have is refused
   when set (it would do nothing).
2. ``check_args(args)``: raise ``ValueError`` naming a setting of its flags it cannot run,
   with what to use instead (before any process does work; once on the command line, once on
   Megatron-LM's validated arguments). Megatron-LM options it does not run are refused by
   :mod:`megatron.plugin.option_classes`.
3. ``build_model(args, config, vocab_size, layer_spec, **gpt_kwargs)``: this rank's model
   chunk, for a schedule that does not run ``GPTModel`` stages (helix places layer parts).
   ``plans_recomputation``: the schedule runs Megatron's ``--recompute-granularity full`` as a
   checkpointing table of its own plan (elastic and seq1f1b): the model is built without
   Megatron's recomputation (its ``TransformerConfig`` has none), so that layers are not
   checkpointed twice. ``borrows_weights(args) -> bool``: the run computes with copies of
   weights that are not the parameters (sppo's ``--sppo-multiplex`` helpers): they have no
   ``main_grad``, so the model is built without Megatron's fused weight-gradient accumulation.
4. ``prepare_input(documents, args, model) -> (input, units)``: its input for one global batch
   of documents, and the number of units (micro-batches, chunks) in it. Without it the
   schedule gets this data-parallel replica's documents packed into ``--seq-length``
   micro-batches, as Megatron's schedules do. Under Megatron's default loss (no
   ``--calculate-per-token-loss``), units that are not those micro-batches carry the weights
   of :mod:`megatron.plugin.default_loss` (``MicroBatch.loss_weights``).
   ``prefetch_input(documents, args, model)`` starts preparing the next batch (background
   planning) while this one trains.
5. ``run(call)``: this rank's part of one forward-backward over a :class:`RankCall`, returning
   Megatron's list of loss dicts; ``input_type`` is the type ``prepare_input`` makes (checked
   before ``run``). The registry wraps ``run`` into Megatron's forward-backward signature once
   (:attr:`ScheduleSpec.forward_backward`). Megatron's own schedules give
   ``megatron_function``, a function with that signature, instead.
6. ``report(input) -> dict``: what the step reports beside what the training loop measures,
   asked once the step has run: ``planned_activation_bytes`` and ``host_allocations`` (the
   host buffers this rank's stage allocated in the step; per-stage figures: the loop takes
   the maximum per stage), ``plan_solve_s``, ``plan_wait_s``, ``padding_microbatches``,
   ``padding_fraction`` (:mod:`megatron.plugin.reporting`).
7. ``build_ir(pp, units, options, **knobs) -> Built``: the schedule as IR with the costs that
   price it (:mod:`megatron.plugin.pipeline.catalog`), for tools that draw, simulate or
   validate it without running it (``scripts/show_schedule.py``). ``options`` are the unit
   costs every schedule shares; ``draw_arguments`` are functions ``add(parser)`` adding the
   schedule's own drawing flags, whose values ``build_ir`` takes as keywords named by their
   ``dest``. A function may be shared by schedules (added once); two that add the same flag
   are refused at registration. ``units`` is the drawing's ``--microbatches``; a schedule
   that makes its units from its own flags (elastic plans a batch's documents) sets
   ``draw_units=False`` and gets ``None``. ``draw_missing(flags) -> list[str]`` names what
   the drawing flags (a namespace of the schedule's own, by ``dest``) leave out that
   ``build_ir`` needs, so that the drawing names it together with a missing ``--pp`` or
   ``--microbatches``.
8. ``substitutions``: :class:`~megatron.plugin.substitutions.Substitution` records of the
   accepted option values that run something other than they name under this schedule (or
   nothing on this device); start-up says each that applies once, beside the core's
   (:mod:`megatron.plugin.substitutions`).
9. ``proofs``: what it honours of Megatron-LM's options and of its own flags, ``dest -> proof``
   (a test that runs the option with a value other than its default under this schedule and
   compares with Megatron's meaning; :mod:`megatron.plugin.option_classes` says the forms, names
   the groups of options that one layout proves, and names a setting of two options,
   ``SPLIT_EXPERTS``); every other option that is neither inert nor refused everywhere is
   refused under it, and a flag of its own that only it names is refused under the other
   schedules. ``refusals``: ``dest -> `` its own refusal of an option it does not
   honour, a whole sentence (``{flag}``: the flag as given), where the core's would not say
   why. Megatron's own schedules (``1f1b``, ``interleaved``, and ``default``) have theirs in
   the core.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from megatron.plugin.substitutions import Substitution

#: What ``report`` may return; ``planned_activation_bytes`` and ``host_allocations`` are
#: per-stage figures.
REPORT_KEYS = ("planned_activation_bytes", "host_allocations", "plan_solve_s", "plan_wait_s",
               "padding_microbatches", "padding_fraction")


@dataclass(frozen=True)
class RankCall:
    """One forward-backward call on this rank: Megatron's arguments, with the one model chunk
    an IR schedule runs and the input its ``prepare_input`` made."""

    name: str
    model: Any
    input: Any
    forward_step_func: Callable
    num_microbatches: int
    seq_length: int
    micro_batch_size: int
    decoder_seq_length: int | None
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: bool | None


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule; see the module docstring for what each field is asked for."""

    name: str
    run: Callable[[RankCall], list] | None = None
    megatron_function: Callable | None = None
    input_type: type | None = None
    argument_groups: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    check_args: Callable[[argparse.Namespace], None] | None = None
    build_model: Callable | None = None
    plans_recomputation: bool = False
    borrows_weights: Callable[[argparse.Namespace], bool] | None = None
    prepare_input: Callable | None = None
    prefetch_input: Callable | None = None
    report: Callable[[Any], dict] | None = None
    build_ir: Callable | None = None
    draw_arguments: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    draw_units: bool = True
    substitutions: tuple[Substitution, ...] = ()
    draw_missing: Callable[[argparse.Namespace], list[str]] | None = None
    proofs: Mapping[str, str] = field(default_factory=dict)
    refusals: Mapping[str, str] = field(default_factory=dict)
    forward_backward: Callable = field(init=False, repr=False, compare=False)
    """Megatron's forward-backward signature: ``megatron_function``, or ``run`` wrapped."""

    def __post_init__(self):
        if (self.run is None) == (self.megatron_function is None):
            raise ValueError(f"schedule {self.name!r}: give exactly one of run and "
                             f"megatron_function")
        if self.build_ir is None and (self.draw_arguments or not self.draw_units
                                      or self.draw_missing):
            raise ValueError(f"schedule {self.name!r}: drawing flags without build_ir")
        object.__setattr__(self, "forward_backward",
                           self.megatron_function or _megatron_signature(self))


def single_model_chunk(name: str, model, data_iterator):
    """``(model, data_iterator)`` of the one model chunk an IR schedule runs per rank."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(f"{name} runs one model chunk per rank: drop "
                             f"--num-layers-per-virtual-pipeline-stage or use 'interleaved'")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    return model, data_iterator


def _megatron_signature(spec: ScheduleSpec) -> Callable:
    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches,
                         seq_length, micro_batch_size, decoder_seq_length=None,
                         forward_only=False, collect_non_loss_data=False, first_val_step=None,
                         **unused):
        del unused  # Megatron's other arguments: its default process groups are used
        model, prepared = single_model_chunk(spec.name, model, data_iterator)
        if spec.input_type is not None and not isinstance(prepared, spec.input_type):
            raise TypeError(f"{spec.name} consumes the {spec.input_type.__name__} its "
                            f"prepare_input makes from the documents, got "
                            f"{type(prepared).__name__}")
        return spec.run(RankCall(
            name=spec.name, model=model, input=prepared, forward_step_func=forward_step_func,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step))

    forward_backward.__name__ = f"forward_backward_{spec.name.replace('-', '_')}"
    forward_backward.__doc__ = f"Megatron's forward-backward signature over ``{spec.name}``."
    return forward_backward

"""What a schedule reports about one training step, to Megatron-LM's log and to a JSON-lines file.

:class:`StepReporter` measures one forward-backward call (wall time, the bytes autograd
saved for backward through :class:`~megatron.plugin.layers.memory.SavedTensorMeter` and, on
CUDA, the allocator's peak over the call:
:func:`~megatron.plugin.layers.memory.device_peak_bytes`), reads what the schedule's input
carries (the plan's predicted activation peak, planning time, padding: helix's empty
micro-batches, the padded share of Megatron's packed rows) and turns it into:

* **entries of Megatron's loss dictionary**: ``[value, 1]`` pairs next to ``lm loss``. Megatron's
  ``train_step`` averages each pair over the data-parallel ranks (every rank reports the same
  value, so the value is kept), ``training_log`` averages it over the log interval and prints
  ``name: value |`` in its log line, and writes the step's own value to TensorBoard (every
  ``--tensorboard-log-interval`` steps, from the last rank; ``--tensorboard-dir`` is refused at
  start-up without the ``tensorboard`` package) and W&B under that name. Training steps only:
  Megatron's evaluation prints a perplexity for every entry it gets. The names are
  :data:`LOG_NAMES`' values.
* **one JSON object per training step** in ``--metrics-jsonl`` (written by the last rank):
  per-stage peaks (activations, planned, device) and predictions in full, for benchmarks and
  plots; an iteration trained again after a resume replaces its row
  (:mod:`megatron.plugin.metrics_file`).

A line a schedule logs once per step on every rank (its plan's summary) is logged at
:func:`summary_level`: the rank that prints Megatron-LM's iteration line says it, the others at
debug level, so the log grows by one line a step however many ranks run.

Memory figures are the maximum over all ranks; per-stage figures the maximum over the ranks of
that stage. A figure that is not measured here (the device peak off CUDA, the planned peak of a
schedule without a plan) is left out of the record. Token counts are global (all data-parallel
replicas).
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin import metrics_file
from megatron.plugin.layers.devices import collective_device
from megatron.plugin.layers.memory import SavedTensorMeter, device_peak_bytes, reset_device_peak
from megatron.plugin.schedule_spec import REPORT_KEYS

#: record key -> name in Megatron's log line, TensorBoard and W&B.
LOG_NAMES = {
    "tokens_per_s": "tokens per second",
    "peak_activation_bytes": "peak activation bytes",
    "planned_activation_bytes": "planned activation bytes",
    "plan_solve_s": "plan solve seconds",
    "plan_wait_s": "plan wait seconds",
    "padding_microbatches": "padding micro-batches",
    "padding_fraction": "padding fraction",
}


def summary_level() -> int:
    """The level of a line that every rank logs once a step: ``INFO`` on the last rank, which
    prints Megatron-LM's iteration line (``print_rank_last``) and writes ``--metrics-jsonl``,
    ``DEBUG`` on the others (``--logging-level 10`` shows every rank's)."""
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        return logging.INFO
    return logging.DEBUG


class StepReporter:
    """Measures forward-backward calls; :attr:`last` is the record of the latest one."""

    def __init__(self):
        self.meter = SavedTensorMeter()
        self.last: dict | None = None
        self.prepare_s = 0.0
        """Seconds the schedule's input took to prepare (planning, packing), set by the caller."""
        self._elapsed = 0.0
        self._device_window = False

    @contextlib.contextmanager
    def measure(self, device_window: bool = True):
        """Around the schedule call: saved-tensor bytes, wall seconds and, with
        ``device_window``, the device peak over the call (the allocator's peak statistics are
        reset: not while Megatron-LM logs them, ``--log-memory-to-tensorboard``, whose peak
        counts from the start of the run; the record then has no device peak)."""
        self.meter.reset_peak()
        self._device_window = device_window
        if device_window:
            reset_device_peak()
        start = time.perf_counter()
        with self.meter.active():
            yield
        self._elapsed = time.perf_counter() - start

    def finish(self, totals: torch.Tensor, reported: dict, num_microbatches: int, args,
               forward_only: bool) -> dict:
        """The record of the call just measured, from this replica's ``(loss sum, tokens)``
        on every pipeline stage and what the schedule reported about its input
        (``ScheduleSpec.report``: keys of :data:`~megatron.plugin.schedule_spec.REPORT_KEYS`);
        written to ``--metrics-jsonl`` after a training step."""
        unknown = set(reported) - set(REPORT_KEYS)
        if unknown:
            raise ValueError(f"a schedule reported {sorted(unknown)}; known: {REPORT_KEYS}")
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        totals = totals.to(collective_device(group), copy=True)
        dist.all_reduce(totals, group=group)
        totals = totals.cpu()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        # Per-stage figures (None: not measured here), one row each in the stage's column, and
        # the live bytes in the last row; a MAX all-reduce gives every rank the stage maxima.
        peaks = {"peak_activation_bytes": self.meter.peak,
                 "planned_activation_bytes": reported.get("planned_activation_bytes"),
                 "host_allocations": reported.get("host_allocations"),
                 "device_peak_bytes": device_peak_bytes() if self._device_window else None}
        held = torch.zeros(len(peaks) + 1, pp, dtype=torch.float64)
        for row, value in enumerate(peaks.values()):
            if value is not None:
                held[row, stage] = value
        held[-1, 0] = self.meter.current
        held = held.to(collective_device())
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        held = held.cpu()
        tokens = float(totals[1])
        record = {
            "iteration": getattr(args, "curr_iteration", 0) + 1,
            "lm_loss": float(totals[0]) / max(tokens, 1.0),
            "num_tokens": int(tokens),
            "num_microbatches": num_microbatches,
            "forward_backward_s": self._elapsed,
            "prepare_s": self.prepare_s,
            "tokens_per_s": tokens / self._elapsed if self._elapsed > 0 else 0.0,
            "live_activation_bytes": int(held[-1, 0]),
        }
        for row, (key, value) in enumerate(peaks.items()):
            if value is not None:
                per_stage = [int(b) for b in held[row]]
                record.update({key: max(per_stage), f"{key}_per_stage": per_stage})
        record.update((key, value) for key, value in reported.items()
                      if key not in peaks and value is not None)
        self.last = record
        if not forward_only and args.metrics_jsonl and \
                dist.get_rank() == dist.get_world_size() - 1:
            metrics_file.write(args.metrics_jsonl, record)
        return record


def loss_entries(record: dict, device) -> dict[str, torch.Tensor]:
    """The record's figures as Megatron loss-dictionary entries (``[value, 1]``)."""
    return {name: torch.tensor([float(record[key]), 1.0], device=device)
            for key, name in LOG_NAMES.items() if key in record}

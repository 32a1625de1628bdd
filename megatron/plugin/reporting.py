"""What a schedule reports about one training step, to Megatron-LM's log and to a JSON-lines file.

:class:`StepReporter` measures one forward-backward call (wall time, and the bytes autograd
saved for backward through :class:`~megatron.plugin.memory.SavedTensorMeter`), reads what the
schedule's input carries (the plan's predicted activation peak, planning time, padding) and
turns it into:

* **entries of Megatron's loss dictionary**: ``[value, 1]`` pairs next to ``lm loss``. Megatron's
  ``train_step`` averages each pair over the data-parallel ranks (every rank reports the same
  value, so the value is kept), ``training_log`` averages it over the log interval and prints
  ``name: value |`` in its log line, and writes it to TensorBoard and W&B under that name.
  Training steps only: Megatron's evaluation prints a perplexity for every entry it gets.
  The names are :data:`LOG_NAMES`' values.
* **one JSON object per training step** in ``--metrics-jsonl`` (written by the last rank):
  per-stage peaks and predictions in full, for benchmarks and plots.

Memory figures are the maximum over all ranks; per-stage figures the maximum over the ranks of
that stage. Token counts are global (all data-parallel replicas).
"""
from __future__ import annotations

import contextlib
import json
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin.devices import collective_device
from megatron.plugin.memory import SavedTensorMeter, device_peak_bytes

#: record key -> name in Megatron's log line, TensorBoard and W&B.
LOG_NAMES = {
    "tokens_per_s": "tokens per second",
    "peak_activation_bytes": "peak activation bytes",
    "planned_activation_bytes": "planned activation bytes",
    "plan_solve_s": "plan solve seconds",
    "plan_wait_s": "plan wait seconds",
    "padding_microbatches": "padding micro-batches",
}


class StepReporter:
    """Measures forward-backward calls; :attr:`last` is the record of the latest one."""

    def __init__(self):
        self.meter = SavedTensorMeter()
        self.last: dict | None = None
        self.prepare_s = 0.0
        """Seconds the schedule's input took to prepare (planning, packing), set by the caller."""
        self._elapsed = 0.0

    @contextlib.contextmanager
    def measure(self):
        """Around the schedule call: saved-tensor bytes and wall seconds."""
        self.meter.reset_peak()
        start = time.perf_counter()
        with self.meter.active():
            yield
        self._elapsed = time.perf_counter() - start

    def finish(self, totals: torch.Tensor, prepared, num_microbatches: int, args,
               forward_only: bool) -> dict:
        """The record of the call just measured, from this replica's ``(loss sum, tokens)``
        on every pipeline stage; written to ``--metrics-jsonl`` after a training step."""
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        totals = totals.to(collective_device(group), copy=True)
        dist.all_reduce(totals, group=group)
        totals = totals.cpu()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        planned = getattr(prepared, "planned_activation_bytes", None)
        held = torch.zeros(2 + 2 * pp, dtype=torch.float64)
        held[0], held[1], held[2 + stage] = self.meter.peak, self.meter.current, self.meter.peak
        if planned is not None:
            held[2 + pp + stage] = planned
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
            "peak_activation_bytes": int(held[0]),
            "peak_activation_bytes_per_stage": [int(b) for b in held[2:2 + pp]],
            "live_activation_bytes": int(held[1]),
        }
        if planned is not None:
            per_stage = [int(b) for b in held[2 + pp:]]
            record.update(planned_activation_bytes=max(per_stage),
                          planned_activation_bytes_per_stage=per_stage)
        timing = getattr(prepared, "timing", None)
        if timing is not None:
            record.update(plan_solve_s=timing.solve_s, plan_wait_s=timing.waited_s)
        padding = getattr(prepared, "padding", None)
        if padding is not None:
            record["padding_microbatches"] = padding
        device_peak = device_peak_bytes()
        if device_peak is not None:
            record["device_peak_bytes"] = device_peak
        self.last = record
        if not forward_only and args.metrics_jsonl and \
                dist.get_rank() == dist.get_world_size() - 1:
            with open(args.metrics_jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def loss_entries(record: dict, device) -> dict[str, torch.Tensor]:
    """The record's figures as Megatron loss-dictionary entries (``[value, 1]``)."""
    return {name: torch.tensor([float(record[key]), 1.0], device=device)
            for key, name in LOG_NAMES.items() if key in record}

"""``--sppo-memory-gb`` and ``--sppo-host-memory-gb`` as training reads them (parsed by
Megatron-LM's parser, planned by :func:`sppo_offload.subsequence_batch.plan_batch`, the plan
``prepare_input`` runs): each budget changes the plan it is given to, the plan keeps within it,
and a batch that cannot is refused before any compute, naming the flag."""
import math

import pytest

from megatron.plugin import arguments

from longctx.cost_model import GB
from longctx.job_costs import cost_model_from_args
from sppo_offload.batch_plan import replay
from sppo_offload.subsequence_batch import plan_batch

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "2", "--calculate-per-token-loss",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--pipeline-schedule", "sppo"]
#: Documents that fit Megatron-LM's rows of ``--seq-length`` 64 (its micro-batches are a plan).
SHORT = [60, 50, 40, 30, 20, 10, 5, 3]
#: A document four rows long (cut into subsequences, the first offloaded) and two short ones.
LONG = [256, 30, 20]


def _planned(monkeypatch, lengths, *flags):
    """``(plan, simulated peak device bytes, host bytes)`` per stage, as training plans it on
    CPU (the host tier copies synchronously: an infinitely fast link)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = arguments.parse([*TINY, *flags])
    cost = cost_model_from_args(args, 256)
    plan, peaks = plan_batch(lengths, cost, args, (), math.inf)
    return plan, peaks, replay(plan, cost, math.inf)[1]


def test_the_device_budget_chooses_a_plan_that_fits_it(monkeypatch):
    """Unbudgeted (the CPU's default), Megatron's micro-batches of the short documents are
    planned; at 1.1 MB a rank they do not fit, and subsequences that do are planned instead.
    Below what any plan needs, the batch is refused naming the flag."""
    default, default_peaks, _ = _planned(monkeypatch, SHORT)
    budget = 0.0011
    plan, peaks, _ = _planned(monkeypatch, SHORT, "--sppo-memory-gb", str(budget))
    assert max(default_peaks) > budget * GB >= max(peaks)
    assert len(plan.chunks) > len(default.chunks)
    with pytest.raises(ValueError, match=r"more than --sppo-memory-gb 0\.0006; "):
        _planned(monkeypatch, SHORT, "--sppo-memory-gb", "0.0006")


def test_the_host_budget_caps_what_is_offloaded(monkeypatch):
    """``auto`` offloads the long document's first subsequence whole on both stages
    (0.68 and 0.86 MB); with 0.4 MB of host memory a rank it lowers the ratios until each
    stage's host bytes are the budget. A fixed ratio that needs more is refused naming it."""
    _, _, unbudgeted = _planned(monkeypatch, LONG)
    budget = 0.0004
    plan, _, host = _planned(monkeypatch, LONG, "--sppo-host-memory-gb", str(budget))
    assert min(unbudgeted) > budget * GB
    assert host == pytest.approx([budget * GB] * 2, rel=1e-3)
    assert all(0 < row[0] < 1 for row in plan.alphas)
    with pytest.raises(ValueError, match=r"more than --sppo-host-memory-gb 0\.0004; raise it"):
        _planned(monkeypatch, LONG, "--sppo-offload", "1", "--sppo-host-memory-gb", str(budget))

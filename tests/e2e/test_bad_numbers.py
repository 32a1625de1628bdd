"""NaN and Inf losses under the project's schedules, with Megatron-LM's meaning of
``--check-for-nan-in-loss-and-grad`` (on by default) and ``--rerun-mode``.

The weights are initialised so large (``--init-method-std 1e30``) that the logits overflow and
the first loss is NaN: a fault in the numbers, not in the program.

* ``--rerun-mode disabled``: the step fails at once, the error names the rank, the iteration
  and the check, and no checkpoint is saved from the poisoned state.
* ``validate_results`` (Megatron's default; like Megatron it does not validate the first
  iteration): the iteration is run again in place -- the schedule replays the same global
  batch -- the NaN reproduces, and Megatron saves a checkpoint of the iteration before and
  exits with its code 16 (resume elsewhere to tell a faulty GPU from a faulty model). The
  rerun state machine pickles the batch it would replay into that checkpoint.
"""
import os
import re

import pytest

from harness import torchrun
from test_pretrain import TINY

SCRIPT = "pretrain_gpt_elastic.py"
EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
POISON = ["--init-method-std", "1e30", "--train-iters", "3", "--save-interval", "1"]


@pytest.mark.parametrize("schedule", ["elastic", "helix"])
def test_a_nan_loss_stops_the_run_naming_rank_and_iteration(tmp_path, schedule):
    save = tmp_path / "ckpt"
    result = torchrun(2, SCRIPT, [*TINY, *POISON, "--pipeline-schedule", schedule,
                                  "--rerun-mode", "disabled", "--save", str(save)],
                      check=False, timeout=240)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    # The rank of the loss: the last pipeline stage (the first under helix's two folds).
    assert re.search(r"RuntimeError: Rank [01], node \S+, device \S+, iteration \d+: Unexpected "
                     r"result nan \(message='found NaN in local forward loss calculation'\)",
                     output), output[-3000:]
    assert not (save / "latest_checkpointed_iteration.txt").exists()


def test_a_reproducible_nan_is_rerun_and_saved_for_diagnosis(tmp_path):
    save = tmp_path / "ckpt"
    result = torchrun(2, SCRIPT, [*TINY, *POISON, "--pipeline-schedule", "elastic",
                                  "--save", str(save)], check=False, timeout=240)
    output = result.stdout + result.stderr
    assert f"exitcode: {EXIT_CODE_RESUME_TO_DISAMBIGUATE}" in output, output[-3000:]
    assert "First rerun: unexpected result is reproducible" in output
    assert "Saving a checkpoint and exiting now" in output
    # The checkpoint holds the iteration before the failing one, complete.
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert os.listdir(save / "iter_0000001")

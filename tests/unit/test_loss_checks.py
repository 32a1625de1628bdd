"""Megatron's loss checks once a step (:mod:`megatron.plugin.loss_checks`): inside
``once_per_step`` a unit's loss reaches the host only at the end of the step, all losses in one
copy, and each is checked as before, in order: a NaN still raises naming the rank and the
iteration (``--rerun-mode disabled``), and a spiky loss is still reported. Outside it, each
check reads its loss back at once (what :class:`~host_syncs.HostSyncCounter` counts: the
instrument of ``tests/distributed/test_host_syncs.py`` is shown able to fail)."""
import argparse
import contextlib
import logging
import types

import pytest
import torch
from megatron.core import rerun_state_machine as rsm
from megatron.training import global_vars

from host_syncs import HostSyncCounter
from megatron.plugin import loss_checks


#: A model config with neither of the functions the checks wrap.
CONFIG = types.SimpleNamespace(no_sync_func=None, finalize_model_grads_func=None)


@pytest.fixture
def disabled_machine(monkeypatch):
    """Megatron's arguments with both checks on and its rerun state machine disabled."""
    args = argparse.Namespace(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=True)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(rsm, "_GLOBAL_RERUN_STATE_MACHINE", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # named in its messages
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    yield rsm.get_rerun_state_machine()
    monkeypatch.setattr(rsm, "_GLOBAL_RERUN_STATE_MACHINE", None)


def test_each_unit_check_reads_back_outside_a_step(disabled_machine):
    with HostSyncCounter() as counter:
        for value in (1.0, 2.0, 3.0):
            loss_checks.validate_loss(torch.tensor(value))
    assert sum(counter.seen.values()) >= 3


def test_inside_a_step_the_losses_come_back_once(disabled_machine):
    seen = {}
    with loss_checks.once_per_step(CONFIG):
        with HostSyncCounter() as counter:
            for value in (1.0, 2.0, 3.0):
                loss_checks.validate_loss(torch.tensor(value))
        seen = dict(counter.seen)
    assert seen == {}


def test_a_nan_unit_still_fails_the_step_naming_rank_and_iteration(disabled_machine):
    with pytest.raises(RuntimeError, match=r"Rank 0, node \S+, device \S+, iteration \d+: "
                                           r"Unexpected result \S*nan\S* \(message='found "
                                           r"NaN in local forward loss calculation'\)"):
        with loss_checks.once_per_step(CONFIG):
            for value in (1.0, float("nan"), 3.0):
                loss_checks.validate_loss(torch.tensor(value))


def test_the_checks_keep_their_order(disabled_machine, monkeypatch):
    """Each unit's loss goes through Megatron's checks in unit order: the spiky-loss tracker
    sees every value, and a check that fails at unit ``k`` fails there."""
    checked = []
    monkeypatch.setattr(disabled_machine, "is_unexpectedly_large",
                        lambda result, **kw: checked.append(float(result)) or False)
    with loss_checks.once_per_step(CONFIG):
        for value in (5.0, 1.0, 7.0):
            loss_checks.validate_loss(torch.tensor(value))
        assert checked == []
    assert checked == [5.0, 1.0, 7.0]


def test_a_spiky_loss_is_still_reported(disabled_machine, caplog):
    disabled_machine.large_value_counts["loss"] = 100
    disabled_machine.max_values["loss"] = 1.0
    with caplog.at_level(logging.WARNING):
        with loss_checks.once_per_step(CONFIG):
            for value in (1.0, 20.0):
                loss_checks.validate_loss(torch.tensor(value))
    assert "Spiky loss" in caplog.text


def test_the_losses_are_checked_before_the_gradients(disabled_machine):
    """Megatron DDP checks the gradients for NaN when the last backward leaves ``no_sync``
    (with ``--overlap-grad-reduce``) or in ``finalize_model_grads``; in Megatron's 1F1B every
    loss was checked before either, so a NaN loss must be reported as the loss's."""
    events = []

    @contextlib.contextmanager
    def no_sync():
        yield
        events.append("sync")

    config = types.SimpleNamespace(no_sync_func=no_sync,
                                   finalize_model_grads_func=lambda *a: events.append("final"))
    with loss_checks.once_per_step(config):
        loss_checks.validate_loss(torch.tensor(1.0))
        with config.no_sync_func():
            loss_checks.validate_loss(torch.tensor(2.0))
        assert loss_checks._PENDING == [] and events == ["sync"]
        loss_checks.validate_loss(torch.tensor(float("nan")))
        with pytest.raises(RuntimeError, match="found NaN in local forward loss"):
            config.finalize_model_grads_func()
        assert events == ["sync"]
    assert config.no_sync_func is no_sync

"""Schedule registry: Megatron's dispatcher (and every module that imported it) answers with
the schedule named by ``--pipeline-schedule``, wrapped to take global batches of documents."""
import sys
import types

import pytest
from megatron.core import pipeline_parallel
from megatron.core.pipeline_parallel import schedules

from megatron.plugin import registry
from megatron.plugin.schedule_spec import ScheduleSpec


@pytest.fixture(autouse=True)
def restore_dispatcher():
    yield
    registry.restore_megatron()
    registry._SPECS.pop("test-schedule", None)


def test_megatron_schedules_are_registered():
    assert registry.get_schedule("1f1b") is schedules.forward_backward_pipelining_without_interleaving
    assert registry.get_schedule("interleaved") is \
        schedules.forward_backward_pipelining_with_interleaving
    assert {"default", "1f1b", "interleaved"} <= set(registry.schedule_names())


def test_dispatcher_returns_each_registered_schedule_everywhere():
    def my_schedule(**kwargs):
        return []

    registry.register(ScheduleSpec("test-schedule", megatron_function=my_schedule))
    # A module that took the name with ``from ... import`` before the switch (Megatron-LM's
    # training.py does).
    user = types.ModuleType("user_training_script")
    user.get_forward_backward_func = pipeline_parallel.get_forward_backward_func
    sys.modules[user.__name__] = user
    try:
        for name in ("1f1b", "interleaved", "test-schedule"):
            wrapped = registry.use_schedule(name)()
            assert isinstance(wrapped, registry.DocumentSchedule)
            assert wrapped.schedule is registry.get_schedule(name)
            for getter in (schedules.get_forward_backward_func,
                           pipeline_parallel.get_forward_backward_func,
                           user.get_forward_backward_func):
                assert getter() is wrapped  # one reporter per process and layout
            assert registry.active_schedule_name() == name
        registry.restore_megatron()
        for getter in (schedules.get_forward_backward_func,
                       pipeline_parallel.get_forward_backward_func,
                       user.get_forward_backward_func):
            assert getter is registry._MEGATRON_DISPATCH
    finally:
        del sys.modules[user.__name__]


def test_default_keeps_megatron_choice():
    registry.use_schedule("1f1b")
    registry.use_schedule(registry.DEFAULT)
    # Megatron's own choice, fed with document batches: without pipeline parallelism, no
    # pipelining.
    assert schedules.get_forward_backward_func(pp_size=1).schedule is \
        schedules.forward_backward_no_pipelining
    assert schedules.get_forward_backward_func(pp_size=2, vp_size=None).schedule is \
        schedules.forward_backward_pipelining_without_interleaving


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zigzag'; valid names: "
                                         r"default, 1f1b, 1f1b-ir, elastic, helix, interleaved, "
                                         r"seq1f1b, sppo \(a package's schedules are found "
                                         r"through its entry points of the group "
                                         r"megatron_longctx\.schedules: install it, for this "
                                         r"project `pip install -e \.` in its checkout, or name "
                                         r"its MODULE:ATTRIBUTE in LONGCTX_SCHEDULES\)$"):
        registry.use_schedule("zigzag")


def test_conflicting_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        registry.register(ScheduleSpec("1f1b", megatron_function=lambda **kwargs: []))
    with pytest.raises(ValueError, match="invalid schedule name"):
        registry.register(ScheduleSpec("default", megatron_function=lambda **kwargs: []))
    with pytest.raises(ValueError, match="exactly one of run and megatron_function"):
        ScheduleSpec("neither")

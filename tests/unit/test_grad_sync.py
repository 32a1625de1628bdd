"""The executor's gradient sync (``megatron/plugin/pipeline/grad_sync.py``): the no-sync context
is entered once and left once, and a step whose grad-ready counts differ from the first step's
is refused naming the bucket group (Megatron's DDP would have started its reduction before the
last gradient was in); with several distributed-optimizer instances the end-of-step start
leaves the buckets that ``finish_grad_sync`` starts itself."""
import contextlib
from types import SimpleNamespace

import pytest

from megatron.plugin.pipeline.grad_sync import GradSync, one_start_per_step


def _bucket_group(first: bool, counts: dict, golden: dict, params: list, started=True):
    return SimpleNamespace(is_first_batch=first, per_param_grad_ready_counts=counts,
                           golden_per_param_grad_ready_counts=golden, params=params,
                           grad_reduce_handle=object() if started else None)


def _model(groups, overlap=True):
    return SimpleNamespace(ddp_config=SimpleNamespace(overlap_grad_reduce=overlap),
                           bucket_groups=groups, expert_parallel_bucket_groups=[])


def test_no_sync_is_entered_and_left_once():
    calls = []

    @contextlib.contextmanager
    def no_sync():
        calls.append("enter")
        yield
        calls.append("exit")

    sync = GradSync(SimpleNamespace(no_sync_func=no_sync), _model([]))
    sync.disable()
    sync.disable()
    sync.enable()
    sync.enable()
    assert calls == ["enter", "exit"]


def test_counts_equal_to_the_first_steps_pass():
    a, b = object(), object()
    groups = [_bucket_group(False, {a: 1, b: 2}, {a: 1, b: 2}, [a, b]),
              _bucket_group(True, {a: 1}, {}, [a, b])]  # the first step only counts
    GradSync(SimpleNamespace(no_sync_func=None), _model(groups)).check_ready_counts(0, False)


@pytest.mark.parametrize("counts,started,started_at_end", [
    ({"a": 2, "b": 1}, True, True),  # started from the hooks, then a gradient came
    ({"b": 1}, False, False),  # never started, and nothing at the end starts it
])
def test_counts_that_differ_from_the_first_steps_are_refused(counts, started, started_at_end):
    a, b = object(), object()
    objects = {"a": a, "b": b}
    groups = [_bucket_group(False, {a: 1, b: 1}, {a: 1, b: 1}, [a, b]),
              _bucket_group(False, {objects[k]: n for k, n in counts.items()},
                            {a: 1, b: 1}, [a, b], started)]
    sync = GradSync(SimpleNamespace(no_sync_func=None), _model(groups))
    with pytest.raises(RuntimeError, match="pipeline rank 1: 1 of the 2 parameters of gradient "
                                           "bucket group 1 .* drop --overlap-grad-reduce"):
        sync.check_ready_counts(1, started_at_end)


@pytest.mark.parametrize("counts,refused", [
    ({"a": 2, "b": 1}, True),  # went past every count of the first step's: may have started
    ({"a": 2}, False),  # b never came: the counts never equalled the first step's
])
def test_without_a_handle_the_counts_tell_whether_it_started(counts, refused):
    """With several distributed-optimizer instances Megatron keeps no handle of a started
    reduction (it runs synchronously on its communication stream)."""
    a, b = object(), object()
    objects = {"a": a, "b": b}
    group = _bucket_group(False, {objects[k]: n for k, n in counts.items()}, {a: 1, b: 1},
                          [a, b], started=False)
    sync = GradSync(SimpleNamespace(no_sync_func=None), _model([group]))
    if refused:
        with pytest.raises(RuntimeError, match="may have started"):
            sync.check_ready_counts(0, True)
    else:
        sync.check_ready_counts(0, True)


def test_a_bucket_the_end_of_the_step_starts_passes():
    """A rank without a backward in this step counted nothing: the end of the step starts its
    buckets (``grad_sync_func``)."""
    a = object()
    groups = [_bucket_group(False, {}, {a: 1}, [a], started=False)]
    GradSync(SimpleNamespace(no_sync_func=None), _model(groups)).check_ready_counts(0, True)


def test_without_overlap_nothing_is_checked():
    a = object()
    groups = [_bucket_group(False, {a: 3}, {a: 1}, [a])]
    GradSync(SimpleNamespace(no_sync_func=None), _model(groups, overlap=False)) \
        .check_ready_counts(0, False)
    GradSync(SimpleNamespace(no_sync_func=None), object()).check_ready_counts(0, False)


class _Chunk:
    """A DDP model chunk's ``start_grad_sync`` over bucket groups that record their starts."""

    def __init__(self, instances: int, first_batch: list):
        self.ddp_config = SimpleNamespace(num_distributed_optimizer_instances=instances)
        self.started = []
        self.bucket_groups = [SimpleNamespace(is_first_batch=first, start_grad_sync=(
            lambda index=index: self.started.append(index))) for index, first in
            enumerate(first_batch)]
        self.expert_parallel_bucket_groups = []

    def start_grad_sync(self, *unused):
        for group in self.bucket_groups:
            group.start_grad_sync()


@pytest.mark.parametrize("as_list", [False, True])
def test_with_several_instances_the_end_of_step_start_leaves_first_step_buckets(as_list):
    """``finish_grad_sync`` starts a bucket in its first step itself, and with several
    distributed-optimizer instances nothing stops that second start: the end-of-step start
    leaves those buckets to it, for the duration only."""
    chunk = _Chunk(2, [True, False, True])
    funcs = [chunk.start_grad_sync] if as_list else chunk.start_grad_sync
    config = SimpleNamespace(grad_sync_func=funcs)
    with one_start_per_step(config):
        (config.grad_sync_func[0] if as_list else config.grad_sync_func)([])
    assert chunk.started == [1]
    assert config.grad_sync_func == funcs


def test_with_one_instance_the_end_of_step_start_is_megatrons():
    chunk = _Chunk(1, [True, False])
    config = SimpleNamespace(grad_sync_func=chunk.start_grad_sync)
    with one_start_per_step(config):
        assert config.grad_sync_func == chunk.start_grad_sync
    config = SimpleNamespace(grad_sync_func=None)
    with one_start_per_step(config):
        assert config.grad_sync_func is None

"""What a training step reports: the device's allocator peak per forward-backward call, reduced
over the ranks like the activation figures (CUDA's statistics faked on a one-rank gloo group),
``--metrics-jsonl`` rows of a resumed run's iterations replaced, not repeated, the folders of
``--metrics-jsonl`` and ``--trace-dir`` made or refused at start-up, and ``--tensorboard-dir``
refused where Megatron-LM would write no TensorBoard log."""
import json
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin import arguments
from megatron.plugin.reporting import StepReporter

ARGS = SimpleNamespace(curr_iteration=0, metrics_jsonl=None)
TOTALS = torch.tensor([6.0, 3.0], dtype=torch.float64)  # (loss sum, tokens) of one replica


class FakeAllocator:
    """The CUDA allocator's statistics as the reporter reads them."""

    def __init__(self, allocated: int, peak: int):
        self.allocated, self.peak = allocated, peak
        self.resets = 0

    def transient(self, nbytes: int) -> None:
        """Allocate ``nbytes`` and free them again."""
        self.peak = max(self.peak, self.allocated + nbytes)

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1
        self.peak = self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def fake_device(monkeypatch, cuda: bool) -> FakeAllocator:
    """Model state of 1000 bytes, and a start-up peak far above any step's."""
    allocator = FakeAllocator(allocated=1000, peak=10**6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", allocator.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", allocator.max_memory_allocated)
    return allocator


def step(reporter: StepReporter, allocator: FakeAllocator, nbytes: int) -> dict:
    with reporter.measure():
        allocator.transient(nbytes)
    return reporter.finish(TOTALS, {}, 1, ARGS, forward_only=False)


def test_device_peak_is_per_call_on_cuda(one_rank, monkeypatch):
    allocator = fake_device(monkeypatch, cuda=True)
    reporter = StepReporter()
    first = step(reporter, allocator, 5000)
    # Not the start-up peak (10**6), nor the first call's in the second (cumulative).
    assert first["device_peak_bytes"] == 6000
    assert first["device_peak_bytes_per_stage"] == [6000]
    second = step(reporter, allocator, 100)
    assert second["device_peak_bytes"] == 1100
    assert second["device_peak_bytes_per_stage"] == [1100]
    assert allocator.resets == 2
    assert second["lm_loss"] == 2.0 and second["num_tokens"] == 3


def test_megatrons_own_peak_logging_keeps_its_run_long_peak(one_rank, monkeypatch):
    """Under --log-memory-to-tensorboard Megatron-LM logs the allocator's peak since the start
    of the run: the reporter leaves the statistics alone and records no device peak."""
    allocator = fake_device(monkeypatch, cuda=True)
    reporter = StepReporter()
    with reporter.measure(device_window=False):
        allocator.transient(5000)
    record = reporter.finish(TOTALS, {}, 1, ARGS, forward_only=False)
    assert allocator.resets == 0 and allocator.max_memory_allocated() == 10**6
    assert "device_peak_bytes" not in record


def test_device_peak_is_not_recorded_off_cuda(one_rank, monkeypatch):
    allocator = fake_device(monkeypatch, cuda=False)
    record = step(StepReporter(), allocator, 5000)
    assert "device_peak_bytes" not in record and "device_peak_bytes_per_stage" not in record
    assert allocator.resets == 0
    assert record["peak_activation_bytes_per_stage"] == [0]


def test_each_peak_is_in_its_stage_column(one_rank, monkeypatch):
    """On stage 1 of 2 every per-stage figure is in column 1 (the MAX all-reduce fills the
    other stages' columns), and the whole-pipeline figure is the largest column."""
    allocator = fake_device(monkeypatch, cuda=True)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    reporter = StepReporter()
    weight = torch.nn.Parameter(torch.ones(4, 4))
    with reporter.measure():
        allocator.transient(5000)
        (torch.ones(8, 4) @ weight).sum().backward()  # saves the 8 x 4 fp32 input: 128 bytes
    record = reporter.finish(TOTALS, {"planned_activation_bytes": 300}, 1, ARGS,
                             forward_only=False)
    assert record["peak_activation_bytes_per_stage"] == [0, 128]
    assert record["planned_activation_bytes_per_stage"] == [0, 300]
    assert record["device_peak_bytes_per_stage"] == [0, 6000]
    assert (record["peak_activation_bytes"], record["planned_activation_bytes"],
            record["device_peak_bytes"]) == (128, 300, 6000)
    assert record["live_activation_bytes"] == 0


BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "2", "--calculate-per-token-loss",
        "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


def test_tensorboard_dir_is_refused_without_tensorboard(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*BASE, "--tensorboard-dir", str(tmp_path / "tb")]
    assert arguments.parse(argv).tensorboard_dir == str(tmp_path / "tb")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(ValueError, match=r"--tensorboard-dir .* cannot be imported .* "
                                         r"pip install tensorboard"):
        arguments.parse(argv)
    assert arguments.parse(BASE).tensorboard_dir is None  # without the flag: nothing needed


def test_a_resumed_run_replaces_the_rows_of_the_iterations_it_trains_again(one_rank, tmp_path):
    """An old run's rows 1-5 and the torn row 6 of a rank killed while writing; this run
    resumes from the checkpoint of iteration 2, then restarts from it once more in-process."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "lm_loss": 9.0}) + "\n"
                            for i in range(1, 6)) + '{"iteration": 6, "lm_lo')
    reporter = StepReporter()

    def train(iteration):
        with reporter.measure(device_window=False):
            pass
        args = SimpleNamespace(curr_iteration=iteration - 1, metrics_jsonl=str(path))
        reporter.finish(TOTALS, {}, 1, args, forward_only=False)

    def rows():
        return [(row["iteration"], row["lm_loss"])
                for row in map(json.loads, path.read_text().splitlines())]

    train(3)
    assert rows() == [(1, 9.0), (2, 9.0), (3, 2.0)]
    train(4)
    assert rows() == [(1, 9.0), (2, 9.0), (3, 2.0), (4, 2.0)]
    train(3)
    assert rows() == [(1, 9.0), (2, 9.0), (3, 2.0)]


def test_metrics_and_trace_folders_are_made_or_refused_at_start_up(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    metrics, traces = tmp_path / "new" / "metrics.jsonl", tmp_path / "deep" / "er" / "traces"
    arguments.check_command_line([*BASE, "--metrics-jsonl", str(metrics),
                                  "--trace-dir", str(traces)])
    assert metrics.parent.is_dir() and traces.is_dir()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(arguments.Refusals) as refused:
        arguments.check_command_line([*BASE, "--metrics-jsonl", str(a_file / "metrics.jsonl"),
                                      "--trace-dir", str(a_file / "traces")])
    assert [message.split(":")[0] for message in refused.value.messages] == [
        f"--metrics-jsonl {a_file / 'metrics.jsonl'}", f"--trace-dir {a_file / 'traces'}"]
    assert f"{a_file} is a file, not a folder" in refused.value.messages[0]
    assert "cannot be made (Not a directory)" in refused.value.messages[1]
    with pytest.raises(arguments.Refusals, match="--metrics-jsonl .* is a folder: give a file"):
        arguments.check_command_line([*BASE, "--metrics-jsonl", str(tmp_path)])

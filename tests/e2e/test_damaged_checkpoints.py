"""A checkpoint that cannot be loaded or written stops the run with one message naming it and
the way on, and the checkpoint before it stays loadable.

Damage: a shard file of the latest checkpoint lost (a disk that filled up, a copy cut short);
mismatch: a checkpoint loaded into a model of another shape; a write refused (a full disk).
"""
import resource
import signal

from harness import torchrun
from test_pretrain import TINY, metrics

SCRIPT = "pretrain_gpt_elastic.py"
COMMON = [*TINY, "--train-iters", "3", "--pipeline-schedule", "elastic"]


def test_a_damaged_checkpoint_is_named_and_the_one_before_still_loads(tmp_path):
    save = tmp_path / "ckpt"
    torchrun(2, SCRIPT, [*COMMON, "--exit-interval", "2", "--save", str(save),
                         "--save-interval", "1"])
    (save / "iter_0000002" / "__1_0.distcp").unlink()
    resume = [*COMMON, "--load", str(save)]

    failed = torchrun(2, SCRIPT, resume, check=False, timeout=240)
    assert failed.returncode != 0
    # The lost shard is rank 1's: the rank that hit it names itself.
    assert (f"error on rank 1 of 2: --load {save}: the checkpoint of iteration 2 "
            f"({save}/iter_0000002) cannot be loaded (FileNotFoundError: ") in failed.stderr, \
        failed.stderr[-3000:]
    assert "__1_0.distcp" in failed.stderr
    assert "with --ckpt-step ITERATION" in failed.stderr

    out = tmp_path / "resumed.jsonl"
    torchrun(2, SCRIPT, [*resume, "--ckpt-step", "1", "--metrics-jsonl", str(out)])
    assert [r["iteration"] for r in metrics(out)] == [2, 3]

    wider = [*COMMON, "--load", str(save), "--ckpt-step", "1"]
    wider[wider.index("--hidden-size") + 1] = "64"
    mismatched = torchrun(2, SCRIPT, wider, check=False, timeout=240)
    assert mismatched.returncode != 0
    # Each stage names its own mismatched tensor: a line per rank, each naming its rank.
    for rank in (0, 1):
        assert (f"error on rank {rank} of 2: --load {save}: the checkpoint of iteration 1 "
                f"({save}/iter_0000001) cannot be loaded") in mismatched.stderr, \
            mismatched.stderr[-3000:]
    assert "Global shape mismatch" in mismatched.stderr
    assert "load it with the flags it was saved with" in mismatched.stderr


def test_a_failed_save_names_the_last_complete_checkpoint_which_resumes(tmp_path):
    """A file system that refuses the write (simulated with a file-size limit on the workers,
    ``RLIMIT_FSIZE``: the write fails as on a full disk): one message, the tracker still at the
    last complete checkpoint, and the same command resumes from it."""
    save, records = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    one_rank = list(TINY)
    one_rank[one_rank.index("--pipeline-model-parallel-size") + 1] = "1"
    command = [*one_rank, "--train-iters", "4", "--pipeline-schedule", "elastic",
               "--save", str(save), "--load", str(save), "--save-interval", "1",
               "--metrics-jsonl", str(records)]
    torchrun(1, SCRIPT, [*command, "--exit-interval", "2"])

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    failed = torchrun(1, SCRIPT, command, check=False, timeout=240, preexec_fn=small_files)
    assert failed.returncode != 0
    assert (f"error: --save {save}: the checkpoint of iteration 3 could not be written "
            in failed.stderr), failed.stderr[-3000:]
    assert (f"{save}/iter_0000003 is incomplete; {save}/latest_checkpointed_iteration.txt still "
            "names iteration 2, a complete checkpoint, which the same command resumes from"
            in failed.stderr)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    torchrun(1, SCRIPT, command)
    assert [r["iteration"] for r in metrics(records)][-2:] == [3, 4]

"""A checkpoint that cannot be loaded stops the run with one message naming it and the way on,
and the checkpoint before it stays loadable (Megatron-LM's ``--ckpt-step``).

Damage: a shard file of the latest checkpoint lost (a disk that filled up, a copy cut short);
mismatch: a checkpoint loaded into a model of another shape.
"""

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
    assert (f"error: --load {save}: the checkpoint of iteration 2 ({save}/iter_0000002) cannot "
            f"be loaded (FileNotFoundError: ") in failed.stderr, failed.stderr[-3000:]
    assert "__1_0.distcp" in failed.stderr
    assert "with --ckpt-step ITERATION" in failed.stderr

    out = tmp_path / "resumed.jsonl"
    torchrun(2, SCRIPT, [*resume, "--ckpt-step", "1", "--metrics-jsonl", str(out)])
    assert [r["iteration"] for r in metrics(out)] == [2, 3]

    wider = [*COMMON, "--load", str(save), "--ckpt-step", "1"]
    wider[wider.index("--hidden-size") + 1] = "64"
    mismatched = torchrun(2, SCRIPT, wider, check=False, timeout=240)
    assert mismatched.returncode != 0
    assert (f"error: --load {save}: the checkpoint of iteration 1 ({save}/iter_0000001) cannot "
            "be loaded") in mismatched.stderr, mismatched.stderr[-3000:]
    assert "Global shape mismatch" in mismatched.stderr
    assert "load it with the flags it was saved with" in mismatched.stderr

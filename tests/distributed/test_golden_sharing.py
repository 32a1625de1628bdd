"""A golden layout run after another one in the same launch (``golden_run.py
--golden-layouts``, :func:`megatron.plugin.launch.reset` between them) equals the same layout run
alone in a launch of its own: the same loss, the same gradients to the bit, and the same order
of Megatron's forward and backward steps, so the shared launches of ``test_golden_megatron.py``
test what separate launches would.

The layout before it runs Megatron's interleaved schedule (two model chunks per rank: virtual
pipeline state, another schedule selected, other micro-batch counts), the layout checked runs
Megatron's 1F1B with the call order recorded; both on two ranks, from the same initial weights
(Megatron's loader: checkpoint state too).
"""
import json

import torch

from harness import TINY_MODEL, torchrun, torchrun_each

WORKER = "tests/distributed/golden_worker.py"
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
               "1", "--pipeline-schedule", "interleaved"]
NATIVE = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]


def test_layout_after_another_equals_layout_alone(tmp_path):
    common = [*TINY_MODEL, "--golden-dir", str(tmp_path)]
    init = str(tmp_path / "init")
    torchrun(1, WORKER, [*common, "--golden-mode", "init", "--save", init, "--save-interval", "1"])
    common += ["--load", init, "--no-load-optim", "--no-load-rng"]
    torchrun(2, WORKER, [*common, *NATIVE, "--golden-mode", "run", "--golden-tag", "alone"])
    torchrun_each(2, WORKER, [
        [*common, *INTERLEAVED, "--golden-mode", "run", "--golden-tag", "before"],
        [*common, *NATIVE, "--golden-mode", "run", "--golden-tag", "after"],
    ], str(tmp_path / "shared.json"))
    torchrun(1, WORKER, [*common, "--golden-mode", "reference", "--golden-tags", "alone",
                         "after"])

    def read(name):
        with open(tmp_path / name) as f:
            return json.load(f)

    assert read("loss_after.json") == read("loss_alone.json")
    for rank in range(2):
        assert read(f"order_after_{rank}.json") == read(f"order_alone_{rank}.json")
    alone = torch.load(tmp_path / "grads_alone.pt")
    after = torch.load(tmp_path / "grads_after.pt")
    assert set(after) == set(alone)
    assert all(grad.abs().sum() > 0 for grad in alone.values()), "a gradient is zero"
    for name, expected in alone.items():
        torch.testing.assert_close(after[name], expected, rtol=0, atol=0, msg=name)

"""Golden: Megatron's native schedules on CPU (gloo) equal the single-process reference.

Loss and every parameter gradient of one training step over a fixed set of documents
(packed into micro-batches for the pipeline; one document at a time for the reference).
"""
import glob
import json
import os

import pytest
import torch

from harness import TINY_MODEL, torchrun

from megatron.plugin import cpu_compat

WORKER = "tests/distributed/golden_worker.py"

#: model variant -> (model flags, {layout tag: (ranks, parallel flags)}). Each variant has its
#: own initial weights and its own single-process reference.
VARIANTS = {
    "learned": ([], {
        "pp2": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
        "pp4": (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "1f1b"]),
        "pp2_tp2_sp": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                           "2", "--sequence-parallel", "--pipeline-schedule", "1f1b"]),
        "pp2_full_recompute": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                   "1f1b", "--recompute-granularity", "full",
                                   "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
        "pp2_vp2_interleaved": (2, ["--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1",
                                    "--pipeline-schedule", "interleaved"]),
    }),
    "rope_swiglu_rmsnorm": (["--position-embedding-type", "rope", "--swiglu",
                             "--normalization", "RMSNorm", "--disable-bias-linear",
                             "--untie-embeddings-and-output-weights"], {
        "pp2_dp2": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
    }),
}
CASES = [(variant, tag) for variant, (_, layouts) in VARIANTS.items() for tag in layouts]


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    for variant, (model_flags, layouts) in VARIANTS.items():
        common = [*TINY_MODEL, *model_flags, "--golden-dir", str(root / variant)]
        torchrun(1, WORKER, [*common, "--golden-mode", "init"])
        for tag, (nprocs, flags) in layouts.items():
            torchrun(nprocs, WORKER, [*common, *flags, "--golden-mode", "run", "--golden-tag", tag])
        torchrun(1, WORKER, [*common, "--golden-mode", "reference", "--golden-tags", *layouts])
    return root


@pytest.mark.parametrize("variant,tag", CASES)
def test_loss_and_gradients_match_reference(golden, variant, tag):
    golden = str(golden / variant)
    reference = torch.load(os.path.join(golden, "reference.pt"))
    with open(os.path.join(golden, f"loss_{tag}.json")) as f:
        loss = json.load(f)
    assert loss["tokens"] == reference["tokens"]
    torch.testing.assert_close(loss["loss_sum"] / loss["tokens"],
                               reference["loss_sum"] / reference["tokens"], rtol=1e-4, atol=1e-5)
    grads = torch.load(os.path.join(golden, f"grads_{tag}.pt"))
    assert set(grads) == set(reference["grads"])
    for name, expected in reference["grads"].items():
        assert expected.abs().sum() > 0, f"reference gradient of {name} is zero"
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-5, msg=name)


def test_every_cpu_compat_patch_is_exercised(golden):
    """Each patched megatron-core module (and replaced function / wrapped method) redirected at
    least one CUDA request to the CPU during the golden runs: no patch is dead weight."""
    hits = {}
    for path in glob.glob(str(golden / "*" / "hits_*.json")):
        with open(path) as f:
            for module, counts in json.load(f).items():
                for what, n in counts.items():
                    hits.setdefault(module, {}).setdefault(what, 0)
                    hits[module][what] += n
    missing = sorted(m for m in cpu_compat.patched_modules() if not any(hits.get(m, {}).values()))
    assert not missing, f"patched but never exercised: {missing}; hits: {hits}"
    assert hits["megatron.core.pipeline_parallel.schedules"]["zeros"] > 0
    assert hits["megatron.core.pipeline_parallel.p2p_communication"]["cuda.current_device"] > 0

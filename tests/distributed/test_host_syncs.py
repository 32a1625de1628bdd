"""No host sync on the per-unit path: during every forward and backward a document schedule's
executor runs (two training steps on 2 CPU ranks, pipeline size 2, RoPE, the golden tiny GPT),
no tensor value reaches the host (``item``, ``tolist``, ``int``, ``float``, ``bool``, ``numpy``,
``cpu``) and no copy blocks (:class:`host_sync_worker.HostSyncCounter`). The loss checks run
once a step (:mod:`megatron.plugin.loss_checks`), the RoPE table's length comes from the plan
(:class:`~megatron.plugin.layers.layout.PackedDocuments`), the batches are pinned when they are
built and copied without blocking, SPPO's multiplexed blocks take their shapes from the plan.

The counter is proved able to fail by the unit test beside the loss checks'
(``tests/unit/test_loss_checks.py`` counts the per-unit check it replaces)."""
import json
import os

import pytest

from harness import TINY_MODEL, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
PP2 = ["--pipeline-model-parallel-size", "2"]
ROPE = ["--position-embedding-type", "rope"]
LAYOUTS = {
    "elastic": [*PP2, *ROPE, "--pipeline-schedule", "elastic", "--elastic-slices", "3"],
    "seq1f1b": [*PP2, *ROPE, "--pipeline-schedule", "seq1f1b", "--elastic-slices", "2"],
    "sppo_offload": [*PP2, *ROPE, "--pipeline-schedule", "sppo", "--sppo-subsequences", "5",
                     "--sppo-offload", "0.5"],
    "sppo_mux": [*PP2, *ROPE, "--pipeline-schedule", "sppo", "--sppo-subsequences", "4",
                 "--sppo-offload", "off", "--sppo-multiplex", "--global-batch-size", "1"],
    "helix": [*PP2, *ROPE, "--pipeline-schedule", "helix"],
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_syncs")
    layouts = [[tag, [*TINY_MODEL, *flags]] for tag, flags in LAYOUTS.items()]
    torchrun(2, os.path.join(HERE, "host_sync_worker.py"), [str(out), json.dumps(layouts)],
             timeout=600)
    return out


@pytest.mark.parametrize("tag", sorted(LAYOUTS))
def test_no_host_sync_during_a_unit(counted, tag):
    for rank in (0, 1):
        with open(counted / f"{tag}_{rank}.json") as f:
            found = json.load(f)
        assert found["units"], f"{tag}: rank {rank} ran no unit through the executor"
        assert found["syncs"] == {}, f"{tag}: rank {rank} synced during its units"

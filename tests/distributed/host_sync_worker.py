"""The no-host-sync test's worker (``test_host_syncs.py`` runs it under torchrun).

Arguments: an output directory, then a JSON list of ``[tag, argv]`` pairs, run one after
another in the same processes (:func:`launch.reset` between them). For each, two training
steps of Megatron's ``train_step`` (:data:`STEPS`) over the golden documents, with every
forward and backward action the executor hands to a handler run inside
:class:`~host_syncs.HostSyncCounter`; each rank writes what the counter saw (``<tag>_<rank>.json``: the units counted and every conversion, by
operation and the line of the project that made it).
"""
import json
import os
import sys

import torch.distributed as dist

from megatron.plugin import launch
from megatron.plugin.document_data import GlobalBatch
from megatron.plugin.pipeline import executor
from megatron.plugin.pipeline.ir import Kind

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from golden_run import golden_documents  # noqa: E402
from host_syncs import HostSyncCounter  # noqa: E402

#: Megatron's rerun state machine validates a loss from the second step on.
STEPS = 2


def counting_units(units: list, counter: HostSyncCounter):
    """Wrap the executor's choice of handler so that forward and backward actions run inside
    ``counter``; ``units`` collects the actions counted."""
    choose = executor._handler

    def handler(run, action):
        chosen = choose(run, action)
        if action.kind not in (Kind.FORWARD, Kind.BACKWARD):
            return chosen

        def counted(run, index, action):
            units.append(str(action))
            with counter:
                return chosen(run, index, action)
        return counted
    return choose, handler


def main() -> None:
    out, layouts = sys.argv[1], json.loads(sys.argv[2])
    for tag, argv in layouts:
        args = launch.initialize(argv)
        model, optimizer, scheduler, config = launch.setup_model_and_optimizer()
        docs = golden_documents(args.global_batch_size, args.seq_length, 255, args.seed)
        counter, units = HostSyncCounter(), []
        choose, executor._handler = counting_units(units, counter)
        try:
            for iteration in range(STEPS):
                launch.train_step(model, optimizer, scheduler, config,
                                  iter([GlobalBatch(docs, lambda: docs)]), iteration)
        finally:
            executor._handler = choose
        with open(os.path.join(out, f"{tag}_{dist.get_rank()}.json"), "w") as f:
            json.dump({"units": units, "syncs": dict(counter.seen)}, f, indent=1)
        del model, optimizer, scheduler
        launch.reset()
    launch.shutdown()


if __name__ == "__main__":
    main()

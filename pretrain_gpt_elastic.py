"""Drop-in for Megatron-LM's ``pretrain_gpt.py`` with long-context pipeline schedules.

    torchrun --nproc-per-node 2 pretrain_gpt_elastic.py <Megatron-LM flags> \\
        --pipeline-schedule {default,1f1b,interleaved,1f1b-ir,elastic,seq1f1b,helix,sppo}

Megatron-LM's own parser, training loop, checkpointing and logging (``megatron.training``);
the project provides the model (document attention), the document batches and the schedules.
"""
import logging
import sys


def main() -> int:
    # Imported here, not at the top: the elastic planner's worker process (spawned) re-imports
    # this file and needs none of torch or Megatron.
    from megatron.plugin.launch import report_error, run_pretrain

    # The elastic cost model's refits, unprefixed, on stdout beside Megatron's log lines.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    refits = logging.getLogger("elastic_pipe.refit")
    refits.addHandler(handler)
    refits.setLevel(logging.INFO)
    refits.propagate = False
    try:
        run_pretrain()
    except (ValueError, FileNotFoundError) as err:
        report_error(err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

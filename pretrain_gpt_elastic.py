"""Drop-in for Megatron-LM's ``pretrain_gpt.py`` with long-context pipeline schedules.

    torchrun --nproc-per-node 2 pretrain_gpt_elastic.py <Megatron-LM flags> \
        --pipeline-schedule {default,1f1b,interleaved,1f1b-ir,elastic,seq1f1b}
"""
import logging
import sys


def main(argv=None) -> int:
    # Imported here, not at the top: the elastic planner's worker process (spawned) re-imports
    # this file and needs none of torch or Megatron.
    from megatron.plugin.arguments import parse_args
    from megatron.plugin.training import pretrain

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Megatron-style log lines: the training loop's INFO records (and the elastic cost model's
    # refits), unprefixed, on stdout.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("megatron.plugin.training", "elastic_pipe.refit"):
        lines = logging.getLogger(name)
        lines.addHandler(handler)
        lines.setLevel(logging.INFO)
        lines.propagate = False
    args = parse_args(argv)
    try:
        pretrain(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launched with torchrun by ``test_golden_megatron.py``: runs :func:`golden_run.main`.

torch and Megatron are imported only when this file runs as the program: processes that
Megatron spawns (the result queue of its checkpoint writer, once per rank on the first save)
import this file again, and importing them there cost each launch several seconds of CPU per
rank (the same reason ``pretrain_gpt_elastic.py`` imports late).
"""
import sys

if __name__ == "__main__":
    from golden_run import main

    sys.exit(main())

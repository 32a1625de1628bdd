"""``1f1b-ir``: Megatron-LM's non-interleaved 1F1B written as IR and run by the executor."""

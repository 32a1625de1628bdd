"""Launched with torchrun by ``test_megatron_examples.py``: builds the model, optimizer and
scheduler of its command line as Megatron-LM's ``pretrain`` would (same seed, same schedule,
nothing loaded) and saves them as iteration 0 into ``--save``, the weights that command line's
run starts from. Imports are late for the reason ``pretrain_gpt_elastic.py`` gives."""
import sys

if __name__ == "__main__":
    from megatron.plugin import launch
    from megatron.training.checkpointing import save_checkpoint

    launch.initialize(sys.argv[1:])
    model, optimizer, scheduler, _ = launch.setup_model_and_optimizer()
    save_checkpoint(0, model, optimizer, scheduler, 0)
    launch.shutdown()

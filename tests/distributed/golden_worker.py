"""Worker for golden gradient tests (launched with torchrun by ``harness.py``).

Modes:
* ``init`` (1 process): build the model with the given seed and save its weights as a
  Megatron distributed checkpoint, so every layout starts from identical parameters.
* ``run`` (any layout): load those weights, run one forward-backward with the schedule under
  test over the fixed documents, then save the reduced gradients (``main_grad``) *as model
  weights* — dist_checkpointing then reshards them into any other layout — and the loss.
  Document-level schedules (``elastic``, ``seq1f1b``) also write their plan's chunk kinds and
  checkpointing table (``plan_<tag>.json``), ``helix`` its micro-batch and padding counts
  and MLP chunk rows (``helix_<tag>.json``), ``sppo`` its subsequences, offload ratios and
  what each offload moved, per rank (``sppo_<tag>_<rank>.json``), so the test can check what a
  run exercised.
  Finally step Megatron's optimizer (grad-norm and clipping on CPU) and record which
  CPU-compatibility patches were exercised (``hits_<tag>_<rank>.json``). Under Megatron's
  native ``1f1b`` the order in which its loop called ``forward_step`` / ``backward_step`` on
  each rank is recorded too (``order_<tag>_<rank>.json``), an independent oracle for the IR
  generator of 1F1B.
* ``reference`` (1 process): the single-process reference over whole documents, each document
  alone (no packing): per-token loss and gradients; then, for every tag given, load that run's
  gradient checkpoint into the single-process layout. Everything is written with ``torch.save``
  for the test to compare.
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.plugin import checkpointing, cpu_compat
from megatron.plugin.arguments import build_parser, validate_args
from megatron.plugin.batches import forward_step, micro_batch, pack_row
from megatron.plugin.training import (initialize_distributed, reduce_losses, schedule_input,
                                      setup_model_and_optimizer, shutdown_distributed)
from megatron.plugin import registry


def golden_documents(count: int, seq_length: int, vocab: int, seed: int):
    """Skewed lengths: a few documents near ``seq_length`` and many short ones."""
    rng = np.random.default_rng(seed)
    lengths = []
    for i in range(count):
        if i % 4 == 0:
            lengths.append(int(rng.integers(seq_length // 2, seq_length + 1)))
        else:
            lengths.append(int(rng.integers(2, seq_length // 4)))
    return [rng.integers(0, vocab, size=n + 1).astype(np.int64) for n in lengths]


def parse():
    parser = build_parser()
    parser.add_argument("--golden-mode", choices=["init", "run", "reference"], required=True)
    parser.add_argument("--golden-dir", required=True)
    parser.add_argument("--golden-tag", default="")
    parser.add_argument("--golden-tags", nargs="*", default=[])
    parser.add_argument("--golden-docs", type=int, default=12)
    args = parser.parse_args()
    validate_args(args)
    return args


def grads_as_weights(model):
    """Replace every parameter's data by its reduced gradient (after finalize_model_grads)."""
    for chunk in model:
        for param in chunk.module.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            param.data.copy_(grad.view_as(param) if grad is not None else torch.zeros_like(param))


def record_call_order(order: list):
    """Wrap megatron-core's ``forward_step``/``backward_step`` (as its schedules call them) to
    append ``"F<microbatch>"`` / ``"B<k>"`` to ``order``. 1F1B runs backwards first-in first-out,
    so the k-th backward is micro-batch k."""
    from megatron.core.pipeline_parallel import schedules

    forward, backward = schedules.forward_step, schedules.backward_step

    def forward_step(*args, current_microbatch=None, **kwargs):
        order.append(f"F{current_microbatch}")
        return forward(*args, current_microbatch=current_microbatch, **kwargs)

    def backward_step(*args, **kwargs):
        order.append(f"B{sum(1 for step in order if step[0] == 'B')}")
        return backward(*args, **kwargs)

    schedules.forward_step, schedules.backward_step = forward_step, backward_step


def main():
    args = parse()
    initialize_distributed(args)
    run(args)
    shutdown_distributed()


def run(args):
    registry.use_schedule(args.pipeline_schedule)
    vocab = 256
    model, optimizer, _, config = setup_model_and_optimizer(args, vocab)
    init_dir = os.path.join(args.golden_dir, "init")
    docs = golden_documents(args.golden_docs, args.seq_length, vocab, args.seed)
    if args.golden_mode == "init":
        checkpointing.save_model(init_dir, model)
        return
    checkpointing.load_model(init_dir, model)
    if args.golden_mode == "run":
        from megatron.core.pipeline_parallel import get_forward_backward_func
        schedule_fn = get_forward_backward_func()
        data_iterator, num_microbatches = schedule_input(schedule_fn, docs, args, model)
        order: list[str] = []
        if args.pipeline_schedule == "1f1b":
            record_call_order(order)
        for chunk in model:
            chunk.zero_grad_buffer()
        losses = schedule_fn(forward_step_func=forward_step, data_iterator=data_iterator,
                             model=model, num_microbatches=num_microbatches,
                             seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                             forward_only=False)
        loss_sum, tokens = reduce_losses(losses)
        plan = getattr(data_iterator, "plan", None)
        if plan is not None and dist.get_rank() == 0:
            with open(os.path.join(args.golden_dir, f"plan_{args.golden_tag}.json"), "w") as f:
                json.dump({"kinds": [chunk.kind for chunk in plan.chunks()],
                           "ckpt": plan.ckpt_table(),
                           "status": [p.status for p in plan.pipelines]}, f)
        if hasattr(data_iterator, "padding") and dist.get_rank() == 0:
            with open(os.path.join(args.golden_dir, f"helix_{args.golden_tag}.json"), "w") as f:
                json.dump({"microbatches": num_microbatches,
                           "padding": data_iterator.padding,
                           "mlp_rows": data_iterator.mlp_rows}, f)
        offloader = getattr(data_iterator, "offloader", None)
        if offloader is not None:
            name = f"sppo_{args.golden_tag}_{dist.get_rank()}.json"
            with open(os.path.join(args.golden_dir, name), "w") as f:
                json.dump({**data_iterator.subsequences.to_dict(),
                           "stage": parallel_state.get_pipeline_model_parallel_rank(),
                           "shares": [str(a) for a in data_iterator.schedule[
                               parallel_state.get_pipeline_model_parallel_rank()]
                               if a.is_compute() and a.part is not None],
                           "offloads": [[r.unit[0], r.ratio, r.offloadable, r.moved]
                                        for r in offloader.records],
                           "host_peak": offloader.tier.peak, "host_used": offloader.tier.used},
                          f)
        grads_as_weights(model)
        checkpointing.save_model(os.path.join(args.golden_dir, f"grads_{args.golden_tag}"), model)
        if dist.get_rank() == 0:
            with open(os.path.join(args.golden_dir, f"loss_{args.golden_tag}.json"), "w") as f:
                json.dump({"loss_sum": loss_sum, "tokens": tokens}, f)
        if order:
            name = f"order_{args.golden_tag}_{dist.get_rank()}.json"
            with open(os.path.join(args.golden_dir, name), "w") as f:
                json.dump({"pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                           "pp": args.pipeline_model_parallel_size,
                           "microbatches": num_microbatches, "order": order}, f)
        optimizer.step()
        hits = {module: dict(counter) for module, counter in cpu_compat.HITS.items()}
        name = f"hits_{args.golden_tag}_{dist.get_rank()}.json"
        with open(os.path.join(args.golden_dir, name), "w") as f:
            json.dump(hits, f)
        return
    # reference: whole documents, one at a time, on a plain single-process model.
    # Megatron DDP's hooks accumulate gradients into ``main_grad``; no sync in one process.
    model[0].zero_grad_buffer()
    module = model[0].module
    loss_sum, tokens = 0.0, 0
    for doc in docs:
        batch = micro_batch([pack_row([doc])])
        output, loss_fn = forward_step(iter([batch]), module)
        doc_loss, doc_tokens, _ = loss_fn(output)
        doc_loss.backward()
        loss_sum += float(doc_loss)
        tokens += int(doc_tokens)
    reference = {name: p.main_grad.detach().clone().view_as(p) / tokens
                 for name, p in module.named_parameters()}
    torch.save({"loss_sum": loss_sum, "tokens": tokens, "grads": reference},
               os.path.join(args.golden_dir, "reference.pt"))
    for tag in args.golden_tags:
        checkpointing.load_model(os.path.join(args.golden_dir, f"grads_{tag}"), model)
        grads = {name: p.detach().clone() for name, p in module.named_parameters()}
        torch.save(grads, os.path.join(args.golden_dir, f"grads_{tag}.pt"))


if __name__ == "__main__":
    sys.exit(main())

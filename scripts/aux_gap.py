"""Report: the project's load-balancing loss per document (``--moe-per-document-aux-loss-coeff``,
``elastic`` and ``seq1f1b``) against Megatron's ``aux_loss`` per micro-batch
(``--moe-aux-loss-coeff`` under ``1f1b``, ``interleaved`` and ``1f1b-ir``), on one model and
batch: the gap for which ``elastic`` and ``seq1f1b`` refuse ``--moe-aux-loss-coeff``.

    python scripts/aux_gap.py [--json OUT]

Runs two batches of skewed documents (a quarter near ``--seq-length``, the rest short, as the
golden tests draw them) through a 4-layer model of 4 experts, top-3 routing, one process on
the CPU, dropout off:

* ``golden``: the golden tests' batch and model (12 documents, ``--seq-length`` 64, seed 1234);
* ``skewed``: 64 documents at ``--seq-length`` 512.

Each document runs alone (routing is per token and a token's router logits depend on its own
document only, so these are the logits of any packing); Megatron's micro-batches are the
project's packing of the batch (``micro_batch_rows``: ``--micro-batch-size`` 1 rows of
``--seq-length``), whose padding runs as its own segment, as its router sees it. Printed per
batch: the logged value (the Switch loss without the coefficient, mean over the MoE layers) per
document (mean over the documents) and Megatron's (mean over the micro-batches), and the
relative difference ``|g_doc - g_megatron| / |g_megatron|`` of the router weights' gradients
(every layer's router weights together) of the auxiliary term alone and of the whole step's
loss at coefficient 0.01, under the per-token loss and Megatron's default loss.
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
         "--calculate-per-token-loss", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--num-experts", "4", "--moe-router-topk", "3",
         "--moe-ffn-hidden-size", "48", "--disable-bias-linear", "--eval-interval", "1000",
         "--pipeline-schedule", "1f1b"]
#: name -> (documents, --seq-length, --max-position-embeddings)
BATCHES = {"golden": (12, 64, 128), "skewed": (64, 512, 512)}
COEFF = 0.01


def skewed_documents(count: int, seq_length: int, vocab: int, seed: int):
    """The golden tests' rule: every fourth document ``seq_length / 2`` to ``seq_length``
    tokens long, the others 2 to ``seq_length / 4``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(seq_length // 2, seq_length + 1)) if i % 4 == 0
               else int(rng.integers(2, seq_length // 4)) for i in range(count)]
    return [rng.integers(0, vocab, size=n + 1).astype(np.int64) for n in lengths]


def switch_loss(logits, topk: int):
    """The Switch Transformer's loss of ``T`` tokens' logits ``[T, E]`` (coefficient 1)."""
    import torch

    scores = torch.softmax(logits.float(), dim=-1)
    routed = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1.0)
    count, experts = scores.shape
    return experts * torch.sum(routed.sum(dim=0) / (count * topk) * scores.mean(dim=0))


def worker(name: str) -> dict:
    import numpy as np
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron.plugin import launch
    from megatron.plugin.batches import forward_step, micro_batch, micro_batch_rows, pack_row

    args = launch.initialize(sys.argv[1:])
    model, _, _, _ = launch.setup_model_and_optimizer()
    module = model[0].module
    docs = skewed_documents(BATCHES[name][0], args.seq_length, 256, args.seed)
    routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
    topk = routers[0].topk
    recorded = [[] for _ in routers]

    def recording(gating, calls):
        def gate(hidden):
            logits = gating(hidden)
            calls.append(logits.reshape(-1, logits.shape[-1]))
            return logits
        return gate

    for router, calls in zip(routers, recorded):
        router.gating = recording(router.gating, calls)

    def run(piece):
        """Forward of one piece alone: ``(its loss sum, its logits per layer)``."""
        for calls in recorded:
            calls.clear()
        output, loss_fn = forward_step(iter([micro_batch([pack_row([piece])])]), module)
        return loss_fn(output)[0], [calls[0] for calls in recorded]

    lengths = [len(doc) - 1 for doc in docs]
    runs = [run(doc) for doc in docs]
    loss_tokens = sum(lengths)
    batches = micro_batch_rows(lengths, args.seq_length, 1)
    per_doc = [sum(switch_loss(logits[layer], topk) for layer in range(len(routers)))
               for _, logits in runs]
    per_mb, mb_tokens = [], []
    for rows in batches:
        members = [index for row in rows for index in row]
        pad = len(rows) * args.seq_length - sum(lengths[index] for index in members)
        pieces = [runs[index][1] for index in members]
        if pad:
            pieces.append(run(np.zeros(pad + 1, dtype=np.int64))[1])
        per_mb.append(sum(switch_loss(torch.cat([p[layer] for p in pieces]), topk)
                          for layer in range(len(routers))))
        mb_tokens.append(len(rows) * args.seq_length)
    weights = [router.weight for router in routers]

    def grad(loss):
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, weights,
                                                                   retain_graph=True)])

    # Megatron's cross entropy reuses its saved tensors in its backward: one backward per
    # document's loss, weighted afterwards.
    main = [grad(loss) for loss, _ in runs]
    per_token_main = sum(main) / loss_tokens
    default_main = sum(sum(main[index] for row in rows for index in row)
                       / sum(lengths[index] for row in rows for index in row)
                       for rows in batches) / len(batches)
    terms = {
        "per_token": (per_token_main,
                      sum(a * n for a, n in zip(per_doc, lengths)) / loss_tokens,
                      sum(a * n for a, n in zip(per_mb, mb_tokens)) / loss_tokens),
        "default": (default_main, sum(per_doc) / len(docs), sum(per_mb) / len(batches)),
    }
    layers = len(routers)
    report = {"documents": len(docs), "micro_batches": len(batches),
              "seq_length": args.seq_length, "moe_layers": layers,
              "logged_per_document": float(sum(per_doc) / len(docs) / layers),
              "logged_megatron": float(sum(per_mb) / len(batches) / layers)}
    for loss_kind, (g_main, document, megatron) in terms.items():
        g_doc, g_mb = grad(document), grad(megatron)
        report[f"{loss_kind}_aux_grad_rel_diff"] = float((g_doc - g_mb).norm() / g_mb.norm())
        step_doc, step_mb = g_main + COEFF * g_doc, g_main + COEFF * g_mb
        report[f"{loss_kind}_step_grad_rel_diff"] = float(
            (step_doc - step_mb).norm() / step_mb.norm())
    launch.shutdown()
    return report


def main() -> int:
    if "RANK" in os.environ:
        report = worker(os.environ["AUX_GAP_BATCH"])
        print(json.dumps(report))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    known = parser.parse_args()
    reports = {}
    for name, (count, seq, positions) in BATCHES.items():
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                   "--master-addr=127.0.0.1", "--master-port=29533", os.path.abspath(__file__),
                   *MODEL, "--seq-length", str(seq), "--max-position-embeddings",
                   str(positions), "--global-batch-size", str(count)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONWARNINGS="ignore",
                   AUX_GAP_BATCH=name)
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
            return done.returncode
        reports[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(name, json.dumps(reports[name], indent=1))
    if known.json:
        with open(known.json, "w") as f:
            json.dump({"argv": sys.argv[1:], **reports}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

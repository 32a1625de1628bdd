"""Sweep of Megatron-LM's GPT functional-test configs through ``pretrain_gpt_elastic.py``'s
start-up checks (not a test; nothing is trained, nothing is downloaded).

Reads ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of a Megatron-LM checkout
(``--megatron-lm DIR``), keeps the pretraining ones (no ``MODE``, or ``MODE: pretraining``),
turns each one's ``MODEL_ARGS`` into a command line the way Megatron-LM's functional-test
harness does (``true`` alone, lists spread, empty values left out), and shrinks it:

* sizes: a model of ``PP x virtual stages`` layers (one per stage and virtual stage; uneven
  first/last stages one layer each), ``2 x TP x CP`` heads of 8 channels (query groups
  ``TP x CP`` under grouped-query attention), a 4x MLP, 64 tokens (or ``TP x CP`` if more);
  ``--global-batch-size`` a multiple of micro-batch x data-parallel size;
* paths: every ``$NAME`` / ``${NAME}`` becomes a folder of the sweep's own (the checks read
  no file);
* tokenizer: the tests' NullTokenizer (``tests/harness.py`` ``NULL_TOKENIZER_256``) in place of
  the config's tokenizer flags and files.

Nothing else is changed. The world size is the functional tests' node of 8 GPUs, or
``TP x PP x CP`` when that is larger (``WORLD_SIZE`` for Megatron-LM's validation).

Each shrunk config runs, once per ``--schedules`` entry (``--pipeline-schedule``), the checks
the training script runs before anything slow: the project's refusals, all at once
(:func:`megatron.plugin.arguments.check_command_line` with ``training=True``), then, when it
has none, Megatron-LM's parsing and validation (its ``assert`` turned into a refusal as at
start-up) and the project's rules on the validated flags. The project's checks run twice: as
this machine is, and as a GPU machine with Transformer Engine would be
(``torch.cuda.is_available`` and the Transformer Engine check answering yes). The outcome is
``starts``, ``cuda_only`` (refused here, but not on the GPU machine), ``refused`` (refused
there too) or ``unparsed`` (Megatron-LM's parser rejects the command line itself).

A refused config is checked once more on each machine with every refusal's advice followed
(the flags it is about, and those it says to drop, removed): ``after_advice`` lists what is
refused then, and ``chained`` what of that the first refusals did not name (advice that leads
into another refusal), each under ``here`` and ``gpu``.

    python scripts/sweep_megatron_configs.py --megatron-lm DIR \\
        [--json benchmarks/results/megatron_configs_sweep.json]

writes ``{"argv", "megatron_lm_commit", "configs", "schedules": {NAME: {"counts", "ranked",
"start_after_advice", "chained"}}, "messages": [TEXT], "results": [{"config", "schedule",
"outcome", "refusals", "cpu_refusals", "after_advice", "chained"}]}`` (each refusal an index
into ``messages``) and prints the counts and the refusals ranked by how many configs they
stop. ``--megatron-lm-commit`` records the commit of a checkout that is not a git work tree
(``git archive`` of a mirror).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import io
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("default", "1f1b", "elastic", "seq1f1b", "helix", "sppo")
NODE_GPUS = 8
CONFIGS = "tests/functional_tests/test_cases/gpt/*/model_config.yaml"
#: The tests' tokenizer (``tests/harness.py`` ``NULL_TOKENIZER_256``).
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]
#: The config's tokenizer flags, replaced by :data:`TOKENIZER`.
TOKENIZER_FLAGS = frozenset((
    "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file", "--vocab-size",
    "--tokenizer-hf-use-fast", "--tokenizer-hf-include-special-tokens",
    "--tokenizer-metadata", "--tiktoken-pattern", "--tiktoken-num-special-tokens",
    "--tiktoken-special-tokens", "--vocab-extra-ids", "--tokenizer-special-tokens"))
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def load_configs(megatron_lm: str) -> list[tuple[str, dict]]:
    """``(name, MODEL_ARGS)`` of each pretraining config of the checkout, sorted by name."""
    import yaml

    found = []
    for path in sorted(glob.glob(os.path.join(megatron_lm, CONFIGS))):
        with open(path) as f:
            config = yaml.safe_load(f)
        if config.get("MODE", "pretraining") == "pretraining" and config.get("MODEL_ARGS"):
            found.append((os.path.basename(os.path.dirname(path)), config["MODEL_ARGS"]))
    return found


def _number(model_args: dict, flag: str, default: int = 1) -> int:
    value = model_args.get(flag)
    return default if value in (None, "", False) else int(value)


def shrink(model_args: dict, workdir: str) -> dict:
    """``model_args`` with the sizes, paths and tokenizer shrunk (see the module's docstring);
    every other entry as it is."""
    tp = _number(model_args, "--tensor-model-parallel-size")
    pp = _number(model_args, "--pipeline-model-parallel-size")
    cp = _number(model_args, "--context-parallel-size")
    layers = _number(model_args, "--num-layers", pp)
    per_virtual = model_args.get("--num-layers-per-virtual-pipeline-stage")
    virtual = _number(model_args, "--num-virtual-stages-per-pipeline-rank")
    if per_virtual:
        virtual = max(1, layers // (pp * int(per_virtual)))
    heads = max(4, 2 * tp * cp)
    # Megatron-LM splits the layers, the embedding and the loss where the config counts them
    # as layers: one layer a virtual stage, those counted included.
    counted = sum(bool(model_args.get(flag)) for flag in (
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"))
    sizes = {"--num-layers": max(1, pp * virtual - counted), "--num-attention-heads": heads,
             "--hidden-size": 8 * heads, "--seq-length": max(64, tp * cp),
             "--max-position-embeddings": max(64, tp * cp)}
    if per_virtual:
        sizes["--num-layers-per-virtual-pipeline-stage"] = 1
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        if model_args.get(flag):
            sizes[flag] = 1
    for flag, value in (("--ffn-hidden-size", 32 * heads), ("--kv-channels", 8),
                        ("--num-query-groups", tp * cp)):
        if model_args.get(flag):
            sizes[flag] = value
    micro = _number(model_args, "--micro-batch-size")
    step = micro * data_parallel_size(model_args)
    batch = _number(model_args, "--global-batch-size", step)
    sizes["--global-batch-size"] = max(step, batch // step * step)
    shrunk = {}
    for flag, value in model_args.items():
        if flag in TOKENIZER_FLAGS:
            continue
        if flag in sizes:
            value = sizes[flag]
        elif isinstance(value, str) and "$" in value:
            value = _VARIABLE.sub(lambda m: os.path.join(workdir, m.group(1).lower()), value)
        shrunk[flag] = value
    shrunk.update((flag, value) for flag, value in sizes.items() if flag not in shrunk)
    return shrunk


def world_size(model_args: dict) -> int:
    """The functional tests' node of :data:`NODE_GPUS`, or ``TP x PP x CP`` when larger."""
    model = (_number(model_args, "--tensor-model-parallel-size")
             * _number(model_args, "--pipeline-model-parallel-size")
             * _number(model_args, "--context-parallel-size"))
    return max(model, NODE_GPUS // model * model)


def data_parallel_size(model_args: dict) -> int:
    return world_size(model_args) // (_number(model_args, "--tensor-model-parallel-size")
                                      * _number(model_args, "--pipeline-model-parallel-size")
                                      * _number(model_args, "--context-parallel-size"))


def command_line(model_args: dict) -> list[str]:
    """``model_args`` as Megatron-LM's functional-test harness passes them: ``true`` as the
    flag alone, a list spread into values, an empty value left out, the tokenizer of
    :data:`TOKENIZER` last."""
    argv = []
    for flag, value in model_args.items():
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value not in (None, ""):
            argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return argv + TOKENIZER


def subjects(message: str) -> list[str]:
    """The flags a refusal is about: those named before its first ``:`` (its reason follows),
    ``--pipeline-schedule`` left out; Megatron-LM's own refusal by its text."""
    if message.startswith("Megatron-LM refused"):
        return ["Megatron-LM: " + message.split("): ", 1)[-1][:100]]
    head = message.split(": ", 1)[0]
    flags = [flag for flag in dict.fromkeys(_FLAG.findall(head)) if flag != "--pipeline-schedule"]
    return flags or [head[:100]]


def outcome(cpu: list[str] | None, gpu: list[str] | None) -> str:
    """``unparsed`` (``None``: the parser rejected the command line), ``starts`` (no refusal
    here), ``cuda_only`` (refusals here, none on the GPU machine) or ``refused``."""
    if cpu is None or gpu is None:
        return "unparsed"
    if not cpu:
        return "starts"
    return "refused" if gpu else "cuda_only"


def check(argv: list[str], world: int, gpu: bool) -> list[str] | None:
    """The start-up refusals of ``argv`` (``[]``: it starts), or ``None`` when Megatron-LM's
    parser rejects it; ``gpu``: the project's checks as on a CUDA machine with Transformer
    Engine installed (Megatron-LM's own validation runs as it does here either way: it asks
    nothing of the device, and a pretended one has no driver)."""
    from megatron.plugin import arguments, cpu_compat, launch
    from megatron.plugin.layers import te_layers
    from megatron.training.arguments import parse_args, validate_args

    def as_on_the_machine():
        patches = contextlib.ExitStack()
        if gpu:
            patches.enter_context(mock.patch("torch.cuda.is_available", return_value=True))
            patches.enter_context(mock.patch.object(te_layers, "missing", return_value=None))
        return patches

    out = io.StringIO()
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world), "RANK": "0"}), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            with as_on_the_machine():
                arguments.check_command_line(argv, training=True)
            cpu_compat.install()
            with launch._refusals(), arguments.command_line(argv):
                args = validate_args(parse_args(arguments.add_arguments), arguments.DEFAULTS)
            with as_on_the_machine():
                arguments.check_args(args)
        except arguments.Refusals as refusals:
            return refusals.messages
        except SystemExit:
            return None
        except (ValueError, TypeError, AttributeError, RuntimeError) as error:
            return [str(error) or type(error).__name__]
    return []


@contextlib.contextmanager
def _parsers_built_fast():
    """Megatron-LM's parser reads its config classes' field docstrings from their source at
    every build (most of a check's time): read once per class for the sweep."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    read = ArgumentGroupFactory._get_field_docstrings
    memo = {}

    def memoized(self, cls):
        if cls not in memo:
            memo[cls] = read(self, cls)
        return dict(memo[cls])

    with mock.patch.object(ArgumentGroupFactory, "_get_field_docstrings", memoized):
        yield


def sweep(configs: list[tuple[str, dict]], schedules, workdir: str) -> list[dict]:
    with _parsers_built_fast():
        return [_sweep_one(name, model_args, schedule, workdir)
                for name, model_args in configs for schedule in schedules]


def _sweep_one(name: str, model_args: dict, schedule: str, workdir: str) -> dict:
    shrunk = shrink(model_args, workdir)
    argv = command_line(shrunk) + ["--pipeline-schedule", schedule]
    world = world_size(model_args)
    cpu, gpu = check(argv, world, gpu=False), check(argv, world, gpu=True)
    found = {"config": name, "schedule": schedule, "outcome": outcome(cpu, gpu),
             "refusals": gpu or [],
             "cpu_refusals": [m for m in cpu or [] if m not in (gpu or [])]}
    for machine, first, on_gpu in (("here", cpu, False), ("gpu", gpu, True)):
        if first:
            dropped = {flag for message in first for flag in advised_drops(message)}
            followed = {flag: value for flag, value in shrunk.items() if flag not in dropped}
            again = check(command_line(followed) + ["--pipeline-schedule", schedule], world,
                          gpu=on_gpu)
            found.setdefault("after_advice", {})[machine] = again
            found.setdefault("chained", {})[machine] = chained(first, again or [])
    return found


def advised_drops(message: str) -> list[str]:
    """The flags a refusal asks to remove, each once: those it is about (:func:`subjects`; a
    refused value is replaced by the default that way) and those after "drop"."""
    named = [flag for flag in subjects(message) if flag.startswith("--")]
    named += re.findall(r"drop (--[a-z0-9-]+(?:(?:, | and | or )--[a-z0-9-]+)*)", message)
    return list(dict.fromkeys(flag for text in named for flag in _FLAG.findall(text)))


def chained(first: list[str], after: list[str]) -> list[str]:
    """The refusals met only after following the advice of ``first``: those about a flag
    (or, Megatron-LM's, with a text) that no refusal of ``first`` named."""
    before = {subject for message in first for subject in subjects(message)}
    return [message for message in after
            if not set(subjects(message)) <= before]


def summary(results: list[dict], schedules) -> dict:
    """Per schedule: the outcomes counted, and the refusals met on the GPU machine ranked by
    the configs they stop (``[subject, count]``)."""
    found = {}
    for schedule in schedules:
        mine = [r for r in results if r["schedule"] == schedule]
        counts = collections.Counter(r["outcome"] for r in mine)
        ranked = collections.Counter(
            subject for r in mine
            for subject in dict.fromkeys(s for m in r["refusals"] for s in subjects(m)))
        chains = collections.Counter(
            f"{machine}: {subject}" for r in mine
            for machine, messages in r.get("chained", {}).items()
            for subject in dict.fromkeys(s for m in messages for s in subjects(m)))
        found[schedule] = {"counts": {k: counts.get(k, 0) for k in
                                      ("starts", "cuda_only", "refused", "unparsed")},
                           "ranked": ranked.most_common(),
                           "start_after_advice": {
                               machine: sum(r.get("after_advice", {}).get(machine) == []
                                            for r in mine) for machine in ("here", "gpu")},
                           "chained": chains.most_common()}
    return found


def indexed(results: list[dict]) -> tuple[list[str], list[dict]]:
    """``(messages, results)``: every refusal's text once, and the results with each message
    replaced by its index in ``messages`` (the JSON holds each text once)."""
    messages: dict[str, int] = {}

    def index(found):
        if isinstance(found, dict):
            return {key: index(value) for key, value in found.items()}
        if isinstance(found, list):
            return [messages.setdefault(m, len(messages)) for m in found]
        return found

    compact = [{key: value if key in ("config", "schedule", "outcome") else index(value)
                for key, value in r.items()} for r in results]
    return list(messages), compact


def table(by_schedule: dict, configs: int, top: int) -> str:
    lines = [f"{configs} pretraining configs; starts here / also on a GPU with TE (CUDA-only "
             "refusals) / refused / unparsed", ""]
    for schedule, found in by_schedule.items():
        c = found["counts"]
        lines.append(f"{schedule:8s} {c['starts']:4d} {c['starts'] + c['cuda_only']:4d} "
                     f"{c['refused']:4d} {c['unparsed']:4d}")
    lines += ["", "after following every refusal's advice: configs that start here / on a GPU "
                  "with TE; refusals the advice led into (configs)"]
    for schedule, found in by_schedule.items():
        after = found["start_after_advice"]
        lines.append(f"{schedule:8s} {after['here']:4d} {after['gpu']:4d} "
                     + ", ".join(f"{subject} ({count})" for subject, count in found["chained"]))
    for schedule, found in by_schedule.items():
        lines += ["", f"refusals under {schedule} on a GPU (configs stopped):"]
        lines += [f"  {count:4d}  {subject}" for subject, count in found["ranked"][:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True,
                        help="a Megatron-LM checkout (its tests/functional_tests are read)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--top", type=int, default=25, help="refusals shown per schedule")
    parser.add_argument("--megatron-lm-commit", default=None,
                        help="the checkout's commit, recorded in the JSON (default: git's)")
    options = parser.parse_args()
    configs = load_configs(options.megatron_lm)
    if not configs:
        raise SystemExit(f"error: no {CONFIGS} under {options.megatron_lm}: pass the root of "
                         "a Megatron-LM checkout to --megatron-lm")
    with tempfile.TemporaryDirectory() as workdir:
        results = sweep(configs, options.schedules, workdir)
    by_schedule = summary(results, options.schedules)
    print(table(by_schedule, len(configs), options.top))
    if options.json:
        sys.path.insert(0, os.path.join(REPO, "scripts"))
        from _launch import write_json

        commit = options.megatron_lm_commit or subprocess.run(
            ["git", "-C", options.megatron_lm, "rev-parse", "HEAD"],
            capture_output=True, text=True).stdout.strip() or None
        messages, compact = indexed(results)
        write_json(options.json, {"megatron_lm_commit": commit, "configs": len(configs),
                                  "schedules": by_schedule, "messages": messages,
                                  "results": compact})


if __name__ == "__main__":
    main()

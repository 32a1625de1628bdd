"""The mutation check's hook (``tests/mutation/sitecustomize.py``) resets the option in the
process under test and keeps it in the golden harness's reference, and the check refuses to
run a proof that already runs the option at its no-effect value."""
import json
import os
import subprocess
import sys

import pytest

from harness import REPO, TINY_MODEL, python_path

HOOK = os.path.join(REPO, "tests", "mutation")

_PROBE = """
import json, sys
from megatron.plugin import arguments
from megatron.training.arguments import parse_args


def with_golden_mode(parser):
    arguments.add_arguments(parser)
    parser.add_argument("--golden-mode")
    return parser


argv, dest = json.loads(sys.argv[1]), sys.argv[2]
under_test = arguments.parse(argv)
with arguments.command_line([*argv, "--golden-mode", "reference"]):
    reference = parse_args(with_golden_mode)
print(json.dumps([repr(getattr(under_test, dest)), repr(getattr(reference, dest))]))
"""


@pytest.mark.parametrize("flags,dest,mutation,reset", [
    (["--hidden-dropout", "0.25"], "hidden_dropout", "0.0", ("0.0", "0.25")),
    # An enumeration's member, named by the JSON string.
    (["--attention-backend", "unfused"], "attention_backend", '"auto"',
     ("<AttnBackend.auto: 5>", "<AttnBackend.unfused: 3>")),
])
def test_the_option_is_reset_in_the_run_and_kept_in_the_reference(flags, dest, mutation, reset):
    argv = [*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
            *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HOOK, python_path()]), WORLD_SIZE="2",
               LONGCTX_MUTATE=f"{dest}={mutation}")
    result = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv), dest], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == list(reset)
    assert f"mutation: {dest} reset from {reset[1]} to {reset[0]}" in result.stderr


def test_a_proof_at_the_no_effect_value_is_not_caught_without_running():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import mutation_check

    entry = mutation_check.check("hidden_dropout", "1f1b", "golden:pp2", baseline=False,
                                 timeout=1)
    assert entry["verdict"] == "NOT CAUGHT (no-effect value)", entry
    assert mutation_check.no_effect_value("swiglu") is False
    assert mutation_check.no_effect_value("attention_backend") == "auto"


def test_the_shares_of_the_cells_cover_each_once():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import mutation_check

    cells = list(range(17))
    shares = [mutation_check.shard(cells, f"{index}/5") for index in range(1, 6)]
    assert sorted(cell for share in shares for cell in share) == cells
    assert shares[1] == [1, 6, 11, 16]
    for spec in ("0/5", "6/5", "2", "a/b"):
        with pytest.raises(SystemExit, match=f"--shard {spec}: write I/N"):
            mutation_check.shard(cells, spec)


def test_a_parse_without_the_option_is_left_alone():
    """Megatron-LM's fault-tolerance setup parses its own flags only (``ft_integration.setup``,
    before the training script's parse): the hook leaves that namespace as parsed, and the
    run goes on to the parse that has the option."""
    probe = ("from megatron.training.arguments import parse_args; "
             "print(parse_args(ignore_unknown_args=True).num_layers)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HOOK, python_path()]),
               LONGCTX_MUTATE="metrics_jsonl=null")
    result = subprocess.run([sys.executable, "-c", probe, "--num-layers", "3", "--metrics-jsonl",
                             "m.jsonl"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "3"

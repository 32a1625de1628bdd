"""The README's "Running it" commands, run as written in a stand-in for a clone's root after
the quickstart (the repository's files linked in, empty ``data/`` and ``runs/``), with fewer
iterations."""
import glob
import json
import os
import re
import shlex
import subprocess
import sys

from megatron.core.datasets.indexed_dataset import IndexedDataset

from harness import REPO, python_path, torchrun

#: What the test changes in the training command (each flag must be there): fewer iterations
#: of fewer documents.
SHRUNK = {"--train-iters": "2", "--eval-iters": "1", "--global-batch-size": "4",
          "--log-interval": "1"}
#: The quickstart's folders (its corpus, its run), empty in the stand-in clone.
MADE = {"data", "runs"}


def running_it_block(path: str) -> str:
    """The first fenced ``bash`` block under ``## Running it`` (README) or the first one of the
    file (docs/running.md)."""
    with open(path) as f:
        text = f.read()
    if "\n## Running it\n" in text:
        text = text.split("\n## Running it\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", text, re.S).group(1)


def commands(block: str) -> list[str]:
    """The block's commands as bash reads them: continuation lines joined, comments dropped."""
    lines = (re.sub(r"(^|\s)#.*$", "", line).strip()
             for line in block.replace("\\\n", " ").splitlines())
    return [line for line in lines if line]


def clone(tmp_path) -> str:
    """A folder holding links to the repository's top-level files and folders (hidden ones
    left out) and the quickstart's folders, empty."""
    root = tmp_path / "clone"
    root.mkdir()
    for entry in MADE:
        (root / entry).mkdir()
    for entry in os.listdir(REPO):
        if entry not in MADE and not entry.startswith("."):
            os.symlink(os.path.join(REPO, entry), root / entry)
    return str(root)


def shrunk(argv: list[str]) -> list[str]:
    argv = list(argv)
    for flag, value in SHRUNK.items():
        argv[argv.index(flag) + 1] = value
    return argv


def test_the_readme_commands_run_as_written(tmp_path):
    """Activate, preprocess the user's text byte-level, train with torchrun on 2 ranks (PP = 2,
    elastic): the dataset holds every input file, the run logs Megatron's lines for both
    iterations and the evaluation, writes its metrics and saves its checkpoint where the
    command says. docs/running.md opens with the same commands."""
    block = running_it_block(os.path.join(REPO, "README.md"))
    assert running_it_block(os.path.join(REPO, "docs", "running.md")) == block
    activate, preprocess, train = commands(block)
    # The quickstart's environment (scripts/_env.sh makes .venv); this test runs in its own.
    assert activate == "source .venv/bin/activate"
    root = clone(tmp_path)
    env = dict(os.environ, PYTHONPATH=python_path(), OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    written = subprocess.run(["bash", "-c", preprocess], cwd=root, env=env, capture_output=True,
                             text=True, timeout=120)
    assert written.returncode == 0, written.stderr[-3000:]
    words = shlex.split(preprocess)
    patterns = words[words.index("--input") + 1:words.index("--output-prefix")]
    inputs = [path for pattern in patterns for path in glob.glob(os.path.join(root, pattern))
              if os.path.getsize(path)]
    data = IndexedDataset(os.path.join(root, "data", "my_corpus_text_document"))
    assert len(data.index.document_indices) - 1 == len(inputs) > 50

    argv = shlex.split(train)
    assert argv[:4] == ["torchrun", "--nproc-per-node", "2", "pretrain_gpt_elastic.py"]
    result = torchrun(2, argv[3], shrunk(argv[4:]), cwd=root, timeout=240)
    lines = re.findall(r" iteration +\d+/ +2 \|.*", result.stdout)
    assert len(lines) == 2 and "lm loss:" in lines[-1], result.stdout[-3000:]
    assert "validation loss at iteration 2 on validation set" in result.stdout
    with open(os.path.join(root, "runs", "m.jsonl")) as f:
        assert [json.loads(line)["iteration"] for line in f] == [1, 2]
    with open(os.path.join(root, "runs", "ckpt", "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"

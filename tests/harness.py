"""Launch multi-process gloo runs with torchrun, with a timeout, from tests."""
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from scripts.marked_processes import kill_marked

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Megatron-LM's NullTokenizer sized so that every supported megatron-core builds the same
#: 256-row embedding: 0.18 and later count the end-of-document id within ``--vocab-size``
#: (255 ids), 0.17 adds it on top (256); both pad to a multiple of 128 x TP = 256 for TP <= 2.
NULL_TOKENIZER_256 = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]

#: A tiny GPT, fp32, no dropout: the model of every golden test.
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "128", "--micro-batch-size", "1",
    "--global-batch-size", "12", "--train-iters", "1", "--lr", "1e-3",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
    "--calculate-per-token-loss", *NULL_TOKENIZER_256,
]


def assert_matches_golden(path: str, text: str) -> None:
    """``text`` equals the golden file ``path``; with ``REGENERATE_GOLDEN=1`` it is written
    there first (after an intended change)."""
    if os.environ.get("REGENERATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert f.read() == text


def python_path() -> str:
    """``PYTHONPATH`` for a subprocess: the repository first, then what this process was given
    (an environment that installs packages by ``PYTHONPATH`` keeps them)."""
    return os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The environment variable that marks every process of one launch (inherited by all of them,
#: whatever session or parent they end up with).
LAUNCH_MARK = "LONGCTX_TEST_LAUNCH"


def torchrun(nprocs: int, script: str, args, timeout: float = 300, env=None, check=True,
             preexec_fn=None, cwd: str = REPO):
    """Run ``script`` on ``nprocs`` local ranks in ``cwd``; returns the CompletedProcess.
    ``preexec_fn`` runs in the launcher's process before it starts (limits set there hold for
    the ranks).

    Once the launcher ends, every process of the launch still alive is killed (they carry
    :data:`LAUNCH_MARK` in their environment; the ranks run in sessions of their own): a process
    a rank started and left behind (a rank that died) would otherwise hold the output pipes
    open, and the run with them, until the time limit."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", script, *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path(),
                    TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    full_env.update(env or {})
    mark = uuid.uuid4().hex
    full_env[LAUNCH_MARK] = mark
    launcher = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        try:
            stdout, stderr = launcher.communicate(timeout=1)
            break
        except subprocess.TimeoutExpired:
            timed_out = timed_out or (launcher.poll() is None and time.monotonic() > deadline)
            if launcher.returncode is not None or timed_out:
                kill_marked(LAUNCH_MARK, mark)
    kill_marked(LAUNCH_MARK, mark)
    result = subprocess.CompletedProcess(command, launcher.returncode, stdout, stderr)
    if timed_out:
        pytest.fail(f"{script} on {nprocs} ranks timed out after {timeout}s:\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    if check and result.returncode != 0:
        pytest.fail(f"{script} on {nprocs} ranks failed ({result.returncode}):\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def torchrun_each(nprocs: int, script: str, command_lines, list_path: str,
                  timeout_per_line: float = 120, env=None):
    """Run ``script`` on ``nprocs`` local ranks once for several command lines: they are
    written to ``list_path`` (a JSON list of argument lists) and the script gets
    ``--golden-layouts list_path``; it runs them one after another in the same processes. The
    limit is 300 s plus ``timeout_per_line`` per command line."""
    command_lines = [[str(arg) for arg in line] for line in command_lines]
    with open(list_path, "w") as f:
        json.dump(command_lines, f, indent=1)
    return torchrun(nprocs, script, ["--golden-layouts", list_path],
                    timeout=300 + timeout_per_line * len(command_lines), env=env)

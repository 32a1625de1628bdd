"""The GPU check's steps, run side by side within one time limit, judged into one report.

    python3 scripts/gpu_check.py [--dry-run] [--limit-s 510] [--report PATH] [--log-dir DIR]

Steps (``scripts/gpu_check.sh`` runs this on a CUDA machine; each step in its own process
session under its own time limit, every process it left behind killed when it ends):

* ``golden``: the golden tests' GPU set (``LONGCTX_GOLDEN_GPU=1``: PP = 2 and PP = 4 under every
  schedule, PP = 2 x TP = 2 with sequence parallelism) on NCCL, the ranks sharing the GPU;
* ``unit``: ``tests/unit`` on CUDA (pytest-xdist where it imports);
* ``train``: each schedule at PP = 2 in fp32, bf16 and fp16 and at PP = 4 in fp32 and bf16, the
  ranks sharing the GPU (``LONGCTX_SHARE_GPU=1``), six iterations of an 8-layer model without
  dropout, fp16 from an initial loss scale of 2^12 (Megatron-LM's ``--initial-loss-scale``);
  where ``transformer_engine`` imports, also bf16 with its layers at PP = 2
  (``train/<schedule>/pp2/bf16-te``, judged against the fp32 run like bf16).

:mod:`scripts.gpu_verdicts` judges every step's log; the report (one line per verdict, the
commit and device first) goes to ``--report``, by default
``benchmarks/results/gpu/verdicts_<commit>.txt`` (the commit from git, or ``GPU_CHECK_COMMIT``
in a copy without its git directory). Steps not started within ``--limit-s`` are
``SKIP`` lines. The exit code is 1 if any verdict failed.

``--dry-run``: on a machine without CUDA, the same plumbing on gloo with tiny sizes: the
golden tests' ``pp2`` and ``pp2_ir`` layouts, two unit-test files, and ``1f1b`` and ``elastic``
at PP = 2 in fp32 (the CPU trains fp32 only: the bf16 and fp16 verdicts are ``SKIP``); the
report goes to the log directory unless ``--report`` names a path.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import gpu_verdicts as verdicts  # noqa: E402
from scripts.marked_processes import kill_marked  # noqa: E402

ITERATIONS = 6
TRAIN_MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "256", "--max-position-embeddings", "256",
               "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3",
               "--train-iters", str(ITERATIONS), "--lr-warmup-iters", "1", "--log-interval", "1",
               "--eval-interval", "1000", "--eval-iters", "0", "--calculate-per-token-loss",
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--mock-data",
               "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0"]
PRECISION = {"fp32": [], "bf16": ["--bf16"],
             "fp16": ["--fp16", "--initial-loss-scale", "4096"]}
MARK = "LONGCTX_GPU_CHECK_STEP"


def schedule_flags(schedule: str, pp: int) -> list[str]:
    """A training run's schedule flags at ``pp`` stages (8 layers)."""
    flags = ["--pipeline-schedule", schedule]
    if schedule == "interleaved":
        flags += ["--num-layers-per-virtual-pipeline-stage", str(8 // (2 * pp))]
    if schedule == "sppo":
        flags += ["--sppo-subsequences", str(2 * pp), "--sppo-offload", "0.5"]
    return flags


SCHEDULES = ("1f1b", "interleaved", "1f1b-ir", "elastic", "seq1f1b", "helix", "sppo")
MATRIX = {2: ("fp32", "bf16", "fp16"), 4: ("fp32", "bf16")}
#: Trained at PP = 2 in bf16 with Megatron-LM's Transformer Engine layers where
#: ``transformer_engine`` imports (never on the lent test machines: it cannot be carried there).
TE_SCHEDULES = ("1f1b", "interleaved", "1f1b-ir", "elastic", "seq1f1b", "sppo")


@dataclass(eq=False)
class Step:
    name: str
    command: list[str]
    procs: int
    limit_s: float
    env: dict = field(default_factory=dict)
    returncode: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0
    #: A training run's (schedule, "pp<P>", dtype).
    train: tuple | None = None

    @property
    def log(self) -> str:
        return f"{self.name}.log"


def training_steps(dry_run: bool) -> list[Step]:
    steps = []
    schedules = ("1f1b", "elastic") if dry_run else SCHEDULES
    matrix = {2: ("fp32",)} if dry_run else MATRIX
    share = {} if dry_run else {"LONGCTX_SHARE_GPU": "1"}
    for dtype in ("fp32", "bf16", "fp16"):  # the fp32 runs first: the others compare with them
        for pp, dtypes in matrix.items():
            if dtype not in dtypes:
                continue
            for schedule in schedules:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={pp}", "pretrain_gpt_elastic.py", *TRAIN_MODEL,
                           "--pipeline-model-parallel-size", str(pp),
                           *schedule_flags(schedule, pp), *PRECISION[dtype]]
                steps.append(Step(f"train-{schedule}-pp{pp}-{dtype}", command, pp,
                                  120 if dry_run else 150, share, train=(schedule, f"pp{pp}",
                                                                         dtype)))
    if not dry_run and importlib.util.find_spec("transformer_engine") is not None:
        for schedule in TE_SCHEDULES:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2", "pretrain_gpt_elastic.py", *TRAIN_MODEL,
                       "--pipeline-model-parallel-size", "2", *schedule_flags(schedule, 2),
                       *PRECISION["bf16"], "--transformer-impl", "transformer_engine"]
            steps.append(Step(f"train-{schedule}-pp2-bf16-te", command, 2, 150, share,
                              train=(schedule, "pp2", "bf16-te")))
    return steps


def test_steps(log_dir: Path, dry_run: bool) -> list[Step]:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    golden_env = {"LONGCTX_GOLDEN_GPU": "1"}
    if dry_run:
        golden_env["LONGCTX_GOLDEN_TAGS"] = "pp2,pp2_ir"
    unit = ["tests/unit/test_gpu_verdicts.py", "tests/unit/test_shared_gpu.py"] if dry_run \
        else ["tests/unit"]
    workers = []
    if not dry_run and importlib.util.find_spec("xdist") is not None:
        workers = ["-n", "4"]
    return [Step("golden", [*pytest, f"--junitxml={log_dir / 'golden.xml'}",
                            "tests/distributed/test_golden_megatron.py"], 4,
                 300 if dry_run else 330, golden_env),
            Step("unit", [*pytest, *workers, f"--junitxml={log_dir / 'unit.xml'}", *unit], 4,
                 120 if dry_run else 330)]


def run_steps(steps: list[Step], log_dir: Path, cores: int, deadline: float) -> list[Step]:
    """Run ``steps`` in order, as many at once as their processes fit ``cores``, each under
    its limit (cut to the deadline); returns the steps not started before the deadline."""
    pending, running = list(steps), {}
    while pending or running:
        for step, (process, mark, started) in list(running.items()):
            over = time.monotonic() - started > step.limit_s
            if process.poll() is None and not over:
                continue
            if process.poll() is None:
                step.timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            kill_marked(MARK, mark)
            step.returncode, step.wall_s = process.returncode, time.monotonic() - started
            del running[step]
        busy = sum(step.procs for step in running)
        while pending and time.monotonic() < deadline \
                and (not running or busy + pending[0].procs <= cores):
            step = pending.pop(0)
            step.limit_s = min(step.limit_s, deadline - time.monotonic())
            mark = uuid.uuid4().hex
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")])),
                       **step.env, **{MARK: mark})
            with open(log_dir / step.log, "w") as out:
                process = subprocess.Popen(step.command, cwd=ROOT, env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            running[step] = (process, mark, time.monotonic())
            busy += step.procs
        if pending and time.monotonic() >= deadline and not running:
            break
        time.sleep(0.5)
    return pending


def judge(steps: list[Step], not_started: list[Step], log_dir: Path,
          dry_run: bool) -> list[verdicts.Verdict]:
    result = []
    logs = {step.name: (log_dir / step.log).read_text(errors="replace")
            for step in steps if step not in not_started}
    for step in steps:
        if step in not_started:
            result.append(verdicts.Verdict("SKIP", f"step/{step.name}",
                                           "not started within the check's time limit"))
        elif step.timed_out:
            result.append(verdicts.Verdict("FAIL", f"step/{step.name}",
                                           f"stopped at its limit of {step.limit_s:.0f} s"))
    for name, judge_xml in (("golden", verdicts.golden), ("unit", verdicts.unit)):
        xml = log_dir / f"{name}.xml"
        if name in logs and xml.exists():
            result += judge_xml(xml.read_text())
        elif name in logs:
            result.append(verdicts.Verdict("FAIL", f"step/{name}",
                                           f"no test report (log: {log_dir / (name + '.log')})"))
    for step in steps:
        if step.train is None or step.name not in logs:
            continue
        schedule, pp, dtype = step.train
        key = f"train/{schedule}/{pp}/{dtype}"
        fp32 = logs.get(f"train-{schedule}-{pp}-fp32")
        result.append(verdicts.training(key, logs[step.name], step.returncode, ITERATIONS,
                                        fp32, dtype.removesuffix("-te")))
    if dry_run:
        result += [verdicts.Verdict("SKIP", f"train/{schedule}/pp2/{dtype}",
                                    "dry run: the CPU trains fp32 only")
                   for schedule in ("1f1b", "elastic") for dtype in ("bf16", "fp16")]
    return result


def _commit() -> str:
    """``GPU_CHECK_COMMIT`` where given (a copy of the tree without its git directory), else
    git's short hash of HEAD, marked when tracked files have uncommitted changes."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + (" with uncommitted changes" if dirty else "")


def _device() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"CPU only (dry run), torch {torch.__version__}"
    return (f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--limit-s", type=float, default=510)
    parser.add_argument("--report")
    parser.add_argument("--log-dir")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device visible: run this on a GPU machine, or pass --dry-run",
              file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    commit, start = _commit(), time.monotonic()
    steps = [*test_steps(log_dir, args.dry_run), *training_steps(args.dry_run)]
    cores = os.cpu_count() or 2
    not_started = run_steps(steps, log_dir, cores, start + args.limit_s)
    result = judge(steps, not_started, log_dir, args.dry_run)
    text = verdicts.report(commit, _device(), result)
    default = (log_dir / "verdicts.txt" if args.dry_run else
               ROOT / "benchmarks/results/gpu" / f"verdicts_{commit.split()[0]}.txt")
    report = Path(args.report) if args.report else default
    report.write_text(text)
    print(text, end="")
    print(f"report: {report}; logs: {log_dir}; wall {time.monotonic() - start:.0f} s")
    return 1 if any(v.outcome == "FAIL" for v in result) else 0


if __name__ == "__main__":
    sys.exit(main())

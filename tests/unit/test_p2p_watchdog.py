"""Transfers on NCCL wait on the stream, never on the host, and the watchdog holds their
deadline (``megatron.plugin.pipeline.p2p`` and ``p2p_watchdog``); gloo's host waits are
tests/distributed/test_p2p_timeout.py's."""
import time

from megatron.plugin.pipeline import p2p
from megatron.plugin.pipeline.ir import parse
from megatron.plugin.pipeline.p2p_watchdog import TransferWatchdog


class FakeWork:
    """A work that records how it was waited for and completes when told."""

    def __init__(self):
        self.done = False
        self.waits = []

    def is_completed(self):
        return self.done

    def wait(self, *timeout):
        self.waits.append(timeout)
        return True


class FakeChannel:
    rank_label = "rank 1 (pipeline stage 1)"
    timeout_s = 0.05
    host_waits = False


def test_a_wait_on_nccl_hands_the_batch_to_the_watchdog_without_a_host_wait(monkeypatch):
    reports = []
    watchdog = TransferWatchdog(on_timeout=reports.append)
    monkeypatch.setattr(p2p, "WATCHDOG", watchdog)
    actions = [parse("1RECV_F3<0"), parse("1SEND_B2>2")]
    works = [FakeWork(), FakeWork()]
    p2p.Posted(FakeChannel(), actions, works, ops=[object(), object()]).wait()
    assert [w.waits for w in works] == [[()], [()]]  # the stream waits: no timeout argument
    assert watchdog.pending() == 1
    watchdog.check()
    assert reports == [] and watchdog.pending() == 1
    time.sleep(0.06)
    watchdog.check()
    assert len(reports) == 1 and watchdog.pending() == 0
    assert reports[0].startswith("rank 1 (pipeline stage 1): batch 1RECV_F3<0 1SEND_B2>2 "
                                 "(peer stages [0, 2]) did not complete within 0.")
    assert "--pipeline-timeout-s" in reports[0]


def test_completed_batches_are_dropped_and_never_reported():
    reports = []
    watchdog = TransferWatchdog(on_timeout=reports.append)
    finished, stuck = FakeWork(), FakeWork()
    watchdog.watch([finished], 0.0, lambda waited: "finished")
    watchdog.watch([stuck], 3600.0, lambda waited: "stuck")
    finished.done = True
    watchdog.check()
    assert reports == [] and watchdog.pending() == 1
    stuck.done = True
    watchdog.check()
    assert watchdog.pending() == 0


def test_the_watchdog_thread_reports_a_late_batch_by_itself():
    reports = []
    watchdog = TransferWatchdog(on_timeout=reports.append, poll_s=0.01)
    watchdog.watch([FakeWork()], 0.02, lambda waited: f"late after {waited:.2f}s")
    deadline = time.monotonic() + 5
    while not reports and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(reports) == 1 and reports[0].startswith("late after 0.0")

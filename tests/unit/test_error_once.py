"""An error many ranks hit is printed once, naming the ranks (``megatron.plugin.error_once``);
ranks are threads here, meeting in an in-process store with the agent store's interface."""
import threading
import time

import torch.distributed as dist

from megatron.plugin import error_once


def _report_from(ranks, messages, world_size, settle_s=5.0, store=None, finished=None):
    """Each of ``ranks`` reports its message of ``messages`` (one per rank, or one for all)
    at once; returns the lines written and the seconds it took. ``finished`` gets
    ``(time, event)`` pairs: each line written (after a slow write) and each rank's return."""
    store = dist.HashStore() if store is None else store
    lines, lock = [], threading.Lock()
    finished = [] if finished is None else finished

    def write(line):
        time.sleep(0.2)
        with lock:
            lines.append(line)
            finished.append((time.monotonic(), "written"))

    def rank_reports(rank):
        error_once.report(messages.get(rank, messages.get("*")), rank, world_size, store, write,
                          settle_s=settle_s, grace_s=5.0, poll_s=0.01)
        with lock:
            finished.append((time.monotonic(), "returned"))

    threads = [threading.Thread(target=rank_reports, args=(rank,)) for rank in ranks]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return lines, time.monotonic() - start


def test_an_error_of_every_rank_is_printed_once_without_waiting_out_the_settle_time():
    """No rank returns (and exits: torchrun would stop the others) before the line is out."""
    finished = []
    lines, took = _report_from(range(8), {"*": "--data-path x: x.bin not found"}, 8,
                               finished=finished)
    assert lines == ["error on all 8 ranks: --data-path x: x.bin not found"]
    assert took < 5.0
    assert [event for _, event in sorted(finished)] == ["written"] + ["returned"] * 8


def test_an_error_of_some_ranks_names_them_and_other_errors_get_lines_of_their_own():
    messages = {0: "no plan fits", 1: "no plan fits", 2: "no plan fits", 3: "no plan fits",
                6: "no plan fits", 7: "a corrupt shard"}
    lines, _ = _report_from(messages, messages, 8, settle_s=0.5)
    assert sorted(lines) == ["error on rank 7 of 8: a corrupt shard",
                             "error on ranks 0-3, 6 (5 of 8): no plan fits"]


def test_a_rank_that_reports_after_the_line_was_printed_prints_its_own():
    store = dist.HashStore()
    first, _ = _report_from([1], {"*": "boom"}, 4, settle_s=0.1, store=store)
    late, _ = _report_from([2], {"*": "boom"}, 4, settle_s=0.1, store=store)
    assert first == ["error on rank 1 of 4: boom"] and late == ["error on rank 2 of 4: boom"]


def test_without_a_store_or_peers_each_process_prints_its_own():
    lines = []
    error_once.report("boom", 3, 8, None, lines.append)
    error_once.report("boom", 0, 1, dist.HashStore(), lines.append)
    assert lines == ["error on rank 3 of 8: boom", "error: boom"]


def test_rank_ranges():
    assert error_once.ranks_text([5, 0, 1, 2, 9, 8], 16) == "ranks 0-2, 5, 8-9 (6 of 16)"
    assert error_once.ranks_text([0, 1], 2) == "all 2 ranks"
    assert error_once.ranks_text([4], 8) == "rank 4 of 8"

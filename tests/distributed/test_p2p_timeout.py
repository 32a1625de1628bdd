"""A receive that never arrives ends with an error naming rank, action and peer: no hang."""
from harness import torchrun


def test_missing_send_times_out_with_a_clear_error():
    result = torchrun(2, "tests/distributed/p2p_timeout_worker.py", [], timeout=120, check=False)
    assert result.returncode != 0
    assert ("TIMEOUT: pipeline rank 1: receive of 1RECV_F5<0 (peer stage 0) did not complete "
            "within") in result.stdout

"""Transfers travel on links: one two-rank group per ordered pair of a pipeline's stages."""
from harness import torchrun


def test_each_link_carries_one_direction_between_two_stages():
    result = torchrun(4, "tests/distributed/p2p_links_worker.py", [], timeout=180)
    assert all(f"LINKS OK rank {r}" in result.stdout for r in range(4))

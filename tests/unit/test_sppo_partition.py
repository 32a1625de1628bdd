"""SPPO subsequence partition: FLOPs balance under causal context, rounding, bad input."""
import pytest

from sppo_offload.partition import balanced_lengths, starts, subsequence_work

CASES = [(1 << 20, 16, 2.7e-7, 3.4e-12, 8), (131072, 7, 1e-6, 1e-11, 4),
         (100_000, 5, 1.0, 0.0, 1), (65536, 8, 0.0, 1.0, 8), (8192, 3, 1e-6, 1e-9, 2)]


@pytest.mark.parametrize("total,n,linear,quadratic,multiple", CASES)
def test_lengths_sum_round_and_shrink(total, n, linear, quadratic, multiple):
    lengths = balanced_lengths(total, n, linear, quadratic, multiple)
    assert len(lengths) == n and sum(lengths) == total
    assert all(length % multiple == 0 and length >= multiple for length in lengths)
    assert lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("total,n,linear,quadratic,multiple", CASES)
def test_work_is_balanced_within_the_rounding(total, n, linear, quadratic, multiple):
    lengths = balanced_lengths(total, n, linear, quadratic, multiple)
    work = [subsequence_work(s, c, linear, quadratic) for s, c in zip(lengths, starts(lengths))]
    mean = sum(work) / n
    slack = subsequence_work(2 * multiple, total - 2 * multiple, linear, quadratic)
    assert max(abs(w - mean) for w in work) <= slack
    equal = [total // n] * n
    equal_work = [subsequence_work(s, c, linear, quadratic) for s, c in zip(equal, starts(equal))]
    if quadratic > 0:
        assert max(work) - min(work) < max(equal_work) - min(equal_work)


def test_linear_cost_gives_equal_lengths():
    assert balanced_lengths(4096, 4, 1.0, 0.0, 8) == [1024] * 4


@pytest.mark.parametrize("args,message", [
    ((1024, 0, 1.0, 1.0), "must be >= 1"),
    ((1001, 4, 1.0, 1.0, 8), "pad it to 1008 tokens"),
    ((64, 9, 1.0, 1.0, 8), "use at most 8 subsequences"),
    ((64, 2, -1.0, 1.0), "non-negative"),
    ((64, 2, 0.0, 0.0), "not both zero"),
    ((64, 2, 1.0, 1.0, 0), "multiple must be >= 1"),
])
def test_bad_input_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        balanced_lengths(*args)

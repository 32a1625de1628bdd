"""The GitHub-like length mixture against the InfiniPipe paper's statistics of its GitHub data,
and how far its tail reaches against an independent power-law oracle with the same figures."""
import numpy as np
import pytest

from elastic_pipe.workloads import github_like, lognormal, lognormal_for, sample, truncate

DRAWS = 400_000


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return np.array(github_like(DRAWS, seed=7))


def test_the_papers_three_statistics(lengths):
    """91.5% of documents at most 8K tokens, 0.6% over 64K holding 21.6% of the tokens."""
    assert (lengths <= 8192).mean() == pytest.approx(0.915, abs=0.01)
    assert (lengths > 65536).mean() == pytest.approx(0.006, abs=0.0008)
    assert lengths[lengths > 65536].sum() / lengths.sum() == pytest.approx(0.216, abs=0.02)


def test_the_tail_past_192k_is_what_the_statistics_imply(lengths):
    """Oracle: a Pareto tail above 64K with the mixture's mass and mean there has exponent
    a = mean / (mean - 64K), and puts mass x 3^-a over 192K. The mixture's own share agrees
    within a quarter; a 512-document batch then reaches 192K in about one batch of four."""
    long = lengths[lengths > 65536]
    mass, mean = len(long) / len(lengths), long.mean()
    exponent = mean / (mean - 65536)
    oracle = mass * 3.0 ** -exponent
    share = (lengths > 196608).mean()
    assert share == pytest.approx(oracle, rel=0.25)
    assert 1 - (1 - share) ** 512 == pytest.approx(0.26, abs=0.08)


def test_sampling_and_truncation():
    drawn = sample([5, 70000, 300], 4, seed=0)
    assert len(drawn) == 4 and set(drawn) <= {5, 70000, 300}
    cut, count = truncate([10, 70000, 65536], 65536)
    assert cut == [10, 65536, 65536] and count == 1
    with pytest.raises(ValueError, match="global batch size"):
        sample([1], 0, seed=0)


def test_lognormal_draws_as_megatron_lms_mock_dataset():
    lengths = lognormal(4000, 0)
    assert min(lengths) == 128 and max(lengths) == 8192  # clipped to NVIDIA's 128-8192
    wide = lognormal(200000, 1, mean=1000.0, sigma=0.5, least=1, most=10 ** 9)
    assert abs(sum(wide) / len(wide) - 1000.0) < 10.0  # mu = log(mean) - sigma^2 / 2
    assert lognormal(10, 2) == lognormal(10, 2)
    assert max(lognormal_for(65536)(4000, 0)) == 65536

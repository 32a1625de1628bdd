"""Document-length workloads: files, Megatron datasets, sampling, and a GitHub-like generator."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

GITHUB_MIXTURE = ((0.85, 500.0, 1.2), (0.15, 8000.0, 1.2))
"""(weight, median tokens, log-space sigma) of the two log-normal components. Fitted to the
InfiniPipe paper's GitHub figures: the mixture has 91.8% of documents at most 8K tokens (paper
91.5%), 0.60% over 64K (0.6%), and those hold 21.5% of the tokens (21.6%); mean 3.3K tokens.

How far the tail reaches follows from those figures, not from the log-normal shape: documents
over 64K make up 0.6% and hold 21.6% of 3.3K-token-mean data, so they average about 120K
tokens; a power-law tail with that mass and mean (exponent 2.2) puts 0.055% of documents over
192K, the mixture 0.059%. A batch of 512 documents therefore holds one over 192K about a
quarter of the time (over 96K three times in four, over 48K nearly always): a 192K context is
rarely filled by this data, the paper's GitHub included. The benchmarks report each batch's
longest document for that reason (``tests/unit/test_workloads.py`` checks both figures)."""


def read_lengths(path: str) -> list[int]:
    """One integer a line (``.gz`` allowed); blank lines skipped; bad lines raise ValueError."""
    opener = gzip.open if str(path).endswith(".gz") else open
    if not Path(path).is_file():
        raise ValueError(f"lengths file {path!r} does not exist")
    lengths = []
    with opener(path, "rt") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    lengths.append(int(line))
                except ValueError:
                    raise ValueError(f"{path}:{number}: {line.strip()!r} is not an integer "
                                     f"length") from None
    return lengths


def dataset_lengths(prefix: str) -> list[int]:
    """Document lengths of a Megatron ``.bin/.idx`` dataset (megatron-core, imported lazily).

    ``IndexedDataset.sequence_lengths`` is a view into the index's memory map, which the
    dataset unmaps when it is freed: the lengths are copied out while it is alive."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    missing = [prefix + suffix for suffix in (".idx", ".bin")
               if not Path(prefix + suffix).is_file()]
    if missing:
        raise ValueError(f"--data-path {prefix}: {' and '.join(missing)} not found; give a "
                         f"Megatron dataset's prefix, without .bin/.idx")
    try:
        dataset = IndexedDataset(prefix)
    except (AssertionError, ValueError, struct.error) as error:
        raise ValueError(f"--data-path {prefix}: {prefix}.idx cannot be read ({error}): it is "
                         f"damaged or not a Megatron index") from None
    return dataset.sequence_lengths.tolist()


def sample(lengths: list[int], count: int, seed: int) -> list[int]:
    """``count`` lengths drawn without replacement (with, if the file is smaller), seeded."""
    if count < 1:
        raise ValueError(f"global batch size must be >= 1, got {count}")
    if not lengths:
        raise ValueError("no document lengths to sample from")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(lengths), size=count, replace=count > len(lengths))
    return [lengths[i] for i in picks]


def truncate(lengths: list[int], context: int) -> tuple[list[int], int]:
    """Lengths cut to ``context`` and how many were cut."""
    if context < 1:
        raise ValueError(f"seq-length must be >= 1, got {context}")
    return [min(n, context) for n in lengths], sum(n > context for n in lengths)


def github_like(count: int, seed: int) -> list[int]:
    """``count`` lengths from :data:`GITHUB_MIXTURE` (at least 1 token each), seeded."""
    rng = np.random.default_rng(seed)
    weights = [w for w, _, _ in GITHUB_MIXTURE]
    component = rng.choice(len(GITHUB_MIXTURE), size=count, p=weights)
    medians = np.array([m for _, m, _ in GITHUB_MIXTURE])[component]
    sigmas = np.array([s for _, _, s in GITHUB_MIXTURE])[component]
    values = medians * np.exp(sigmas * rng.standard_normal(count))
    return [max(1, int(v)) for v in values]


NVIDIA_LOGNORMAL = (1024, 1.5, 128, 8192)
"""(mean, log-space sigma, least, most) tokens of the lognormal lengths of NVIDIA's dynamic
context parallelism example (Megatron-LM dev, ``examples/dynamic_context_parallel``: its
``VARLEN_DATASET_JSON``)."""


def lognormal(count: int, seed: int, mean: float = NVIDIA_LOGNORMAL[0],
              sigma: float = NVIDIA_LOGNORMAL[1], least: int = NVIDIA_LOGNORMAL[2],
              most: int = NVIDIA_LOGNORMAL[3]) -> list[int]:
    """``count`` lengths drawn as Megatron-LM's mock variable-length dataset draws them
    (``MockSFTLowLevelDataset``): log-normal with ``mu = log(mean) - sigma^2 / 2`` (so that
    the unclipped mean is ``mean``), clipped to ``[least, most]`` and truncated to integers;
    seeded. Defaults: :data:`NVIDIA_LOGNORMAL`."""
    if not 1 <= least <= most:
        raise ValueError(f"lognormal lengths need 1 <= least <= most, got {least}, {most}")
    rng = np.random.default_rng(seed)
    values = np.exp(np.log(mean) - sigma ** 2 / 2 + sigma * rng.standard_normal(count))
    return [int(v) for v in np.clip(values, least, most)]


def lognormal_for(context: int):
    """NVIDIA's lognormal scaled to ``context``: the same shape (mean an eighth of the most,
    sigma 1.5, least 128), the most ``context``: ``generate(count, seed)`` -> lengths."""
    mean, sigma, least, most = NVIDIA_LOGNORMAL
    return lambda count, seed: lognormal(count, seed, mean * context / most, sigma, least,
                                         context)


WORKLOADS = {"github-like": github_like, "lognormal": lognormal}
"""Generated workloads by name: ``generate(count, seed)`` -> lengths."""

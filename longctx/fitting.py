"""Exact non-negative least squares for the cost model's few coefficients (numpy only).

Shared by ``scripts/profile_costs.py`` (fitting eq. 1 to a measured grid) and
:mod:`elastic_pipe.refit` (refitting it to a training run's measured actions).
"""
from __future__ import annotations

import itertools

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares ``min |a x - b|, x >= 0`` for a few columns.

    Enumerates the 2^n supports of the n columns: the constrained optimum equals the
    unconstrained optimum on its own support, so the best feasible subset solution is it.
    Columns are scaled to unit norm for conditioning.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n = a.shape[1]
    if n > 12:
        raise ValueError("nnls enumerates supports; use it for a few columns only")
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms
    best, best_residual = np.zeros(n), float(np.dot(b, b))
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(scaled[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(n)
            x[cols] = sol
            residual = float(np.sum((scaled @ x - b) ** 2))
            if residual < best_residual:
                best, best_residual = x, residual
    return best / norms

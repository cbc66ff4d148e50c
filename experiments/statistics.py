"""Percentile bootstrap intervals over prompts, the experiments' statistics: of a mean, of any
statistic of paired per-prompt columns (a ratio of means), and of a paired difference."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def bootstrap_ci(
    values: Sequence[float] | np.ndarray, *, num: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap of the mean over the given units (prompts)."""
    x = np.asarray(values, np.float64)
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (num, len(x)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(x.mean()), float(lo), float(hi)


def bootstrap_statistic(columns: Sequence[np.ndarray], statistic: Callable[..., np.ndarray], *, num: int = 2000,
                        level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(value, low, high) of ``statistic`` over paired per-prompt columns, resampling prompts.

    Args:
      columns: arrays [prompts] over the same prompts in the same order.
      statistic: maps the columns, each [..., prompts], to [...] (vectorized over resamples), e.g.
        a ratio of means ``lambda a, b: a.mean(-1) / b.mean(-1)``.

    NaN resamples (a statistic undefined there) are left out of the interval.
    """
    cols = [np.asarray(c, np.float64) for c in columns]
    if len({c.shape for c in cols}) != 1:
        raise ValueError(f"paired columns need the same prompts: shapes {[c.shape for c in cols]}")
    if cols[0].size == 0:
        return float("nan"), float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, len(cols[0]), (num, len(cols[0])))
    values = np.asarray(statistic(*(c[idx] for c in cols)), np.float64)
    values = values[np.isfinite(values)]
    value = float(statistic(*cols))
    if not len(values):
        return value, float("nan"), float("nan")
    lo, hi = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    return value, float(lo), float(hi)


def paired_bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    baseline: Sequence[float] | np.ndarray,
    *,
    num: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(mean, low, high) of the per-prompt difference ``values - baseline`` (both [prompts],
    the same prompts in the same order), resampling prompts."""
    a, b = np.asarray(values, np.float64), np.asarray(baseline, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same prompts: shapes {a.shape} and {b.shape}")
    return bootstrap_ci(a - b, num=num, level=level, seed=seed)

"""Two-sample statistics the harness judges sampled (T > 0) cases with: a chi-square test of two
samples of small integers (accepted lengths, rounds per request), and the smallest planted bias
it detects, so a pass states its power. scipy is imported on first use."""

from __future__ import annotations

import functools

import numpy as np

POWER = 0.9
MIN_EXPECTED = 5.0


@functools.cache
def _scipy():
    import scipy.stats

    return scipy.stats


def power(P: np.ndarray, N: int, delta: float, alpha: float) -> float:
    """Power of a chi-square over bins P against the planted bias P' = (1 - delta) P + delta e_c:
    a share delta of the samples fall on the most likely bin c instead of their own (c is the
    least visible choice: lambda = N delta^2 (1 - P_c) / P_c is smallest for the largest P_c)."""
    df = len(P) - 1
    if df < 1:
        return 0.0
    pc = float(np.max(P))
    lam = N * delta ** 2 * (1 - pc) / pc
    return float(_scipy().ncx2.sf(_scipy().chi2.isf(alpha, df), df, lam))


def detectable(P: np.ndarray, N: int, alpha: float, target: float = POWER) -> float:
    """Smallest planted bias delta (see `power`) detected with probability >= target."""
    if power(P, N, 1.0, alpha) < target:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(P, N, mid, alpha) < target else (lo, mid)
    return hi


def two_sample(a: np.ndarray, b: np.ndarray, alpha: float) -> dict:
    """Two-sample chi-square (2 x K contingency) of two samples of small non-negative integers;
    neighbouring values are merged until every column expects >= MIN_EXPECTED per row. Its
    `power_delta`: the smallest planted bias (see `power`) detected at `alpha`."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    K = int(max(a.max(), b.max())) + 1
    table = np.stack([np.bincount(a, minlength=K), np.bincount(b, minlength=K)]).astype(np.float64)
    cols, acc = [], np.zeros(2)
    for j in range(K):
        acc = acc + table[:, j]
        exp = acc.sum() * table.sum(axis=1) / table.sum()
        if exp.min() >= MIN_EXPECTED:
            cols.append(acc)
            acc = np.zeros(2)
    if acc.sum() > 0:
        if cols:
            cols[-1] = cols[-1] + acc
        else:
            cols.append(acc)
    t = np.stack(cols, axis=1)
    if t.shape[1] < 2:
        return {"p": 1.0, "df": 0, "table": t, "power_delta": float("inf")}
    _, p, df, _ = _scipy().chi2_contingency(t, correction=False)
    pooled = t.sum(axis=0) / t.sum()
    n_eff = t[0].sum() * t[1].sum() / t.sum()
    return {"p": float(p), "df": int(df), "table": t, "power_delta": detectable(pooled, int(n_eff), alpha)}

"""The statistics of the T > 0 tests (tests/test_sampling_*.py; a helper module: no tests here).

Claim: for every source and acceptance mode, the tokens speculative decoding emits have exactly
the target's own sampling distribution (same sampler, same logits processors). Tested by
chi-square goodness of fit of N independent streams against the EXACT distribution, enumerated
from the target's own conditionals (an uncached batched forward over every prefix, through the
same Sampler and processors; no sampling noise on the reference side, so the test is a
one-sample test, the "exact multinomial" form of the two-sample one).

Statistics (stated once, used everywhere):
- Each distribution tested (the whole short sequence, and each position's marginal) is one
  chi-square test. Cells are binned in index order so every bin expects >= max(5, N/40)
  samples (<= ~40 bins); a stream on a cell of exact probability 0 (e.g. a banned token) fails
  the test outright.
- End to end also the PIT test: every emitted token's randomized probability integral
  transform in its own exact conditional (tokens ordered by descending probability), N x n
  values that are i.i.d. U(0, 1) under the claim (Rosenblatt), chi-square on PIT_BINS = 20
  equiprobable bins. It pools every position and context coherently (a bug that moves mass
  toward, or away from, each context's likely tokens adds up across contexts), where the
  binned sequence test merges contexts once they are many.
- False-alarm rate: each test is held to ALPHA = 5e-6 = 1e-3 / 200, a Bonferroni bound over at
  most 200 tests in tests/test_sampling_*.py (counted by tests/test_sampling_stats.py: 158 now), so a correct implementation fails a
  full run by chance with probability <= 1e-3. The seeds are fixed, so a run is reproducible.
- Power: every lossless test computes, from its own exact distribution and N, the smallest
  planted bias it detects with probability >= 0.9 at ALPHA. The planted bias: a share delta of
  the requests emits the most likely bin instead of its own sample, P' = (1 - delta) P +
  delta e_c (of all single-outcome biases the least visible to chi-square); power from the
  noncentral chi-square with lambda = N delta^2 (1 - P_c) / P_c. For the PIT test: a share
  delta of the emitted tokens is replaced by the most likely token of its conditional (bin
  probabilities averaged over the observed conditionals). The noncentral approximation is
  checked by simulation (the PIT test's true power at its claimed 0.9: 0.88). The tests print
  it and assert a bound: <= 2 % on the chain; end to end <= 5 % for the PIT test and <= 8 % for
  the sequence and per-position tests (the first token, a single conditional drawn before any
  draft, is the weakest: ~7.5 %; the sequence and drafted positions of the agreeing pair ~4 %).
- Negative controls (planted bugs, spec_parity/controls/sampling.py) must be REJECTED by the same tests at
  the same ALPHA.
- Parity with the references' own sampled loops (the pairs' `sampled` cases, judged by the
  harness): spec_parity.stats.two_sample, the two-sample chi-square, at the level of that family.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from spec_parity import stats as _stats


@functools.cache
def scipy_stats():
    """scipy.stats on first use: its import takes ~1 s, paid by each xdist worker that collects this
    file, and the dev loop's tests here mostly do not need it."""
    return pytest.importorskip("scipy.stats", reason="pip install scipy (the dev extra)")


ALPHA_FAMILY = 1e-3
MAX_TESTS = 200
ALPHA = ALPHA_FAMILY / MAX_TESTS
POWER = _stats.POWER
PIT_BINS = 20
MIN_EXPECTED = _stats.MIN_EXPECTED
MAX_BINS = 40


def gof(samples: np.ndarray, probs: np.ndarray) -> dict:
    """Chi-square goodness of fit of integer samples (cell ids) to exact cell probabilities.

    Cells are binned in index order (neighbouring tokens / sequences sharing a prefix) so that
    every bin expects >= max(MIN_EXPECTED, N / MAX_BINS) samples (at most ~MAX_BINS bins: many
    bins dilute a concentrated bias over many degrees of freedom); a cell expecting that much
    alone is its own bin. (One pool of all the small cells would hide a bias concentrated on one
    rare cell.) A sample on a cell of probability 0 fails the test outright (p = 0)."""
    N = len(samples)
    least = max(MIN_EXPECTED, N / MAX_BINS)
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    possible = probs > 1e-12
    impossible = int(counts[~possible].sum())
    ids = np.flatnonzero(possible)
    expected = probs[ids] * N
    bins = np.empty(len(ids), np.int64)
    b, acc = 0, 0.0
    for j, e in enumerate(expected.tolist()):
        if acc > 0 and e >= least:              # a large cell: close the small ones before it
            b, acc = b + 1, 0.0
        bins[j] = b
        acc += e
        if acc >= least:
            b, acc = b + 1, 0.0
    if acc > 0 and b > 0:                      # a short last bin joins the one before
        bins[bins == b] = b - 1
    P = np.bincount(bins, weights=probs[ids])
    obs = np.bincount(bins, weights=counts[ids])
    P, obs = P[P > 0], obs[P > 0]
    df = len(P) - 1
    stat = float(((obs - N * P) ** 2 / (N * P)).sum()) if df > 0 else 0.0
    pvalue = 0.0 if impossible else (float(scipy_stats().chi2.sf(stat, df)) if df > 0 else 1.0)
    return {"N": N, "cells": len(P), "df": df, "stat": stat, "p": pvalue, "impossible": impossible,
            "P": P}


def power(P: np.ndarray, N: int, delta: float, alpha: float = ALPHA) -> float:
    """spec_parity.stats.power at this family's ALPHA by default."""
    return _stats.power(P, N, delta, alpha)


def detectable(P: np.ndarray, N: int, alpha: float = ALPHA, target: float = POWER) -> float:
    """spec_parity.stats.detectable at this family's ALPHA by default."""
    return _stats.detectable(P, N, alpha, target)


def pit(seqs: np.ndarray, conds: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Randomized probability integral transform of each emitted token in its own exact
    conditional: seqs [N, n], conds [N, n, V] (the target's distribution of token j given the
    prompt and tokens < j). Tokens are ordered by descending probability (ties by id), so
    u = P(tokens before t) + U * P(t), U ~ U(0, 1) from `seed`. Under the claim the N * n values
    are i.i.d. U(0, 1) (Rosenblatt: each u_j is uniform given everything before it).
    Returns u, the conditionals' largest probability (for the power) and the count of tokens on
    zero-probability cells."""
    order = np.argsort(-conds, axis=-1, kind="stable")
    ranked = np.take_along_axis(conds, order, axis=-1)
    before = np.cumsum(ranked, axis=-1) - ranked
    rank = np.argmax(order == seqs[..., None], axis=-1)
    p = np.take_along_axis(conds, seqs[..., None], axis=-1)[..., 0]
    u = np.take_along_axis(before, rank[..., None], axis=-1)[..., 0] + np.random.default_rng(seed).random(seqs.shape) * p
    return u, ranked[..., 0], int((p <= 1e-12).sum())


def pit_gof(u: np.ndarray, pmax: np.ndarray, impossible: int = 0) -> dict:
    """Chi-square of the PIT values on PIT_BINS equiprobable bins (a sample on a zero-probability
    cell fails outright). `pmax` feeds `pit_power`."""
    u = u.reshape(-1)
    N, B = len(u), PIT_BINS
    obs = np.bincount(np.minimum((u * B).astype(np.int64), B - 1), minlength=B)
    stat = float(((obs - N / B) ** 2 / (N / B)).sum())
    pvalue = 0.0 if impossible else float(scipy_stats().chi2.sf(stat, B - 1))
    return {"N": N, "cells": B, "df": B - 1, "stat": stat, "p": pvalue, "impossible": impossible,
            "pmax": pmax.reshape(-1)}


def pit_power(pmax: np.ndarray, N: int, delta: float, alpha: float = ALPHA) -> float:
    """Power of `pit_gof` against the planted bias: a share delta of the emitted tokens is
    replaced by the most likely token of its conditional (its u then lies in [0, pmax)). Bin
    probabilities under the bias averaged over the observed conditionals (first order in delta:
    the bias also moves later contexts), noncentral chi-square with lambda = N sum (P'_b - 1/B)^2 B."""
    B = PIT_BINS
    edges = np.linspace(0.0, 1.0, B + 1)
    pm = np.maximum(pmax.reshape(-1, 1), 1e-12)
    inside = np.clip(np.minimum(edges[1:], pm) - edges[:-1], 0.0, None) / pm
    P = (1 - delta) / B + delta * inside.mean(axis=0)
    lam = N * float(((P - 1 / B) ** 2 * B).sum())
    return float(scipy_stats().ncx2.sf(scipy_stats().chi2.isf(alpha, B - 1), B - 1, lam))


def bias_detected(r: dict, alpha: float = ALPHA, target: float = POWER) -> float:
    """Smallest planted bias (see `power`, `pit_power`) the test r detects with probability >= target."""
    if "pmax" not in r:
        return detectable(r["P"], r["N"], alpha, target)
    lo, hi = 0.0, 1.0
    if pit_power(r["pmax"], r["N"], 1.0, alpha) < target:
        return float("inf")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pit_power(r["pmax"], r["N"], mid, alpha) < target else (lo, mid)
    return hi


def encode(seqs: np.ndarray, V: int) -> np.ndarray:
    """Sequences [N, n] -> cell ids in V**n (first token most significant)."""
    out = np.zeros(len(seqs), np.int64)
    for j in range(seqs.shape[1]):
        out = out * V + seqs[:, j]
    return out


def stat_tests(seqs: np.ndarray, joint: np.ndarray, V: int, conds: list[np.ndarray] | None = None,
               seed: int = 0) -> dict[str, dict]:
    """The whole sequence and each position's marginal, each against the exact distribution;
    with `conds` (conds[j] [V**j, V]: token j's conditional after each prefix of j tokens) also
    the PIT test of every emitted token in its own conditional."""
    n = seqs.shape[1]
    J = joint.reshape((V,) * n)
    out = {"sequence": gof(encode(seqs, V), joint.reshape(-1))}
    for j in range(n):
        marg = J.sum(axis=tuple(i for i in range(n) if i != j))
        out[f"token{j + 1}"] = gof(seqs[:, j], marg)
    if conds is not None:
        rows = np.stack([conds[j][encode(seqs[:, :j], V)] for j in range(n)], axis=1)   # [N, n, V]
        out["pit"] = pit_gof(*pit(seqs, rows, seed))
    return out


def assert_lossless(results: dict[str, dict], max_bias: dict[str, float] | None, label: str) -> None:
    """Every test accepts at ALPHA; with max_bias ({"pit": bound, "*": bound of the others}),
    each must also detect its planted bias (see `power`, `pit_power`) of that size at power
    POWER (else N is too small for the claim)."""
    lines, worst = [], {}
    for name, r in results.items():
        bias = bias_detected(r)
        kind = "pit" if "pmax" in r else "*"
        worst[kind] = max(worst.get(kind, 0.0), bias)
        lines.append(f"{label} {name}: N={r['N']} cells={r['cells']} chi2={r['stat']:.1f} p={r['p']:.3g} "
                     f"detects {bias:.4f} at power {POWER}")
        assert r["impossible"] == 0, f"{label} {name}: {r['impossible']} streams on zero-probability cells"
        assert r["p"] >= ALPHA, f"{label} {name}: p={r['p']:.3g} < {ALPHA} (chi2 {r['stat']:.1f}, df {r['df']})"
    print("\n".join(lines))
    for kind, bias in worst.items():
        bound = None if max_bias is None else max_bias[kind]
        assert bound is None or bias <= bound, f"{label}: too few samples, detectable bias {bias:.4f} > {bound} ({kind})"


def assert_rejected(results: dict[str, dict], label: str) -> None:
    worst = min(r["p"] for r in results.values())
    print(f"{label}: min p = {worst:.3g} " + " ".join(f"{k}:{r['p']:.2g}" for k, r in results.items()))
    assert worst < ALPHA, f"negative control {label} was not rejected: min p = {worst:.3g} >= {ALPHA}"


two_sample = _stats.two_sample

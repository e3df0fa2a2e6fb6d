"""Sampling at T > 0 (port/sampling.py, port/serve.py): statistical losslessness.

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
  most 200 tests in this file (counted by a test: 158 now), so a correct implementation fails a
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
- Negative controls (planted bugs, port/sampling.py BUGS) must be REJECTED by the same tests at
  the same ALPHA.

Three layers:
1. The acceptance rules themselves (`sampling.accept_match` / `accept_rejection`, the functions
   the loop calls, with a batch axis) driving 2 x 10^5 independent streams at once over a small
   Markov-chain "target" and "drafter" (vocab 8, gamma 2, first 4 tokens): well under a second
   per test. All three controls are rejected here.
2. End to end through `port.serve.generate` on tiny Gemma-4 targets (vocab 64 agreeing pair,
   vocab 16 random pair, see `_setup_kinds`), with the assistant, DSpark, DFlash and
   DSpark-on-DFlash sources in both modes: 2500 requests (one seed each) per test, marked slow;
   cheap smoke versions (200 requests) in the default set. The controls run where their bug
   moves the output (`CONTROLS`).
3. Parity at T > 0 with the references (oracle, slow): acceptance / tau distributions of our
   loop vs DeepSpec's rejection-sampling loop and vs optiq's sampled token-match loop, by
   two-sample chi-square in their own family (ALPHA_PARITY), and optiq's reference delta at
   T > 0 (it samples the logits without the final softcap).
"""

from __future__ import annotations

import functools
import time
import zlib

import mlx.core as mx
import numpy as np
import pytest

from port import assistant, dflash, dspark, sampling, serve, targets
from spec_parity import checkpoints, harness


@functools.cache
def scipy_stats():
    """scipy.stats on first use: its import takes ~1 s, paid by each xdist worker that collects this
    file, and the dev loop's tests here mostly do not need it."""
    return pytest.importorskip("scipy.stats", reason="pip install scipy (the dev extra)")


ALPHA_FAMILY = 1e-3
MAX_TESTS = 200
ALPHA = ALPHA_FAMILY / MAX_TESTS
POWER = 0.9
PIT_BINS = 20
MIN_EXPECTED = 5.0
MAX_BINS = 40


# ---------------------------------------------------------------------------------------------
# the test statistic


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
    """Power of `gof` (bins P) against the planted bias P' = (1 - delta) P + delta e_c: a share
    delta of the requests emit the most likely bin c instead of their own sample (c is the least
    visible choice: lambda = N delta^2 (1 - P_c) / P_c is smallest for the largest P_c)."""
    df = len(P) - 1
    if df < 1:
        return 0.0
    pc = float(np.max(P))
    lam = N * delta ** 2 * (1 - pc) / pc
    return float(scipy_stats().ncx2.sf(scipy_stats().chi2.isf(alpha, df), df, lam))


def detectable(P: np.ndarray, N: int, alpha: float = ALPHA, target: float = POWER) -> float:
    """Smallest planted bias delta (see `power`) detected with probability >= target."""
    if power(P, N, 1.0, alpha) < target:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(P, N, mid, alpha) < target else (lo, mid)
    return hi


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


def test_the_lossless_tests_fit_their_bonferroni_family():
    """ALPHA is the family rate over MAX_TESTS: count the tests that can raise a false alarm."""
    n = {name: _setup_kinds(name)["n"] for name in ("agreeing", "random")}
    per = lambda setup_name: n[setup_name] + 2   # noqa: E731  sequence, n positions, PIT
    # the two self-tests' null draws, the chain, the slow end-to-end cases, the smoke and ban ones
    count = (2 + len(CHAIN_CASES) * (CHAIN["n"] + 1) + sum(per(c[0]) for c in E2E_CASES)
             + (len(SOURCES) + len(BAN_CASES)) * per("agreeing"))
    assert count <= MAX_TESTS, f"{count} lossless tests > MAX_TESTS {MAX_TESTS}: ALPHA no longer bounds the family"


def test_statistics_detect_a_planted_bias_and_hold_their_false_alarm_rate():
    """The test itself, on exact multinomial draws: it rejects the planted bias at the power it
    claims and keeps its false-alarm rate."""
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.full(40, 0.5))
    N = 4000
    r = gof(rng.choice(len(P), N, p=P), P)
    assert r["p"] >= ALPHA
    delta = detectable(r["P"], N)
    assert 0.01 < delta < 0.1, delta
    planted = (1 - delta) * P
    planted[np.argmax(P)] += delta
    rejected = np.mean([gof(rng.choice(len(P), N, p=planted), P)["p"] < ALPHA for _ in range(200)])
    assert rejected >= 0.85, rejected            # claimed 0.9; 200 draws (sd 0.02)
    # false alarms at a loose level, 500 null draws: the rate is the nominal one
    alarms = np.mean([gof(rng.choice(len(P), 2000, p=P), P)["p"] < 0.05 for _ in range(500)])
    assert 0.02 <= alarms <= 0.09, alarms


@pytest.mark.slow
def test_pit_detects_its_planted_bias_and_holds_its_false_alarm_rate():
    """The PIT test on exact draws from arbitrary conditionals: it rejects its planted bias (a
    share delta of the tokens replaced by their conditional's most likely one) at the power it
    claims, and keeps its false-alarm rate."""
    rng = np.random.default_rng(2)
    V, n, N = 12, 3, 1000
    conds = rng.dirichlet(np.full(V, 0.7), size=(N, n))

    def draw(delta: float) -> np.ndarray:
        t = np.minimum((rng.random((N, n))[..., None] > conds.cumsum(axis=-1)).sum(axis=-1), V - 1)
        return np.where(rng.random((N, n)) < delta, conds.argmax(axis=-1), t)

    r = pit_gof(*pit(draw(0.0), conds, 1))
    assert r["p"] >= ALPHA
    delta = bias_detected(r)
    assert 0.01 < delta < 0.25, delta
    rejected = np.mean([pit_gof(*pit(draw(delta), conds, s))["p"] < ALPHA for s in range(600)])
    assert rejected >= 0.85, rejected            # claimed 0.9; 600 draws (sd 0.012)
    alarms = np.mean([pit_gof(*pit(draw(0.0), conds, s))["p"] < 0.05 for s in range(400)])
    assert 0.02 <= alarms <= 0.09, alarms


# ---------------------------------------------------------------------------------------------
# 1. the acceptance rules on a Markov-chain target, many streams at once


def chain_logits(V: int, seed: int, agree: float) -> tuple[np.ndarray, np.ndarray]:
    """Target logits row c -> the token after c; the drafter's logits share `agree` of them."""
    rng = np.random.default_rng(seed)
    lp = rng.standard_normal((V, V)) * 1.5
    lq = agree * lp + (1 - agree) * rng.standard_normal((V, V)) * 1.5
    return lp.astype(np.float32), lq.astype(np.float32)


def chain_exact(lp: np.ndarray, sampler: sampling.Sampler, start: int, n: int,
                processors=()) -> np.ndarray:
    """Exact distribution of the first n tokens of plain sampling from the chain [V**n]."""
    V = lp.shape[0]
    rows = mx.array(lp)
    if processors:
        rows = mx.stack([sampling.process(processors, mx.array([start, c], mx.int32), rows[c]) for c in range(V)])
    P = np.array(sampler.probs(rows), np.float64)
    joint = P[start]
    for _ in range(n - 1):
        joint = (joint[..., None] * P.reshape((1,) * (joint.ndim - 1) + (V, V)))
    return joint.reshape(-1)


def simulate(lp: np.ndarray, lq: np.ndarray, start: int, n: int, B: int, sampler: sampling.Sampler, mode: str,
             gamma: int, seed: int, bugs=frozenset(), draft_sampler=None, bonus: bool = True) -> np.ndarray:
    """B independent speculative-decoding streams over the chain, through the loop's own
    acceptance functions and samplers; returns the first n emitted tokens of each [B, n]."""
    keys = sampling.Keys(seed)
    P = sampling.verify_sampler(sampler, frozenset(bugs)).probs(mx.array(lp))     # verify rows
    Q = sampling.drafting_sampler(sampler, mode, draft_sampler).probs(mx.array(lq))
    first = sampler.probs(mx.array(lp[start]))
    cur = sampling.sample(mx.broadcast_to(first, (B, lp.shape[0])), keys.uniform((B,)))
    out = np.full((B, n), -1, np.int64)
    out[:, 0] = np.array(cur)
    count = np.ones(B, np.int64)
    rows = np.arange(B)
    while (count < n).any():
        prev, drafts, qs = cur, [], []
        for _ in range(gamma):
            q = Q[prev]
            d = sampling.sample(q, keys.uniform((B,)))
            drafts.append(d)
            qs.append(q)
            prev = d
        d = mx.stack(drafts, axis=1)
        q = mx.stack(qs, axis=1)
        p = P[mx.concatenate([cur[:, None], d], axis=1)]
        if mode == "match":
            k, nxt = sampling.accept_match(d, p, keys.uniform((B, gamma + 1)))
        else:
            k, nxt = sampling.accept_rejection(d, q, p, keys.uniform((B, gamma)), keys.uniform((B,)), frozenset(bugs))
        k, nxt, dn = np.array(k), np.array(nxt), np.array(d)
        full = k == gamma
        new = np.concatenate([dn, np.zeros((B, 1), np.int64)], axis=1)
        new[rows, k] = nxt
        drop = full & (not bonus)
        n_new = k + 1 - drop
        for j in range(gamma + 1):
            pos = count + j
            m = (j < n_new) & (pos < n)
            out[rows[m], pos[m]] = new[m, j]
        count += n_new
        cur = mx.array(np.where(drop, dn[:, -1], nxt).astype(np.int32))
    return out


CHAIN = {"V": 8, "start": 0, "n": 4, "gamma": 2, "B": 200_000}
CHAIN_MAX_BIAS = 0.02


@functools.cache
def _chain(agree: float = 0.6, seed: int = 0):
    return chain_logits(CHAIN["V"], seed, agree)


def _chain_tests(sampler, mode, seed, bugs=frozenset(), draft_sampler=None, bonus=True, agree=0.6, B=None):
    lp, lq = _chain(agree)
    seqs = simulate(lp, lq, CHAIN["start"], CHAIN["n"], B or CHAIN["B"], sampler, mode, CHAIN["gamma"], seed,
                    bugs, draft_sampler, bonus)
    return stat_tests(seqs, chain_exact(lp, sampler, CHAIN["start"], CHAIN["n"]), CHAIN["V"])


CHAIN_CASES = {
    "match-T1": (sampling.Sampler(1.0), "match", None),
    "match-T0.7-topk5": (sampling.Sampler(0.7, top_k=5), "match", None),
    "rejection-T1": (sampling.Sampler(1.0), "rejection", None),
    "rejection-T0.7-topp0.9": (sampling.Sampler(0.7, top_p=0.9), "rejection", None),
    "rejection-greedy-draft": (sampling.Sampler(1.0), "rejection", sampling.Sampler()),
    "rejection-draft-T2": (sampling.Sampler(0.8), "rejection", sampling.Sampler(2.0)),
}


@pytest.mark.parametrize("name", harness.slow_except(CHAIN_CASES, "match-T1", "rejection-T1"))
def test_acceptance_rule_is_lossless_on_a_chain(name):
    sampler, mode, draft = CHAIN_CASES[name]
    t0 = time.perf_counter()
    res = _chain_tests(sampler, mode, seed=zlib.crc32(name.encode()), draft_sampler=draft)
    assert_lossless(res, {"*": CHAIN_MAX_BIAS}, f"chain {name} ({time.perf_counter() - t0:.2f}s)")


@pytest.mark.parametrize("bug", sorted(sampling.BUGS))
def test_acceptance_rule_controls_are_rejected_on_a_chain(bug):
    sampler = sampling.Sampler(0.7)       # != 1, so the temperature bug has something to drop
    assert_rejected(_chain_tests(sampler, "rejection", seed=7, bugs={bug}), f"chain control {bug}")



# ---------------------------------------------------------------------------------------------
# 2. end to end through port.serve.generate

TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
GAMMA = 2
SOURCES = ("assistant", "dspark", "dflash", "dflash-extras")
DFLASH_MARKOV = {"markov_rank": 8, "markov_gain": 3.0}   # extension: a Markov bias of ~3 logits
DFLASH_THRESHOLDS = [0.5]                                 # extension: confidence pruning on


def _setup_kinds(name: str) -> dict:
    """Tiny Gemma-4 targets with small vocabularies and their sources (factory overrides).

    The planted bias a test can see at a given N shrinks with its distributions' largest
    probability (see `power`), so both targets sample at a temperature where no conditional is
    close to a point mass, and the prompt is the one whose first token is the flattest (the
    first token is one conditional; the later positions mix many).

    "agreeing": vocab 64, the agreeing pair (spec_parity/checkpoints/, agree_frac 0.8) at T = 4:
        the successor has p ~ 0.16-0.3, the drafters propose it (or a wrong token) with q from
        ~0.05 (assistant) to ~1 (DSpark), so every accepted length 0..gamma occurs and
        rejections with q != p are frequent. Prompt [3, 4, 17] (its first token: max p 0.16).
        First n = 3 tokens (the prefill's, then d1 / correction, d2 / correction).
    "random": vocab 16, random (context-sensitive) target and drafters, the target's softcap 4
        (its raw logits span tens: at softcap 30 a later conditional's max p averages ~0.7) at
        T = 2, a prompt of 10 tokens (past the sliding window of 8: rotating caches are trimmed
        after rejections), the flattest first token (max p 0.13) of 64 random prompts. First
        n = 4 tokens: the prefill's and a whole round at gamma 2 (d1, d2, bonus).
    DFlash on both (block gamma + 1, one layer); "dflash-extras" is the same drafter with the
    DSpark-on-DFlash extension (a random Markov head and confidence head, pruning at 0.5)."""
    if name == "agreeing":
        V, H = 64, 64
        t = {"vocab_size": V, "vocab_size_per_layer_input": V, "hidden_size": H, **TWO_LAYERS}
        return {"V": V, "n": 3, "prompt": [3, 4, 17], "sampler": sampling.Sampler(4.0),
                "target": ("gemma4-target-agreeing", t),
                "assistant": ("gemma4-assistant-agreeing", {"agree_frac": 0.8, "backbone_hidden_size": H,
                                                            "text_config": {"vocab_size": V, "hidden_size": 16,
                                                                            **TWO_LAYERS}}),
                "dspark": ("dspark-drafter-agreeing", {"agree_frac": 0.8, "target_overrides": t, "target_layer_ids": [0],
                                                      "num_draft_layers": 1, "block_size": 3}),
                "dflash": ("dflash-drafter-agreeing", {"target_kind": "gemma4-target-agreeing", "target_overrides": t,
                                                       "agree_frac": 0.8, "target_layer_ids": [0], "num_draft_layers": 1,
                                                       "block_size": GAMMA + 1, "num_attention_heads": 2})}
    V = 16
    t = {"vocab_size": V, "vocab_size_per_layer_input": V, "final_logit_softcapping": 4.0, **TWO_LAYERS}
    return {"V": V, "n": 4, "prompt": [13, 13, 4, 8, 11, 9, 11, 11, 11, 3], "sampler": sampling.Sampler(2.0),
            "target": ("gemma4-target", t),
            "assistant": ("gemma4-assistant", {"text_config": {"vocab_size": V, **TWO_LAYERS}}),
            "dspark": ("dspark-drafter", {"target_overrides": t, "target_layer_ids": [0], "num_draft_layers": 1,
                                          "block_size": 3}),
            "dflash": ("dflash-drafter", {"target_kind": "gemma4-target", "target_overrides": t, "target_layer_ids": [0],
                                          "num_draft_layers": 1, "block_size": GAMMA + 1, "mask_token_id": 0})}


@functools.cache
def setup(name: str):
    k = _setup_kinds(name)
    build = lambda kind: checkpoints.build(k[kind][0], 0, k[kind][1])  # noqa: E731
    extras_dir = checkpoints.build(k["dflash"][0], 0, {**k["dflash"][1], "dspark_extras": DFLASH_MARKOV})
    target = targets.load(build("target"))
    providers = {"assistant": assistant.AssistantProvider(build("assistant")),
                 "dspark": dspark.DeepspecProvider(build("dspark")),
                 "dflash": dflash.DflashProvider(build("dflash")),
                 "dflash-extras": dflash.DflashProvider(extras_dir, extras=True, thresholds=DFLASH_THRESHOLDS)}
    return target, providers, k


def provider_for(setup_name: str, source: str | None):
    """The named source of a setup; "<source>-deterministic" hides its `draft_sampled`."""
    if source is None:
        return None
    prov = setup(setup_name)[1][source.removesuffix("-deterministic")]
    return Deterministic(prov) if source.endswith("-deterministic") else prov


def target_exact(target, prompt: list[int], n: int, sampler: sampling.Sampler,
                 processors=()) -> tuple[np.ndarray, list[np.ndarray]]:
    """Exact distribution [V**n] of the first n tokens the target samples after the prompt, and
    the conditionals it is built from (conds[j] [V**j, V]: token j after each prefix of j
    tokens, prefixes in `encode` order): an uncached batched forward (mlx-lm's own model call)
    over every prefix of n - 1 tokens gives every conditional (causal: position j of a row is
    the conditional after its first j tokens); each distinct context's row goes through the
    same processors and Sampler."""
    V = target.config["vocab_size"]
    prefixes = (np.stack(np.meshgrid(*[np.arange(V)] * (n - 1), indexing="ij"), -1).reshape(-1, n - 1)
                if n > 1 else np.zeros((1, 0), np.int64))
    ids = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
    chunks = []
    for c in range(0, len(ids), 2048):
        out = target.model(mx.array(ids[c:c + 2048], mx.int32))[:, len(prompt) - 1:, :].astype(mx.float32)
        mx.eval(out)
        chunks.append(out)
    logits = mx.concatenate(chunks, axis=0)        # [V**(n-1), n, V]
    joint, conds = None, []
    for j in range(n):
        step = V ** (n - 1 - j)                    # rows that share their first j prefix tokens
        sel = logits[::step, j, :]                 # [V**j, V]
        if processors:
            ctx = ids[::step, : len(prompt) + j]
            sel = mx.stack([sampling.process(processors, mx.array(c, mx.int32), sel[i]) for i, c in enumerate(ctx)])
        P = np.array(sampler.probs(sel), np.float64)
        conds.append(P)
        joint = P.reshape(-1) if joint is None else (joint[:, None] * P).reshape(-1)
    return joint, conds


BANNED = [5, 9, 12, 20, 31]
PROCESSORS = {"": (), "ban": (sampling.ban(BANNED),)}


@functools.cache
def exact(setup_name: str, processors: str = "") -> tuple[np.ndarray, list[np.ndarray]]:
    target, _, k = setup(setup_name)
    return target_exact(target, k["prompt"], k["n"], k["sampler"], PROCESSORS[processors])


def run_streams(setup_name: str, source: str | None, mode: str, N: int, seed0: int = 0, processors: str = "",
                **kw) -> tuple[np.ndarray, dict, float]:
    """N independent requests through serve.generate (seeds seed0..seed0+N-1): the first n
    tokens of each [N, n], the accepted-length histogram of their rounds, CPU seconds per request."""
    target, _, k = setup(setup_name)
    provider = provider_for(setup_name, source)
    n, sp = k["n"], k["sampler"]
    seqs = np.zeros((N, n), np.int64)
    hist: dict[int, int] = {}
    t0 = time.process_time()
    for i in range(N):
        s = sampling.Sampler(sp.temperature, sp.top_k, sp.top_p, seed0 + i)
        toks, stats = serve.generate(target, k["prompt"], n, provider, gamma=GAMMA, eos=set(), sampler=s, mode=mode,
                                     processors=PROCESSORS[processors], **kw)
        seqs[i] = toks
        for _, a, _ in stats.trace:
            hist[a] = hist.get(a, 0) + 1
    return seqs, dict(sorted(hist.items())), (time.process_time() - t0) / N


def e2e_tests(setup_name, source, mode, N, seed0=0, processors="", **kw):
    seqs, hist, per = run_streams(setup_name, source, mode, N, seed0, processors, **kw)
    joint, conds = exact(setup_name, processors)
    res = stat_tests(seqs, joint, setup(setup_name)[2]["V"], conds, seed=seed0)
    label = (f"{setup_name}/{source or 'plain'}/{mode}{'/' + processors if processors else ''} accepted={hist} "
             f"{per * 1e3:.1f}ms CPU/request")
    return res, hist, label


E2E_N = {"agreeing": 2500, "random": 2500}   # requests per slow end-to-end test
# every test's detectable planted bias at power 0.9 must be below this: "pit" the PIT test (see
# `pit_power`), "*" the sequence and per-position tests (see `power`)
E2E_MAX_BIAS = {"*": 0.08, "pit": 0.05}
SMOKE_N = 200
# The controls, each where its bug moves the output: in the agreeing pair DFlash scores with the
# target's own head and its q is ~p wherever the two overlap, so a skipped residual barely moves
# its output there (not rejected at 2500 requests); on the random pair it does.
CONTROLS = [("agreeing", "dspark", 400), ("random", "dflash", 800), ("random", "dflash-extras", 800)]


E2E_CASES = [("agreeing", None, "match")] + [("agreeing", s, m) for s in SOURCES for m in sampling.MODES] + [
    ("agreeing", "dspark-deterministic", "rejection"), ("random", None, "match"), ("random", "assistant", "rejection"), ("random", "dspark", "match"),
    ("random", "dspark", "rejection"), ("random", "dflash", "rejection"), ("random", "dflash-extras", "rejection")]


@pytest.mark.slow
@pytest.mark.parametrize("setup_name,source,mode", E2E_CASES, ids=["-".join(map(str, c)) for c in E2E_CASES])
def test_speculative_output_has_the_targets_distribution(setup_name, source, mode):
    res, hist, label = e2e_tests(setup_name, source, mode, E2E_N[setup_name], seed0=1000)
    if source is not None:
        assert set(hist) == set(range(GAMMA + 1)), f"{label}: not every accepted length occurred"
    assert_lossless(res, E2E_MAX_BIAS, label)


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_speculative_output_distribution_smoke(source):
    """The cheap version of the test above (default set): agreeing pair, rejection mode."""
    res, hist, label = e2e_tests("agreeing", source, "rejection", SMOKE_N, seed0=50_000)
    assert set(hist) == set(range(GAMMA + 1)), f"{label}: not every accepted length occurred"
    assert_lossless(res, None, label)


@pytest.mark.slow
@pytest.mark.parametrize("setup_name,source,N", CONTROLS, ids=[f"{c[0]}-{c[1]}" for c in CONTROLS])
@pytest.mark.parametrize("bug", sorted(sampling.BUGS))
def test_loop_controls_are_rejected(bug, setup_name, source, N):
    res, _, label = e2e_tests(setup_name, source, "rejection", N, seed0=2000, bugs={bug})
    assert_rejected(res, f"{label} control {bug}")


@pytest.mark.slow
def test_loop_control_temperature_smoke():
    """One control end to end in the default set: the loop's own verify-sampler path."""
    res, _, label = e2e_tests("agreeing", "dspark", "rejection", 150, seed0=3000, bugs={"target_no_temperature"})
    assert_rejected(res, f"{label} control target_no_temperature")


BAN_CASES = [("assistant", "rejection"), ("dspark", "match"), ("dflash", "match"), ("dflash-extras", "rejection")]


@pytest.mark.slow
@pytest.mark.parametrize("source,mode", BAN_CASES)
def test_drafted_path_stays_lossless_under_a_ban(source, mode):
    res, hist, label = e2e_tests("agreeing", source, mode, E2E_N["agreeing"], seed0=4000, processors="ban")
    assert_lossless(res, E2E_MAX_BIAS, label)


# ---------------------------------------------------------------------------------------------
# logits processors: a grammar-style ban


def _ban_runs(setup_name: str, seeds: int, max_tokens: int):
    target, providers, k = setup(setup_name)
    banned = set(BANNED)
    hits_without = 0
    for source in (None, *SOURCES):
        for mode in ("match",) if source is None else ("match", "rejection"):
            for T in (0.0, k["sampler"].temperature):
                plain_greedy = None
                for seed in range(seeds):
                    s = sampling.Sampler(T, seed=seed)
                    prov = providers[source] if source else None
                    toks, st = serve.generate(target, k["prompt"], max_tokens, prov, gamma=GAMMA, eos=set(), sampler=s,
                                              mode=mode, processors=PROCESSORS["ban"])
                    assert not banned & set(toks), (source, mode, T, seed, toks)
                    drafted = {t for p in st.proposals for t in p}
                    assert not banned & drafted, f"the ban did not reach {source}'s draft logits: {st.proposals}"
                    if T == 0.0:
                        plain_greedy = plain_greedy or serve.generate(
                            target, k["prompt"], max_tokens, None, eos=set(), sampler=s,
                            processors=PROCESSORS["ban"])[0]
                        assert toks == plain_greedy, "T=0 with a processor: drafting changed the greedy stream"
                    free, _ = serve.generate(target, k["prompt"], max_tokens, prov, gamma=GAMMA, eos=set(), sampler=s,
                                             mode=mode)
                    hits_without += len(banned & set(free))
    assert hits_without > 0, "the banned tokens never occur without the ban: the test would be vacuous"


@pytest.mark.slow
def test_banned_tokens_are_never_emitted_with_or_without_drafting():
    _ban_runs("agreeing", seeds=3, max_tokens=10)


@pytest.mark.slow
def test_banned_tokens_are_never_emitted_on_a_context_sensitive_target():
    _ban_runs("random", seeds=6, max_tokens=16)


def test_a_ban_of_every_token_is_refused():
    target, _, k = setup("agreeing")
    with pytest.raises(sampling.SamplingError, match="no token the target may emit"):
        serve.generate(target, k["prompt"], 4, None, sampler=sampling.Sampler(1.0),
                       processors=[sampling.ban(range(k["V"]))])


# ---------------------------------------------------------------------------------------------
# the sampler, the seam, the defaults


def _reference_probs(logits: np.ndarray, T: float, top_k: int, top_p: float) -> np.ndarray:
    """An independent numpy transcription of temperature -> top-k -> top-p (HF's order)."""
    x = logits.astype(np.float64) / T
    if top_k:
        kth = np.sort(x)[-top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(len(p), bool)
        mass = 0.0
        for i in order:
            keep[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 5, 1.0), (1.0, 0, 0.6),
                                           (0.7, 8, 0.9), (1.3, 1, 1.0), (1.0, 0, 1e-3)])
def test_sampler_probs_match_an_independent_transcription(T, top_k, top_p):
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = (rng.standard_normal(24) * 2).astype(np.float32)
        got = np.array(sampling.Sampler(T, top_k, top_p).probs(mx.array(logits)))
        np.testing.assert_allclose(got, _reference_probs(logits, T, top_k, top_p), atol=2e-6)


def test_greedy_sampler_is_the_argmax_and_a_banned_row_is_empty():
    logits = mx.array([[0.1, 3.0, -1.0, 2.9], [-mx.inf] * 4])
    p = sampling.Sampler(0.0).probs(logits).tolist()
    assert p == [[0.0, 1.0, 0.0, 0.0], [0.0] * 4]
    assert sampling.Sampler(1.0).probs(logits)[1].tolist() == [0.0] * 4


def test_sample_is_the_inverse_cdf():
    p = mx.array([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = mx.array([0.0, 0.2499, 0.25, 0.9999, 0.99999994])
    assert sampling.sample(p, u).tolist() == [1, 1, 3, 3, 3]
    short = mx.array([[0.1, 0.2, 0.0]])                 # unnormalized: the leftover goes to the last nonzero
    assert sampling.sample(short, mx.array([0.9])).tolist() == [1]


def test_seeded_requests_are_reproducible():
    target, providers, k = setup("agreeing")
    for source, mode in [(None, "match"), ("dspark", "rejection"), ("assistant", "rejection"),
                         ("dflash", "rejection"), ("dflash-extras", "rejection")]:
        prov = providers[source] if source else None
        runs = [serve.generate(target, k["prompt"], 12, prov, gamma=GAMMA, eos=set(),
                               sampler=sampling.Sampler(3.0, seed=s), mode=mode) for s in (5, 5, 6)]
        assert runs[0][0] == runs[1][0] and runs[0][1].trace == runs[1][1].trace
        assert runs[0][0] != runs[2][0]


@pytest.mark.parametrize("setup_name", harness.slow_except(["agreeing", "random"], "agreeing"))
def test_temperature_zero_sampling_paths_equal_the_default_greedy_loop(setup_name):
    target, providers, k = setup(setup_name)
    for source in (*SOURCES, "dspark-deterministic", "dflash-deterministic"):
        prov = provider_for(setup_name, source)
        base, st = serve.generate(target, k["prompt"], 12, prov, gamma=GAMMA, eos=set())
        for mode in sampling.MODES:
            toks, st2 = serve.generate(target, k["prompt"], 12, prov, gamma=GAMMA, eos=set(),
                                       sampler=sampling.Sampler(0.0, seed=3), mode=mode)
            assert toks == base and st2.trace == st.trace, (source, mode)


class Deterministic:
    """A provider whose sources hide `draft_sampled` (like a source written before it): rejection
    mode then verifies its greedy drafts with q = the point mass."""

    def __init__(self, inner):
        self.inner, self.id, self.weights_bytes, self.trained_gamma = inner, inner.id, inner.weights_bytes, None

    def open(self, view):
        src = self.inner.open(view)

        class Source:
            tap_layers = src.tap_layers
            prefill, draft, commit, dispose = src.prefill, src.draft, src.commit, src.dispose

        return Source()

    def dispose(self):
        pass


class Spy:
    """Records which seam method the loop drafted through."""

    def __init__(self, inner):
        self.inner, self.id, self.weights_bytes, self.trained_gamma, self.calls = (
            inner, inner.id, inner.weights_bytes, None, [])

    def open(self, view):
        src, calls = self.inner.open(view), self.calls

        class Source:
            tap_layers = src.tap_layers
            prefill, commit, dispose = src.prefill, src.commit, src.dispose

            def draft(self, *a):
                calls.append("draft")
                return src.draft(*a)

            def draft_sampled(self, *a):
                calls.append("draft_sampled")
                return src.draft_sampled(*a)

        return Source()

    def dispose(self):
        pass


@pytest.mark.parametrize("source", SOURCES)
def test_default_arguments_draft_through_the_plain_seam(source):
    target, providers, k = setup("agreeing")
    spy = Spy(providers[source])
    serve.generate(target, k["prompt"], 8, spy, gamma=GAMMA, eos=set())
    serve.generate(target, k["prompt"], 8, spy, gamma=GAMMA, eos=set(), sampler=sampling.Sampler(1.0))
    assert set(spy.calls) == {"draft"}                    # match mode drafts greedily, as the seed did
    spy.calls.clear()
    serve.generate(target, k["prompt"], 8, spy, gamma=GAMMA, eos=set(), sampler=sampling.Sampler(1.0), mode="rejection")
    assert set(spy.calls) == {"draft_sampled"}


def test_a_source_whose_drafts_are_not_its_picks_is_refused():
    target, providers, k = setup("agreeing")
    inner = providers["dspark"]

    class Liar(Deterministic):
        def open(self, view):
            src = inner.open(view)

            class Source:
                tap_layers = src.tap_layers
                prefill, draft, commit, dispose = src.prefill, src.draft, src.commit, src.dispose

                def draft_sampled(self, feed, n, anchor, pick):
                    return [(t + 1) % k["V"] for t in src.draft_sampled(feed, n, anchor, pick)]

            return Source()

    with pytest.raises(sampling.SamplingError, match="not a prefix of its picks"):
        for seed in range(20):
            serve.generate(target, k["prompt"], 8, Liar(inner), gamma=GAMMA, eos=set(),
                           sampler=sampling.Sampler(3.0, seed=seed), mode="rejection")


def test_unknown_mode_bug_and_sampler_values_are_refused():
    target, _, k = setup("agreeing")
    with pytest.raises(sampling.SamplingError, match="unknown acceptance mode"):
        serve.generate(target, k["prompt"], 4, None, mode="typical")
    with pytest.raises(sampling.SamplingError, match="unknown planted bug"):
        serve.generate(target, k["prompt"], 4, None, bugs={"nope"})
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(sampling.SamplingError):
            sampling.Sampler(**bad)


def test_admission_accounting():
    """Stats carry the provider's weight bytes and the request's bytes: the target's K/V caches
    plus what the source holds (DSpark, DFlash: their per-layer context K/V; the assistant:
    nothing)."""
    target, providers, k = setup("random")
    for source in SOURCES:
        prov = providers[source]
        for kw in ({}, {"sampler": sampling.Sampler(2.0), "mode": "rejection"}):
            toks, st = serve.generate(target, k["prompt"], 8, prov, gamma=GAMMA, eos=set(), **kw)
            assert st.weights_bytes == prov.weights_bytes > 0
            assert st.target_cache_bytes > 0 and st.request_bytes == st.target_cache_bytes + st.source_bytes
            js = st.to_json()
            assert js["request_bytes"] == st.request_bytes and js["weights_bytes"] == st.weights_bytes
            if source == "assistant":
                assert st.source_bytes == 0
            else:
                a = prov.drafter.args
                rows = len(k["prompt"]) + len(toks) - 1 - 1   # context rows committed before the last draft
                per_row = a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 4
                assert st.source_bytes >= per_row * rows, (st.source_bytes, per_row, rows)
    _, plain = serve.generate(target, k["prompt"], 8, None, eos=set())
    assert plain.weights_bytes == 0 and plain.source_bytes == 0 and plain.target_cache_bytes > 0


# ---------------------------------------------------------------------------------------------
# 3. parity at T > 0 with DeepSpec's rejection-sampling loop (acceptance and tau distributions)

PARITY = {"temperature": 2.0, "threshold": 0.5, "max_new_tokens": 5, "runs": 600, "agree_frac": 0.8}
ALPHA_PARITY = 1e-3 / 6      # its own family: 6 tests (DeepSpec 2, optiq 3, optiq's softcap delta 1), Bonferroni at 1e-3


def two_sample(a: np.ndarray, b: np.ndarray) -> dict:
    """Two-sample chi-square (2 x K contingency) of two samples of small non-negative integers;
    neighbouring values are merged until every column expects >= MIN_EXPECTED per row."""
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
    stat, p, df, _ = scipy_stats().chi2_contingency(t, correction=False)
    pooled = t.sum(axis=0) / t.sum()
    n_eff = t[0].sum() * t[1].sum() / t.sum()
    return {"p": float(p), "df": int(df), "table": t,
            "power_delta": detectable(pooled, int(n_eff), alpha=ALPHA_PARITY)}


def _dspark_parity_runs():
    """The agreeing DSpark pair of the loop-agree0.8 cases, and their prompt."""
    tdir = checkpoints.build("gemma4-target-agreeing", 0, {})
    ddir = checkpoints.build("dspark-drafter-agreeing", 0, {"target_kind": "gemma4-target-agreeing",
                                                           "agree_frac": PARITY["agree_frac"]})
    prompt = np.random.default_rng([0, 13]).integers(3, 128, (1, 12)).astype(np.int32)
    return tdir, ddir, prompt


def _ours(tdir, ddir, prompt, seeds, **kw):
    target = targets.load(tdir)
    provider = dspark.DeepspecProvider(ddir, PARITY["threshold"])
    first, rounds, accepted, proposed = [], [], 0, 0
    n = PARITY["max_new_tokens"]
    for seed in seeds:
        # DeepSpec runs a round while fewer than n + 1 tokens are committed, then trims to n.
        _, st = serve.generate(target, prompt[0].tolist(), n + 1, provider, gamma=provider.trained_gamma, eos=set(),
                               sampler=sampling.Sampler(PARITY["temperature"], seed=seed), mode="rejection", **kw)
        first.append(st.trace[0][1])
        rounds.append(len(st.trace))
        accepted += st.accepted
        proposed += st.drafted
    return {"first": np.array(first), "rounds": np.array(rounds), "acceptance": accepted / max(proposed, 1)}


@pytest.mark.oracle
@pytest.mark.slow
def test_acceptance_and_tau_match_deepspecs_rejection_sampling_loop(live_oracle):
    """Same agreeing DSpark checkpoint, same prompt, T = 2, confidence threshold 0.5: the
    first-round accepted length and the rounds a request needs (its tau) have the same
    distribution in our loop (rejection mode) and in DeepSpec's `generate_decoding_sample`
    (its sampled proposal and rejection-sampling verify). Control: our loop with the drafts
    drawn at 3T (still lossless, a different acceptance) must be told apart by the same tests."""
    live_oracle("dspark")
    from oracles import dspark as oracle

    tdir, ddir, prompt = _dspark_parity_runs()
    R = PARITY["runs"]
    t0 = time.perf_counter()
    ref = oracle.loop_sampled(tdir, ddir, prompt, PARITY["max_new_tokens"], PARITY["threshold"],
                              PARITY["temperature"], list(range(R)))
    t_ref = time.perf_counter() - t0
    starts = np.cumsum(np.r_[0, ref["rounds"][:-1]])
    theirs = {"first": ref["accepted"][starts].astype(np.int64), "rounds": ref["rounds"].astype(np.int64),
              "acceptance": ref["accepted"].sum() / max(ref["proposed"].sum(), 1)}
    t0 = time.perf_counter()
    ours = _ours(tdir, ddir, prompt, range(10_000, 10_000 + R))
    t_ours = time.perf_counter() - t0
    control = _ours(tdir, ddir, prompt, range(20_000, 20_000 + R),
                    draft_sampler=sampling.Sampler(3 * PARITY["temperature"]))
    lines = [f"DeepSpec {t_ref:.1f}s, ours {t_ours:.1f}s for {R} requests each; acceptance DeepSpec "
             f"{theirs['acceptance']:.3f} ours {ours['acceptance']:.3f} control {control['acceptance']:.3f}; "
             f"mean rounds {theirs['rounds'].mean():.2f} / {ours['rounds'].mean():.2f} / {control['rounds'].mean():.2f}"]
    control_p = []
    for stat in ("first", "rounds"):
        r = two_sample(theirs[stat], ours[stat])
        c = two_sample(theirs[stat], control[stat])
        control_p.append(c["p"])
        lines.append(f"{stat}: p={r['p']:.3g} (df {r['df']}, detects {r['power_delta']:.3f} at power {POWER}); "
                     f"control p={c['p']:.3g}; DeepSpec {np.bincount(theirs[stat]).tolist()} "
                     f"ours {np.bincount(ours[stat]).tolist()}")
        assert r["p"] >= ALPHA_PARITY, "\n".join(lines)
    print("\n".join(lines))
    assert min(control_p) < ALPHA_PARITY, "the parity test cannot tell a different acceptance apart:\n" + "\n".join(lines)


OPTIQ_PARITY = {"temperature": 3.0, "gamma": GAMMA, "max_tokens": 10, "runs": 1000, "control_runs": 400}
OPTIQ_MAX_BIAS = 0.33  # each statistic's detectable planted bias at power 0.9 (two_sample) must be below this


def run_statistics(rounds: list[list[tuple[int, int, int]]], gamma: int, max_tokens: int) -> dict[str, np.ndarray]:
    """Per run, from its rounds (drafted, accepted, committed) (independent across runs; rounds
    within a run are not): the accepted length of the first and of the second drafting round,
    and the rounds needed to commit M = max_tokens - gamma - 1 tokens (the prefill's token
    counts). Every round before that point drafts a full gamma in both loops (optiq shrinks its
    last drafts to what is left; the serve loop drafts gamma and drops the excess), so no
    statistic sees the end of a request."""
    M = max_tokens - gamma - 1
    first, second, to_m = [], [], []
    for rs in rounds:
        committed, n = 1, 0
        while committed < M:
            drafted, _, emitted = rs[n]
            assert drafted == gamma, (rs, n)
            committed, n = committed + emitted, n + 1
        first.append(rs[0][1])
        second.append(rs[1][1])
        to_m.append(n)
    return {"first": np.array(first), "second": np.array(second), "rounds_to_M": np.array(to_m)}


def _optiq_pair(softcap: bool):
    """The agreeing target (as built: Gemma-4's final softcap 30; or with it off) and assistant."""
    k = setup("agreeing")[2]
    tdir = checkpoints.build(k["target"][0], 0, k["target"][1] if softcap else
                             {**k["target"][1], "final_logit_softcapping": None})
    return tdir, checkpoints.build(k["assistant"][0], 0, k["assistant"][1]), k["prompt"]


@pytest.mark.oracle
@pytest.mark.slow
def test_optiqs_sampled_loop_samples_the_logits_without_the_softcap(live_oracle):
    """A reference delta at T > 0: optiq projects its verify rows with the head alone
    (`_project_to_logits`, no final softcap; at T = 0 the argmax is the same, REFERENCES.md), so
    it samples softmax(raw / T), not the target's softmax(softcap(raw) / T). Its first sampled
    token (softcapped agreeing target, T = 3, the prompt [3, 4, 51] whose successor's logit is
    large enough for the softcap to matter: total variation 0.11 between the two) fits the
    un-softcapped conditional (gof at ALPHA_PARITY, power stated) and is rejected against the
    target's own."""
    live_oracle("assistant", "optiq")
    from oracles import assistant as oracle

    tdir, ddir, _ = _optiq_pair(softcap=True)
    prompt, T, R = [3, 4, 51], OPTIQ_PARITY["temperature"], 1500
    ref = oracle.optiq_generate_step_sampled(tdir, ddir, np.array([prompt], np.int32), GAMMA, 1, T, list(range(R)))
    target = targets.load(tdir)
    ids = mx.array([prompt], mx.int32)
    raw = target.model.model.embed_tokens.as_linear(target.model.model(ids))[0, -1]
    sampler = sampling.Sampler(T)
    fits = {name: gof(ref["tokens"][:, 0].astype(np.int64), np.array(sampler.probs(row), np.float64))
            for name, row in (("raw", raw), ("softcapped", target.model(ids)[0, -1]))}
    msg = " ".join(f"{n}: p={r['p']:.3g} (detects {detectable(r['P'], R, ALPHA_PARITY):.3f})" for n, r in fits.items())
    print(f"optiq's first token vs the target's conditional, {R} runs: {msg}")
    assert fits["raw"]["p"] >= ALPHA_PARITY, msg
    assert fits["softcapped"]["p"] < ALPHA_PARITY, "optiq samples the softcapped logits after all: " + msg


@pytest.mark.oracle
@pytest.mark.slow
def test_acceptance_and_tau_match_optiqs_sampled_loop(live_oracle):
    """optiq samples too (`assistant_generate_step` with mlx-lm's sampler: greedy drafts, token
    match). On the agreeing assistant pair with the target's softcap off (where optiq samples
    the target's distribution, see the test above) at T = 3, our loop (mode "match") and
    optiq's have the same distribution of the first and the second round's accepted length and
    of the rounds a request needs to commit M tokens (its tau), by `two_sample` at ALPHA_PARITY,
    each with its detectable bias asserted. Controls, planted bugs in our loop the same
    comparisons must tell apart: the bonus token dropped on a full accept (lossless, but fewer
    tokens per round) and the verify sampling the target at T = 1 (`target_no_temperature`)."""
    live_oracle("assistant", "optiq")
    from oracles import assistant as oracle

    tdir, ddir, prompt = _optiq_pair(softcap=False)
    target, provider = targets.load(tdir), setup("agreeing")[1]["assistant"]
    cfg, R = OPTIQ_PARITY, OPTIQ_PARITY["runs"]
    t0 = time.process_time()
    ref = oracle.optiq_generate_step_sampled(tdir, ddir, np.array([prompt], np.int32), cfg["gamma"],
                                             cfg["max_tokens"], cfg["temperature"], list(range(R)))
    t_ref = time.process_time() - t0
    # optiq commits accepted + 1 per round: the correction (or bonus) becomes its pending token
    theirs = run_statistics([[(d, a, a + 1) for d, a in rs] for rs in ref["rounds"]], cfg["gamma"], cfg["max_tokens"])
    assert (theirs["first"] == ref["first_accepted"]).all()       # the per-round read agrees with the old one

    def ours(seed0: int, runs: int = R, **bug) -> dict[str, np.ndarray]:
        rounds = []
        for seed in range(seed0, seed0 + runs):
            _, st = serve.generate(target, prompt, cfg["max_tokens"], provider, gamma=cfg["gamma"], eos=set(),
                                   sampler=sampling.Sampler(cfg["temperature"], seed=seed), **bug)
            rounds.append(st.trace)
        return run_statistics(rounds, cfg["gamma"], cfg["max_tokens"])

    t0 = time.process_time()
    mine = ours(10_000)
    t_ours = time.process_time() - t0
    controls = {"bonus dropped": ours(20_000, cfg["control_runs"], bonus=False),
                "target_no_temperature": ours(30_000, cfg["control_runs"], bugs={"target_no_temperature"})}
    lines = [f"optiq {t_ref:.1f}s, ours {t_ours:.1f}s CPU for {R} requests each (controls {cfg['control_runs']}; "
             f"max_tokens {cfg['max_tokens']}, T {cfg['temperature']})"]
    failed, rejected = [], {c: [] for c in controls}
    for stat, theirs_s in theirs.items():
        r = two_sample(theirs_s, mine[stat])
        cp = {c: two_sample(theirs_s, v[stat])["p"] for c, v in controls.items()}
        lines.append(f"{stat}: p={r['p']:.3g} (df {r['df']}, detects {r['power_delta']:.3f} at power {POWER}); "
                     f"optiq {np.bincount(theirs_s).tolist()} ours {np.bincount(mine[stat]).tolist()}; controls "
                     + " ".join(f"{c}: p={p:.3g}" for c, p in cp.items()))
        if r["p"] < ALPHA_PARITY or r["power_delta"] > OPTIQ_MAX_BIAS:
            failed.append(stat)
        for c, p in cp.items():
            rejected[c].append(p < ALPHA_PARITY)
    print("\n".join(lines))
    assert not failed, f"{failed} differ from optiq or lack power:\n" + "\n".join(lines)
    for c, hits in rejected.items():
        assert any(hits), f"the parity tests cannot tell our loop with {c} apart:\n" + "\n".join(lines)

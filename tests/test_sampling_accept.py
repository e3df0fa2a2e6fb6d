"""Sampling at T > 0, layer 1: the acceptance rules themselves (`sampling.accept_match` /
`accept_rejection`, the functions the loop calls, with a batch axis) driving 2 x 10^5
independent streams at once over a small Markov-chain "target" and "drafter" (vocab 8, gamma 2,
first 4 tokens), against the chain's exact distribution (tests/stats.py): well under a second
per test. Every control (spec_parity/controls/sampling.py) is rejected here, in each mode whose rule
it changes."""

from __future__ import annotations

import functools
import time
import zlib

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import harness
from spec_parity.controls import planted, registry
from spec_parity.controls.sampling import MODES
from spec_parity.port import sampling

from stats import assert_lossless, assert_rejected, stat_tests


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
             gamma: int, seed: int, draft_sampler=None, bonus: bool = True) -> np.ndarray:
    """B independent speculative-decoding streams over the chain, through the loop's own
    acceptance functions and samplers; returns the first n emitted tokens of each [B, n]."""
    keys = sampling.Keys(seed)
    P = sampling.verify_probs(sampler, mx.array(lp))     # verify rows
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
            k, nxt = sampling.accept_rejection(d, q, p, keys.uniform((B, gamma)), keys.uniform((B,)))
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


def _chain_tests(sampler, mode, seed, draft_sampler=None, bonus=True, agree=0.6, B=None):
    lp, lq = _chain(agree)
    seqs = simulate(lp, lq, CHAIN["start"], CHAIN["n"], B or CHAIN["B"], sampler, mode, CHAIN["gamma"], seed,
                    draft_sampler, bonus)
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


@pytest.mark.parametrize("bug,mode", [(b, m) for b in sorted(registry("sampling")) for m in MODES[b]])
def test_acceptance_rule_controls_are_rejected_on_a_chain(bug, mode):
    sampler = sampling.Sampler(0.7)       # != 1, so the temperature bug has something to drop
    with planted("sampling", bug):
        res = _chain_tests(sampler, mode, seed=7)
    assert_rejected(res, f"chain control {bug} ({mode})")

"""The statistics of the T > 0 tests (tests/stats.py) tested themselves: on exact draws each
test rejects its planted bias at the power it claims and holds its false-alarm rate, and the
lossless tests fit the Bonferroni family that ALPHA bounds."""

import numpy as np
import pytest

from sampling_setup import SOURCES, setup_kinds
from stats import ALPHA, MAX_TESTS, bias_detected, detectable, gof, pit, pit_gof
from test_sampling_accept import CHAIN, CHAIN_CASES
from test_sampling_loop import BAN_CASES, E2E_CASES


def test_the_lossless_tests_fit_their_bonferroni_family():
    """ALPHA is the family rate over MAX_TESTS: count the tests that can raise a false alarm."""
    n = {name: setup_kinds(name)["n"] for name in ("agreeing", "random")}
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

"""spec_parity.port.calibration: threshold fit (seed semantics), the calibration file, STS, Algorithm 1.

No reference implementation exists for this math, so the proof is properties. Each property is a
plain function `prop_*(fn, example)` that asserts; the `@given` test runs it on the port, and its
control runs the SAME function on a deliberately broken variant (built below from a transcription
of the seed / the paper with one bug switched on) and shows it fails: `must_fail` returns a
counterexample found by hypothesis `find`, or from a fixed list. The transcriptions with no bug
are held equal to the port (differential tests), so each planted bug is the only difference.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from typing import NamedTuple

import numpy as np
import pytest
from deepdiff import DeepDiff
from hypothesis import given
from hypothesis import strategies as st

from spec_parity.port import calibration as cal

from controls import must_fail

# ================================================================================================
# Thresholds


class FitCase(NamedTuple):
    samples: list
    gamma: int
    target: float
    min_samples: int

    def run(self, fit, samples=None, target=None, min_samples=None):
        return fit(self.samples if samples is None else samples, self.gamma,
                   self.target if target is None else target,
                   self.min_samples if min_samples is None else min_samples)


# Valid confidences (sigmoid outputs, [0, 1]); a few fixed values so that ties are common.
conf_st = st.one_of(st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0]), st.floats(0, 1))
targets_st = st.one_of(st.just(0.5), st.sampled_from([0.3, 0.6, 0.75, 0.9]), st.floats(0.05, 0.95))
TARGET_LADDER = (0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9)


@st.composite
def fit_cases(draw, max_size=40):
    """Small min_samples mostly (so rules 3 and 4 are exercised on short lists), the default 50
    sometimes; gamma 2 most often (position 0 is never fitted)."""
    gamma = draw(st.sampled_from([1, 2, 2, 3, 4]))
    samples = draw(st.lists(st.tuples(st.integers(0, gamma - 1), conf_st, st.booleans()), max_size=max_size))
    min_samples = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 50]))
    return FitCase(samples, gamma, draw(targets_st), min_samples)


@st.composite
def permuted_cases(draw):
    case = draw(fit_cases())
    return case, draw(st.permutations(range(len(case.samples))))


@st.composite
def junk_cases(draw):
    """A clean case plus samples the intake must drop (non-finite confidence at any position;
    finite confidence at an out-of-range or non-integer position), mixed in anywhere."""
    case = draw(fit_cases())
    g = case.gamma
    bad_conf = st.tuples(st.integers(-2, g + 2), st.sampled_from([math.nan, math.inf, -math.inf]), st.booleans())
    bad_pos = st.tuples(st.sampled_from([-1, g, g + 3, 0.5, 1.5, math.nan, math.inf]), conf_st, st.booleans())
    junk = draw(st.lists(st.one_of(bad_conf, bad_pos), min_size=1, max_size=10))
    mixed = case.samples + junk
    perm = draw(st.permutations(range(len(mixed))))
    return case, [mixed[i] for i in perm]


def _clean_by_pos(case: FitCase) -> list[list[tuple[float, bool]]]:
    by_pos = [[] for _ in range(case.gamma)]
    for pos, conf, acc in case.samples:
        by_pos[pos].append((conf, acc))
    return by_pos


def _laplace(samples, tau) -> float:
    kept = [acc for conf, acc in samples if conf >= tau]
    return (sum(kept) + 1) / (len(kept) + 2)


def _valid_pos(pos, gamma) -> bool:
    return (isinstance(pos, (int, float)) and not isinstance(pos, bool) and math.isfinite(pos)
            and pos == int(pos) and 0 <= pos < gamma)


def seed_fit(samples, gamma, target=0.5, min_samples=50, bug=None):
    """dspark/calibration.ts fitStsThresholds, line by line (O(n^2) candidate scan), with one
    planted bug when `bug` is set."""
    by_pos = [[] for _ in range(gamma)]
    for pos, conf, acc in samples:
        finite = not math.isnan(conf) if bug == "nan-only-filter" else math.isfinite(conf)
        if finite and _valid_pos(pos, gamma):
            by_pos[int(pos)].append((conf + 0.0, bool(acc)))
    thresholds = [0.0] * gamma
    for k in range(0 if bug == "fits-position-0" else 1, gamma):
        pos = by_pos[k]
        too_few = len(pos) <= min_samples if bug == "min-samples-off-by-one" else len(pos) < min_samples
        if too_few:
            thresholds[k] = 0.0
            continue
        cands = [c for c, _ in pos] if bug == "unsorted-candidates" else sorted(c for c, _ in pos)
        if bug == "largest-clearing":
            cands = cands[::-1]
        chosen = None
        for tau in cands:
            kept = [a for c, a in pos if c >= tau]
            prec = sum(kept) / len(kept) if bug == "no-laplace" else (sum(kept) + 1) / (len(kept) + 2)
            if prec >= target:
                chosen = tau
                if bug != "keep-while-clears":
                    break
            elif bug == "keep-while-clears" and chosen is not None:
                break
        thresholds[k] = (0.0 if bug == "fallback-0" else 1.0) if chosen is None else chosen
    if bug != "fits-position-0":
        thresholds[0] = 0.0
    return cal.StsCalibration(thresholds, float(target), len(samples), gamma, min_samples,
                              [len(p) for p in by_pos])


def buggy(bug):
    return lambda samples, gamma, target=0.5, min_samples=50: seed_fit(samples, gamma, target, min_samples, bug)


def accumulating_fit():
    """A fresh fit with a classic Python bug: a list kept across calls (a mutable default), so a
    second call also sees the first call's samples."""
    seen: list = []

    def fit(samples, gamma, target=0.5, min_samples=50):
        seen.extend(samples)
        return seed_fit(seen, gamma, target, min_samples)

    return fit


# --- the properties ------------------------------------------------------------------------------


def prop_order_invariance(fit, ex):
    case, perm = ex
    base = case.run(fit).to_json()
    for other in ([case.samples[i] for i in perm], case.samples[::-1]):
        assert DeepDiff(base, case.run(fit, samples=other).to_json()) == {}


def prop_determinism(fit, case):
    first, second = case.run(fit).to_json(), case.run(fit).to_json()
    assert DeepDiff(first, second) == {}
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def prop_rule1_position0(fit, case):
    assert case.run(fit).thresholds[0] == 0.0


def prop_rule2_min_samples(fit, case):
    """Below min_samples -> 0; at or above it the position is fitted exactly as with no gate.
    Checked at the case's min_samples and on both sides of every position's sample count."""
    by_pos = _clean_by_pos(case)
    ungated = [case.run(fit, samples=[s for s in case.samples if s[0] == k], min_samples=0).thresholds[k]
               for k in range(case.gamma)]
    for m in sorted({case.min_samples} | {len(p) + d for p in by_pos for d in (0, 1)}):
        got = case.run(fit, min_samples=m).thresholds
        for k in range(1, case.gamma):
            assert got[k] == (0.0 if len(by_pos[k]) < m else ungated[k]), (m, k)


def prop_rule3_nothing_clears(fit, case):
    got = case.run(fit).thresholds
    for k, pos in enumerate(_clean_by_pos(case)):
        if k and len(pos) >= case.min_samples and not any(_laplace(pos, c) >= case.target for c, _ in pos):
            assert got[k] == 1.0


def prop_rule4_smallest_clearing(fit, case):
    """Checked at the case's target and a ladder."""
    for target in (case.target, *TARGET_LADDER):
        got = case.run(fit, target=target).thresholds
        for k, pos in enumerate(_clean_by_pos(case)):
            clearing = [c for c, _ in pos if _laplace(pos, c) >= target]
            if k and len(pos) >= case.min_samples and clearing:
                assert got[k] == min(clearing), (target, k)


def prop_precision_guarantee(fit, case):
    """On the samples a fitted threshold keeps, Laplace precision >= target (rule 3's 1.0,
    chosen because nothing clears, promises nothing). Checked at the case's target and a ladder."""
    for target in (case.target, *TARGET_LADDER):
        got = case.run(fit, target=target).thresholds
        for k, pos in enumerate(_clean_by_pos(case)):
            if not k or len(pos) < case.min_samples:
                continue
            if got[k] == 1.0 and not any(_laplace(pos, c) >= target for c, _ in pos):
                continue
            assert _laplace(pos, got[k]) >= target, (target, k, got[k])


def prop_nonfinite_robust(fit, ex):
    """Junk samples change nothing but the count of samples given; the result stays JSON-clean."""
    case, dirty = ex
    clean, messy = case.run(fit).to_json(), case.run(fit, samples=dirty).to_json()
    assert messy["samples"] == len(dirty)
    assert DeepDiff({**clean, "samples": None}, {**messy, "samples": None}) == {}
    json.dumps(messy, allow_nan=False)


def prop_monotone_in_target(fit, case):
    """Confidences in [0, 1]: a stricter target never lowers a threshold (rule 3's 1.0 is the top).
    Checked along the case's target and a ladder, sorted."""
    fits = [case.run(fit, target=t).thresholds for t in sorted({case.target, *TARGET_LADDER})]
    for a, b in zip(fits, fits[1:]):
        assert all(x <= y for x, y in zip(a, b)), (a, b)


# --- the tests ---------------------------------------------------------------------------------


THRESHOLD_PROPS = {
    # property: (body, strategy, planted bug that must fail it)
    "order_invariance": (prop_order_invariance, permuted_cases(), buggy("unsorted-candidates")),
    "determinism": (prop_determinism, fit_cases(), None),  # fresh accumulating_fit per example
    "rule1_position0": (prop_rule1_position0, fit_cases(), buggy("fits-position-0")),
    "rule2_min_samples": (prop_rule2_min_samples, fit_cases(), buggy("min-samples-off-by-one")),
    "rule3_nothing_clears": (prop_rule3_nothing_clears, fit_cases(), buggy("fallback-0")),
    "rule4_smallest_clearing": (prop_rule4_smallest_clearing, fit_cases(), buggy("largest-clearing")),
    "precision_guarantee": (prop_precision_guarantee, fit_cases(), buggy("no-laplace")),
    "nonfinite_robust": (prop_nonfinite_robust, junk_cases(), buggy("nan-only-filter")),
    "monotone_in_target": (prop_monotone_in_target, fit_cases(), buggy("keep-while-clears")),
}


@pytest.mark.property
@given(permuted_cases())
def test_thresholds_order_invariance(ex):
    prop_order_invariance(cal.fit_sts_thresholds, ex)


@pytest.mark.property
@given(fit_cases())
def test_thresholds_determinism(case):
    prop_determinism(cal.fit_sts_thresholds, case)


@pytest.mark.property
@given(fit_cases())
def test_thresholds_rule1_position0(case):
    prop_rule1_position0(cal.fit_sts_thresholds, case)


@pytest.mark.property
@given(fit_cases())
def test_thresholds_rule2_min_samples(case):
    prop_rule2_min_samples(cal.fit_sts_thresholds, case)


@pytest.mark.property
@given(fit_cases())
def test_thresholds_rule3_nothing_clears(case):
    prop_rule3_nothing_clears(cal.fit_sts_thresholds, case)


@pytest.mark.property
@given(fit_cases())
def test_thresholds_rule4_smallest_clearing(case):
    prop_rule4_smallest_clearing(cal.fit_sts_thresholds, case)


@pytest.mark.property
@given(fit_cases())
def test_thresholds_precision_guarantee(case):
    prop_precision_guarantee(cal.fit_sts_thresholds, case)


@pytest.mark.property
@given(junk_cases())
def test_thresholds_nonfinite_robust(ex):
    prop_nonfinite_robust(cal.fit_sts_thresholds, ex)


@pytest.mark.property
@given(fit_cases())
def test_thresholds_monotone_in_target(case):
    prop_monotone_in_target(cal.fit_sts_thresholds, case)


@pytest.mark.property
@pytest.mark.parametrize("name", sorted(THRESHOLD_PROPS))
def test_thresholds_control(name):
    prop, strategy, bad = THRESHOLD_PROPS[name]
    if name == "determinism":
        must_fail(lambda case: prop(accumulating_fit(), case), strategy)
    else:
        must_fail(lambda ex: prop(bad, ex), strategy)


@pytest.mark.property
@given(junk_cases())
def test_thresholds_equal_seed_transcription(ex):
    """The port (O(n log n) suffix sums) equals the seed's literal candidate scan, junk included:
    the controls above differ from the port only by their planted bug."""
    case, dirty = ex
    for samples in (case.samples, dirty):
        port, seed = case.run(cal.fit_sts_thresholds, samples), case.run(seed_fit, samples)
        assert DeepDiff(port.to_json(), seed.to_json()) == {}


def test_thresholds_worked_example():
    """Position 1: confidences .1 (acc) .2 (acc) .3 (rej), ten times each. Candidate .1 keeps 30
    (20 acc) -> 21/32 = .656; .2 keeps 20 (10 acc) -> 11/22 = .5; .3 keeps 10 (0) -> 1/12."""
    samples = [(1, 0.1, True), (1, 0.2, True), (1, 0.3, False)] * 10 + [(0, 0.9, False)] * 99
    samples += [(2, 0.5, False)] * 49 + [(3, math.nan, True), (7, 0.5, True)]
    got = cal.fit_sts_thresholds(samples, gamma=3, target=0.6, min_samples=30)
    assert DeepDiff(got.to_json(), {"thresholds": [0.0, 0.1, 1.0], "target": 0.6, "samples": 180,
                                    "gamma": 3, "min_samples": 30,
                                    "samples_by_position": [99, 30, 49]}) == {}
    assert cal.fit_sts_thresholds(samples, 3, target=0.5, min_samples=30).thresholds == [0.0, 0.1, 1.0]
    assert cal.fit_sts_thresholds(samples, 3, target=0.7, min_samples=30).thresholds == [0.0, 1.0, 1.0]
    assert cal.fit_sts_thresholds(samples, 3, target=0.01, min_samples=49).thresholds == [0.0, 0.0, 0.5]
    zero = cal.fit_sts_thresholds([{"pos": 1, "conf": -0.0, "accepted": True}], 2, 0.5, 1).thresholds[1]
    assert zero == 0.0 and math.copysign(1.0, zero) == 1.0  # -0.0 read as 0.0: no sign in the JSON
    with pytest.raises(ValueError):
        cal.fit_sts_thresholds(samples, gamma=0)


# --- the calibration file ------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dspark"}))
    return tmp_path


def test_calibration_file_roundtrip(checkpoint):
    fit = cal.fit_sts_thresholds([(1, 0.4, True)] * 3 + [(1, 0.2, False)] * 3 + [(2, math.inf, True)],
                                 gamma=3, target=0.5, min_samples=2)
    path = cal.write_calibration(checkpoint, fit, temperatures=[1.0, 1.5, 0.75])
    assert path == checkpoint / "calibration.json" and path.parent == checkpoint
    expected = {"format": cal.FORMAT, "thresholds": [0.0, 0.2, 0.0], "target": 0.5, "samples": 7,
                "gamma": 3, "min_samples": 2, "samples_by_position": [0, 6, 0],
                "temperatures": [1.0, 1.5, 0.75]}
    assert DeepDiff(json.loads(path.read_text()), expected) == {}
    assert DeepDiff(cal.load_calibration(checkpoint), expected) == {}
    assert cal.read_calibration(checkpoint) == [0.0, 0.2, 0.0]
    first = path.read_bytes()
    cal.write_calibration(checkpoint, fit, temperatures=[1.0, 1.5, 0.75])
    assert path.read_bytes() == first  # same fit -> same bytes
    assert sorted(p.name for p in checkpoint.iterdir()) == ["calibration.json", "config.json"]


def test_calibration_file_atomic_and_validated(checkpoint, tmp_path_factory, monkeypatch):
    assert cal.read_calibration(checkpoint) is None  # uncalibrated checkpoint
    old = cal.fit_sts_thresholds([], gamma=2)
    cal.write_calibration(checkpoint, old)
    before = (checkpoint / "calibration.json").read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        cal.write_calibration(checkpoint, cal.fit_sts_thresholds([(1, 0.3, True)], 2, 0.5, 1))
    monkeypatch.undo()
    assert (checkpoint / "calibration.json").read_bytes() == before  # old file intact
    assert sorted(p.name for p in checkpoint.iterdir()) == ["calibration.json", "config.json"]  # no temp left
    with pytest.raises(FileNotFoundError):
        cal.write_calibration(tmp_path_factory.mktemp("not-a-checkpoint"), old)
    with pytest.raises(ValueError):
        cal.write_calibration(checkpoint, old, temperatures=[1.0])
    (checkpoint / "calibration.json").write_text(json.dumps({"format": cal.FORMAT, "gamma": 2, "thresholds": [0]}))
    with pytest.raises(ValueError):
        cal.read_calibration(checkpoint)


# ================================================================================================
# STS


class StsCase(NamedTuple):
    blocks: list
    gamma: int


@st.composite
def sts_cases(draw):
    """Held-out rounds: each drafts 1..gamma positions with confidences c; acceptance follows a
    head that is over- or under-confident by a power (accepted while u_i < c_i ** power)."""
    gamma = draw(st.integers(1, 4))
    power = draw(st.sampled_from([0.5, 1.0, 2.0, 4.0]))
    blocks = []
    for _ in range(draw(st.integers(0, 30))):
        n = draw(st.integers(1, gamma))
        confs = draw(st.lists(conf_st, min_size=n, max_size=n))
        accepted = 0
        while accepted < n and draw(st.floats(0, 1)) < confs[accepted] ** power:
            accepted += 1
        blocks.append((confs, accepted))
    return StsCase(blocks, gamma)


def sts_fit_variant(blocks, gamma, bug=None, grid=cal.DEFAULT_GRID, n_bins=10):
    """The STS fit transcribed from §3.2.1, with one planted bug when `bug` is set."""
    temps = np.array(sorted(set(grid) | {1.0}))
    temps = temps[sorted(range(len(temps)), key=lambda i: (abs(math.log(temps[i])), temps[i]))]
    fitted = []
    for k in range(gamma):
        rows = [(np.array(c[: k + 1], dtype=float), a) for c, a in blocks if len(c) > k]
        if not rows:
            fitted.append(1.0)
            continue
        conf = np.stack([c for c, _ in rows])
        labels = np.array([a > k for _, a in rows], dtype=float)
        if bug == "raw-predecessors":  # the product uses the UNcalibrated earlier positions
            prefix = np.prod(conf[:, :k], axis=1)
        else:
            prefix = cal.survival(cal.apply_sts(conf[:, :k], fitted))[:, -1] if k else np.ones(len(rows))
        pred = prefix[None, :] * cal._sigmoid(cal._logit(conf[:, k])[None, :] / temps[:, None])
        errs = cal._ece_rows(pred, labels, n_bins)
        fitted.append(float(temps[int(np.flatnonzero(errs <= errs.min() + cal.ECE_TIE)[0])]))
    return fitted


def apply_inverted_logit(confidences, temperatures):
    """A sign slip: logit written log(1-c) - log(c)."""
    c = np.asarray(confidences, dtype=float)
    with np.errstate(divide="ignore"):
        z = np.log1p(-c) - np.log(c)
    return cal._sigmoid(z / np.asarray(temperatures, dtype=float)[: c.shape[-1]])


def prop_sts_order_preserving(fit, apply, ex):
    """Within each position the calibrated confidence is a non-decreasing map [0,1] -> [0,1] of
    the raw one (the head's ranking survives calibration)."""
    case, probes = ex
    temps = fit(case.blocks, case.gamma)
    assert len(temps) == case.gamma and all(math.isfinite(t) and t > 0 for t in temps)
    xs = np.sort(np.array(probes + [0.0, 1.0]))
    for k in range(case.gamma):
        grid = np.full((len(xs), case.gamma), 0.5)
        grid[:, k] = xs
        out = apply(grid, temps)[:, k]
        assert np.all((out >= 0) & (out <= 1))
        assert np.all(np.diff(out) >= 0), (k, temps[k], xs, out)


def prop_sts_ece_not_above(fit, case):
    """On the fit set, every position's cumulative-product ECE is <= the ECE with that position
    left uncalibrated (T_k = 1, earlier positions as fitted); for position 1 that is the raw ECE."""
    temps = fit(case.blocks, case.gamma)
    fitted = cal.sts_ece_by_position(case.blocks, temps)
    raw = cal.sts_ece_by_position(case.blocks, [1.0] * case.gamma)
    assert fitted[0] <= raw[0] + cal.ECE_TIE
    for k in range(case.gamma):
        base = cal.sts_ece_by_position(case.blocks, list(temps[:k]) + [1.0])[k]
        assert fitted[k] <= base + cal.ECE_TIE, (k, fitted[k], base, temps)


sts_probe_cases = st.tuples(sts_cases(), st.lists(conf_st, max_size=12))


@pytest.mark.property
@given(sts_probe_cases)
def test_sts_order_preserving(ex):
    prop_sts_order_preserving(cal.fit_sts_temperatures, cal.apply_sts, ex)


@pytest.mark.property
def test_sts_order_preserving_control():
    must_fail(lambda ex: prop_sts_order_preserving(cal.fit_sts_temperatures, apply_inverted_logit, ex),
              sts_probe_cases)


@pytest.mark.property
@given(sts_cases())
def test_sts_ece_not_above_uncalibrated(case):
    prop_sts_ece_not_above(cal.fit_sts_temperatures, case)


@pytest.mark.property
def test_sts_ece_control():
    must_fail(lambda case: prop_sts_ece_not_above(
        lambda b, g: sts_fit_variant(b, g, bug="raw-predecessors"), case), sts_cases())


@pytest.mark.property
@given(sts_cases())
def test_sts_equals_transcription(case):
    assert cal.fit_sts_temperatures(case.blocks, case.gamma) == sts_fit_variant(case.blocks, case.gamma)


def test_sts_fixes_an_overconfident_head_and_the_literal_claim_is_not_a_theorem():
    # An overconfident head: says .9, survives half the time -> T > 1 pulls it to ~.5.
    blocks = [([0.9], 1), ([0.9], 0)] * 20
    (t,) = cal.fit_sts_temperatures(blocks)
    assert t > 1 and cal.sts_ece_by_position(blocks, [t])[0] < 0.05 < cal.sts_ece_by_position(blocks, [1.0])[0]
    # Left-to-right fitting can leave a LATER position above its raw ECE: one round (.1, .5),
    # first accepted. T_1 = 16 lifts position 1 (ECE .9 -> .53) but position 2's raw product .05
    # (label 0) becomes .47 x sigma(0) = .23 whatever T_2 is, since logit(.5) = 0.
    blocks = [([0.1, 0.5], 1)]
    temps = cal.fit_sts_temperatures(blocks)
    fitted, raw = cal.sts_ece_by_position(blocks, temps), cal.sts_ece_by_position(blocks, [1.0, 1.0])
    assert temps[0] == 16.0 and fitted[0] < raw[0] and fitted[1] > raw[1]
    assert np.allclose(cal.apply_sts([[0.0, 0.5, 1.0]], [3.0, 0.2, 7.0]), [[0.0, 0.5, 1.0]])
    with pytest.raises(ValueError):
        cal.apply_sts([0.5, 0.5], [1.0])
    with pytest.raises(ValueError):
        cal.fit_sts_temperatures([([1.2], 1)])


# ================================================================================================
# Algorithm 1


class SchedCase(NamedTuple):
    confs: list
    sps: dict


@st.composite
def sched_cases(draw, log_concave=False):
    """Requests with 0..3 drafts each; an SPS table over every batch size the schedule can reach.
    log_concave: SPS(R) > 0 then non-increasing ratios SPS(B+1)/SPS(B) in (0, 1]."""
    R = draw(st.sampled_from([1, 1, 2, 3]))
    confs = [draw(st.lists(conf_st, max_size=3)) for _ in range(R)]
    top = R + sum(len(c) for c in confs)
    if log_concave:
        ratio = st.one_of(st.floats(0.5, 1.0), st.floats(0.05, 1.0))  # light load (near 1) is where it matters
        ratios = sorted(draw(st.lists(ratio, min_size=top - R, max_size=top - R)), reverse=True)
        sps = {R: draw(st.floats(0.1, 100))}
        for i, rho in enumerate(ratios):
            sps[R + i + 1] = sps[R + i] * rho
    else:
        sps = {b: draw(st.floats(0.01, 10)) for b in range(R, top + 1)}
    return SchedCase(confs, sps)


resampled_cases = st.tuples(sched_cases(), conf_st)  # a case, and a value to put in place of a c_{r,j}


def alg1(confs, sps, bug=None):
    """Algorithm 1 transcribed from the paper, with one planted bug when `bug` is set."""
    R = len(confs)
    surv = [[float(x) for x in np.cumprod(np.array(c, dtype=float))] for c in confs]
    key = confs if bug == "sort-by-conditional" else surv
    pool = sorted((-key[r][j - 1], r, j) for r in range(R) for j in range(1, len(confs[r]) + 1)
                  if surv[r][j - 1] > 0)
    lengths, batch, tau = [0] * R, R, float(R)
    best, best_l, best_b, best_t, evaluated = tau * sps[batch], tuple(lengths), batch, tau, 0
    for _, r, j in pool:
        evaluated += 1
        lengths[r], batch = j, batch + 1
        tau += confs[r][j - 1] if bug == "gain-conditional" else surv[r][j - 1]
        theta = tau * sps[batch]
        if theta > best:
            best, best_l, best_b, best_t = theta, tuple(lengths), batch, tau
        elif bug != "no-early-stop":
            if bug == "commit-breaker":  # records l* <- l for the candidate that stopped the scan
                best_l = tuple(lengths)
            break
    return cal.Schedule(best_l, best, best_b, best_t, evaluated)


def sched_bug(bug):
    return lambda confs, sps: alg1(confs, sps, bug)


def _survival(confs):
    return [list(itertools.accumulate(c, lambda x, y: x * y)) for c in confs]


def prop_selected_prefixes(sched, case):
    """Lengths in 0..gamma_r; what is verified is a prefix of each block, only tokens with a > 0,
    and the top of the global survival order; batch/tau/Theta describe exactly those lengths."""
    s = sched(case.confs, case.sps)
    R, surv = len(case.confs), _survival(case.confs)
    assert len(s.lengths) == R
    assert all(0 <= n <= len(c) for n, c in zip(s.lengths, case.confs))
    admitted = [a[j] for a, n in zip(surv, s.lengths) for j in range(n)]
    rest = [a[j] for a, n in zip(surv, s.lengths) for j in range(n, len(a)) if a[j] > 0]
    assert all(x > 0 for x in admitted)
    assert not admitted or not rest or min(admitted) >= max(rest)
    assert s.batch == R + sum(s.lengths)
    assert math.isclose(s.expected_tokens, R + math.fsum(admitted), rel_tol=1e-9)
    assert math.isclose(s.throughput, cal.throughput(case.confs, s.lengths, case.sps), rel_tol=1e-9)


def prop_not_worse_than_no_drafts(sched, case):
    s = sched(case.confs, case.sps)
    none = cal.throughput(case.confs, [0] * len(case.confs), case.sps)
    assert cal.throughput(case.confs, s.lengths, case.sps) >= none * (1 - 1e-12)


def prop_equals_brute_force(sched, case):
    """Greedy = exhaustive optimum when SPS is positive, non-increasing and log-concave over the
    reachable batch sizes (the paper's "Theta unimodal" made concrete). Why: for m admitted tokens
    the best tau is R + (sum of the m largest a), which the greedy order reaches; log(that) is
    concave in m (increments non-increasing) and log SPS(R+m) is concave, so log Theta(m) is
    concave: the first step that does not improve is the global maximum. Non-increasing SPS makes
    verifying a zero-survival token never pay, so the exhaustive search over all lengths agrees.
    Checked at the case's curve and at lighter/heavier loads SPS(R) (SPS(B)/SPS(R))^p, which keep
    the condition."""
    R = len(case.confs)
    for p in (1.0, 0.25, 0.5, 2.0, 4.0):
        sps = {b: case.sps[R] * (v / case.sps[R]) ** p for b, v in case.sps.items()}
        s = sched(case.confs, sps)
        best = max(cal.throughput(case.confs, ls, sps)
                   for ls in itertools.product(*(range(len(c) + 1) for c in case.confs)))
        got = cal.throughput(case.confs, s.lengths, sps)
        assert math.isclose(got, best, rel_tol=1e-9), (p, got, best, s)


def prop_non_anticipating(sched, ex):
    """Admitting draft k of request r (l_r >= k) never depends on c_{r,j} for j > k, which are
    functions of the not-yet-verified draft k itself (Markov confidence): replacing any c_{r,j}
    (by 0, 1 or the drawn value) leaves min(l_r, j-1) unchanged."""
    case, value = ex
    before = sched(case.confs, case.sps).lengths
    for r, conf in enumerate(case.confs):
        for j in range(1, len(conf) + 1):
            for v in (0.0, 1.0, value):
                confs = [list(c) for c in case.confs]
                confs[r][j - 1] = v
                after = sched(confs, case.sps).lengths[r]
                assert min(before[r], j - 1) == min(after, j - 1), (r, j, v, before[r], after)


APPENDIX_A_SPS = {1: 1.0, 2: 0.5, 3: 0.45}


def check_appendix_a(sched):
    """Appendix A: R = 1, gamma = 2, a_1 = .8, SPS(1..3) = 1, .5, .45. Theta_0 = 1 > Theta_1 = .9,
    so the scan stops before c_2 (a function of x_1) is looked at: l = 0 for c_2 = .9 and c_2 = 0."""
    high = sched([[0.8, 0.9]], APPENDIX_A_SPS)
    low = sched([[0.8, 0.0]], APPENDIX_A_SPS)
    assert high.lengths == low.lengths == (0,)
    assert high.throughput == low.throughput == 1.0
    assert high.evaluated == 1


ALG1_PROPS = {
    # property: (body, strategy, planted bug that must fail it)
    "selected_prefixes": (prop_selected_prefixes, sched_cases(), "sort-by-conditional"),
    "not_worse_than_no_drafts": (prop_not_worse_than_no_drafts, sched_cases(), "commit-breaker"),
    "equals_brute_force": (prop_equals_brute_force, sched_cases(log_concave=True), "gain-conditional"),
    "non_anticipating": (prop_non_anticipating, resampled_cases, "no-early-stop"),
}


@pytest.mark.property
@given(sched_cases())
def test_alg1_selected_prefixes(case):
    prop_selected_prefixes(cal.schedule_prefix, case)


@pytest.mark.property
@given(sched_cases())
def test_alg1_not_worse_than_no_drafts(case):
    prop_not_worse_than_no_drafts(cal.schedule_prefix, case)


@pytest.mark.property
@given(sched_cases(log_concave=True))
def test_alg1_equals_brute_force_when_log_concave(case):
    prop_equals_brute_force(cal.schedule_prefix, case)


@pytest.mark.property
@given(resampled_cases)
def test_alg1_non_anticipating(ex):
    prop_non_anticipating(cal.schedule_prefix, ex)


@pytest.mark.property
@pytest.mark.parametrize("name", sorted(ALG1_PROPS))
def test_alg1_control(name):
    prop, strategy, bug = ALG1_PROPS[name]
    must_fail(lambda ex: prop(sched_bug(bug), ex), strategy)


@pytest.mark.property
@given(sched_cases())
def test_alg1_equals_transcription(case):
    port, paper = cal.schedule_prefix(case.confs, case.sps), alg1(case.confs, case.sps)
    assert DeepDiff(port, paper, math_epsilon=1e-12) == {}


def test_alg1_appendix_a_early_stop():
    check_appendix_a(cal.schedule_prefix)
    assert math.isclose(cal.throughput([[0.8, 0.9]], [1], APPENDIX_A_SPS), 0.9)


@pytest.mark.property
def test_alg1_appendix_a_control():
    """Without the break (the retrospective global search) the paper's two cases split: l = 2
    with Theta_2 = 1.134 for c_2 = .9, l = 0 for c_2 = 0: x_1's admission depends on x_1."""
    retro = sched_bug("no-early-stop")
    must_fail(lambda _: check_appendix_a(retro), fixed=[None])
    high, low = retro([[0.8, 0.9]], APPENDIX_A_SPS), retro([[0.8, 0.0]], APPENDIX_A_SPS)
    assert high.lengths == (2,) and math.isclose(high.throughput, 1.134) and low.lengths == (0,)


def test_alg1_edges():
    assert cal.schedule_prefix([], {}) == cal.Schedule((), 0.0, 0, 0.0, 0)
    flat = {b: 1.0 for b in range(2, 8)}  # verification free: take everything with a > 0
    s = cal.schedule_prefix([[0.9, 0.0, 0.9], [1.0, 1.0]], flat)
    assert s.lengths == (1, 2) and s.batch == 5 and math.isclose(s.expected_tokens, 4.9)
    assert cal.schedule_prefix([[0.5]], lambda b: 10.0 / b).lengths == (0,)  # callable table
    with pytest.raises(ValueError):
        cal.schedule_prefix([[0.5, 1.5]], flat)
    with pytest.raises(ValueError):
        cal.schedule_prefix([[0.9, 0.9, 0.9]], {1: 1.0, 2: 1.0})  # table too short

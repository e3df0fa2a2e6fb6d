"""The sampled cases' check (spec_parity/sampled.py), judged on arrays made here: one distribution
passes, a shifted one fails, a sample too small for the stated power fails, and anything but
non-negative integers (NaN included) cannot pass; the statistics' coding, and every sampled case
planting and seeing each rule-bug family."""

import numpy as np
import pytest

from spec_parity import checks, harness
from spec_parity.compare import Result
from spec_parity.controls.sampling import FAMILIES, MODES
from spec_parity.sampled import (
    BUG_FAMILIES,
    FAMILY_ALPHA,
    Distribution,
    first_round_end,
    match_statistics,
)


def _judge(port, ref, max_bias=None) -> Result:
    result = Result("dspark", "t", "golden", "L2")
    plan = checks.Plan([Distribution("first", checks.P("x"), checks.R("x"), FAMILY_ALPHA, max_bias)])
    checks.judge(plan, {"port": {"x": port}, "ref": {"x": ref}}, "dspark", "float32", result)
    return result


def _draws(p, n, seed):
    return np.random.default_rng(seed).choice(len(p), n, p=p).astype(np.int32)


P = [0.5, 0.3, 0.2]


@pytest.mark.slow
def test_same_distribution_passes_and_a_shift_fails():
    assert _judge(_draws(P, 600, 1), _draws(P, 600, 2)).verdict == "PASS"
    shifted = _judge(_draws([0.3, 0.3, 0.4], 600, 1), _draws(P, 600, 2))
    assert shifted.verdict == "FAIL" and "differs" in shifted.reason


@pytest.mark.slow
def test_too_few_samples_for_the_stated_power_fail():
    assert _judge(_draws(P, 600, 1), _draws(P, 600, 2), max_bias=0.5).verdict == "PASS"
    small = _judge(_draws(P, 20, 1), _draws(P, 20, 2), max_bias=0.1)
    assert small.verdict == "FAIL" and "too few samples" in small.reason


@pytest.mark.parametrize("bad", [np.array([0.0, np.nan, 1.0]), np.array([-1, 0, 1], np.int32),
                                 np.array([], np.int32)])
def test_non_integer_or_negative_samples_never_pass(bad):
    assert _judge(bad, _draws(P, 30, 2)).verdict == "FAIL"


def test_match_statistics_refuses_a_short_round_before_M():
    assert match_statistics([[(2, 2), (2, 0), (2, 1), (2, 2)]], 2, 10)["sampled.rounds_to_M"].tolist() == [3]
    with pytest.raises(ValueError, match="drafted 1"):
        match_statistics([[(2, 0), (1, 0), (2, 2)]], 2, 10)


def test_first_round_end_codes_correction_bonus_and_not_reached():
    end = first_round_end([(3, 1, 7), (3, 3, 7), (0, 0, 5), (2, 1, None)], 10)["sampled.end"]
    assert end.tolist() == [7, 17, 15, 20]


@pytest.mark.parametrize("module,mode", [("dspark", "rejection"), ("assistant", "match")])
def test_each_sampled_case_plants_and_sees_every_rule_bug_family(module, mode):
    """Every sampled case has a control of each rule-bug family in the matrix, each control changes
    the rule the case runs, and the case's statistics see every family."""
    cases = [c for c in harness.pair(module).cases() if c.params.KIND == "sampled"]
    for base in [c for c in cases if not c.control]:
        bugs = [c.control["bug"] for c in cases if c.control and c.control["base"] == base.name]
        assert {FAMILIES[b] for b in bugs} == set(BUG_FAMILIES), f"{base.name}: controls {bugs}"
        assert all(mode in MODES[b] for b in bugs), f"{base.name}: a control the {mode} rule never runs"
        plan = harness.pair(module).plan(base, {})
        seen = {f for d in plan.checks for f in d.sees}
        assert seen == set(BUG_FAMILIES), f"{base.name}: statistics see only {sorted(seen)}"

"""Where a case's time goes: every phase of harness.evaluate is timed onto the result, and the
phases cover the case's wall time (a phase left out of the record would hide where it went)."""

import time

from spec_parity import harness


def _case(name):
    return next(c for c in harness.all_cases(["targets"]) if c.name == name)


def test_phases_cover_the_case():
    t0 = time.perf_counter()
    result = harness.evaluate(_case("qwen3"), "golden")
    wall = time.perf_counter() - t0
    assert set(result.phases) == {"factory", "reference", "port", "compare"}
    assert all(s >= 0 for s in result.phases.values())
    assert 0.9 * wall <= sum(result.phases.values()) <= wall + 1e-3
    assert result.to_json()["phases"] == result.phases


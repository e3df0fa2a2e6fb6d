"""Where a run's time goes: every phase of harness.evaluate is timed onto the result, and the
phases cover the case's wall time (a phase left out of the record would hide where it went)."""

import time

import pytest

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



def test_a_factory_reference_runs_on_one_torch_thread():
    """Tiny references on one torch thread (a second only adds handoffs), the caller's count restored."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with harness.one_torch_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

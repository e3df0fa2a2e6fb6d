"""The target pair on a real checkpoint given by path (SPEC_PARITY_TARGET), against the live oracle."""

import os

import pytest

from spec_parity import harness
from spec_parity.cli import _fits
from spec_parity.pairs import targets as pair

TARGET = os.environ.get("SPEC_PARITY_TARGET")


@pytest.mark.real
@pytest.mark.oracle
def test_real_target(live_oracle):
    if not TARGET:
        pytest.skip("set SPEC_PARITY_TARGET=/path/to/checkpoint to run the target pair on real weights")
    live_oracle("targets")
    cases = [c.on_path(TARGET) for c in pair.cases() if not c.control and _fits(c, TARGET)]
    assert cases, f"{TARGET}: no built-in case for this model family"
    for case in cases:
        result = harness.evaluate(case, "live")
        assert result.ok, result.message()

"""The planted-bug control of a property test, shared by tests/test_ab.py and
tests/test_calibration.py (a helper module: no tests here)."""

import pytest
from hypothesis import Phase, find, settings

CONTROL_SETTINGS = settings(database=None, deadline=None, derandomize=True,
                            max_examples=settings.get_profile("ci").max_examples, phases=[Phase.generate])


def must_fail(prop, strategy=None, fixed=()):
    """Planted-bug control: `prop(example)` must raise AssertionError on some example: one of
    `fixed`, or one that hypothesis `find` draws from the property's own strategy within the
    default example count (no database, derandomized, no shrinking: the same search every run).
    Returns the counterexample."""

    def fails(ex) -> bool:
        try:
            prop(ex)
        except AssertionError:
            return True
        return False

    hits = [ex for ex in fixed if fails(ex)]
    if hits:
        found = hits[0]
    else:
        assert strategy is not None, "no fixed example fails and no strategy to search"
        found = find(strategy, fails, settings=CONTROL_SETTINGS)
    with pytest.raises(AssertionError):
        prop(found)
    return found

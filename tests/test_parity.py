"""Every pair's cases (spec_parity.harness.all_cases(), ids `module/case`): port vs reference,
once against the committed golden (no reference needed) and once against the live reference
(skipped with one line naming what to install/set when it cannot run here). A case must pass
and a negative control must be caught; a control that names the layer it perturbs must be
caught first at that layer.

The slow marks are the harness's (`harness.params`): the dev loop runs every module case and
control and the first serve loop of each checkpoint kind, per module against the goldens and per
reference live (z-lab's torch twins have their own first loops live; against the goldens they
repeat their MLX twins'). Checking a port (--port / --port-cmd, handed in by the `selection`
fixture) runs every case of its modules but their negative controls, golden and live, and
`-m oracle` every live case (conftest.py). The live cases of z-lab's torch reference carry
`tf515`: they need transformers 5.15 (`tox -e oracle-tf515`)."""

import pytest

from spec_parity import harness
from spec_parity.drafters.dflash import pair as dflash


def _params(group, extra_marks=lambda case: (), keep=lambda case: True) -> list:
    """The cases `keep` keeps, id `module/case`, marked by `harness.params` over their group and
    `parity(module)` (conftest.py: a port's module runs whole, the others are deselected)."""
    groups: dict = {}
    for case in filter(keep, harness.all_cases()):
        groups.setdefault(group(case), []).append(case)
    return [pytest.param(case, id=case.id, marks=[*p.marks, *extra_marks(case), pytest.mark.parity(case.module)])
            for cases in groups.values() for p in harness.params(cases) for case in p.values]


def _tf515(case) -> tuple:
    return (pytest.mark.tf515,) if case.module == "dflash" and case.oracle == dflash.TORCH else ()


def _check(case, result, require):
    harness.check(case, result, require)
    if case.control and "layer" in case.control:
        assert result.metrics["layers"]["first_divergent_layer"] == case.control["layer"], result.message()


@pytest.mark.golden
@pytest.mark.parametrize("case", _params(lambda case: case.module))
def test_vs_golden(case, selection, require):
    _check(case, harness.evaluate(case, "golden", selection), require)


@pytest.mark.oracle
@pytest.mark.parametrize("case", _params(lambda case: (case.module, case.oracle), _tf515, harness.runs_live))
def test_vs_live(case, selection, live_oracle, require):
    live_oracle(case.module, case.oracle)
    _check(case, harness.evaluate(case, "live", selection), require)

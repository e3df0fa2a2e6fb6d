"""Every pair's cases (spec_parity.harness.all_cases(), ids `module/case`): port vs reference,
once against the golden (no reference needed) and once against the live reference (skipped with
one line naming what to install/set when it cannot run here). A case must pass and a negative
control must be caught; a control that names the layer it perturbs must be caught first at that
layer. Each test records its verdict and reason as properties (--junitxml writes them).

Collected by the pytest plugin (spec_parity/pytest_plugin.py) in a port's own repository, and by
this repository's tests/test_parity.py; who answers each module and what a pass must have
checked come from the config's stash, which either fills.

The slow marks are the harness's (`harness.params`). The live cases of z-lab's torch reference
carry `tf515`: they need transformers 5.15."""

import pytest

from spec_parity import harness, pytest_plugin
from spec_parity.drafters.dflash import pair as dflash


def _params(group, extra_marks=lambda case: (), keep=lambda case: True) -> list:
    """The cases `keep` keeps, id `module/case`, marked by `harness.params` over their group and
    `parity(module)` (a checked port's module runs whole, the others are deselected)."""
    groups: dict = {}
    for case in filter(keep, harness.all_cases()):
        groups.setdefault(group(case), []).append(case)
    return [pytest.param(case, id=case.id, marks=[*p.marks, *extra_marks(case), pytest.mark.parity(case.module)])
            for cases in groups.values() for p in harness.params(cases) for case in p.values]


def _tf515(case) -> tuple:
    return (pytest.mark.tf515,) if case.module == "dflash" and case.oracle == dflash.TORCH else ()


def need_oracle(module: str, oracle: str = "") -> None:
    """Skips with one line naming what to install/set if `module`'s oracle is absent."""
    name = oracle or harness.pair(module).ORACLE
    status = harness.pair(module).oracle_status(name)
    if status is not None:
        pytest.skip(f"{name} oracle unavailable: {status}")


@pytest.fixture
def parity(request):
    """Judges a case on the port the stash's selection names for its module: records its verdict
    and reason, then fails with the verdict's message (no traceback: the message is the finding)
    unless it is what the case expects."""
    config = request.config

    def run(case, source: str):
        result = harness.evaluate(case, source, config.stash[pytest_plugin.SELECTION])
        request.node.user_properties += [("verdict", result.verdict), ("reason", result.reason)]
        try:
            harness.check(case, result, config.stash[pytest_plugin.REQUIRE])
        except AssertionError as e:
            pytest.fail(str(e), pytrace=False)
        want = case.control.get("layer") if case.control else None
        if want is not None and (got := result.metrics["layers"]["first_divergent_layer"]) != want:
            pytest.fail(f"negative control caught first at layer {got}, not at layer {want} where it plants "
                        f"its bug:\n{result.message()}", pytrace=False)

    return run


@pytest.mark.golden
@pytest.mark.parametrize("case", _params(lambda case: case.module))
def test_vs_golden(case, parity):
    parity(case, "golden")


@pytest.mark.oracle
@pytest.mark.parametrize("case", _params(lambda case: (case.module, case.oracle), _tf515, harness.runs_live))
def test_vs_live(case, parity):
    need_oracle(case.module, case.oracle)
    parity(case, "live")

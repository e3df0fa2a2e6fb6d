"""The one path every module takes: Case -> run(oracle) / run(port) -> compare(tier) -> record.

A pair is a module in `spec_parity.pairs` exposing:
  NAME                     the module name (port/NAME.py, oracles/NAME.py, fixtures/NAME/)
  ORACLE                   the default reference's name (a case may name another: case.oracle)
  cases() -> list[Case]    its built-in cases (controls included)
  oracle_status(oracle) -> str|None   None if that reference runs here, else what to install/set
  run_oracle(case) -> (arrays, provenance)
  run_port(case, ref) -> arrays        (ref: the reference arrays, for teacher-forced modes; a
                           control's bug is planted around it: spec_parity.controls)
                           both functions of their arguments alone: `live` and `port_run` run
                           each once per process and key (spec_parity.shared)
  compare(case, port, ref, result)     fills the Result
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

from . import controls, goldens, shared
from .case import Case
from .compare import Result

PAIRS = ("targets", "assistant", "dspark", "dflash")


def pair(module: str):
    if module not in PAIRS:
        raise KeyError(f"unknown module {module!r}; known: {list(PAIRS)}")
    return importlib.import_module(f"spec_parity.pairs.{module}")


def all_cases(modules: Iterable[str] = PAIRS) -> list[Case]:
    return [c for m in modules for c in pair(m).cases()]


def reference(case: Case, source: str = "auto"):
    """The reference arrays, a short label saying where they came from, and the reference's
    versions (recorded in the result's metrics).

    source: "live" runs the reference (error if it cannot run here), "golden" reads fixtures,
    "auto" prefers live and falls back to goldens.
    """
    name = oracle_name(case)
    status = pair(case.module).oracle_status(name)
    if source == "live" or (source == "auto" and status is None):
        if status is not None:
            raise RuntimeError(f"{name} cannot run here: {status}")
        arrays, provenance = live(case)
        return arrays, f"{name} (live)", provenance["reference"]["versions"]
    if case.path:
        raise RuntimeError(f"{case.id} is on a real checkpoint: it needs the live {name} ({status})")
    arrays, manifest = goldens.load(case)
    return arrays, f"{name} (golden)", manifest.get("reference", {}).get("versions", {})


def live(case: Case):
    """run_oracle(case), once per process for each manifest (spec_parity.shared). A case on a real
    checkpoint runs every time (its manifest would hash the weights, its arrays are large)."""
    run = pair(case.module).run_oracle
    if case.path:
        return run(case)
    return shared.once(("oracle", oracle_name(case), shared.manifest_key(case)), lambda: run(case))


def port_run(case: Case, ref: dict) -> dict:
    """run_port(case, ref) under the case's control (spec_parity.controls), once per process for each
    case and reference bytes (spec_parity.shared)."""
    def run():
        with controls.applied(case):
            return pair(case.module).run_port(case, ref)

    if case.path:
        return run()
    return shared.once(("port", shared.case_key(case), shared.digest(ref)), run)


def params(cases: list[Case]) -> list:
    """`cases` as pytest params (id: the case name) for a module's golden and live tests. The dev
    loop (plain `pytest`) runs every module case, every control and its base case, and the first
    serve-loop case of each checkpoint kind; the module's other serve-loop cases (the same loop on
    another gamma, EOS, window, head or torch twin) are `slow`: `pytest --slow` and CI run them."""
    import pytest

    loops = [c for c in cases if c.params.get("loop") and not c.control]
    first: dict[str, str] = {}
    for c in loops:
        first.setdefault(c.kind, c.name)
    slow = {c.name for c in loops} - set(first.values()) - {c.control["base"] for c in cases if c.control}
    return [pytest.param(c, id=c.name, marks=pytest.mark.slow if c.name in slow else ()) for c in cases]


def slow_except(values, *keep) -> list:
    """Parametrize values (plain, tuples or pytest.param) of a test whose every variant costs a
    serve loop or more: those whose first value or whole tuple of values is in `keep` stay in the
    dev loop, the others are marked `slow` (their own marks kept)."""
    import pytest
    from _pytest.mark import ParameterSet

    out = []
    for v in values:
        ps = v if isinstance(v, ParameterSet) else pytest.param(*(v if isinstance(v, tuple) else (v,)))
        out.append(ps if ps.values[0] in keep or tuple(ps.values) in keep else
                   pytest.param(*ps.values, id=ps.id, marks=[*ps.marks, pytest.mark.slow]))
    return out


def oracle_name(case: Case) -> str:
    return case.oracle or pair(case.module).ORACLE


def evaluate(case: Case, source: str = "auto") -> Result:
    p = pair(case.module)
    ref, label, versions = reference(case, source)
    result = Result(case.module, case.name, label, case.tier)
    result.metrics["reference"] = {"ok": True, "versions": versions}
    port = port_run(case, ref)
    p.compare(case, port, ref, result)
    if case.control:
        result.note(f"negative control ({case.control['what']}): expected to fail")
    return result


def check(case: Case, result: Result) -> None:
    """The test-side verdict: a case must pass, a negative control must be caught."""
    if result.verdict != case.expect:
        lead = "negative control was not caught" if case.control else "parity failed"
        raise AssertionError(f"{lead}:\n{result.message()}")


def regen(case: Case) -> str:
    """Write the golden of `case` from the live reference (controls share their base's golden)."""
    p = pair(case.module)
    status = p.oracle_status(oracle_name(case))
    if status is not None:
        raise RuntimeError(f"cannot regenerate {case.id}: {status}")
    arrays, provenance = p.run_oracle(case)
    return str(goldens.save(case, arrays, provenance))


def cpu_count_threads() -> None:
    """Keep torch from oversubscribing the 2-core CI machine under pytest-xdist."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")

"""spec-parity as a pytest plugin (pyproject's `pytest11` entry point), for a port's own
repository: `pytest --spec-parity-port dflash=mypkg.adapter:make_port` (or the ini option
`spec_parity_port`) collects one test per case of that module (its negative controls aside: they
plant bugs in our port), against the goldens and the live reference (`--spec-parity-source`), the
verdict's message as the failure text and its verdict and reason as JUnit properties.

Without a port named it adds its options and nothing else. The tests are spec_parity/parity_tests.py,
the ones this repository's tests/test_parity.py runs (its conftest.py fills the same stash from
--port)."""

from __future__ import annotations

from pathlib import Path

import pytest

SELECTION = pytest.StashKey["ports.Selection"]()
"""Who answers each module's parity cases (spec_parity.ports.Selection)."""
REQUIRE = pytest.StashKey[tuple]()
"""What a parity case's pass must have checked, as harness.check reads it."""
TESTS = Path(__file__).with_name("parity_tests.py")
MARKERS = ("parity(module): a parity case of `module` (spec_parity/parity_tests.py)",
           "golden: compares against the goldens shipped with spec-parity",
           "oracle: needs a live reference implementation (skips with one line naming what to install/set)",
           "slow: a parity case that runs a serve loop or samples",
           "tf515: needs transformers 5.15 (z-lab's torch DFlash reference)")


def pytest_addoption(parser):
    group = parser.getgroup("spec-parity", "checking a port with spec-parity")
    group.addoption("--spec-parity-port", action="append", default=[], metavar="MODULE=SPEC",
                    help="run every parity case of MODULE on this port (pkg.module:make_port or a registered "
                         "name); repeat per module. Without it (or the ini option) the plugin collects nothing")
    group.addoption("--spec-parity-source", choices=("live", "golden"),
                    help="only the cases against the goldens, or only those against the live reference "
                         "(default: both; a live case skips with one line where its reference is absent)")
    group.addoption("--spec-parity-require", choices=("outputs", "internals"),
                    help="as `spec-parity run --require`: a PASS-PARTIAL fails unless `outputs`; "
                         "`internals` fails it too with the checks not run")
    parser.addini("spec_parity_port", "MODULE=SPEC per line, as --spec-parity-port", type="linelist")


def configure(config, specs: list[str], cmd: str | None, require: str | None) -> None:
    """The selection and requirement the parity tests read, in the config's stash; a spec that
    cannot be used is a one-line usage error. Called by this plugin and by the repository's conftest."""
    from spec_parity import exchange, ports

    try:
        config.stash[SELECTION] = ports.configure(specs, exchange.command_port(cmd) if cmd else None)
    except ports.PortError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[REQUIRE] = (require,) if require else ()
    config.addinivalue_line("markers", MARKERS[0])


def ours_answers(item, ported: tuple[str, ...]) -> bool:
    """A parity case our port answers while another port is checked: its module is not a ported
    one, or it is a negative control (it plants its bug in our port)."""
    mark = item.get_closest_marker("parity")
    if mark is None:
        return False
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    return mark.args[0] not in ported or bool(getattr(case, "control", None))


def pytest_configure(config):
    specs = config.getoption("--spec-parity-port") or config.getini("spec_parity_port")
    if not specs:
        return
    configure(config, specs, None, config.getoption("--spec-parity-require"))
    for line in MARKERS[1:]:
        config.addinivalue_line("markers", line)
    config.pluginmanager.register(_Checking(config.getoption("--spec-parity-source")), "spec-parity-checking")
    config.args.append(str(TESTS))


class _Checking:
    """The hooks of a run that checks a port: only its modules' cases, from the chosen source."""

    def __init__(self, source: str | None):
        self.mark = {"golden": "golden", "live": "oracle", None: None}[source]

    def pytest_collection_modifyitems(self, config, items):
        ported = config.stash[SELECTION].theirs()
        out = [i for i in items if ours_answers(i, ported) or (
            self.mark and i.get_closest_marker("parity") and not i.get_closest_marker(self.mark))]
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [i for i in items if i not in out]

    def pytest_report_header(self, config):
        return f"spec-parity: checking {config.stash[SELECTION].describe()}"

"""Suite-wide options: --regen-goldens, --slow, the one-line skip of a test whose oracle is absent,
the hypothesis profiles, and xdist by default.

Plain `pytest` is the developer loop: the suite under pytest-xdist (`-n auto`) when it is installed,
the `slow` tests deselected and each parametrized test once, hypothesis's `dev` profile. CI (tox) runs
`--slow --hypothesis-profile ci`: every test, hypothesis's default example counts.

Checking a port is not the dev loop: with --port / --port-cmd the parity tests run every case of
the ported modules (golden and live) and none of the others (our port answers those); with `-m`
selecting `oracle` (what a port author runs before merge) every live parity case runs."""

import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores under pytest -n auto: no oversubscription

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import spec_parity  # noqa: E402,F401  (full-fp32 MLX matmuls before any test imports mlx)
from spec_parity import pytest_plugin  # noqa: E402
from spec_parity.pytest_plugin import SELECTION  # noqa: E402

# Hypothesis's wall-clock checks (the per-example deadline, the too_slow health check) fail on a
# 2-core machine under `-n auto` or other load: timing, not the properties. `ci` keeps every other
# setting at hypothesis's default (100 examples); `dev` draws fewer examples per property. The
# planted-bug searches (`find` in tests/test_ab.py, tests/test_calibration.py) use the `ci` count in
# both. `--hypothesis-profile default` restores hypothesis's own settings.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", settings.get_profile("ci"), max_examples=20)
settings.load_profile("dev")


def pytest_addoption(parser):
    parser.addoption("--regen-goldens", action="store_true",
                     help="regenerate every golden from the live references before testing")
    parser.addoption("--slow", action="store_true",
                     help="also run the `slow` tests (deselected by default unless -m names `slow` or the test "
                          "is named by its id); CI runs `pytest --slow --hypothesis-profile ci`")
    parser.addoption("--port", action="append", default=[], metavar="MODULE=SPEC",
                     help="run MODULE's parity cases on another port (pkg.module:make_port or a registered name)")
    parser.addoption("--port-cmd", metavar="CMD", help='a port in any language: "CMD {case} {out}" per case')
    parser.addoption("--require", choices=("outputs", "internals"),
                     help="what a parity case's pass must have checked, as `spec-parity run --require`: a "
                          "PASS-PARTIAL fails unless `outputs`; `internals` fails it too with the checks not run")


def pytest_configure(config):
    """--port / --port-cmd select who answers the parity cases and --require what their pass must
    have checked, as `spec-parity run` does: kept on the config, where the parity tests read them
    (spec_parity/pytest_plugin.py, which fills them from its own options in a port's repository)."""
    pytest_plugin.configure(config, config.getoption("--port"), config.getoption("--port-cmd"),
                            config.getoption("--require"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`-n auto` by default when pytest-xdist is installed and no path is given (the whole suite:
    plain `pytest`, `pytest -m oracle`), unless -n/--dist, --pdb or --collect-only is given. A named
    file or test runs in this process (worker start-up would dominate it)."""
    opt = config.option
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or getattr(opt, "numprocesses", None) is not None or getattr(opt, "dist", "no") != "no"
            or opt.usepdb or opt.collectonly or config.args_source != pytest.Config.ArgsSource.TESTPATHS):
        return
    opt.numprocesses = "auto"


def _slow_selected(config) -> bool:
    return config.getoption("--slow") or re.search(r"\bslow\b", config.option.markexpr or "") is not None


def _oracle_selected(config) -> bool:
    """-m selects `oracle`: a test marked only `oracle` is selected and an unmarked one is not."""
    from _pytest.mark.expression import Expression

    expr = config.option.markexpr
    if not expr:
        return False
    compiled = Expression.compile(expr)
    return compiled.evaluate(lambda name, **kw: name == "oracle") and not compiled.evaluate(lambda name, **kw: False)


def _parity_module(item) -> str | None:
    mark = item.get_closest_marker("parity")
    return mark.args[0] if mark else None


def pytest_collection_modifyitems(config, items):
    """Checking a port: the ported modules' parity cases all run, the other modules' are deselected.
    `-m oracle`: every live parity case runs. The dev loop, for the rest: `slow` tests out, and
    each parametrized test function once (its first parameter set not marked slow); a test named
    by its id runs. --slow: the whole matrix."""
    ported = config.stash[SELECTION].theirs()
    oracle, slow = _oracle_selected(config), _slow_selected(config)
    named = [a for a in config.args if "::" in a]
    keep, out, seen = [], [], set()
    for item in items:
        module = _parity_module(item)
        if ported and pytest_plugin.ours_answers(item, ported):
            out.append(item)
            continue
        whole = slow or module in ported or (oracle and module is not None and item.get_closest_marker("oracle"))
        is_named = any(item.nodeid == a or item.nodeid.startswith(a + "[") for a in named)
        function = item.nodeid.split("[", 1)[0]
        if whole or is_named or not (item.get_closest_marker("slow") or function in seen):
            keep.append(item)
            seen.add(function)
        else:
            out.append(item)
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = keep


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    from spec_parity import protocol

    ported = config.stash[SELECTION].theirs()
    ours = [m for m in protocol.MODULES if m not in ported]
    if ported:
        terminalreporter.write_line(f"checking a port: every parity case of {', '.join(ported)} run (golden and live)"
                                    + (f"; those of {', '.join(ours)} deselected (our port answers them)" if ours else ""))
    if _oracle_selected(config):
        terminalreporter.write_line("-m oracle: every live parity case run (no dev-loop thinning)")
    if not _slow_selected(config):
        terminalreporter.write_line("the dev loop: slow tests and all but one parameter set per test deselected"
                                    f"{' (parity cases aside)' if ported or _oracle_selected(config) else ''}; "
                                    "--slow runs them")


def pytest_sessionstart(session):
    if not session.config.getoption("--regen-goldens") or hasattr(session.config, "workerinput"):
        return
    from spec_parity import harness

    seen = set()
    for case in harness.all_cases():
        if case.control or (case.module, case.golden_name) in seen:
            continue
        seen.add((case.module, case.golden_name))
        harness.regen(case)


@pytest.fixture
def live_oracle():
    """Call with a module name: skips with one line naming what to install/set if its oracle is absent."""
    from spec_parity.parity_tests import need_oracle

    return need_oracle


def pytest_collection_finish(session):
    """The imported modules and collected tests out of the collector's way (gc.freeze): every full
    collection after this, automatic or a bench's own gc.collect, walks only what the tests make."""
    import gc

    gc.freeze()

"""What `pytest` selects, as README and docs/harness.md say: checking a port (--port) runs every
parity case of its module, golden and live, and none of the others; `-m oracle` runs every live
parity case; plain `pytest` (the dev loop) keeps one parameter set per test. Each is read from a
`pytest --collect-only` run in a subprocess (conftest.py's options parsed as a user's would be):
`slow`, as every test that spawns processes is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spec_parity import harness
from spec_parity.drafters.dflash import pair as dflash

ROOT = Path(__file__).resolve().parent.parent
PARITY = "tests/test_parity.py"

pytestmark = pytest.mark.slow


def _collect(*args: str) -> tuple[list[str], str]:
    """The node ids `pytest --collect-only -q ARGS` selects, and its whole output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *args], capture_output=True, text=True, cwd=ROOT, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return [line for line in done.stdout.splitlines() if line.startswith(PARITY + "::")], out


def _ids(test: str, cases) -> set[str]:
    return {f"{PARITY}::{test}[{c.id}]" for c in cases}


def test_a_third_party_port_runs_every_case_of_its_module_and_no_other():
    selected, out = _collect(PARITY, "--port", "dflash=tests.wrapped_port:make_port")
    cases = [c for c in dflash.PAIR.cases() if not c.control]      # the controls plant bugs in our port only
    expected = _ids("test_vs_golden", cases) | _ids("test_vs_live", filter(harness.runs_live, cases))
    assert sorted(selected) == sorted(expected)
    slow = [p.values[0] for p in harness.params(dflash.PAIR.cases()) if p.marks and not p.values[0].control]
    assert slow and _ids("test_vs_golden", slow) <= set(selected)    # the ones --slow used to need
    assert "every parity case of dflash run" in out
    assert "those of targets, assistant, dspark deselected (our port answers them)" in out


def test_control_the_dev_loop_still_keeps_one_case_per_test():
    selected, out = _collect(PARITY)
    assert sorted(s.split("[")[0] for s in selected) == [f"{PARITY}::test_vs_golden", f"{PARITY}::test_vs_live"]
    assert "checking a port" not in out and "-m oracle" not in out


def test_m_oracle_runs_every_live_parity_case():
    selected, out = _collect(PARITY, "-m", "oracle")
    assert sorted(selected) == sorted(_ids("test_vs_live", filter(harness.runs_live, harness.all_cases())))
    assert "-m oracle: every live parity case run" in out


def test_control_m_not_oracle_is_still_the_dev_loop():
    selected, _ = _collect(PARITY, "-m", "not oracle")
    assert [s.split("[")[0] for s in selected] == [f"{PARITY}::test_vs_golden"]


def test_a_port_spec_that_cannot_load_is_a_one_line_usage_error():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", PARITY, "--port",
                           "dflash=nosuch:make_port"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 4, done.stdout + done.stderr      # pytest's usage error
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "port 'nosuch:make_port' cannot be imported" in lines[0], done.stderr


@pytest.mark.parametrize("require, rc", [((), 1), (("--require", "outputs"), 0), (("--require", "internals"), 1)])
def test_a_pass_partial_is_not_green_under_pytest(require, rc):
    """A port that returns only the public outputs passes them, but its parity test fails unless
    --require outputs accepts it, as `spec-parity run` exits 4 unless told so."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           f"{PARITY}::test_vs_golden[dflash/mod-qwen3]", "--port",
                           "dflash=tests.wrapped_port:public_only", *require], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    out = done.stdout + done.stderr
    assert done.returncode == rc, out
    if rc:
        assert ("passed only what the port exposes" if not require else "parity failed") in out

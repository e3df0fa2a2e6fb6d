"""spec-parity in a port's own repository: the pytest plugin (spec_parity/pytest_plugin.py) in a
throwaway port repository outside this checkout, and the distribution: a wheel built from this
tree, installed into a fresh virtual environment, checks that repository's port with the goldens
it ships, by docs/ci.md's own commands. `slow`: every test spawns processes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from spec_parity import harness
from spec_parity.drafters.dflash import pair as dflash

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ("-p", "spec_parity.pytest_plugin", "--noconftest", "-p", "no:cacheprovider")   # this checkout's conftest out
CASE = "mod-qwen3"

pytestmark = pytest.mark.slow


def _port_repo(tmp: Path) -> Path:
    """A port author's repository: mypkg/adapter.py is tests/wrapped_port.py (our DFlash port under
    another name, and one that exposes only the public outputs), and a test of its own."""
    repo = tmp / "myport"
    (repo / "mypkg").mkdir(parents=True)
    (repo / "mypkg" / "__init__.py").write_text("")
    shutil.copy(ROOT / "tests" / "wrapped_port.py", repo / "mypkg" / "adapter.py")
    (repo / "test_own.py").write_text("def test_own():\n    pass\n")
    return repo


def _pytest(repo: Path, *args: str, python: str = sys.executable, env: dict | None = None):
    env = env or {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(repo)])}
    return subprocess.run([python, "-m", "pytest", "-q", *args], capture_output=True, text=True, cwd=repo, env=env)


def _collected(done) -> list[str]:
    assert done.returncode == 0, done.stdout + done.stderr
    return [line.split("::", 1)[1] for line in done.stdout.splitlines() if "::" in line]


def _junit(path: Path) -> dict[str, dict]:
    """{test name: {"outcome": passed|failure|skipped, "text": its message, property: value}}
    from a JUnit file."""
    out = {}
    for tc in ET.parse(path).iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        found = next((c for c in tc if c.tag in ("failure", "error", "skipped")), None)
        out[tc.get("name")] = {"outcome": "passed" if found is None else found.tag,
                               "text": "" if found is None else found.text or "", **props}
    return out


def _golden_ids() -> set[str]:
    return {f"test_vs_golden[{c.id}]" for c in dflash.PAIR.cases() if not c.control}


def test_without_its_option_the_plugin_collects_nothing_of_its_own(tmp_path):
    repo = _port_repo(tmp_path)
    assert _collected(_pytest(repo, "--collect-only", *PLUGIN)) == ["test_own"]


def test_its_option_collects_every_case_of_the_module_but_the_controls(tmp_path):
    repo = _port_repo(tmp_path)
    spec = ("--spec-parity-port", "dflash=mypkg.adapter:make_port")
    golden = _collected(_pytest(repo, "--collect-only", *PLUGIN, *spec, "--spec-parity-source", "golden"))
    assert sorted(golden) == sorted(_golden_ids() | {"test_own"})
    live = _collected(_pytest(repo, "--collect-only", *PLUGIN, *spec, "-m", "oracle"))
    assert sorted(live) == sorted(f"test_vs_live[{c.id}]" for c in dflash.PAIR.cases() if not c.control and harness.runs_live(c))
    (repo / "pytest.ini").write_text("[pytest]\nspec_parity_port = dflash=mypkg.adapter:make_port\n")
    both = _collected(_pytest(repo, "--collect-only", *PLUGIN))
    assert _golden_ids() <= set(both) and set(live) <= set(both)


def test_a_port_spec_that_cannot_load_is_a_one_line_usage_error(tmp_path):
    done = _pytest(_port_repo(tmp_path), "--collect-only", *PLUGIN, "--spec-parity-port", "dflash=nosuch:make_port")
    assert done.returncode == 4, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "port 'nosuch:make_port' cannot be imported" in lines[0], done.stderr


@pytest.mark.parametrize("spec, require, rc, verdict", [("make_port", (), 0, "PASS"),
                                                        ("public_only", (), 1, "PASS-PARTIAL"),
                                                        ("public_only", ("--spec-parity-require", "outputs"), 0,
                                                         "PASS-PARTIAL")])
def test_junit_carries_each_cases_verdict_and_reason(tmp_path, spec, require, rc, verdict):
    """A PASS-PARTIAL is not green unless required outputs only, as `spec-parity run --require`."""
    repo = _port_repo(tmp_path)
    done = _pytest(repo, *PLUGIN, "--spec-parity-port", f"dflash=mypkg.adapter:{spec}", "--spec-parity-source",
                   "golden", "-k", f"{CASE}]", "--junitxml", "out.xml", *require)
    assert done.returncode == rc, done.stdout + done.stderr
    case = _junit(repo / "out.xml")[f"test_vs_golden[dflash/{CASE}]"]
    assert case["verdict"] == verdict and case["outcome"] == ("failure" if rc else "passed")
    assert ("public outputs only" in case["reason"]) == (spec == "public_only")
    if rc:    # the failure text is the verdict's message, no traceback
        assert case["text"].startswith("passed only what the port exposes") and "[PASS-PARTIAL]" in case["text"]
        assert "Traceback" not in case["text"] and "harness.py" not in case["text"], case["text"]


def _ci_commands() -> list[str]:
    """docs/ci.md's job: its `run:` commands, the install aside (the test installs its own wheel)."""
    block = re.search(r"```yaml\n(.*?)```", (ROOT / "docs" / "ci.md").read_text(), re.S).group(1)
    runs = re.findall(r"^\s*- run: (.+)$", block, re.M)
    assert runs[0].startswith("python -m pip install ") and len(runs) == 3, runs
    return runs[1:]


def _venv(tmp: Path) -> Path:
    """A fresh virtual environment outside the checkout that sees this one's packages (the
    dependencies) after its own, without running their .pth files (no editable install of spec_parity)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "_deps.pth").write_text("\n".join(deps) + "\n")
    return venv


def test_an_installed_wheel_checks_a_port_by_the_ci_recipe(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".tox", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".*_cache", ".hypothesis", ".venv"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheel"), str(src)], check=True, capture_output=True)
    wheel, = (tmp_path / "wheel").glob("spec_parity-*.whl")
    venv = _venv(tmp_path)
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel],
                   check=True, capture_output=True)

    dist, = (venv / "lib").glob("python*/site-packages/spec_parity-*.dist-info")
    record = [line.split(",")[0] for line in (dist / "RECORD").read_text().splitlines()]
    assert {r.split("/")[0] for r in record if not r.startswith("..")} == {"spec_parity", dist.name}
    assert (dist / "top_level.txt").read_text().split() == ["spec_parity"]
    shipped = {r for r in record if r.startswith("spec_parity/fixtures/")}
    assert shipped == {"spec_parity/" + str(f.relative_to(ROOT)) for f in (ROOT / "fixtures").rglob("*") if f.is_file()}

    repo = _port_repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPEC_PARITY_FIXTURES")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", PYTHONPATH=str(repo))   # the port: its own install
    where = subprocess.run(["python", "-c", "import spec_parity; print(spec_parity.__file__)"], cwd=repo, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert Path(where).is_relative_to(venv), where           # the installed copy, not this checkout
    run, test = _ci_commands()
    done = subprocess.run(f"{run} --case {CASE}", shell=True, cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1/1 as expected" in done.stdout, done.stdout
    done = subprocess.run(f"{test} -k '{CASE}]'", shell=True, cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = _junit(repo / "parity.xml")
    assert cases[f"test_vs_golden[dflash/{CASE}]"]["verdict"] == "PASS", cases

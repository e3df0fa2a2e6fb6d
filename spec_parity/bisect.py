"""`spec-parity bisect`: the first commit of a port's git history at which one case's verdict breaks.

Each revision is checked out into a temporary `git worktree` of the port's repository (the user's
work tree and index are never touched) and judged in a subprocess, `spec-parity run --case CASE
--source golden`, with that checkout first on PYTHONPATH; `git bisect run` drives the search
through this module's `step` entry. With `--port-cmd`, that run answers the case with the command,
run in the revision's checkout (its relative paths are the repository's). Exit codes for git
bisect: as expected -> 0 (good), an unexpected verdict -> 1 (bad), no verdict (the run crashed
before its report, or the port could not be imported) -> 125 (skip).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import site
import subprocess
import sys
import tempfile
from pathlib import Path

from .compare import PARTIAL_EXIT, as_expected

GOOD, BAD, SKIP = 0, 1, 125
# -P (3.11+): the interpreter does not put its cwd first on sys.path, so only PYTHONPATH decides.
PYTHON = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else [])]
# str() of ImportError / ModuleNotFoundError / SyntaxError: a revision whose port does not import
# has no verdict to give, so git bisect skips it rather than blaming it.
IMPORT_FAILURE = re.compile(r"No module named|cannot import name|\(\S+\.py, line \d+\)( \[at .*\])?$")


class BadInput(Exception):
    """A one-line message naming what is wrong with the command's arguments and the fix."""


def classify(returncode: int, report: Path, case: str, stderr: str = "") -> tuple[int, str]:
    """A `spec-parity run` subprocess's outcome as git bisect's exit code, with the reason."""
    if returncode not in (0, 1, PARTIAL_EXIT) or not report.exists():
        lines = [x for x in re.split(r"[\r\n]", stderr) if x.strip()]
        return SKIP, f"no verdict (exit {returncode}): {lines[-1].strip() if lines else 'no output'}"
    rows = json.loads(report.read_text())["results"]
    bad = [r for r in rows if not as_expected(r["verdict"], r["expected"])]
    if not bad:
        return (GOOD, "as expected") if returncode in (0, PARTIAL_EXIT) and rows else (SKIP, f"exit {returncode}, no unexpected verdict")
    r = next((r for r in bad if r["case"] == case), bad[0])
    reason = f"{r['module']}/{r['case']} {r['verdict']} (expected {r['expected']}): {r['reason'] or 'no reason given'}"
    return (SKIP if r["verdict"] == "ERROR" and IMPORT_FAILURE.search(r["reason"]) else BAD), reason


def run_args(ports: list[str], port_cmd: str | None = None, timeout: float | None = None) -> list[str]:
    """The port options as `spec-parity run` (and `step`) take them."""
    return ([a for p in ports for a in ("--port", p)] + (["--port-cmd", port_cmd] if port_cmd else [])
            + (["--timeout", f"{timeout:g}"] if timeout is not None else []))


def verdict(checkout: Path, case: str, ports: list[str], pythonpath: str | None, port_cmd: str | None = None,
            timeout: float | None = None) -> tuple[int, str]:
    """Judge `case` on `checkout` in a fresh interpreter (-P and an empty cwd: no stray `port`;
    with `port_cmd`, the checkout is the cwd: the command's relative paths are its files)."""
    env = _env([str(checkout / (pythonpath or ""))])
    with tempfile.TemporaryDirectory(prefix="spec-parity-bisect-") as tmp:
        cmd = [*PYTHON, "-m", "spec_parity.cli", "run", "--case", case, "--source", "golden",
               "--out", str(Path(tmp) / "report"), *run_args(ports, port_cmd, timeout)]
        proc = subprocess.run(cmd, cwd=checkout if port_cmd else tmp, env=env, capture_output=True, text=True)
        return classify(proc.returncode, Path(tmp) / "report" / "report.json", case, proc.stderr)


def _env(first: list[str]) -> dict:
    """os.environ with `first`, then this spec_parity's own folder (unless it is installed in
    site-packages), ahead of the inherited PYTHONPATH: every step is judged by the harness that
    was invoked."""
    ours = str(Path(__file__).resolve().parents[1])
    paths = first + ([ours] if ours not in site.getsitepackages() else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def _git(repo: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    if check and proc.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _commit(repo: Path, rev: str, flag: str) -> str:
    proc = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if proc.returncode:
        raise BadInput(f"{flag} {rev!r}: no such commit in {repo}; give a sha, tag or branch of that repository")
    return proc.stdout.strip()


def check_inputs(repo: Path, good: str, bad: str, case: str, pythonpath: str | None = None,
                 ports: list[str] | None = None, port_cmd: str | None = None,
                 timeout: float | None = None) -> tuple[str, str]:
    """The two shas, or BadInput naming the problem (the port options as `run` checks them)."""
    if pythonpath and (Path(pythonpath).is_absolute() or ".." in Path(pythonpath).parts):
        raise BadInput(f"--pythonpath {pythonpath}: give a folder inside the repository, relative to its root")
    if not repo.is_dir() or _git(repo, "rev-parse", "--git-dir", check=False).returncode:
        raise BadInput(f"--repo {repo}: not a git repository; give the clone that holds the port's history")
    g, b = _commit(repo, good, "--good"), _commit(repo, bad, "--bad")
    if g == b:
        raise BadInput(f"--good {good} and --bad {bad} are the same commit ({g[:12]}); give an older --good")
    if _git(repo, "merge-base", "--is-ancestor", g, b, check=False).returncode:
        raise BadInput(f"--good {good} is not an ancestor of --bad {bad}; give a --good from before the breakage")
    from . import exchange, harness
    from . import ports as port_specs

    modules = {c.module for c in harness.all_cases() if case in (c.name, c.golden_name)}
    if not modules:
        raise BadInput(f"--case {case!r}: no such case; see `spec-parity list`")
    if timeout is not None and (not port_cmd or not timeout > 0):
        raise BadInput(f"--timeout {timeout:g}: give the seconds (> 0) a case of --port-cmd may take")
    try:
        if port_cmd:
            exchange.parse_cmd(port_cmd)
        port_specs.check(ports, bool(port_cmd), modules, f"--case {case}")
    except port_specs.PortError as e:
        raise BadInput(str(e)) from e
    return g, b


def _note(notes: Path, sha: str, code: int, reason: str) -> None:
    (notes / f"{sha}.json").write_text(json.dumps({"code": code, "reason": reason}))


def bisect(repo: str, good: str, bad: str, case: str, ports: list[str] | None = None,
           pythonpath: str | None = None, out=None, port_cmd: str | None = None, timeout: float | None = None) -> int:
    """Print the first bad commit, its reason and the bisect log; 0 if found, 2 on bad input, 1 if
    git bisect could not name one (skipped commits around it)."""
    repo_dir, ports, out = Path(repo).resolve(), list(ports or []), out or sys.stdout
    try:
        g, b = check_inputs(repo_dir, good, bad, case, pythonpath, ports, port_cmd, timeout)
    except BadInput as e:
        print(f"spec-parity bisect: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spec-parity-bisect-") as tmp:
        wt, notes = Path(tmp) / "checkout", Path(tmp) / "notes"
        notes.mkdir()
        _git(repo_dir, "worktree", "add", "--detach", "--quiet", str(wt), g)
        try:
            for sha, rev, flag, want in ((g, good, "--good", GOOD), (b, bad, "--bad", BAD)):
                _git(wt, "checkout", "--detach", "--quiet", sha)
                if pythonpath and not (wt / pythonpath).is_dir():
                    print(f"spec-parity bisect: --pythonpath {pythonpath}: no such folder at {flag} {rev} "
                          f"({sha[:12]}); give the folder that holds the port's package", file=sys.stderr)
                    return 2
                code, reason = verdict(wt, case, ports, pythonpath, port_cmd, timeout)
                if code != want:
                    what = {GOOD: "passes", BAD: "already fails", SKIP: "cannot be judged"}[code]
                    print(f"spec-parity bisect: {case} {what} at {flag} {rev} ({sha[:12]}): {reason}; "
                          f"give {'an older --good' if flag == '--good' else 'a --bad where it fails'}",
                          file=sys.stderr)
                    return 2
                _note(notes, sha, code, reason)
            _git(wt, "bisect", "start", b, g)
            step = [*PYTHON, "-m", "spec_parity.bisect", "--checkout", str(wt), "--notes",
                    str(notes), "--case", case, *run_args(ports, port_cmd, timeout),
                    *(["--pythonpath", pythonpath] if pythonpath else [])]
            run = _git(wt, "bisect", "run", *step, check=False, env=_env([]))
            log = _git(wt, "bisect", "log").stdout.strip()
            found = re.search(r"^([0-9a-f]{40}) is the first bad commit", run.stdout, re.M)
            if not found:
                tail = (run.stdout + run.stderr).strip().splitlines()[-12:]
                print("spec-parity bisect: git bisect named no first bad commit:\n" + "\n".join(tail), file=out)
                print(f"git bisect log:\n{log}", file=out)
                return 1
            sha = found.group(1)
            subject = _git(wt, "log", "-1", "--format=%s", sha).stdout.strip()
            note = json.loads((notes / f"{sha}.json").read_text())
            print(f"first bad commit {sha} {subject!r}: {note['reason']}", file=out)
            print(f"git bisect log:\n{log}", file=out)
            return 0
        finally:
            _git(wt, "bisect", "reset", "--quiet", check=False)
            _git(repo_dir, "worktree", "remove", "--force", str(wt), check=False)
            _git(repo_dir, "worktree", "prune", check=False)


def step(argv: list[str] | None = None) -> int:
    """git bisect run's command: judge the checkout's HEAD, record the reason, exit 0 / 1 / 125."""
    ap = argparse.ArgumentParser(prog="python -m spec_parity.bisect")
    ap.add_argument("--checkout", required=True, type=Path)
    ap.add_argument("--notes", required=True, type=Path)
    ap.add_argument("--case", required=True)
    ap.add_argument("--port", action="append", default=[])
    ap.add_argument("--port-cmd")
    ap.add_argument("--timeout", type=float)
    ap.add_argument("--pythonpath")
    args = ap.parse_args(argv)
    try:
        sha = _git(args.checkout, "rev-parse", "HEAD").stdout.strip()
        code, reason = verdict(args.checkout, args.case, args.port, args.pythonpath, args.port_cmd, args.timeout)
        _note(args.notes, sha, code, reason)
    except Exception as e:  # our own failure, not the port's: abort the bisect (exit > 127)
        print(f"spec-parity bisect step failed: {e}", file=sys.stderr)
        return 128
    print(f"{sha[:12]}: {('good', 'bad')[code] if code in (GOOD, BAD) else 'skip'}: {reason}")
    return code


if __name__ == "__main__":
    sys.exit(step())

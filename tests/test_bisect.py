"""spec-parity bisect: the exit-code mapping, the bad-input messages, and whole bisects over
throwaway repositories in which one commit plants the bug.

The fast bisects run a stub `spec_parity.cli` committed in the throwaway repository (the checkout
goes first on PYTHONPATH, so it shadows ours; its package path extends into ours, so its reports
are written by our own `report.write`); its verdict per commit is the VERDICT file. The slow one
bisects a copy of our own `port/` with a planted scale on the target's logits, answered through a
fork's adapter (the copy stands in for spec_parity.port) and judged by the real harness against
the targets goldens.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spec_parity import bisect, report
from spec_parity.compare import Result

ROOT = Path(__file__).resolve().parents[1]
CASE = "qwen3"  # targets/qwen3 (and its RoPE control): ~10 s a verdict against its golden
PLANT = ("    return mx.tanh(logits / cap) * cap if cap else logits\n",
         "    return mx.tanh(logits / cap) * cap if cap else logits * 1.001\n")

STUB_INIT = f"__path__.append({str(ROOT / 'spec_parity')!r})\n"
STUB_CLI = '''"""A stand-in for `spec-parity run`: the verdict is the repository's VERDICT file."""
import argparse
import sys
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("cmd")
ap.add_argument("--case")
ap.add_argument("--source")
ap.add_argument("--out")
args = ap.parse_args()
verdict = (Path(__file__).resolve().parents[1] / "VERDICT").read_text().strip()
if verdict == "CRASH":
    raise RuntimeError("the stub crashed before its report")
from spec_parity import report
from spec_parity.compare import Result

reason = {"FAIL": "planted", "IMPORT": "No module named 'spec_parity.port.targets'"}.get(verdict, "")
result = Result("targets", args.case, "stub", "L2", verdict="ERROR" if verdict == "IMPORT" else verdict,
                reason=reason)
report.write(Path(args.out), [(result, "PASS")], "stub")
sys.exit(0 if verdict == "PASS" else 1)
'''


# A fork's adapter: its copy of our port stands in for spec_parity.port, behind our own adapters.
FORK = '''import importlib.util
import sys
from pathlib import Path

import spec_parity

here = Path(__file__).resolve().parent / "port"
spec = importlib.util.spec_from_file_location("spec_parity.port", here / "__init__.py",
                                              submodule_search_locations=[str(here)])
sys.modules[spec.name] = spec_parity.port = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spec_parity.port)
from spec_parity.adapters import make_port  # noqa: E402,F401
'''


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           "-c", "commit.gpgsign=false", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def commit(repo: Path, subject: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", subject)
    return git(repo, "rev-parse", "HEAD")


def stub_history(tmp_path: Path, verdicts: list[str]) -> tuple[Path, list[str]]:
    """A repository with the stub cli, one commit per verdict (the first one adds the stub)."""
    repo = tmp_path / "repo"
    (repo / "spec_parity").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "spec_parity" / "__init__.py").write_text(STUB_INIT)
    (repo / "spec_parity" / "cli.py").write_text(STUB_CLI)
    shas = []
    for i, v in enumerate(verdicts):
        (repo / "VERDICT").write_text(v + "\n")
        shas.append(commit(repo, f"step {i}: {v}"))
    return repo, shas


def first_line(text: str) -> str:
    return text.strip().splitlines()[0]


def test_classify_maps_run_outcomes_to_git_bisect_codes(tmp_path):
    def outcome(rows, rc, stderr=""):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        if rows is not None:
            report.write(out, rows, "test")
        return bisect.classify(rc, out / "report.json", CASE, stderr)

    ok = Result("targets", CASE, "o", "L2")
    ctl = Result("targets", "qwen3-control-rope-L1", "o", "L2", verdict="FAIL", reason="layer 1")
    broken = Result("targets", CASE, "o", "L2", verdict="FAIL", reason="logits differ")
    missing = Result("targets", CASE, "o", "L2", verdict="ERROR", reason="No module named 'spec_parity.port.targets'")
    syntax = Result("targets", CASE, "o", "L2", verdict="ERROR", reason="invalid syntax (targets.py, line 3)")
    crash = Result("targets", CASE, "o", "L2", verdict="ERROR", reason="shapes (1,4) and (2,4) differ")
    assert outcome([(ok, "PASS"), (ctl, "FAIL")], 0) == (bisect.GOOD, "as expected")
    assert outcome([(broken, "PASS"), (ctl, "FAIL")], 1) == (
        bisect.BAD, f"targets/{CASE} FAIL (expected PASS): logits differ")
    # a control that stops failing is the case's breakage too
    assert outcome([(ok, "PASS"), (Result("targets", "qwen3-control-rope-L1", "o", "L2"), "FAIL")], 1)[0] == bisect.BAD
    assert outcome([(crash, "PASS")], 1)[0] == bisect.BAD
    assert outcome([(missing, "PASS")], 1)[0] == bisect.SKIP
    assert outcome([(syntax, "PASS")], 1)[0] == bisect.SKIP
    assert outcome(None, 1, "Traceback ...\r[##..] 0/2\nImportError: boom\n") == (
        bisect.SKIP, "no verdict (exit 1): ImportError: boom")
    assert outcome([(ok, "PASS")], 2)[0] == bisect.SKIP
    assert outcome([(ok, "PASS")], 1)[0] == bisect.SKIP  # exit 1 with every verdict as expected


def test_checkout_shadows_the_installed_port(tmp_path):
    (tmp_path / "port").mkdir()
    (tmp_path / "port" / "__init__.py").write_text("")
    where = subprocess.run([*bisect.PYTHON, "-c", "import port; print(port.__file__)"], cwd=ROOT,
                           env=bisect._env([str(tmp_path)]), capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()) == tmp_path / "port" / "__init__.py"


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    repo, shas = stub_history(tmp_path, ["PASS", "PASS", "FAIL"])
    (tmp_path / "plain").mkdir()
    cases = [
        ((str(tmp_path / "plain"), shas[0], shas[2], CASE), "not a git repository"),
        ((str(repo), "no-such-rev", shas[2], CASE), "--good 'no-such-rev': no such commit"),
        ((str(repo), shas[0], "v9", CASE), "--bad 'v9': no such commit"),
        ((str(repo), shas[1], shas[1], CASE), "are the same commit"),
        ((str(repo), shas[2], shas[0], CASE), "is not an ancestor of --bad"),
        ((str(repo), shas[0], shas[2], "no-such-case"), "--case 'no-such-case': no such case"),
        ((str(repo), shas[2], shas[2] + "~0", CASE), "are the same commit"),
        ((str(repo), shas[0], shas[2], CASE, [], "../elsewhere"), "--pythonpath ../elsewhere: give a folder inside"),
        ((str(repo), shas[0], shas[2], CASE, [], "src"), "--pythonpath src: no such folder at --good"),
    ]
    port_cases = [({"port_cmd": "./my-port {out}"}, "must name {case} and {out}"),
                  ({"ports": ["dflash=mine:make_port"]}, "selects no dflash case (--case qwen3)"),
                  ({"ports": ["targets=mine:make_port"], "port_cmd": "./p {case} {out}"}, "both answer targets"),
                  ({"ports": ["targets=a:make_port", "targets=b:make_port"]}, "one port per module"),
                  ({"timeout": 5.0}, "--timeout 5: give the seconds (> 0) a case of --port-cmd may take"),
                  ({"port_cmd": "./p {case} {out}", "timeout": 0.0}, "--timeout 0")]
    for kw, message in port_cases:
        assert bisect.bisect(str(repo), shas[0], shas[2], CASE, **kw) == 2, message
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
    for args, message in cases:
        assert bisect.bisect(*args) == 2, message
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err


def test_port_cmd_is_run_in_the_checkout(tmp_path, monkeypatch):
    """`run` gets --port-cmd and --timeout, and runs in the revision's checkout (the command's
    relative paths are the repository's); an in-process port's run stays in an empty folder."""
    seen = []

    def fake_run(cmd, cwd, **kw):
        seen.append((cmd, Path(cwd)))
        return subprocess.CompletedProcess(cmd, 2, "", "stub")

    monkeypatch.setattr(bisect.subprocess, "run", fake_run)
    bisect.verdict(tmp_path, CASE, [], None, "./my-port {case} {out}", 30.0)
    bisect.verdict(tmp_path, CASE, ["targets=mine:make_port"], None)
    (cmd, cwd), (plain, plain_cwd) = seen
    assert cmd[-4:] == ["--port-cmd", "./my-port {case} {out}", "--timeout", "30"] and cwd == tmp_path
    assert plain[-2:] == ["--port", "targets=mine:make_port"] and plain_cwd != tmp_path


@pytest.mark.slow
def test_good_rev_must_pass_and_bad_rev_must_fail(tmp_path, capsys):
    repo, shas = stub_history(tmp_path, ["FAIL", "PASS", "PASS", "CRASH"])
    assert bisect.bisect(str(repo), shas[0], shas[2], CASE) == 2
    assert "already fails at --good" in capsys.readouterr().err
    assert bisect.bisect(str(repo), shas[1], shas[2], CASE) == 2
    assert "passes at --bad" in capsys.readouterr().err
    assert bisect.bisect(str(repo), shas[1], shas[3], CASE) == 2
    err = capsys.readouterr().err
    assert "cannot be judged at --bad" in err and "the stub crashed" in err


@pytest.mark.slow
def test_bisect_names_the_planted_commit_and_leaves_the_repo_alone(tmp_path, capsys):
    repo, shas = stub_history(tmp_path, ["PASS", "CRASH", "PASS", "IMPORT", "PASS", "FAIL", "FAIL"])
    (repo / "VERDICT").write_text("user's edit\n")  # a dirty work tree and a staged file stay as they are
    (repo / "staged").write_text("x")
    git(repo, "add", "staged")
    before = (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), git(repo, "worktree", "list"))
    assert bisect.bisect(str(repo), shas[0], shas[-1], CASE) == 0
    out = capsys.readouterr().out
    assert first_line(out) == f"first bad commit {shas[5]} 'step 5: FAIL': targets/{CASE} FAIL (expected PASS): planted"
    assert "git bisect log:" in out and f"# first bad commit: [{shas[5]}]" in out
    assert (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), git(repo, "worktree", "list")) == before


@pytest.mark.slow
def test_skips_next_to_the_breakage_name_no_commit(tmp_path, capsys):
    repo, shas = stub_history(tmp_path, ["PASS", "CRASH", "FAIL"])
    assert bisect.bisect(str(repo), shas[0], shas[2], CASE) == 1
    assert "named no first bad commit" in capsys.readouterr().out


def test_cli_bisect_bad_input(tmp_path):
    repo, shas = stub_history(tmp_path, ["PASS"])
    run = subprocess.run([*bisect.PYTHON, "-m", "spec_parity.cli", "bisect", "--repo", str(repo), "--good",
                          shas[0], "--bad", "HEAD", "--case", CASE], cwd=ROOT, env=bisect._env([]),
                         capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == f"spec-parity bisect: --good {shas[0]} and --bad HEAD are the same commit ({shas[0][:12]}); give an older --good\n"


CMD_PORT = """import sys
from pathlib import Path

from spec_parity import exchange, ports

SCALE = 1.0
req = exchange.read_case(Path(sys.argv[1]))
out = ports.ours().runs[req.module](req)
out["logits"] = out["logits"] * SCALE
exchange.write_outputs(Path(sys.argv[2]), out)
"""


@pytest.mark.slow
def test_bisect_port_cmd_names_the_planted_commit(tmp_path, capsys):
    """A port in the file protocol (a script in the repository, named relative to it) whose
    logits one commit scales by 1.001: bisect --port-cmd names that commit."""
    repo = tmp_path / "cmdport"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "my_port.py").write_text(CMD_PORT)
    shas = [commit(repo, "port: answer through files")]
    (repo / "NOTES").write_text("note\n")
    shas.append(commit(repo, "notes: harmless change"))
    (repo / "my_port.py").write_text(CMD_PORT.replace("SCALE = 1.0", "SCALE = 1.001"))
    shas.append(commit(repo, "port: scale the logits"))
    (repo / "NOTES").write_text("last\n")
    shas.append(commit(repo, "notes: harmless change after"))
    cmd = f"{sys.executable} my_port.py {{case}} {{out}}"
    assert bisect.bisect(str(repo), shas[0], shas[-1], CASE, port_cmd=cmd, timeout=300) == 0
    line = first_line(capsys.readouterr().out)
    assert line.startswith(f"first bad commit {shas[2]} 'port: scale the logits': targets/{CASE} FAIL"), line


@pytest.mark.slow
def test_bisect_finds_a_bug_planted_in_a_copy_of_our_port(tmp_path, capsys):
    repo = tmp_path / "myport"
    shutil.copytree(ROOT / "port", repo / "port", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "fork.py").write_text(FORK)
    git(repo, "init", "-q")
    shas = [commit(repo, "port: import the port")]
    for i in range(3):
        (repo / "NOTES").write_text(f"note {i}\n")
        shas.append(commit(repo, f"notes: harmless change {i}"))
    targets = repo / "port" / "targets.py"
    src = targets.read_text()
    assert src.count(PLANT[0]) == 1, "port/targets.py's head() changed: update PLANT"
    targets.write_text(src.replace(*PLANT))
    shas.append(commit(repo, "targets: scale the logits"))
    (repo / "NOTES").write_text("last\n")
    shas.append(commit(repo, "notes: harmless change after"))
    assert bisect.bisect(str(repo), shas[0], shas[-1], CASE, ports=["targets=fork:make_port"]) == 0
    line = first_line(capsys.readouterr().out)
    assert line.startswith(f"first bad commit {shas[4]} 'targets: scale the logits': targets/{CASE} FAIL"), line

"""Results a CI reads and reports a person reads: report.json against its schema, `spec-parity diff`
on a regression planted through a real port, report.md's first screen, report.html read back by a
headless browser, files 0644."""

from __future__ import annotations

import contextlib
import copy
import datetime
import html.parser
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from spec_parity import cli, report, report_render, report_schema
from spec_parity.compare import Result

ROOT = Path(__file__).resolve().parents[1]
CASE = "qwen3"
PORT = """
from spec_parity import ports

def make_port():
    ours = ports.ours().runs["targets"]
    return ports.Port("ci-good", "0.1", {"targets": lambda req: ours(req)})

def make_bad_port():
    ours = ports.ours().runs["targets"]
    def run(req):
        out = ours(req)
        out["hidden.2"] = out["hidden.2"] * 1.01
        return out
    return ports.Port("ci-bad", "0.1", {"targets": run})
"""


def _cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs of one case: A on a port that computes what ours does, B on one whose layer 2
    is 1% off (a regression planted in the port, as a pull request would bring it)."""
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "ci_report_port.py").write_text(PORT)
    sys.path.insert(0, str(tmp))
    old = os.umask(0o022)
    try:
        done = {}
        for name, factory in (("a", "make_port"), ("b", "make_bad_port")):
            done[name] = _cli("run", "--module", "targets", "--case", CASE, "--source", "golden",
                              "--port", f"targets=ci_report_port:{factory}", "--out", str(tmp / name))
    finally:
        os.umask(old)
        sys.path.remove(str(tmp))
    assert done["a"][0] == 0 and done["b"][0] == 1, (done["a"], done["b"])
    return tmp, done


def test_schema_doc_is_the_codes():
    assert (ROOT / "docs" / "report-schema.md").read_text() == report_schema.markdown(), \
        "regenerate: python -m spec_parity.report_schema > docs/report-schema.md"


def _doc() -> dict:
    r = Result("targets", "qwen3", "transformers (golden)", "L2", verdict="FAIL", reason="logits: off")
    r.metrics["logits"] = {"ok": False, "max_abs": 0.5}
    return report_schema.document([(r, "PASS")], "machine m; ports: x; 1 cases in 0.1 s")


@pytest.mark.parametrize("plant, says", [
    (lambda d: d["results"][0].pop("verdict"), "report.results[0].verdict: missing"),
    (lambda d: d["results"][0].update(as_expected="no"), "report.results[0].as_expected: string, not boolean"),
    (lambda d: d["run"].update(duration_s="1 s"), "report.run.duration_s: string, not number"),
    (lambda d: d["summary"]["modules"]["targets"].pop("declined"), "summary.modules.targets.declined: missing"),
    (lambda d: d.update(schema="spec-parity/report/2"), "schema 'spec-parity/report/2'"),
    (lambda d: d.pop("schema"), "no `schema` field"),
])
def test_the_validator_names_the_wrong_field(plant, says):
    doc = _doc()
    report_schema.validate(doc)
    assert doc["results"][0]["first_failing_check"] == "logits" and doc["results"][0]["as_expected"] is False
    plant(doc)
    with pytest.raises(report_schema.SchemaError) as e:
        report_schema.validate(doc)
    assert says in str(e.value)


@pytest.mark.golden
def test_report_json_records_the_run_ports_tree_and_case(runs):
    tmp, done = runs
    a, b = (json.loads((tmp / n / "report.json").read_text()) for n in "ab")
    report_schema.validate(b)
    assert b["run"]["argv"][:4] == ["run", "--module", "targets", "--case"] and "--case qwen3" in b["run"]["command"]
    assert [(p["module"], p["name"], p["version"]) for p in b["ports"]] == [("targets", "ci-bad", "0.1")]
    assert b["ports"][0]["identity"].startswith("ci-bad 0.1 (") and len(b["ports"][0]["digest"]) == 64
    assert b["versions"]["python"] and b["versions"]["mlx"] and b["tree"]["version"]
    assert (b["tree"]["commit"] is not None) == (ROOT / ".git").exists()
    x = b["results"][0]
    assert (x["verdict"], x["expected"], x["as_expected"], x["category"]) == ("FAIL", "PASS", False, "unexpected")
    assert x["first_failing_check"] and "hidden.2" in x["reason"]
    assert a["results"][0]["as_expected"] and a["results"][0]["first_failing_check"] is None
    assert b["summary"]["line"] in done["b"][1] and b["summary"]["modules"]["targets"]["unexpected"] == 1


@pytest.mark.golden
def test_report_files_are_0644(runs):
    tmp, _ = runs
    written = sorted((tmp / "b").iterdir())
    assert {p.name for p in written} >= {"report.json", "report.md", "report.html", "layers-targets.png"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {p.name: "0o644" for p in written}


@pytest.mark.golden
def test_diff_flags_the_planted_regression(runs):
    tmp, _ = runs
    rc, out, err = _cli("diff", str(tmp / "a"), str(tmp / "b"))
    assert rc == 1 and not err, out + err
    line = next(x for x in out.splitlines() if x.startswith("REGRESSION"))
    assert f"targets/{CASE}: PASS (expected PASS) -> FAIL (expected PASS, NOT as expected)" in line
    assert "1 regression" in out.splitlines()[-1]
    rc, out, _ = _cli("diff", str(tmp / "b"), str(tmp / "a" / "report.json"))
    assert rc == 0 and out.splitlines()[2].startswith(f"FIXED      targets/{CASE}")
    rc, out, _ = _cli("diff", str(tmp / "a"), str(tmp / "a"))     # negative control: the same run
    assert rc == 0 and out.splitlines()[-1].startswith("0 regression, 0 fixed, 0 changed, 0 new, 0 removed")


@pytest.mark.golden
def test_diff_counts_new_removed_and_partial(runs, tmp_path):
    tmp, _ = runs
    a = json.loads((tmp / "a" / "report.json").read_text())
    b = copy.deepcopy(a)
    b["results"][0].update(verdict="PASS-PARTIAL", shown_verdict="PASS-PARTIAL", category="partial")
    b["results"].append({**copy.deepcopy(a["results"][0]), "case": "added"})
    (tmp_path / "b.json").write_text(json.dumps(b))
    rc, out, _ = _cli("diff", str(tmp / "a"), str(tmp_path / "b.json"))
    assert rc == 0 and "CHANGED    targets/qwen3: PASS (expected PASS) -> PASS-PARTIAL" in out
    assert "NEW        targets/added: absent -> PASS" in out
    rc, out, _ = _cli("diff", str(tmp_path / "b.json"), str(tmp / "a"))
    assert rc == 0 and "REMOVED    targets/added: PASS (expected PASS) -> absent" in out


@pytest.mark.golden
def test_diff_misuse_is_one_line_and_exit_2(runs, tmp_path):
    tmp, _ = runs
    old = json.loads((tmp / "a" / "report.json").read_text())
    (tmp_path / "future.json").write_text(json.dumps({**old, "schema": "spec-parity/report/9"}))
    (tmp_path / "bare.json").write_text(json.dumps({"header": old["header"], "results": old["results"]}))
    (tmp_path / "text.json").write_text("not json")
    for path, says in ((tmp_path / "missing", "no report.json there"), (tmp_path / "text.json", "not JSON"),
                       (tmp_path / "future.json", "schema 'spec-parity/report/9'"),
                       (tmp_path / "bare.json", "no `schema` field")):
        rc, out, err = _cli("diff", str(tmp / "a"), str(path))
        assert rc == 2 and not out and len(err.strip().splitlines()) == 1, (path, out, err)
        assert err.startswith("spec-parity diff: error: ") and says in err, err


def _rows() -> list[tuple[Result, str]]:
    long = "; ".join(f"hidden.{i}: {'x' * 400}" for i in range(9))       # a reason of 3,600+ chars
    bad = Result("dflash", "mod qwen3/b", "transformers", "L2", verdict="FAIL", reason=long)
    bad.metrics["hidden.0"] = {"ok": False, "max_abs": 0.25}
    ok = Result("targets", "qwen3", "transformers", "L1")
    return [(ok, "PASS"), (bad, "PASS"), (Result("dflash", "ctl", "t", "L2", verdict="FAIL", reason="r"), "FAIL")]


def test_report_md_opens_with_the_summary_and_unexpected_first(tmp_path):
    run = report_schema.run_info(["run", "--module", "dflash"], datetime.datetime.now(datetime.timezone.utc), 1.5)
    report.write(tmp_path, _rows(), "machine m (x); ports: p; 3 cases in 1.5 s", run)
    md = (tmp_path / "report.md").read_text()
    doc = json.loads((tmp_path / "report.json").read_text())
    first = md.split("\n## ")[0]                  # the first screen: up to the first section
    assert len(first.splitlines()) <= 25
    assert f"**{doc['summary']['line']}**" in first and "2/3 as expected" in first
    assert "| dflash | 1 | 1 | 0 | 0 | 0 | 2 |" in first and "| targets | 1 | 0 | 0 | 0 | 0 | 1 |" in first
    for word in ("command: `spec-parity run --module dflash`", "ports: ", "tree: spec-parity", "versions: python"):
        assert word in first
    table = md.split("## Results, unexpected first")[1].split("\n## ")[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert rows[0].startswith("| dflash | [mod qwen3/b](#case-dflash-mod-qwen3-b) |") and "| **NO** |" in rows[0]
    assert max(len(c) for r in rows for c in r.split(" | ")) <= 200
    assert "hidden.0: xxx" in rows[0] and "(+8 more)" in rows[0]
    details = md.split('<a id="case-dflash-mod-qwen3-b"></a>')[1]
    assert "x" * 400 + "; hidden.8" in details            # the full reason, behind the anchor


class _Summary(html.parser.HTMLParser):
    """The tally line and the summary table's rows, from the DOM a browser returns."""

    def __init__(self):
        super().__init__()
        self.tally, self.rows, self.stack = "", [], []

    def handle_starttag(self, tag, attrs):
        ids = dict(attrs).get("id")
        if ids in ("tally", "summary-table"):
            self.stack.append(ids)
        if self.stack and self.stack[-1] == "summary-table" and tag == "tr":
            self.rows.append([])

    def handle_endtag(self, tag):
        if self.stack and (tag, self.stack[-1]) in (("p", "tally"), ("table", "summary-table")):
            self.stack.pop()

    def handle_data(self, data):
        if self.stack == ["tally"]:
            self.tally += data
        elif self.stack == ["summary-table"] and self.rows and data.strip():
            self.rows[-1].append(data.strip())


def _browser_summary(page: Path) -> _Summary:
    profile = tempfile.mkdtemp(prefix="spec-parity-chromium-")
    try:
        dom = subprocess.run(
            [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--dump-dom", page.resolve().as_uri()], capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    parsed = _Summary()
    parsed.feed(dom)
    return parsed


@pytest.mark.golden
def test_report_html_summary_read_back_by_a_browser(runs):
    if shutil.which("chromium") is None:
        pytest.skip("chromium not installed (apt-get install chromium): report.html is not opened in a browser")
    tmp, done = runs
    for name, line, counts in (("b", "0/1 as expected", ["targets", "0", "1", "0", "0", "0", "1"]),
                               ("a", "1/1 as expected", ["targets", "1", "0", "0", "0", "0", "1"])):
        doc = json.loads((tmp / name / "report.json").read_text())
        seen = _browser_summary(tmp / name / "report.html")
        assert seen.tally == doc["summary"]["line"] and seen.tally.startswith(line)
        assert seen.tally in done[name][1]                 # the line the CLI printed
        assert seen.rows == [["module", *report_schema.CATEGORIES, "total"], counts], seen.rows


def test_short_reason_and_anchor():
    assert report_render.anchor("dflash", "Mod qwen3/b") == "case-dflash-mod-qwen3-b"
    x = {"reason": "a" * 500 + "; b"}
    cell = report_render.short_reason(x)
    assert len(cell) <= report_render.CELL and cell.endswith("… (+1 more)")
    assert report_render.short_reason({"reason": ""}) == ""

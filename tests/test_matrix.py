"""`spec-parity matrix`: counts come from the reports, the doc's table is the rendering of the
runs' summary it keeps beside it, and bad input is one line and exit 2."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from spec_parity import cli, matrix

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "third-party.md"


def _result(module, case, verdict, checked=("tokens",), optional=("taps",)):
    return {"module": module, "case": case, "verdict": verdict, "metrics": {"port": {"identity": "pkg 1.0 (abc)"}},
            "coverage": {"checked": list(checked), "quantities": {"optional": list(optional)}}}


REPORT = {"header": "machine m (x86_64), python 3.11; ports: dflash=pkg 1.0 (abc); 4 cases in 1.0 s",
          "results": [_result("dflash", "a", "PASS", checked=("tokens", "taps")), _result("dflash", "b", "FAIL"),
                      _result("dflash", "c", "DECLINED", checked=()), _result("dflash", "d", "PASS-PARTIAL")]}


def _write(tmp_path: Path, report: dict) -> Path:
    (tmp_path / "report.json").write_text(json.dumps(report))
    return tmp_path


def test_counts_and_coverage_come_from_the_report(tmp_path):
    [row] = matrix.load([_write(tmp_path, REPORT)])
    assert (row["port"], row["module"]) == ("pkg 1.0 (abc)", "dflash")
    assert [row[v] for v in matrix.VERDICTS] == [1, 1, 1, 0, 0, 1] and row["internals"] == 1
    table = matrix.render({"tree": "t", "machine": "m", "rows": [row]})
    assert "| pkg 1.0 (abc) | dflash | 4 | 1 | 1 | 1 | 0 | 0 | 1 | 3/4 | 1/3 |" in table
    flipped = copy.deepcopy(REPORT)                 # negative control: one verdict changed shows
    flipped["results"][1]["verdict"] = "PASS"
    [other] = matrix.load([_write(tmp_path, flipped)])
    assert matrix.render({"tree": "t", "machine": "m", "rows": [other]}) != table


def test_saved_reports_do_not_claim_this_tree(tmp_path):
    rows = matrix.load([_write(tmp_path, REPORT)])
    assert matrix.make(rows, ran_here=False)["tree"] == "not recorded (saved reports)"
    assert matrix.make(rows, ran_here=True)["tree"] == matrix.tree() != "not recorded (saved reports)"


def test_into_replaces_only_the_block_and_keeps_the_summary():
    data = {"tree": "t", "machine": "m", "rows": matrix.summarize(REPORT, "r")}
    doc = f"# x\n\nbefore\n{matrix.BEGIN}\nold\n{matrix.END}\nafter\n"
    out = matrix.into(doc, data)
    assert out.startswith("# x\n\nbefore\n") and out.endswith(f"{matrix.END}\nafter\n") and "old" not in out
    assert matrix.embedded(out) == json.loads(json.dumps(data))
    with pytest.raises(matrix.MatrixError, match="one <!-- matrix:begin -->"):
        matrix.into("no markers", data)


def test_the_doc_table_is_its_runs_rendered():
    """docs/third-party.md's matrix is what its summary renders to: an edit of the table alone, or
    of the summary alone, fails here (regenerate with `spec-parity matrix --report ... --doc`)."""
    doc = DOC.read_text()
    data = matrix.embedded(doc)
    assert matrix.into(doc, data) == doc
    tampered = doc.replace("| mlx-vlm", "| mlx-vlm-x", 1)
    assert matrix.into(tampered, matrix.embedded(tampered)) != tampered


@pytest.mark.parametrize("argv,message", [
    (["matrix"], "nothing to tabulate"),
    (["matrix", "--report", "/nonexistent-spec-parity"], "no report.json"),
    (["matrix", "--report", "/nonexistent-spec-parity", "--doc", "README.md"], "README.md: the doc needs one"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err

"""The support matrix: ports x modules -> verdict counts and coverage, from `spec-parity run`'s
report.json files (saved, or made here by running the given ports over the goldens), rendered as
a markdown table between two markers of a doc. The doc keeps the runs' summary beside the table
(a JSON block), so a test re-renders the table from it and a change to either shows.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

VERDICTS = ("PASS", "PASS-PARTIAL", "FAIL", "DELTA", "ERROR", "DECLINED")
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
_PORT = re.compile(r"ports: (.*?); \d+ cases in")


class MatrixError(ValueError):
    """Bad input to `spec-parity matrix`: one line naming it and the fix."""


def summarize(report: dict, source: str) -> list[dict]:
    """One row per (port, module) of a report.json: the port as its header names it, the
    verdict counts, and how many answered cases checked a drafter internal (an optional quantity)."""
    ports = dict(p.split("=", 1) for p in _port_names(report["header"]))
    rows: dict[tuple[str, str], dict] = {}
    for r in report["results"]:
        port = r.get("metrics", {}).get("port", {}).get("identity") or ports.get(r["module"], "spec-parity")
        row = rows.setdefault((port, r["module"]), {"port": port, "module": r["module"], "source": source,
                                                    "machine": report["header"].split(";")[0],
                                                    **{v: 0 for v in VERDICTS}, "internals": 0})
        row[r["verdict"]] += 1
        cov = r.get("coverage") or {}
        if set(cov.get("checked", ())) & set(cov.get("quantities", {}).get("optional", ())):
            row["internals"] += 1
    return list(rows.values())


def _port_names(header: str) -> list[str]:
    m = _PORT.search(header)
    return [p.strip() for p in m.group(1).split(", ")] if m and m.group(1) != "ours" else []


def load(paths: list[Path]) -> list[dict]:
    """Rows of every report.json named (a file, or a folder holding one)."""
    rows = []
    for p in paths:
        f = p / "report.json" if p.is_dir() else p
        if not f.is_file():
            raise MatrixError(f"{f}: no report.json; give a `spec-parity run --out` folder or its report.json")
        try:
            report = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise MatrixError(f"{f}: not a report.json ({e.msg}); give one `spec-parity run` wrote") from e
        if not isinstance(report, dict) or "results" not in report or "header" not in report:
            raise MatrixError(f"{f}: not a report.json (no header/results); give one `spec-parity run` wrote")
        rows += summarize(report, f.parent.name)
    return rows


def run_ports(specs: list[str], source: str = "golden") -> list[dict]:
    """Run each MODULE=SPEC port over its module's cases (`spec-parity run`, in process) and
    summarize the reports."""
    from . import cli

    rows = []
    for spec in specs:
        module = spec.split("=", 1)[0]
        with tempfile.TemporaryDirectory(prefix="spec-parity-matrix-") as tmp:
            cli.main(["run", "--module", module, "--port", spec, "--source", source, "--out", tmp])
            rows += load([Path(tmp)])
    return rows


def tree() -> str:
    """The repository's commit (and `+dirty` with uncommitted changes), or "-" outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "-"
    return head + ("+dirty" if dirty else "")


def render(data: dict) -> str:
    """The markdown block: what it ran on, the table, and the summary it was made from."""
    lines = [f"Tree {data['tree']}; {data['machine']}.", "",
             "| port | module | cases | " + " | ".join(VERDICTS) + " | answered | internals |",
             "|---|---|---|" + "---|" * len(VERDICTS) + "---|---|"]
    for r in sorted(data["rows"], key=lambda r: (r["port"], r["module"])):
        total = sum(r[v] for v in VERDICTS)
        answered = total - r["DECLINED"] - r["ERROR"]
        lines.append(f"| {r['port']} | {r['module']} | {total} | " + " | ".join(str(r[v]) for v in VERDICTS)
                     + f" | {answered}/{total} | {r['internals']}/{answered} |")
    return "\n".join(lines + ["", "```json", json.dumps(data, indent=1, sort_keys=True), "```"])


def make(rows: list[dict], ran_here: bool) -> dict:
    """The matrix of `rows`; its tree is this checkout's only when every row was run here (a
    saved report.json does not record the tree it ran on)."""
    machines = sorted({r["machine"] for r in rows})
    return {"tree": tree() if ran_here else "not recorded (saved reports)", "machine": "; ".join(machines) or "-",
            "rows": rows}


def embedded(doc: str) -> dict:
    """The summary a doc's matrix block was rendered from."""
    block = _block(doc)
    m = re.search(r"```json\n(.*?)\n```", block, re.S)
    if not m:
        raise MatrixError("the matrix block holds no ```json summary; regenerate it with `spec-parity matrix --doc`")
    return json.loads(m.group(1))


def _block(doc: str) -> str:
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise MatrixError(f"the doc needs one {BEGIN} line before one {END} line, where the table goes")
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def into(doc: str, data: dict) -> str:
    """`doc` with the block between the markers replaced by render(data)."""
    _block(doc)
    head, rest = doc.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{render(data)}\n{END}{rest.split(END, 1)[1]}"

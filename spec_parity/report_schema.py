"""report.json: its versioned schema, the document `spec-parity run` writes, and a validator.

The schema is data (SCHEMA): docs/report-schema.md is rendered from it
(`python -m spec_parity.report_schema > docs/report-schema.md`, held to it by a test), and every
report.json is validated against it before it is written, so a reader such as `spec-parity diff`
or a port's CI can rely on each field. A change to a field's meaning gets a new VERSION.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import compare

VERSION = "spec-parity/report/1"
PACKAGES = ("numpy", "mlx", "mlx-lm", "torch", "transformers")
CATEGORIES = ("as expected", "unexpected", "partial", "delta", "declined")


class SchemaError(ValueError):
    """A document that is not a report.json of VERSION: the message names the first wrong field."""


@dataclass(frozen=True)
class F:
    """One field: its JSON types ("string|null"), what it means, and what it holds (an object's
    fields, or an array's items)."""

    types: str
    doc: str
    fields: dict[str, F] = field(default_factory=dict)
    items: F | None = None
    required: bool = True


_COUNTS = F("object", "counts of the module's cases", {c.replace(" ", "_"): F("integer", c) for c in CATEGORIES})
_PORT = F("object", "who answered a module's cases (spec_parity.ports.Port)", {
    "module": F("string", "the module"),
    "name": F("string", "the port's name"),
    "version": F("string", "the port's version"),
    "identity": F("string", "name, version and the first 12 hex digits of its code digest, as reports show it"),
    "digest": F("string|null", "sha256 of the port's source files; null where it has none to hash"),
})
_RESULT = F("object", "one case's verdict", {
    "module": F("string", "the module (targets, assistant, dspark, dflash, ...)"),
    "case": F("string", "the case's name (`spec-parity list`)"),
    "oracle": F("string", "the reference it was compared against, `(golden)` when read from a golden"),
    "tier": F("string", "L1 bit-exact, L2 budgets, L3 gates (docs/harness.md)"),
    "verdict": F("string", "PASS, PASS-PARTIAL, FAIL, DELTA, ERROR or DECLINED"),
    "shown_verdict": F("string", "the verdict as the tables show it (`FAIL non-finite` for NaN/Inf)"),
    "expected": F("string", "the verdict the case expects: PASS, or FAIL for a negative control"),
    "as_expected": F("boolean", "the verdict is the expected one under the run's --require"),
    "category": F("string", "one of: " + ", ".join(CATEGORIES) + " (how the summary counts it)"),
    "checks_run": F("string", "checks run of those planned (`12/20`), `-` where none was judged"),
    "coverage": F("object", "what was checked and what was not (spec_parity.checks); {} where nothing ran"),
    "first_failing_check": F("string|null", "the first check, in the plan's order, that failed"),
    "layer": F("integer|null", "the first divergent layer (its own, teacher-forced error over budget)"),
    "reason": F("string", "every failing check's reason, `; `-joined (empty on a plain PASS)"),
    "findings": F("object", "finding -> the reasons it failed"),
    "metrics": F("object", "check name -> its metrics (max_abs, budget, ok, ...), as the harness recorded them"),
    "trace": F("string", "an ERROR's traceback, empty otherwise"),
    "phases": F("object", "wall seconds per phase: factory, reference, port, compare (and delta where a plug-in "
                "port's failure was explained)"),
})
SCHEMA = F("object", "the report of one `spec-parity run`", {
    "schema": F("string", f"the schema's name and version: `{VERSION}`"),
    "header": F("string", "the run's one-line header (machine, versions, ports, count, time), as report.md's"),
    "run": F("object", "the command and when it ran", {
        "argv": F("array", "the arguments after `spec-parity`", items=F("string", "an argument")),
        "command": F("string", "the command line, shell-quoted"),
        "started": F("string", "start time, ISO 8601 UTC"),
        "duration_s": F("number", "seconds from the first case to the last"),
        "require": F("array", "the run's --require", items=F("string", "outputs or internals")),
    }),
    "tree": F("object", "the code that ran", {
        "version": F("string", "the installed spec-parity version"),
        "commit": F("string|null", "the git commit, where spec_parity runs from a checkout"),
        "dirty": F("boolean|null", "the checkout has uncommitted changes"),
    }),
    "machine": F("string", "the golden machine key and processor"),
    "versions": F("object", "python and the packages a verdict depends on; null where not installed",
                  {"python": F("string", "python's version"),
                   **{p: F("string|null", f"{p}'s version") for p in PACKAGES}}),
    "ports": F("array", "one entry per module the run selected", items=_PORT),
    "summary": F("object", "the verdicts counted", {
        "total": F("integer", "cases run"),
        "line": F("string", "the CLI's closing `N/N as expected` line"),
        "modules": F("object", "module -> its counts (as_expected, unexpected, partial, delta, declined)"),
    }),
    "results": F("array", "one entry per case, in run order", items=_RESULT),
})

def _kind(x) -> str:
    for name, t in (("null", type(None)), ("boolean", bool), ("integer", int), ("number", float),
                    ("string", str), ("array", list), ("object", dict)):
        if isinstance(x, t):
            return name
    return type(x).__name__


def validate(doc) -> None:
    """Raise SchemaError naming the first field of `doc` that SCHEMA does not allow (a document of
    another version: its version, before any field)."""
    if not isinstance(doc, dict) or "schema" not in doc:
        raise SchemaError("no `schema` field: not a report.json of spec-parity/report/N")
    if doc["schema"] != VERSION:
        raise SchemaError(f"schema {doc['schema']!r}, not {VERSION!r}")
    _check(doc, SCHEMA, "report")
    for m, counts in doc["summary"]["modules"].items():
        _check(counts, _COUNTS, f"report.summary.modules.{m}")


def _check(doc, spec: F, at: str) -> None:
    kind, allowed = _kind(doc), spec.types.split("|")
    if kind not in allowed and not (kind == "integer" and "number" in allowed):
        raise SchemaError(f"{at}: {kind}, not {spec.types}")
    if isinstance(doc, dict):
        for name, sub in spec.fields.items():
            if name in doc:
                _check(doc[name], sub, f"{at}.{name}")
            elif sub.required:
                raise SchemaError(f"{at}.{name}: missing")
    if isinstance(doc, list) and spec.items is not None:
        for i, item in enumerate(doc):
            _check(item, spec.items, f"{at}[{i}]")


def category(verdict: str, expected: str, require: tuple[str, ...] = ()) -> str:
    """How the summary counts a verdict: a DELTA or a decline apart, a PASS-PARTIAL that counts as
    expected apart as partial, the rest as expected or not (the CLI's count)."""
    if verdict == "DELTA":
        return "delta"
    if verdict == "DECLINED":
        return "declined"
    if not compare.as_expected(verdict, expected, require):
        return "unexpected"
    return "partial" if verdict == compare.PARTIAL else "as expected"


def result(r: compare.Result, expected: str, require: tuple[str, ...]) -> dict:
    lay = r.metrics.get("layers") if isinstance(r.metrics.get("layers"), dict) else {}
    return {**r.to_json(), "shown_verdict": r.shown_verdict, "expected": expected,
            "as_expected": compare.as_expected(r.verdict, expected, require),
            "category": category(r.verdict, expected, require), "checks_run": r.checks_run,
            "first_failing_check": r.first_failure, "layer": lay.get("first_divergent_layer")}


def summary(results: list[dict]) -> dict:
    modules: dict[str, dict] = {}
    for x in results:
        counts = modules.setdefault(x["module"], {c.replace(" ", "_"): 0 for c in CATEGORIES})
        counts[x["category"].replace(" ", "_")] += 1
    return {"total": len(results), "line": tally(results), "modules": modules}


def tally(results: list[dict]) -> str:
    """The CLI's closing line: verdicts as expected of those run, and the ones counted apart."""
    n = {c: sum(x["category"] == c for x in results) for c in CATEGORIES}
    words = {"partial": "passed only what the port exposes (PASS-PARTIAL: checks not run, each named in "
             f"the report; exit {compare.PARTIAL_EXIT}: `--require outputs` accepts them, `--require internals` "
             "fails them)", "delta": "explained by a known reference delta (docs/references.md)",
             "declined": "declined by the port"}
    return (f"{n['as expected']}/{len(results)} as expected (controls must FAIL)"
            + "".join(f", {n[c]} {w}" for c, w in words.items() if n[c]))


def document(rows: list[tuple[compare.Result, str]], header: str, run: dict | None = None,
             ports: list[dict] | None = None) -> dict:
    """The report.json of `rows` (results with their expected verdicts); `run` as run_info()
    gives it (default: nothing recorded), `ports` as port_entries() does."""
    run = run or run_info([], datetime.datetime.now(datetime.timezone.utc), 0.0)
    results = [result(r, e, tuple(run["require"])) for r, e in rows]
    return {"schema": VERSION, "header": header, "run": run, "tree": tree(),
            "machine": header.split(";")[0].split(",")[0].removeprefix("machine "),
            "versions": versions(), "ports": ports or [], "summary": summary(results), "results": results}


def run_info(argv: list[str], started: datetime.datetime, duration_s: float,
             require: tuple[str, ...] = ()) -> dict:
    import shlex

    return {"argv": list(argv), "command": shlex.join(["spec-parity", *argv]) if argv else "",
            "started": started.astimezone(datetime.timezone.utc).isoformat(timespec="seconds"),
            "duration_s": round(float(duration_s), 3), "require": list(require)}


def port_entries(selection, modules) -> list[dict]:
    """What report.json records of each module's port (a spec_parity.ports.Selection)."""
    out = []
    for m in dict.fromkeys(modules):
        p = selection.port(m)
        out.append({"module": m, "name": p.name, "version": p.version, "identity": p.identity,
                    "digest": p.digest if p.files else None})
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def tree() -> dict:
    """The spec-parity version, and the git commit where it runs from a checkout."""
    try:
        version = importlib.metadata.version("spec-parity")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    top = Path(__file__).resolve().parents[1]
    commit = dirty = None
    if (top / ".git").exists():
        git = ["git", "-C", str(top)]
        try:
            commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                    check=True, timeout=10).stdout.strip() or None
            dirty = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True, check=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            commit = dirty = None
    return {"version": version, "commit": commit, "dirty": dirty}


def markdown(spec: F = SCHEMA, prefix: str = "") -> str:
    """The schema as docs/report-schema.md's table rows, one per field, nested fields dotted."""
    if not prefix:
        return "\n".join([
            "# report.json schema", "",
            "<!-- generated: python -m spec_parity.report_schema > docs/report-schema.md -->", "",
            f"`spec-parity run --out DIR` writes DIR/report.json; its `schema` field is `{VERSION}`. "
            "Every report.json is validated against this schema before it is written; `spec-parity diff` "
            "reads only this version and refuses another with exit 2. A new field that older readers "
            "may ignore keeps the version; a changed or removed one makes a new one.", "",
            "| field | type | meaning |", "|---|---|---|", markdown(spec, "."),
            "", "`summary.modules.MODULE` holds the integers " +
            ", ".join(f"`{c.replace(' ', '_')}`" for c in CATEGORIES) + ".", ""])
    rows = []
    for name, sub in spec.fields.items():
        path = f"{prefix}{name}".lstrip(".")
        rows.append(f"| `{path}` | {sub.types.replace('|', ' or ')} | {sub.doc} |")
        rows += [markdown(sub, path + ".")] if sub.fields else []
        if sub.items is not None and sub.items.fields:
            rows.append(markdown(sub.items, path + "[].").rstrip("\n"))
    return "\n".join(r for r in rows if r)


if __name__ == "__main__":
    print(markdown(), end="")

"""`spec-parity diff A B`: the verdict changes between two runs' report.json (a port's pull request
against its main branch). A regression is a case as expected in A and not in B; the command exits
1 on one, 0 otherwise, and 2 (one line) on a path that holds no report.json of the schema it reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import report_schema

KINDS = ("regression", "fixed", "changed", "new", "removed")


class DiffError(ValueError):
    """A path that is not a readable report.json: one line naming it and the fix."""


def load(path: str | Path) -> dict:
    """The report.json at `path` (the file, or the `spec-parity run --out` folder holding it)."""
    p = Path(path)
    f = p / "report.json" if p.is_dir() else p
    if not f.is_file():
        raise DiffError(f"{f}: no report.json there; give a `spec-parity run --out` folder or its report.json")
    try:
        doc = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DiffError(f"{f}: not a report.json (not JSON: {e}); give one `spec-parity run` wrote") from e
    try:
        report_schema.validate(doc)
    except report_schema.SchemaError as e:
        raise DiffError(f"{f}: not a report.json this spec-parity reads ({e}); diff two reports of "
                        f"{report_schema.VERSION}: rerun `spec-parity run` with this version, or diff with the "
                        "spec-parity that wrote them") from e
    return doc


def changes(a: dict, b: dict) -> list[dict]:
    """One entry per case whose verdict differs, or that only one run holds: its id, kind (KINDS),
    and each side's result (None where that run has no such case), in B's order then A's."""
    before = {(x["module"], x["case"]): x for x in a["results"]}
    after = {(x["module"], x["case"]): x for x in b["results"]}
    out = []
    for key in list(after) + [k for k in before if k not in after]:
        x, y = before.get(key), after.get(key)
        if x is not None and y is not None:
            if (x["shown_verdict"], x["expected"]) == (y["shown_verdict"], y["expected"]):
                continue
            kind = ("regression" if x["as_expected"] and not y["as_expected"] else
                    "fixed" if y["as_expected"] and not x["as_expected"] else "changed")
        else:
            kind = "new" if x is None else "removed"
        out.append({"id": "/".join(key), "kind": kind, "a": x, "b": y})
    return out


def _side(x: dict | None) -> str:
    if x is None:
        return "absent"
    return f"{x['shown_verdict']} (expected {x['expected']}{'' if x['as_expected'] else ', NOT as expected'})"


def _why(x: dict | None) -> str:
    if x is None or x["as_expected"] or not x["reason"]:
        return ""
    from .report_render import short_reason

    return f": {short_reason(x)}"


def render(a: dict, b: dict, found: list[dict], names: tuple[str, str]) -> str:
    lines = [f"A {names[0]}: {_run(a)}", f"B {names[1]}: {_run(b)}"]
    for c in sorted(found, key=lambda c: KINDS.index(c["kind"])):
        lines.append(f"{c['kind'].upper():10s} {c['id']}: {_side(c['a'])} -> {_side(c['b'])}{_why(c['b'])}")
    n = {k: sum(c["kind"] == k for c in found) for k in KINDS}
    same = len(b["results"]) - n["new"] - n["regression"] - n["fixed"] - n["changed"]
    lines.append(", ".join(f"{v} {k}" for k, v in n.items()) + f"; {same} of B's {len(b['results'])} cases "
                 "unchanged" + ("; exit 1: a case as expected in A is not in B" if n["regression"] else ""))
    return "\n".join(lines)


def _run(doc: dict) -> str:
    tree = doc["tree"]
    at = tree["commit"][:12] + (" (uncommitted changes)" if tree["dirty"] else "") if tree["commit"] \
        else f"spec-parity {tree['version']}"
    return f"{doc['summary']['line']}; {at}; started {doc['run']['started']}"


def main(a_path: str, b_path: str) -> int:
    """Print the changes; 1 on a regression, else 0 (DiffError for bad input)."""
    a, b = load(a_path), load(b_path)
    found = changes(a, b)
    print(render(a, b, found, (a_path, b_path)))
    return 1 if any(c["kind"] == "regression" for c in found) else 0

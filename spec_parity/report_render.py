"""report.md and report.html from one report.json document: the same blocks rendered twice, so the
two never say different things.

The first screen is the summary: the CLI's `N/N as expected` line, per module the cases as
expected / unexpected / partial / delta / declined, then the command, ports, tree and versions.
Then one results table, unexpected results first, each cell short (the reason cut to the first
failing check); every case's full message lies below behind its anchor (#case-MODULE-NAME).
"""

from __future__ import annotations

import html
import re

from .report_schema import CATEGORIES

CELL = 160
ORDER = ("unexpected", "partial", "delta", "declined", "as expected")


def anchor(module: str, case: str) -> str:
    return "case-" + re.sub(r"[^a-z0-9]+", "-", f"{module}-{case}".lower()).strip("-")


def cut(text: str, n: int = CELL) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def short_reason(x: dict) -> str:
    """The first failing check's reason (a reason is `; `-joined, first check first), cut short,
    with how many more follow."""
    parts = [p for p in x["reason"].split("; ") if p]
    if not parts:
        return ""
    more = f" (+{len(parts) - 1} more)" if len(parts) > 1 else ""
    return cut(parts[0], CELL - len(more)) + more


def _worst(x: dict) -> str:
    vals = [m["max_abs"] for m in x["metrics"].values()
            if isinstance(m, dict) and isinstance(m.get("max_abs"), (int, float))
            and not isinstance(m.get("max_abs"), bool)]
    return f"{max(vals):.2e}" if vals else "-"


def blocks(doc: dict, messages: dict[str, str], charts: list[str]) -> list[tuple]:
    """The report as blocks: ("h", level, text, anchor), ("p", id, cells), ("table", id, head, rows),
    ("ul", items), ("pre", text). A cell is a string, ("code", s), ("b", s) or ("link", s, href)."""
    run, tree, s = doc["run"], doc["tree"], doc["summary"]
    counts = [[m] + [str(c[k.replace(" ", "_")]) for k in CATEGORIES] + [str(sum(c.values()))]
              for m, c in s["modules"].items()]
    commit = (f", commit {tree['commit'][:12]}" + (" (uncommitted changes)" if tree["dirty"] else "")
              if tree["commit"] else ", not a git checkout")
    ports = "; ".join(f"{p['module']}={p['identity']}" for p in doc["ports"]) or "not recorded"
    vers = ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v)
    out = [("h", 1, "spec-parity report", None), ("p", "tally", [("b", s["line"])]),
           ("table", "summary-table", ["module", *CATEGORIES, "total"], counts),
           ("ul", [["command: ", ("code", run["command"]) if run["command"] else "not recorded"],
                   [f"ports: {ports}"], [f"tree: spec-parity {tree['version']}{commit}"],
                   [f"versions: {vers}"],
                   [f"machine: {doc['machine']}; started {run['started']}, {s['total']} cases in "
                    f"{run['duration_s']:.1f} s"]])]
    rows = sorted(doc["results"], key=lambda x: ORDER.index(x["category"]))
    out += [("h", 2, "Results, unexpected first", None),
            ("table", "results", ["module", "case", "tier", "verdict", "checks run", "expected", "as expected",
                                  "first failing check", "layer", "worst max abs", "reason"],
             [[x["module"], ("link", x["case"], "#" + anchor(x["module"], x["case"])), x["tier"],
               x["shown_verdict"], x["checks_run"], x["expected"], "yes" if x["as_expected"] else ("b", "NO"),
               x["first_failing_check"] or "-", "-" if x["layer"] is None else str(x["layer"]), _worst(x),
               short_reason(x)] for x in rows])]
    out += _layers(doc, charts)
    out += [("h", 2, "Details", None)]
    for x in rows:
        out += [("h", 3, f"{x['module']}/{x['case']}", anchor(x["module"], x["case"])),
                ("pre", messages.get(f"{x['module']}/{x['case']}", x["reason"]))]
    return out


def _layers(doc: dict, charts: list[str]) -> list[tuple]:
    items = []
    for x in doc["results"]:
        lay = x["metrics"].get("layers")
        if not isinstance(lay, dict) or not lay.get("exposed", True) or "own_max_abs" not in lay:
            continue
        first = lay["first_divergent_layer"]
        items.append([("link", f"{x['module']}/{x['case']}", "#" + anchor(x["module"], x["case"])),
                      f": first divergent layer {'none' if first is None else first}; free ["
                      + ", ".join(f"{v:.1e}" for v in lay["free_max_abs"]) + "]; own ["
                      + ", ".join(f"{v:.1e}" for v in lay["own_max_abs"]) + f"]; budget {lay['budget']}"])
    if not items:
        return []
    return [("h", 2, "Per-layer error (free-running / own teacher-forced max abs)", None),
            ("p", None, ["plots: "] + [("link", c, c) for c in charts]), ("ul", items)]


def _md_cell(c, table: bool = False) -> str:
    if isinstance(c, str):
        return c.replace("|", "/") if table else c
    kind, text = c[0], c[1].replace("|", "/") if table else c[1]
    return {"code": f"`{text}`", "b": f"**{text}**", "link": f"[{text}]({c[-1]})"}[kind]


def markdown(bl: list[tuple]) -> str:
    out = []
    for b in bl:
        if b[0] == "h":
            out += [("#" * b[1]) + " " + b[2] + (f' <a id="{b[3]}"></a>' if b[3] else ""), ""]
        elif b[0] == "p":
            out += ["".join(_md_cell(c) for c in b[2]), ""]
        elif b[0] == "ul":
            out += ["- " + "".join(_md_cell(c) for c in item) for item in b[1]] + [""]
        elif b[0] == "table":
            out += ["| " + " | ".join(b[2]) + " |", "|" + "---|" * len(b[2])]
            out += ["| " + " | ".join(_md_cell(c, True) for c in row) + " |" for row in b[3]] + [""]
        elif b[0] == "pre":
            out += ["```", b[1], "```", ""]
    return "\n".join(out)


def _html_cell(c) -> str:
    if isinstance(c, str):
        return html.escape(c)
    tag = {"code": "code", "b": "strong"}.get(c[0])
    if tag:
        return f"<{tag}>{html.escape(c[1])}</{tag}>"
    return f'<a href="{html.escape(c[2])}">{html.escape(c[1])}</a>'


STYLE = ("body{font:14px system-ui,sans-serif;margin:1.5em;max-width:110em}table{border-collapse:collapse;"
         "margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}"
         "th{background:#f3f3f3}pre{background:#f7f7f7;padding:.5em;overflow-x:auto}img{max-width:100%}")


def html_page(bl: list[tuple]) -> str:
    body, in_summary = [], True
    for b in bl:
        if b[0] == "h" and b[1] == 2 and in_summary:
            body.append("</section>")
            in_summary = False
        if b[0] == "h":
            body.append(f"<h{b[1]}" + (f' id="{b[3]}"' if b[3] else "") + f">{html.escape(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            body.append("<p" + (f' id="{b[1]}"' if b[1] else "") + ">"
                        + "".join(_html_cell(c) for c in b[2]) + "</p>")
        elif b[0] == "ul":
            body.append("<ul>" + "".join("<li>" + "".join(_html_cell(c) for c in i) + "</li>" for i in b[1])
                        + "</ul>")
        elif b[0] == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in b[2])
            rows = "".join("<tr>" + "".join(f"<td>{_html_cell(c)}</td>" for c in r) + "</tr>" for r in b[3])
            body.append(f'<table id="{b[1]}"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')
        elif b[0] == "pre":
            body.append(f"<pre>{html.escape(b[1])}</pre>")
        if b[0] == "p" and b[1] is None:
            body += [f'<img src="{html.escape(c[2])}" alt="{html.escape(c[1])}">' for c in b[2][1:]]
    if in_summary:
        body.append("</section>")
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>spec-parity report</title>"
            f"<style>{STYLE}</style></head><body><section id=\"summary\">\n" + "\n".join(body) + "\n</body></html>\n")

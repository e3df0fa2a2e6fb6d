"""`spec-parity combine`: one table from two or more bench runs, the way docs/benchmarks.md reports.

Two runs may land on two hosts, and one run's spread is not the spread between runs, so one run's
figures are not the figure: each side's figure is shown run by run (median [p10–p90]) with the
median of the runs, and a ratio between two sides is one value only where every run's ratio lies
inside every other run's spread; else it moved more than its spread, and it is given as the range
of the runs. The runs must be of one kind (bench.json or serve.json), of one tree and measured with
the same options; their machines may differ, and each is named.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..goldens import atomic_write

KINDS = {"serve": "serve.json", "bench": "bench.json"}
# Options that choose what runs, not how it is measured: runs may differ in them.
SELECTING = {"sources", "sides", "peers", "conditions", "cases", "torch_device", "kernels", "bw_bytes"}


class CombineError(ValueError):
    """Runs that cannot be combined: one line naming the file and the fix."""


@dataclass(frozen=True)
class Figure:
    """One run's figure: its median and p10–p90 (the spread of its samples)."""

    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, d: dict | None, scale: float = 1.0) -> Figure | None:
        if not d or d.get("median") is None:
            return None
        m = d["median"] * scale
        return cls(m, d.get("p10", d["median"]) * scale, d.get("p90", d["median"]) * scale)

    @classmethod
    def point(cls, v: float) -> Figure:
        """A figure with no spread (the floor: one measured bandwidth per run)."""
        return cls(v, v, v)


@dataclass(frozen=True)
class Ratio:
    """a ÷ b over the runs that have both: `value` (the median of the runs' ratios) where no run's
    ratio leaves another run's spread [a.p10 / b.p90, a.p90 / b.p10], else the range (`moved`)."""

    runs: tuple[float, ...]
    moved: bool

    @property
    def value(self) -> float:
        return statistics.median(self.runs)

    def text(self) -> str:
        if not self.runs:
            return "–"
        if len(self.runs) == 1:
            return f"{_n(self.runs[0])}× (1 run)"
        if self.moved:
            return f"{_n(min(self.runs))}–{_n(max(self.runs))}×"
        return f"{_n(self.value)}×"

    def to_json(self) -> dict:
        return {"runs": list(self.runs), "moved": self.moved, "text": self.text()}


def ratio(a: list[Figure | None], b: list[Figure | None]) -> Ratio:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and y.median and y.p10]
    runs = tuple(x.median / y.median for x, y in pairs)
    spreads = [(x.p10 / y.p90, x.p90 / y.p10) for x, y in pairs]
    moved = any(not lo <= r <= hi for i, r in enumerate(runs) for j, (lo, hi) in enumerate(spreads) if i != j)
    return Ratio(runs, moved)


def _n(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _fig(f: Figure | None, digits: int) -> str:
    return "–" if f is None else f"{f.median:.{digits}f} [{f.p10:.{digits}f}–{f.p90:.{digits}f}]"


def _median(figs: list[Figure | None], digits: int) -> str:
    have = [f.median for f in figs if f is not None]
    if not have:
        return "–"
    return f"{statistics.median(have):.{digits}f}" + (" (1 run)" if len(have) == 1 else "")


# ---- reading the runs ----------------------------------------------------------------------------

def load(paths: list[str | Path]) -> tuple[str, list[tuple[Path, dict]]]:
    """The runs (a serve.json or bench.json, or a folder holding one) and their kind; refused with
    one line where they cannot make one table."""
    runs = [_read(Path(p)) for p in paths]
    if len(runs) < 2:
        raise CombineError(f"{len(runs)} run given: a figure is the median of at least 2 runs; "
                           "name another run's serve.json or bench.json")
    for i, (p, d) in enumerate(runs):
        twice = next((q for q, e in runs[:i] if q.resolve() == p.resolve() or e == d), None)
        if twice is not None:
            raise CombineError(f"{p}: the same run as {twice}; a figure's runs are separate bench runs: "
                               "run the bench again")
    kinds = {_kind(d) for _, d in runs}
    if len(kinds) > 1:
        raise CombineError(f"runs of two kinds ({' and '.join(sorted(kinds))}): combine serve.json files or "
                           "bench.json files, not both")
    (p0, d0), kind = runs[0], kinds.pop()
    for p, d in runs[1:]:
        if _tree(d) != _tree(d0):
            raise CombineError(f"{p}: tree {_tree(d)}, {p0}: tree {_tree(d0)}; a figure combines runs of one "
                               "tree: combine each tree's runs apart and compare the tables")
        e, e0 = _mlx_env(d), _mlx_env(d0)
        if e is not None and e0 is not None and e != e0:
            raise CombineError(f"{p}: MLX settings {_env_text(e)}, {p0}: {_env_text(e0)}; MLX CUDA's graph "
                               "settings move the figures: combine runs made with the same environment")
        o, o0 = d.get("options") or {}, d0.get("options") or {}
        for key in sorted((set(o) | set(o0)) - SELECTING):
            if o.get(key) != o0.get(key):
                raise CombineError(f"{p}: option {key}={o.get(key)!r}, {p0}: {key}={o0.get(key)!r}; runs of one "
                                   "figure are measured alike: rerun with the same command")
    return kind, runs


def _read(path: Path) -> tuple[Path, dict]:
    if path.is_dir():
        found = [path / n for n in KINDS.values() if (path / n).is_file()]
        if len(found) != 1:
            raise CombineError(f"{path}: holds {' and '.join(f.name for f in found) or 'no serve.json or bench.json'}; "
                               "name the file")
        path = found[0]
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CombineError(f"{path}: no such file; name a bench run's serve.json or bench.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CombineError(f"{path}: not a bench run's JSON ({type(e).__name__}: {e}); name the serve.json or "
                           "bench.json that spec-parity bench wrote") from None
    if not _well_formed(doc):
        raise CombineError(f"{path}: not what spec-parity bench writes (each case with its sides, each side "
                           "named); name the serve.json or bench.json that it wrote")
    return path, doc


def _well_formed(doc) -> bool:
    """The shape combine reads: cases, and in each case that ran its sides, each with a name."""
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        return False
    serve = "bandwidth" not in doc
    for c in doc["cases"]:
        if not isinstance(c, dict) or "case" not in c or (serve and "condition" not in c):
            return False
        if c.get("status") == "ok" and not (isinstance(c.get("sides"), list)
                                            and all(isinstance(s, dict) and "side" in s for s in c["sides"])):
            return False
        if not serve and c.get("status") == "ok" and not ("steps_per_call" in c and "floor" in c):
            return False
    return True


def _kind(doc: dict) -> str:
    return "bench" if "bandwidth" in doc else "serve"


def _tree(doc: dict) -> str:
    """Which code ran: the source digest where the run has one, else its commit."""
    p, git = doc.get("project") or {}, doc.get("git")  # `git`: how older runs named their tree
    git = git.get("commit") if isinstance(git, dict) else git
    tree = str(p.get("source_sha256") or p.get("commit") or git or "unknown")
    return tree[:12] if re.fullmatch("[0-9a-f]{13,}", tree) else tree


def _mlx_env(doc: dict) -> dict | None:
    """The run's MLX_* environment (bench.json `machine.mlx_env`); None for runs older than it."""
    return (doc.get("machine") or {}).get("mlx_env")


def _env_text(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none set"


def _stopped(doc: dict) -> str | None:
    """Where a run stopped before its last case (the bench keeps the cases it finished), or None."""
    if doc.get("complete", True):
        return None
    return f"stopped after {len(doc['cases'])} of its {doc.get('cases_planned', '?')} cases"


def _machine(doc: dict) -> str:
    m = doc.get("machine") or {}
    info = m.get("mlx_device_info") or {}
    return f"{info.get('device_name') or m.get('mlx_default_device', '?')}, {m.get('platform', '?')}"


def _cases(runs: list[dict], key) -> list[tuple[str, list[dict | None]]]:
    """Each case (named by `key`) with its record in every run (None where a run lacks it), in the
    order the runs first have them."""
    names = list(dict.fromkeys(key(c) for d in runs for c in d["cases"]))
    return [(n, [next((c for c in d["cases"] if key(c) == n), None) for d in runs]) for n in names]


def _ran(records: list[dict | None]) -> tuple[list[tuple[str, list[dict | None]]], list[str]]:
    """Each side with its record in every run (None where it did not run there), and why each
    case or side that did not run did not ("run 2: ...", "deepspec-torch, run 1: ...")."""
    why = [f"run {i + 1}: {c.get('reason', c.get('status'))}" for i, c in enumerate(records)
           if c and c.get("status") != "ok"]
    records = [c if c and c.get("status") == "ok" else None for c in records]
    names = list(dict.fromkeys(s["side"] for c in records if c for s in c["sides"]))
    sides = []
    for n in names:
        per = [next((s for s in c["sides"] if s["side"] == n), None) if c else None for c in records]
        why += [f"{n}, run {i + 1}: {s.get('reason', s.get('status'))}" for i, s in enumerate(per)
                if s and s.get("status") != "ok"]
        sides.append((n, [s if s and s.get("status") == "ok" else None for s in per]))
    return sides, why


# ---- the tables ----------------------------------------------------------------------------------

def combine(kind: str, runs: list[tuple[Path, dict]]) -> dict:
    """combined.json's content: per case and side, each run's figure, the median of the runs, and
    the ratios, each with what it is of."""
    docs = [d for _, d in runs]
    out = {"kind": kind, "tree": _tree(docs[0]), "runs": [{"path": str(p), "machine": _machine(d),
           "command": d.get("command"), "wall_s": d.get("wall_s"), "stopped": _stopped(d)} for p, d in runs],
           "cases": []}
    per = _serve_case if kind == "serve" else _bench_case
    key = (lambda c: f"{c['condition']}: {c['case']}") if kind == "serve" else (lambda c: c["case"])
    for name, records in _cases(docs, key):
        out["cases"].append({"case": name, **per(records)})
    return out


def _serve_case(records: list[dict | None]) -> dict:
    sides, why = _ran(records)
    rate = {n: [Figure.of(s.get("decode_tokens_per_s")) if s else None for s in ss] for n, ss in sides}
    plain, port = rate.get("plain"), rate.get("port")
    rows = []
    for n, ss in sides:
        rows.append({"side": n, "tokens_per_s": [f.__dict__ if f else None for f in rate[n]],
                     "x_plain": ratio(rate[n], plain).to_json() if plain and n != "plain" else None,
                     "port_over_side": ratio(port, rate[n]).to_json() if port and n not in ("port", "plain") else None,
                     "tau": [s.get("tau") if s else None for s in ss],
                     "split_s": [s.get("round_split_s") if s else None for s in ss],
                     "peak_bytes": max((s.get("peak_bytes", 0) for s in ss if s), default=None),
                     "stream": [None if not s else _lossless((s.get("stream") or {}).get("lossless")) for s in ss]})
    return {"sides": rows, "not_run": why}


def _lossless(v: bool | None) -> str:
    return {True: "yes", False: "NO", None: "ref"}[v]


def _bench_case(records: list[dict | None]) -> dict:
    sides, why = _ran(records)
    records = [c if c and c.get("status") == "ok" else None for c in records]
    steps = [c["steps_per_call"] if c else 1 for c in records]
    step = {n: [Figure.of(s.get("wall_s"), 1 / k) if s else None for s, k in zip(ss, steps)] for n, ss in sides}
    floor = [Figure.point(c["floor"]["copy_floor_s"] / k) if c else None for c, k in zip(records, steps)]
    port = step.get("port")
    rows = [{"side": n, "step_s": [f.__dict__ if f else None for f in step[n]],
             "x_floor": ratio(step[n], floor).to_json(),
             "port_speedup_over_side": ratio(step[n], port).to_json() if port and n != "port" else None,
             "graph_ops": [s.get("graph_ops") if s else None for s in ss],
             "agrees_with_port": [s.get("agrees_with_port") if s else None for s in ss]} for n, ss in sides]
    return {"floor_step_s": [f.median if f else None for f in floor], "rounds": [_rounds(c) for c in records],
            "sides": rows, "not_run": why}


def _rounds(case: dict | None) -> dict | None:
    """The serve section's default loop: its warm and cold round (median s), where the run has both."""
    sv = (case or {}).get("serve") or {}
    warm, cold = sv.get("round_median_s"), (sv.get("cold") or {}).get("round_median_s")
    return {"warm_s": warm["round_s"], "cold_s": cold["round_s"]} if warm and cold else None


def _figs(raw: list[dict | None]) -> list[Figure | None]:
    return [Figure(**f) if f else None for f in raw]


def _ratio_text(r: dict | None) -> str:
    return "–" if r is None else r["text"]


def _runs_text(figs: list[Figure | None], digits: int) -> str:
    return " / ".join(_fig(f, digits) for f in figs)


def markdown(doc: dict) -> str:
    n = len(doc["runs"])
    lines = [f"# spec-parity combine: {n} {doc['kind']} runs of tree {doc['tree']}", ""]
    lines += [f"- run {i + 1}: `{r['path']}` on {r['machine']}" + (f" ({r['stopped']})" if r["stopped"] else "")
              for i, r in enumerate(doc["runs"])]
    lines += ["", "Each run's median [p10–p90], in run order, then the median of the runs. A ratio is the median "
              "of the runs' ratios where every run's ratio lies inside every other run's spread, else the range "
              "of the runs (it moved more than its spread).", ""]
    table = _serve_table if doc["kind"] == "serve" else _bench_table
    for c in doc["cases"]:
        lines += [f"## {c['case']}", "", *table(c), ""]
        lines += [f"- not run: {w}" for w in c["not_run"]] + ([""] if c["not_run"] else [])
    return "\n".join(lines)


def _serve_table(c: dict) -> list[str]:
    lines = ["| side | tok/s, run by run | median of the runs | × plain | port ÷ side | τ | "
             "split ms (d / v / a+t), run by run | peak MiB | stream = plain |", "|" + "---|" * 9]
    for s in c["sides"]:
        figs = _figs(s["tokens_per_s"])
        tau = " / ".join(f"{t:.2f}" if t else "–" for t in s["tau"])
        split = " ; ".join(" / ".join(f"{sp[k] * 1e3:.2f}" for k in ("draft_s", "verify_s", "accept_trim_s"))
                           if sp else "–" for sp in s["split_s"])
        peak = f"{s['peak_bytes'] / 2**20:.0f}" if s["peak_bytes"] else "–"
        lines.append(f"| {s['side']} | {_runs_text(figs, 1)} | {_median(figs, 1)} | {_ratio_text(s['x_plain'])} | "
                     f"{_ratio_text(s['port_over_side'])} | {tau} | {split} | {peak} | "
                     f"{' / '.join(x or '–' for x in s['stream'])} |")
    return lines


def _bench_table(c: dict) -> list[str]:
    floor = " / ".join(f"{f * 1e3:.3f}" if f else "–" for f in c["floor_step_s"])
    rounds = " / ".join(f"{r['warm_s'] * 1e3:.2f} warm, {r['cold_s'] * 1e3:.2f} cold ({r['cold_s'] / r['warm_s']:.2f}×)"
                        if r else "–" for r in c["rounds"])
    lines = [f"Floor ms / step, run by run: {floor}. The serve section's round (default loop, ms, cold ÷ warm), "
             f"run by run: {rounds}.", "",
             "| side | ms / step, run by run | median of the runs | × floor | port's speed-up over it | "
             "graph ops / call | first draft = port's |", "|" + "---|" * 7]
    for s in c["sides"]:
        figs = [Figure(f.median * 1e3, f.p10 * 1e3, f.p90 * 1e3) if f else None for f in _figs(s["step_s"])]
        agree = " / ".join({True: "yes", False: "NO", None: "–"}[a] for a in s["agrees_with_port"])
        ops = " / ".join(str(o) if o is not None else "–" for o in s["graph_ops"])
        lines.append(f"| {s['side']} | {_runs_text(figs, 3)} | {_median(figs, 3)} | {_ratio_text(s['x_floor'])} | "
                     f"{_ratio_text(s['port_speedup_over_side'])} | {ops} | {agree} |")
    return lines


def write(doc: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "combined.json", out / "combined.md"
    atomic_write(js, (json.dumps(doc, indent=2) + "\n").encode())
    atomic_write(md, (markdown(doc) + "\n").encode())
    return [js, md]

"""The comparison core: tiers as data, metrics, and one result record.

Every pair in the project compares through these functions. A tier is a name with a rule; the
rule's numbers live in `spec_parity.budgets`, never at a call site, so a comparison cannot loosen
its tier silently.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from .budgets import Budget, budget_for, knife_edge_bound, ulp

PARTIAL = "PASS-PARTIAL"
"""Every check the port exposed arrays for passed, and some could not run: the port left optional
quantities (internals) out. Counted apart from PASS; `spec-parity run --require internals` fails it."""

TIERS = {
    "L1": "bit-exact: identical bytes (same framework, same ops)",
    "L2": "tensors within the dtype-derived / measured budget AND identical greedy streams and accept traces",
    "L3": "no oracle for the whole: KL, top-1 agreement and acceptance gates; a component that has one "
          "within its L2 budget",
}


@dataclass
class Result:
    """One comparison's record: rendered as the pytest failure message, JSON and Markdown."""

    module: str
    case: str
    oracle: str
    tier: str
    metrics: dict = field(default_factory=dict)
    verdict: str = "PASS"
    reason: str = ""
    findings: dict = field(default_factory=dict)   # finding -> the reasons it failed (spec_parity.checks)
    trace: str = ""                                # an ERROR's formatted traceback
    coverage: dict = field(default_factory=dict)   # what was checked and what was not (spec_parity.checks)
    phases: dict = field(default_factory=dict)     # wall seconds per phase (harness.evaluate)

    @property
    def ok(self) -> bool:
        """Every check that ran passed (PASS, or PASS-PARTIAL where some could not run)."""
        return self.verdict in ("PASS", PARTIAL)

    @property
    def first_failure(self) -> str | None:
        """The first check, in the plan's order, that failed (a metric with ok False)."""
        return next((k for k, m in self.metrics.items() if isinstance(m, dict) and m.get("ok") is False), None)

    def fail(self, reason: str, finding: str = "module") -> None:
        self.verdict = "FAIL"
        self.reason = f"{self.reason}; {reason}" if self.reason else reason
        self.findings.setdefault(finding, []).append(reason)

    def missing(self, check, what: str) -> None:
        """A check (its `name` and `finding`) that could not compare: `what` stood in the way."""
        self.metrics[check.name] = {"ok": False, "error": what}
        self.fail(f"{check.name}: {what}", check.finding)

    def note(self, reason: str) -> None:
        self.reason = f"{self.reason}; {reason}" if self.reason else reason

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self), default=_jsonable))

    @property
    def shown_verdict(self) -> str:
        """The verdict as reports show it: a failure from NaN/Inf says so."""
        nonfinite = any(isinstance(m, dict) and str(m.get("error", "")).startswith("non-finite")
                        for m in self.metrics.values())
        return f"{self.verdict} non-finite" if nonfinite and self.verdict != "PASS" else self.verdict

    def message(self) -> str:
        lines = [f"[{self.shown_verdict}] {self.module}/{self.case} vs {self.oracle} at {self.tier} "
                 f"({TIERS.get(self.tier, '?')})"]
        if self.reason:
            lines.append(f"  reason: {self.reason}")
        if self.coverage:
            lines.append(f"  coverage: {coverage_text(self.coverage)}")
        for finding, reasons in self.findings.items():
            lines.append(f"  FAIL {finding}: {reasons[0]}" + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""))
        for name, m in self.metrics.items():
            lines.append(f"  {name}: {_brief(m)}")
        return "\n".join(lines)

    def markdown_row(self) -> str:
        worst = max((m.get("max_abs", 0.0) for m in self.metrics.values()
                     if isinstance(m, dict) and isinstance(m.get("max_abs"), float)), default=0.0)
        return (f"| {self.module} | {self.case} | {self.oracle} | {self.tier} | {self.shown_verdict} | "
                f"{self.checks_run} | {worst:.2e} | {self.reason.replace('|', '/')} |")

    @property
    def checks_run(self) -> str:
        """Checks run of those planned ("12/20"); "-" where none was judged (declined, error)."""
        c = self.coverage
        return f"{len(c['checked'])}/{sum(len(c.get(k, ())) for k in ('checked', 'not_exposed', 'blocked'))}" if c else "-"


def coverage_text(c: dict) -> str:
    """A result's coverage in one line: the checks run, on which quantities, and the ones not run."""
    q = c.get("quantities", {})
    text = (f"{len(c['checked'])} checks run on {len(q.get('required', []))} required and "
            f"{len(q.get('optional', []))} optional quantities")
    text += f"; not exposed, so not run: {', '.join(c['not_exposed'])}" if c.get("not_exposed") else ""
    return text + (f"; not run, their arrays break the output contract: {', '.join(c['blocked'])}"
                   if c.get("blocked") else "")


PARTIAL_EXIT = 4
"""`spec-parity run`'s exit status when every verdict is as expected but some passed only on what
the port exposes (PASS-PARTIAL): not green, not a failure; `--require outputs` accepts it (exit 0)."""


def as_expected(verdict: str, expect: str, require: tuple[str, ...] = ()) -> bool:
    """Whether a verdict is the one a case expects. PASS-PARTIAL stands for PASS unless the run
    requires the internals (`--require internals`)."""
    if verdict == PARTIAL:
        return expect == "PASS" and "internals" not in require
    return verdict == expect


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _brief(m) -> str:
    if not isinstance(m, dict):
        return str(m)
    keys = ("versions", "identity", "exposed", "ok", "max_abs", "max_rel", "mismatch", "mismatch_pct", "first_mismatch", "cosine",
            "nmse", "max_ulp", "budget", "first_divergence", "equal", "agree", "kl_max", "p", "alpha",
            "detectable_bias", "sees", "residual", "bonus", "acceptance")
    return ", ".join(f"{k}={_fmt(m[k])}" for k in keys if k in m)


def _fmt(v) -> str:
    if v is None:
        return "none"
    return f"{v:.3e}" if isinstance(v, float) else str(v)


MASKED = -1e29
"""Logits at or below this are a mask, not a score: a centroid head's -1e30 (port/assistant.py,
optiq) or transformers' finfo.min. Both sides masked: left out of max|Δ|; one side only: a mismatch."""


def _nonfinite(p: np.ndarray, r: np.ndarray) -> str | None:
    """The error when either side holds NaN/Inf: they never pass, even where both sides agree."""
    counts = []
    for side, x in (("port", p), ("reference", r)):
        x = x if x.dtype.kind in "biu" else x.astype(np.float64)
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            counts.append(f"{side} {int(np.isnan(x).sum())} NaN, {int(np.isinf(x).sum())} Inf")
    return f"non-finite values ({'; '.join(counts)} of {r.size}): NaN/Inf never pass" if counts else None


def _shape_error(p: np.ndarray, r: np.ndarray) -> str:
    return f"shape {list(p.shape)} vs {list(r.shape)} (port vs reference)"


def tensor_metrics(port, ref, budget: Budget, dtype="float32", first_n: int = 5) -> dict:
    """Compare two tensors under `budget` (|p - r| <= atol + rtol·|r|, torch.testing's rule).

    Any NaN/Inf on either side fails ("non-finite"), even where both sides hold the same value: a
    NaN weight makes every logit NaN on both sides, and that is not parity. Masked logits (MASKED)
    must be masked on both sides and are left out of the error figures.
    """
    p = np.asarray(port, np.float64)
    r = np.asarray(ref, np.float64)
    m: dict = {"shape": list(r.shape), "budget": budget.describe()}
    if p.shape != r.shape:
        m.update(ok=False, error=_shape_error(p, r))
        return m
    finite = np.isfinite(p) & np.isfinite(r)
    masked_p, masked_r = finite & (p <= MASKED), finite & (r <= MASKED)
    scored = finite & ~masked_p & ~masked_r
    with np.errstate(invalid="ignore"):
        diff = np.where(scored, np.abs(p - r), np.inf)
    diff = np.where(masked_p & masked_r, 0.0, diff)
    bad = ~(diff <= budget.atol + budget.rtol * np.where(scored, np.abs(r), 0.0))
    n_bad = int(bad.sum())
    pf, rf = p[scored], r[scored]
    denom = float(np.sum(rf * rf))
    nonfinite = _nonfinite(p, r)
    m.update(
        ok=n_bad == 0 and nonfinite is None,
        max_abs=float(np.abs(pf - rf).max()) if pf.size else 0.0,
        max_rel=float(np.max(np.abs(pf - rf) / np.maximum(np.abs(rf), 1e-30))) if pf.size else 0.0,
        mismatch=n_bad,
        mismatch_pct=100.0 * n_bad / max(r.size, 1),
        first_mismatch=[list(map(int, ix)) for ix in np.argwhere(bad)[:first_n]],
        nmse=float(np.sum((pf - rf) ** 2) / denom) if denom > 0 else float(np.sum((pf - rf) ** 2)),
        cosine=float(np.dot(pf, rf) / (np.linalg.norm(pf) * np.linalg.norm(rf)))
        if pf.size and np.linalg.norm(pf) > 0 and np.linalg.norm(rf) > 0 else 1.0,
        max_ulp=float(np.max(np.abs(pf - rf) / ulp(rf, dtype))) if pf.size else 0.0,
        nonfinite_port=int((~np.isfinite(p)).sum()),
        nonfinite_ref=int((~np.isfinite(r)).sum()),
    )
    if int((masked_p != masked_r).sum()):
        m["masked_mismatch"] = int((masked_p != masked_r).sum())
    if nonfinite:  # max|Δ| of a NaN is no number: inf, so that no figure reads as agreement
        m.update(error=nonfinite, max_abs=float("inf"))
    return m


def bit_exact(port, ref) -> dict:
    """L1: identical dtype, shape and bytes, and finite (NaN/Inf never pass, as in tensor_metrics).
    max_abs leaves out logits masked on both sides (MASKED)."""
    p, r = np.asarray(port), np.asarray(ref)
    same = p.dtype == r.dtype and p.shape == r.shape and p.tobytes() == r.tobytes()
    nonfinite = _nonfinite(p, r) if p.shape == r.shape else None
    m = {"ok": bool(same) and nonfinite is None, "dtype": [str(p.dtype), str(r.dtype)]}
    if p.shape != r.shape:
        m["error"] = _shape_error(p, r)
    elif not same:
        pd, rd = p.astype(np.float64), r.astype(np.float64)
        with np.errstate(invalid="ignore"):
            diff = ~((pd == rd) | (np.isnan(pd) & np.isnan(rd)))
            scored = np.isfinite(pd) & np.isfinite(rd) & (pd > MASKED) & (rd > MASKED)
        m.update(mismatch=int(diff.sum()), first_mismatch=[list(map(int, ix)) for ix in np.argwhere(diff)[:5]],
                 max_abs=float(np.abs(pd - rd)[scored].max()) if scored.any() else 0.0)
        masked = int(((pd <= MASKED) != (rd <= MASKED)).sum())
        if masked:
            m["masked_mismatch"] = masked
    if nonfinite:
        m.update(error=nonfinite, max_abs=float("inf"))
    return m


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(ref_logits, port_logits) -> np.ndarray:
    """KL(ref || port) per row, in nats."""
    lr, lp = log_softmax(ref_logits), log_softmax(port_logits)
    return np.sum(np.exp(lr) * (lr - lp), axis=-1)


def stream_metrics(port_tokens, ref_tokens, ref_logits, dtype="float32", topk: int = 5) -> dict:
    """Greedy token streams. At the first divergence: the reference's top-1/top-2 margin, whether
    the port's token is in the reference's top-k, and whether it is a knife-edge (the margin, and
    the port token's gap to top-1, below the dtype-ULP-derived bound)."""
    p = [int(t) for t in port_tokens]
    r = [int(t) for t in ref_tokens]
    m: dict = {"length": [len(p), len(r)]}
    d = next((i for i, (a, b) in enumerate(zip(p, r)) if a != b), None)
    if d is None and len(p) != len(r):
        d = min(len(p), len(r))
    m["first_divergence"] = d
    m["equal"] = d is None
    m["ok"] = d is None
    if d is None or d >= min(len(p), len(r), len(ref_logits)):
        return m
    row = np.asarray(ref_logits[d], np.float64)
    order = np.argsort(-row, kind="stable")
    margin = float(row[order[0]] - row[order[1]])
    gap = float(row[order[0]] - row[p[d]])
    bound = knife_edge_bound(dtype, float(abs(row[order[0]])))
    m.update(port_token=p[d], ref_token=r[d], ref_margin=margin, port_gap_to_top1=gap,
             port_in_ref_topk=bool(p[d] in order[:topk].tolist()), knife_edge_bound=bound,
             knife_edge=bool(margin < bound and gap < bound))
    m["ok"] = m["knife_edge"]
    return m


def teacher_forced(port_logits, ref_logits, ref_tokens) -> dict:
    """Score the port on the reference's own stream, position by position."""
    pl, rl = np.asarray(port_logits), np.asarray(ref_logits)
    agree = pl.argmax(-1) == np.asarray(ref_tokens)
    k = kl(rl, pl)
    return {"agree": int(agree.sum()), "positions": int(agree.size),
            "first_disagreement": int(np.argmin(agree)) if not agree.all() else None,
            "kl_max": float(k.max()) if k.size else 0.0, "kl_mean": float(k.mean()) if k.size else 0.0,
            "kl_per_position": [float(x) for x in k], "ok": bool(agree.all())}


def trace_metrics(port_trace, ref_trace) -> dict:
    """Accept traces: per round (drafted, accepted, emitted) must be equal."""
    p = [tuple(int(x) for x in r) for r in port_trace]
    r = [tuple(int(x) for x in t) for t in ref_trace]
    d = next((i for i, (a, b) in enumerate(zip(p, r)) if a != b), None)
    if d is None and len(p) != len(r):
        d = min(len(p), len(r))
    m = {"rounds": [len(p), len(r)], "first_differing_round": d, "ok": d is None}
    if d is not None:
        m["port_round"] = list(p[d]) if d < len(p) else "end of trace"
        m["ref_round"] = list(r[d]) if d < len(r) else "end of trace"
    return m


def check_tensor(result: Result, name: str, port, ref, module: str, quantity: str, dtype="float32",
                 finding: str = "module") -> dict:
    """Compare one tensor at the result's tier and record it."""
    if result.tier == "L1":
        m = bit_exact(port, ref)
    else:
        m = tensor_metrics(port, ref, budget_for(module, quantity, dtype), dtype)
    result.metrics[name] = m
    if not m["ok"]:
        result.fail(f"{name}: {failure(m)}", finding)
    return m


def failure(m: dict) -> str:
    """One tensor comparison's failure in words (no None, no sentinel-sized max|Δ|)."""
    if m.get("error"):
        return m["error"]
    if m.get("dtype") and m["dtype"][0] != m["dtype"][1] and not m.get("mismatch"):
        return f"dtype {m['dtype'][0]} vs {m['dtype'][1]} (port vs reference)"
    masked = f", {m['masked_mismatch']} masked on one side only" if m.get("masked_mismatch") else ""
    return (f"{m.get('mismatch', 0)} elements outside {m.get('budget', 'bit-exactness')}{masked} "
            f"(max_abs {m.get('max_abs', 0.0):.3e})")

"""What a pair declares about a case, and the one place that judges it.

A pair never compares (llama.cpp's test-backend-ops shape): for each case it returns a list of
checks, plain data naming which arrays of which side to hold to which rule. `judge` applies
them in order: tiers, budgets and the knife-edge rule live here and in spec_parity.compare, never
in a pair. Each check belongs to a *finding* ("module", "stream", "layers", and for serve loops
"lossless", "drafts", "schedule"), and the report gives each finding its own line, so a loop that
is lossless with the reference's drafts but another schedule reads as that, not as a wrong drafter.

Arrays come from three sides: "port" (what the port returned), "ref" (the reference's arrays,
live or golden) and "greedy" (the target's plain greedy stream, computed by the harness, never by
the port under test: `greedy.tokens`, `greedy.logits`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import numpy as np

from . import attended, compare, drafting, sampled
from .attended import Rows, Window
from .compare import Result, check_tensor, stream_metrics, teacher_forced, trace_metrics
from .drafting import Drafts, FirstRound, Pruning, Round, Shift
from .layers import localize


@dataclass(frozen=True)
class Src:
    """Arrays of one side: one key as it is, several stacked along a new first axis. `drop` removes
    trailing tokens in that set (a loop that emits its EOS as an event); `first` keeps the first n;
    `col` takes one column of a table ([rounds, 3] trace)."""

    side: str
    keys: tuple[str, ...]
    drop: frozenset = frozenset()
    first: int | None = None
    col: int | None = None

    def get(self, sides: dict) -> np.ndarray | None:
        arrays = sides[self.side]
        if any(k not in arrays for k in self.keys):
            return None
        a = arrays[self.keys[0]] if len(self.keys) == 1 else np.stack([arrays[k] for k in self.keys])
        if self.col is not None:
            a = a[:, self.col]
        if self.first is not None:
            a = a[: self.first]
        if self.drop and len(a) and int(np.ravel(a)[-1]) in self.drop:
            a = a[:-1]
        return a

    @property
    def label(self) -> str:
        return self.keys[0] if len(self.keys) == 1 else f"{self.keys[0]}..{self.keys[-1]}"


def P(*keys: str, drop=(), first: int | None = None, col: int | None = None) -> Src:
    return Src("port", keys, frozenset(drop), first, col)


def R(*keys: str, drop=(), first: int | None = None, col: int | None = None) -> Src:
    return Src("ref", keys, frozenset(drop), first, col)


def G(*keys: str, drop=(), first: int | None = None) -> Src:
    return Src("greedy", keys, frozenset(drop), first)


@dataclass(frozen=True)
class Tensor:
    """One tensor at the case's tier: L1 identical bytes, L2 the budget of (module, quantity).
    upto: "common" cuts both to their common length; the name of a Tokens check cuts both to the
    path that check found shared. candidates: a centroid head's masked logits (-1e30 on our side,
    the dtype minimum on transformers') are compared as candidate sets, then on the candidates."""

    name: str
    port: Src
    ref: Src
    quantity: str
    finding: str = "module"
    upto: str | None = None
    candidates: bool = False


@dataclass(frozen=True)
class Tokens:
    """Two token sequences must be equal; a divergence is excused only as a knife-edge of `logits`
    (compare.stream_metrics). prefix: the reference is cut to the port's length first."""

    name: str
    port: Src
    ref: Src
    logits: Src
    what: str
    finding: str = "stream"
    prefix: bool = False


@dataclass(frozen=True)
class Same:
    """Integer arrays equal element for element (proposals, counts, anchors)."""

    name: str
    port: Src
    ref: Src
    what: str
    finding: str = "module"


@dataclass(frozen=True)
class Trace:
    """Per-round schedules: the columns of each side stacked, equal round by round."""

    name: str
    port: tuple[Src, ...]
    ref: tuple[Src, ...]
    what: str
    finding: str = "schedule"


@dataclass(frozen=True)
class Mean:
    """A scalar of the port equal (within atol) to the mean of a reference array (tau)."""

    name: str
    port: Src
    ref: Src
    what: str
    atol: float = 1e-9
    finding: str = "schedule"


@dataclass(frozen=True)
class Layers:
    """First divergent layer: each layer's free-running and teacher-forced (own) output against the
    reference's (spec_parity.layers). Fails naming the first layer whose own error is over budget."""

    free: tuple[Src, ...]
    own: tuple[Src, ...]
    ref: tuple[Src, ...]
    name: str = "layers"
    finding: str = "layers"
    quantity: str = "hidden"


@dataclass(frozen=True)
class Scored:
    """Reported, never judged: the port's logits scored on the reference's tokens (teacher_forced),
    or a loop's acceptance."""

    name: str
    kind: str
    srcs: tuple[Src, ...]


@dataclass
class Plan:
    """A case's checks, and what the harness must compute for them: `greedy` = (max_tokens, eos)
    of the target's plain greedy stream, for the lossless checks of a serve loop."""

    checks: list = field(default_factory=list)
    greedy: tuple[int, frozenset] | None = None


def judge(plan: Plan, sides: dict, module: str, dtype: str, result: Result, protocol=None) -> None:
    """Hold the port's arrays to the output contract (`contract`), then apply every check in
    order; a check that reads an array breaking the contract is not run (no tolerance is applied
    to it). A check on arrays the port does not return is skipped, and named in the result's
    coverage, when the protocol (spec_parity.protocol) says they are optional; a required one
    missing fails. A pass with checks skipped is PASS-PARTIAL: what ran passed, not all could run."""
    broken = contract(plan, sides, protocol) if protocol is not None else []
    if protocol is not None:
        result.metrics["contract"] = {"ok": not broken, "violations": [line for _, line in broken]}
    for _, line in broken:
        result.fail(line, "contract")
    port, checked, hidden, blocked = sides["port"], [], [], []
    for check in plan.checks:
        keys = {k for src in _port_srcs(check) for k in src.keys}
        if keys & {k for k, _ in broken} or getattr(check, "upto", None) in blocked:   # or cut by one not run
            blocked.append(check.name)
            continue
        absent = [k for k in keys if k not in port]
        if absent and protocol is not None and all(protocol.optional(k) for k in absent):
            result.metrics[check.name] = {"ok": True, "exposed": False}
            hidden.append(check.name)
            continue
        _JUDGES[type(check)](check, sides, module, dtype, result)
        checked.append(check)
        logits = check.port.logits if isinstance(check, Drafts) else None
        if logits is not None and logits.get(sides) is None:
            hidden.append(f"{check.name}.logits")
    result.coverage = {**_coverage(checked, hidden, port, protocol), **({"blocked": blocked} if blocked else {})}
    if blocked:
        result.note(f"the output contract is broken: not run, no tolerance applied: {', '.join(blocked)}")
    if hidden and result.verdict == "PASS":
        result.verdict = compare.PARTIAL
        what = "partial coverage" if result.coverage["quantities"]["optional"] else "public outputs only"
        result.note(f"{what}: {len(hidden)} checks not run: {', '.join(hidden)}")
    elif hidden:
        result.note(f"not exposed by the port, so not checked: {', '.join(hidden)}")


def _coverage(checked: list, hidden: list[str], port: dict, protocol) -> dict:
    """The checks run and the port quantities they read (required / optional), and the checks not
    run because the port left their optional arrays out."""
    read = sorted({k for c in checked for s in _port_srcs(c) for k in s.keys if k in port})
    required = [k for k in read if protocol is None or (protocol.quantity(k) and protocol.quantity(k).required)]
    return {"checked": [c.name for c in checked], "not_exposed": hidden,
            "quantities": {"required": required, "optional": [k for k in read if k not in required]}}


def contract(plan: Plan, sides: dict, protocol) -> list[tuple[str, str]]:
    """The output contract, before any tolerance: every array the port returns is one the
    protocol declares for the case, in its dtype, every required one is there, and an array
    compared element for element has the reference's shape (one compared otherwise, its rank).
    Returns (array, violation in words)."""
    port, ref = sides["port"], sides["ref"]
    where = f"{protocol.module}/{protocol.kind}"
    unknown = [k for k in port if protocol.quantity(k) is None]
    out = []
    for k in _required(protocol, ref):
        if k in port:
            continue
        stray = difflib.get_close_matches(k, unknown, n=1, cutoff=0.6)
        if stray:
            unknown.remove(stray[0])
            out.append((k, f"{k}: missing; the port returned {stray[0]!r} — name it as the protocol does"))
        else:
            out.append((k, f"{k}: missing (required by the protocol {where})"))
    out += [(k, f"{k}: not an array of the protocol {where} (declared: "
             f"{', '.join(q.name for q in protocol.returns)}); leave it out or name it as the protocol does")
            for k in unknown]
    whole = _whole(plan)
    for k, v in port.items():
        q = protocol.quantity(k)
        if q is None:
            continue
        got = np.asarray(v).dtype
        if str(got) != q.dtype:
            out.append((k, f"{k}: dtype {got}, protocol says {q.dtype}"))
        if k not in ref:
            continue
        ps, rs = np.shape(v), np.shape(ref[k])
        if (ps != rs) if k in whole else (len(ps) != len(rs)):
            out.append((k, f"{k}: shape {list(ps)}, the reference's {list(rs)} (protocol: {q.shape})"))
    return out


def _required(protocol, ref: dict) -> list[str]:
    """The required arrays of a case: the reference's arrays the protocol requires, or where the
    case has no reference (L3) the protocol's required names that are not patterns."""
    if ref:
        return [k for k in ref if (q := protocol.quantity(k)) is not None and q.required]
    return [q.name for q in protocol.returns if q.required and "*" not in q.name]


def _whole(plan: Plan) -> set[str]:
    """Port arrays the plan compares element for element with the reference's array of that name."""
    return {c.port.keys[0] for c in plan.checks if isinstance(c, Tensor) and c.upto is None
            and c.port.keys == c.ref.keys and len(c.port.keys) == 1 and c.port.col is None and c.port.first is None}


def reads(plan: Plan, name: str) -> set[str]:
    """The port arrays the check behind metric `name` reads (a check's own metric, or one it adds
    under its name: `drafts_vs_ref.logits`, `logits.candidates`)."""
    owner = [c for c in plan.checks if c.name == name] or [c for c in plan.checks if name.startswith(c.name + ".")]
    if not owner:
        return set()
    c = owner[0]
    return {k for s in _port_srcs(c) for k in s.keys} | (
        set(c.port.logits.keys) if isinstance(c, Drafts) and c.port.logits is not None else set())


def _port_srcs(check) -> list[Src]:
    """Every port-side Src a check needs, through tuples and the Rounds of a Drafts check (whose
    logits are compared only where the port returns them)."""
    out = []
    for v in vars(check).values():
        for s in v if isinstance(v, tuple) else (v,):
            if isinstance(s, Src) and s.side == "port":
                out.append(s)
            elif isinstance(s, Round):
                out += [x for x in (s.sizes, s.emitted, s.tokens) if x.side == "port"]
            elif isinstance(s, Rows) and s.src.side == "port":
                out.append(s.src)
    return out


def _tensor(c: Tensor, sides, module, dtype, result):
    p, r = c.port.get(sides), c.ref.get(sides)
    if p is None or r is None:
        return result.missing(c, f"missing ({c.port.label if p is None else c.ref.label} not given)")
    if np.shape(p) != np.shape(r) and c.upto is None:
        return result.missing(c, f"shape {list(np.shape(p))} vs {list(np.shape(r))}")
    if c.upto == "common":
        n = min(len(p), len(r))
        p, r = p[:n], r[:n]
    elif c.upto is not None:
        n = result.metrics[c.upto]["first_divergence"]
        n = len(r) if n is None else n
        p, r = p[:n], r[:n]
    if c.candidates and result.tier != "L1" and _masks(p, r):
        nonfinite = compare._nonfinite(np.asarray(p), np.asarray(r))
        if nonfinite:
            return check_tensor(result, c.name, p, r, module, c.quantity, dtype, c.finding)
        pc, rc = _candidates(p), _candidates(r)
        if not np.array_equal(pc, rc):
            result.metrics[c.name + ".candidates"] = {"ok": False, "port_only": np.flatnonzero(pc & ~rc)[:8].tolist(),
                                                      "ref_only": np.flatnonzero(rc & ~pc)[:8].tolist()}
            return result.fail(f"{c.name}: centroid candidate sets differ", c.finding)
        p, r = p[pc], r[pc]
    check_tensor(result, c.name, p, r, module, c.quantity, dtype, c.finding)


def _masks(p, r) -> bool:
    """Whether either side masks with a sentinel (compare.MASKED: ours -1e30, transformers' dtype
    minimum): then the other side's fill may be another convention's (min(candidates) - 1)."""
    return bool((np.asarray(p) <= compare.MASKED).any() or (np.asarray(r) <= compare.MASKED).any())


def _candidates(x) -> np.ndarray:
    """A centroid head's candidates on one side: above the sentinel where it masks with one, else
    above its own minimum (the fill of a side that masks with min(candidates) - 1)."""
    x = np.asarray(x)
    return x > compare.MASKED if (x <= compare.MASKED).any() else x > x.min()


def _tokens(c: Tokens, sides, module, dtype, result):
    p, r, lg = c.port.get(sides), c.ref.get(sides), c.logits.get(sides)
    if p is None or r is None or lg is None:
        return result.missing(c, "missing")
    p = np.ravel(p)
    r = np.ravel(r)[: len(p)] if c.prefix else np.ravel(r)
    s = stream_metrics(p, r, lg, dtype)
    result.metrics[c.name] = s
    d = s["first_divergence"]
    if s["ok"] and not s["equal"]:
        result.note(f"{c.what} diverges at {d}: excused knife-edge (ref margin {s['ref_margin']:.2e} < bound "
                    f"{s['knife_edge_bound']:.2e})")
    elif not s["ok"]:
        at = (f"port {s['port_token']} vs ref {s['ref_token']}, ref margin {s['ref_margin']:.3g}"
              if "port_token" in s else f"lengths {s['length']}")
        result.fail(f"{c.what} differs at {d} ({at})", c.finding)


def _same(c: Same, sides, module, dtype, result):
    p, r = c.port.get(sides), c.ref.get(sides)
    if p is None or r is None:
        return result.missing(c, "missing")
    pl, rl = np.ravel(p).tolist(), np.ravel(r).tolist()
    first = next((i for i, (a, b) in enumerate(zip(pl, rl)) if a != b), None if len(pl) == len(rl) else min(len(pl), len(rl)))
    result.metrics[c.name] = {"ok": first is None, "lengths": [len(pl), len(rl)], "first_difference": first}
    if first is not None:
        result.fail(f"{c.what} differs at {first} (port {pl[first:first + 8]} vs ref {rl[first:first + 8]})", c.finding)


def _trace(c: Trace, sides, module, dtype, result):
    cols = [[s.get(sides) for s in side] for side in (c.port, c.ref)]
    if any(a is None for side in cols for a in side):
        return result.missing(c, "missing")
    t = trace_metrics(np.stack(cols[0], 1) if len(cols[0]) > 1 else cols[0][0],
                      np.stack(cols[1], 1) if len(cols[1]) > 1 else cols[1][0])
    result.metrics[c.name] = t
    if not t["ok"]:
        result.fail(f"{c.what} differs at round {t['first_differing_round']} (port {t.get('port_round')} vs "
                    f"ref {t.get('ref_round')}; rounds {t['rounds']})", c.finding)


def _mean(c: Mean, sides, module, dtype, result):
    p, r = c.port.get(sides), c.ref.get(sides)
    if p is None or r is None:
        return result.missing(c, "missing")
    port_v, ref_v = float(np.ravel(p)[0]), float(np.mean(r)) if len(r) else 0.0
    ok = abs(port_v - ref_v) < c.atol
    result.metrics[c.name] = {"ok": ok, "port": port_v, "ref": ref_v}
    if not ok:
        result.fail(f"{c.what} {port_v:.4f} != reference's {ref_v:.4f}", c.finding)


def _layers(c: Layers, sides, module, dtype, result):
    got = [[s.get(sides) for s in group] for group in (c.free, c.own, c.ref)]
    if any(a is None for group in got for a in group):
        result.metrics[c.name] = {"ok": True, "exposed": False}
        return result.note("per-layer outputs not exposed by the port: no layer localization")
    m = localize(*got, module, dtype, result.tier, c.quantity)
    result.metrics[c.name] = m
    i = m["first_divergent_layer"]
    if i is not None:
        result.fail(f"first divergent layer: {i} (its own, teacher-forced error {m['own_max_abs'][i]:.3e} "
                    f"exceeds {m['budget']})", c.finding)


def _scored(c: Scored, sides, module, dtype, result):
    arrays = [s.get(sides) for s in c.srcs]
    if any(a is None for a in arrays):
        return
    if c.kind == "teacher_forced":
        result.metrics[c.name] = teacher_forced(*arrays)
    else:                                       # acceptance: (drafted, accepted[, tau])
        drafted, accepted = int(np.sum(arrays[0])), int(np.sum(arrays[1]))
        m = {"ok": True, "drafted": drafted, "accepted": accepted, "rate": accepted / drafted if drafted else 0.0}
        if len(arrays) > 2:
            m["tau"] = float(np.ravel(arrays[2])[0])
        result.metrics[c.name] = m


def serve_loop(ref_name: str, n: int, eos, *, schedule: tuple, ref_schedule: tuple, drafts: Round, ref_drop=(),
               greedy_drop=(), greedy_prefix: bool = False, draft_logits: str = "", tau: Src | None = None,
               whole_block: bool = False) -> Plan:
    """The one serve-loop comparison, for every draft source. Findings: lossless against the
    target's greedy stream (n tokens, `eos`; `greedy_prefix` cuts it to the port's length), the
    stream against the reference loop's, the drafts round by round on the same context (the
    reference's side: `drafts`; logits within quantity `draft_logits` where it keeps them;
    `whole_block`: see Drafts), and the schedule (per-round columns, tau)."""
    checks = [Tokens("lossless_vs_greedy", P("stream.tokens"), G("greedy.tokens", drop=greedy_drop), G("greedy.logits"),
                     "not lossless: the stream vs the target's greedy one", "lossless", prefix=greedy_prefix),
              Tensor("path_logits_vs_greedy", P("stream.logits"), G("greedy.logits"), "path_logits", "lossless",
                     upto="common"),
              Tokens("stream_vs_ref", P("stream.tokens"), R("stream.tokens", drop=ref_drop), G("greedy.logits"),
                     f"token stream vs {ref_name}'s")]
    ours = Round(P("stream.drafted"), P("stream.emitted"), P("stream.proposals"),
                 P("stream.draft_logits") if drafts.logits is not None else None, P("stream.prefilled"))
    checks.append(Drafts("drafts_vs_ref", ours, drafts, draft_logits, whole_block=whole_block))
    checks.append(Trace("schedule_vs_ref", schedule, ref_schedule, f"per-round schedule vs {ref_name}'s"))
    if tau is not None:
        checks.append(Mean("tau", P("tau"), tau, "tau"))
    checks.append(Scored("acceptance", "acceptance", (P("stream.drafted"), P("stream.accepted"), P("tau"))))
    return Plan(checks, greedy=(n, frozenset(eos)))


def drafter_layers(ref: dict) -> list:
    """The first divergent drafter layer, where the reference recorded its layers (`layer.i` of
    the first block / step): the port's free-running `layer.i` and teacher-forced `own.i` (layer i
    fed the reference's `layer.{i-1}`, which drafter pairs feed it) against them."""
    n = sum(1 for k in ref if k.startswith("layer."))
    if not n:
        return []
    idx = range(n)
    return [Layers(tuple(P(f"layer.{i}") for i in idx), tuple(P(f"own.{i}") for i in idx),
                   tuple(R(f"layer.{i}") for i in idx), quantity="layer")]


def layer_feeds(ref: dict) -> dict:
    """What a drafter pair feeds the port for the own-error run: the reference's layer outputs."""
    return {k: v for k, v in ref.items() if k.startswith("layer.")}


_JUDGES = {Window: attended.judge, sampled.Distribution: sampled.judge, Drafts: drafting.drafts,
           Shift: drafting.shift, Pruning: drafting.pruning, FirstRound: drafting.first_round, Tensor: _tensor,
           Tokens: _tokens, Same: _same, Trace: _trace, Mean: _mean, Layers: _layers, Scored: _scored}

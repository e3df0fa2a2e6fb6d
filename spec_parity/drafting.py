"""The checks of what a drafter proposes: its loop's drafts round by round against the
reference loop's at the same context (`Drafts`, `FirstRound`), and an extension no reference
implements, held to gates (`Shift`) and to its own pruning rule (`Pruning`). Declared by the
pairs, judged through spec_parity.checks.judge as every check is; each `object` field is a
checks.Src (one side's array, read with .get(sides))."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compare import check_tensor, kl


@dataclass(frozen=True)
class FirstRound:
    """Reported: the first round whose check (one name per round, judged before) failed."""

    name: str
    rounds: tuple[str, ...]


@dataclass(frozen=True)
class Round:
    """One side of a loop's drafts: per round the tokens proposed (`sizes`) and committed
    (`emitted`), every round's proposals in order, and the drafter's logits rows (one per
    proposal) where that side keeps them."""

    sizes: object
    emitted: object
    tokens: object
    logits: object | None = None
    start: object | None = None        # tokens committed before round 0 (absent: 1, the prefill's)


@dataclass(frozen=True)
class Drafts:
    """Each round's drafts against the reference loop's round at the same context (the same number
    of tokens committed before it), on the two proposals' common prefix; and the drafter's logits
    rows there, within the budget of `quantity`. A port that drafts right but schedules its rounds
    otherwise passes this and fails only the schedule. whole_block: a round's drafts are one block
    whose every row depends on its length (DFlash's block attends within itself both ways), so
    only rounds that drafted as many tokens are compared; the others are noted, not compared."""

    name: str
    port: Round
    ref: Round
    quantity: str = ""
    finding: str = "drafts"
    whole_block: bool = False


@dataclass(frozen=True)
class Shift:
    """L3: the distribution shift KL(base || port) per draft position and the top-1 agreement,
    held to gates (budgets.L3_GATES), for an extension that no reference implements."""

    name: str
    base: object
    port: object
    gates: dict
    finding: str = "shift"


@dataclass(frozen=True)
class Pruning:
    """L3: every proposal stops exactly at the first position whose sigmoid(confidence) is below
    its threshold (or at the block's end): the extension's pruning rule, recomputed here."""

    name: str
    confidence: object
    block_len: object
    proposed: object
    thresholds: tuple[float, ...]
    finding: str = "pruning"


def first_round(c: FirstRound, sides, module, dtype, result):
    bad = [r for r, name in enumerate(c.rounds) if not result.metrics.get(name, {}).get("ok", True)]
    result.metrics[c.name] = {"ok": not bad, "first_differing_round": bad[0] if bad else None, "rounds": len(c.rounds)}


def _rounds(r: Round, sides) -> dict | None:
    """context (tokens committed before the round) -> (tokens, logits rows or None)."""
    sizes, emitted, tokens = r.sizes.get(sides), r.emitted.get(sides), r.tokens.get(sides)
    logits = r.logits.get(sides) if r.logits is not None else None
    if sizes is None or emitted is None or tokens is None:
        return None
    first = r.start.get(sides) if r.start is not None else None
    out, at, ctx = {}, 0, 1 if first is None else int(np.ravel(first)[0])
    for n, e in zip(np.ravel(sizes).tolist(), np.ravel(emitted).tolist()):
        out[ctx] = (np.ravel(tokens)[at:at + n], logits[at:at + n] if logits is not None else None)
        at, ctx = at + n, ctx + e
    return out


def drafts(c: Drafts, sides, module, dtype, result):
    """Also the schedule's first fact: a loop whose round 0 drafts the prefill's token starts one
    token before the reference's (its rounds then pair with the reference's one round on)."""
    port, ref = _rounds(c.port, sides), _rounds(c.ref, sides)
    if port is None or ref is None:
        return result.missing(c, "missing")
    shared = sorted(set(port) & set(ref))
    if min(port, default=1) != min(ref, default=1):
        p, r = min(port), min(ref)
        result.metrics["schedule_start"] = {"ok": False, "port": p, "ref": r}
        result.fail(f"its first round starts after {p} tokens past the prompt, the reference's after {r}: its "
                    f"rounds stand {abs(r - p)} token(s) {'before' if p < r else 'after'} the reference's", "schedule")
    other = []
    if c.whole_block:
        other = [ctx for ctx in shared if len(port[ctx][0]) != len(ref[ctx][0])]
        shared = [ctx for ctx in shared if ctx not in other]
        if other:
            result.note(f"{c.name}: {len(other)} round(s) on a shared context drafted a block of another length "
                        f"(first after {other[0]} tokens: {len(port[other[0]][0])} vs {len(ref[other[0]][0])}): "
                        "not compared, a block's drafts depend on its length; the schedule finding says so")
    bad, rows_p, rows_r = [], [], []
    for ctx in shared:
        (tp, lp), (tr, lr) = port[ctx], ref[ctx]
        n = min(len(tp), len(tr))
        if not np.array_equal(tp[:n], tr[:n]):
            bad.append((ctx, tp[:n].tolist(), tr[:n].tolist()))
        if lp is not None and lr is not None:
            rows_p.append(lp[:n])
            rows_r.append(lr[:n])
    result.metrics[c.name] = {"ok": not bad, "rounds_compared": len(shared), "rounds": [len(port), len(ref)],
                              "other_length": len(other), "first_bad": bad[0] if bad else None}
    if bad:
        ctx, tp, tr = bad[0]
        result.fail(f"drafts differ from the reference's on the same context (round after {ctx} tokens past "
                    f"the prompt: port {tp} vs ref {tr}; {len(bad)} of {len(shared)} rounds)", c.finding)
    elif not shared and c.whole_block and set(port) & set(ref):
        result.metrics[c.name]["compared"] = False
    elif not shared and (len(port) or len(ref)):
        result.note(f"{c.name}: not compared, no round of the port starts where one of the reference's does "
                    f"(after {sorted(port)[:4]} vs {sorted(ref)[:4]} committed tokens): the schedule differs")
        result.metrics[c.name]["compared"] = False
    if c.quantity and rows_p:
        V = rows_p[0].shape[-1]
        check_tensor(result, c.name + ".logits", np.concatenate(rows_p).reshape(-1, V),
                     np.concatenate(rows_r).reshape(-1, V), module, c.quantity, dtype, c.finding)


def shift(c: Shift, sides, module, dtype, result):
    base, port = c.base.get(sides), c.port.get(sides)
    if base is None or port is None:
        return result.missing(c, "missing")
    k = kl(base, port)
    top1 = float(np.mean(base.argmax(-1) == port.argmax(-1))) if len(k) else 1.0
    g = c.gates
    ok = bool(np.isfinite(k).all() and g["kl_mean_min"] <= float(k.mean()) <= g["kl_mean_max"] and top1 >= g["top1_min"])
    result.metrics[c.name] = {"ok": ok, "kl_mean": float(k.mean()), "kl_max": float(k.max()), "top1_agree": top1,
                              "kl_per_row": [round(float(x), 5) for x in k], "gates": g}
    if not ok:
        result.fail(f"{c.name}: KL mean {float(k.mean()):.3e}, top-1 agreement {top1:.3f} outside the gates {g}",
                    c.finding)


def pruning(c: Pruning, sides, module, dtype, result):
    conf, lens, proposed = (s.get(sides) for s in (c.confidence, c.block_len, c.proposed))
    if conf is None or lens is None or proposed is None:
        return result.missing(c, "missing")
    p = (1.0 / (1.0 + np.exp(-conf.astype(np.float32)))).astype(np.float32)
    expected, at = [], 0
    for n in lens:
        th = list(c.thresholds) * n if len(c.thresholds) == 1 else list(c.thresholds)
        below = [k for k in range(n) if k < len(th) and float(p[at + k]) < float(th[k])]
        expected.append(below[0] if below else n)
        at += n
    bad = [r for r, (e, q) in enumerate(zip(expected, proposed)) if e != q]
    result.metrics[c.name] = {"ok": not bad, "rounds": len(expected), "pruned": int(sum(e < n for e, n in zip(expected, lens))),
                              "first_bad_round": bad[0] if bad else None}
    if bad:
        r = bad[0]
        result.fail(f"{c.name}: round {r} proposed {int(proposed[r])} tokens, the thresholds keep {expected[r]}",
                    c.finding)

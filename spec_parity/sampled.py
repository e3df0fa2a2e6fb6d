"""Sampled (T > 0) cases: a loop at a temperature run once per seed, per request a few small
integers (the first round's accepted length, the rounds a request needs, the token the first
round ends with), and the check that holds the port's samples to the reference's by the
two-sample chi-square (spec_parity.stats).

The streams of two samplers never match token for token, so these cases compare distributions:
the same checkpoint pair, prompt, temperature and request length on both sides, independent
seeds, every statistic tested at `alpha` (a family's level, stated by the pair), its power
stated and, with `max_bias`, held: a pass that could not have seen a bias that large fails.

What a statistic can see. A bug in the rejection-sampling rule sits in one of three places
(`BUG_FAMILIES`): the acceptance test, the correction drawn after a rejection (the residual), the
bonus drawn after a full accept. Accepted lengths and rounds see only the first: a correction or a
bonus from a wrong distribution leaves every accepted length as it was. The first round's end token
(`first_round_end`) sees all three. Each Distribution names the families it sees (`SEES`), and the
result's `rule_bugs` lists per family the statistics that see it (none: the case is blind to it);
the pairs plant a control of each family (spec_parity/controls/sampling.py) that the case must
catch, their measured p-values in docs/serve.md."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .stats import POWER, two_sample

# The family of the T > 0 parity tests: 8 (DeepSpec 3, optiq 4, optiq's softcap delta 1 in
# tests/test_sampling_reference.py), Bonferroni at 1e-3.
FAMILY_ALPHA = 1e-3 / 8

BUG_FAMILIES = ("acceptance", "residual", "bonus")
SEES = {"first": ("acceptance",), "second": ("acceptance",), "rounds": ("acceptance",),
        "rounds_to_M": ("acceptance",), "end": BUG_FAMILIES}


@dataclass(frozen=True)
class Distribution:
    """The port's samples and the reference's drawn from one distribution (p >= alpha), with the
    power to see a planted bias of `max_bias` (None: power reported, not held)."""

    name: str
    port: object     # checks.Src
    ref: object
    alpha: float
    max_bias: float | None = None
    finding: str = "sampling"

    @property
    def sees(self) -> tuple[str, ...]:
        """The rule-bug families (BUG_FAMILIES) a difference in this statistic can show."""
        return SEES.get(self.name, ())


def judge(c: Distribution, sides, module, dtype, result):
    p, r = c.port.get(sides), c.ref.get(sides)
    if p is None or r is None:
        return result.missing(c, "missing")
    p, r = np.asarray(p), np.asarray(r)
    if p.size == 0 or r.size == 0 or (p < 0).any() or (r < 0).any() or p.dtype.kind not in "iu" or r.dtype.kind not in "iu":
        return result.missing(c, "expected non-empty samples of non-negative integers")
    t = two_sample(r, p, c.alpha)
    powered = c.max_bias is None or t["power_delta"] <= c.max_bias
    ok = t["p"] >= c.alpha and powered
    result.metrics[c.name] = {"ok": ok, "p": t["p"], "df": t["df"], "alpha": c.alpha, "power": POWER,
                              "detectable_bias": t["power_delta"], "max_bias": c.max_bias, "n": [int(r.size), int(p.size)],
                              "ref_counts": np.bincount(r).tolist(), "port_counts": np.bincount(p).tolist(),
                              "sees": list(c.sees), "blind_to": [f for f in BUG_FAMILIES if f not in c.sees]}
    sight = result.metrics.setdefault("rule_bugs", {"ok": True, **{f: [] for f in BUG_FAMILIES}})
    for f in c.sees:
        sight[f].append(c.name)
    if t["p"] < c.alpha:
        result.fail(f"{c.name}: the port's distribution differs from the reference's (two-sample chi-square p="
                    f"{t['p']:.3g} < {c.alpha:.3g}; reference {np.bincount(r).tolist()}, port {np.bincount(p).tolist()})",
                    c.finding)
    elif not powered:
        result.fail(f"{c.name}: too few samples to see a bias of {c.max_bias} (detects {t['power_delta']:.3f} at "
                    f"power {POWER})", c.finding)


def first_and_rounds(accepted_per_round: list[list[int]]) -> dict[str, np.ndarray]:
    """Per request: the first round's accepted length and the number of rounds."""
    return {"sampled.first": np.array([rs[0] for rs in accepted_per_round], np.int32),
            "sampled.rounds": np.array([len(rs) for rs in accepted_per_round], np.int32)}


def match_statistics(rounds: list[list[tuple[int, int]]], gamma: int, max_tokens: int) -> dict[str, np.ndarray]:
    """Per request, from its rounds (drafted, accepted): the accepted length of the first and of
    the second drafting round, and the rounds needed to commit M = max_tokens - gamma - 1 tokens
    (the prefill's token counts). Every round before that point drafts a full gamma in a token-match
    loop (optiq shrinks its last drafts to what is left; the serve loop drafts gamma and drops the
    excess), so no statistic sees the end of a request."""
    M = max_tokens - gamma - 1
    first, second, to_m = [], [], []
    for rs in rounds:
        committed, n = 1, 0
        while committed < M:
            drafted, accepted = rs[n]
            if drafted != gamma:
                raise ValueError(f"round {n} drafted {drafted}, not gamma={gamma}, before M={M} tokens")
            committed, n = committed + accepted + 1, n + 1
        first.append(rs[0][1])
        second.append(rs[1][1])
        to_m.append(n)
    return {"sampled.first": np.array(first, np.int32), "sampled.second": np.array(second, np.int32),
            "sampled.rounds_to_M": np.array(to_m, np.int32)}


def first_round_end(rounds: list[tuple[int, int, int | None]], vocab: int) -> dict[str, np.ndarray]:
    """Per request, from its first drafting round (drafted n, accepted k, the token it ends with,
    None where the request stops before that token): that token as one small integer, the
    correction's id after a rejection (k < n), vocab + the bonus's id after a full accept, 2 vocab
    where it was not reached. Its distribution moves with any of the three rule bugs: the
    correction's with the residual, the bonus's with the bonus row, both with the acceptance test."""
    return {"sampled.end": np.array([2 * vocab if t is None else t + vocab * (k == n) for n, k, t in rounds],
                                    np.int32)}


"""Sampling at T > 0, layer 3: parity with the references (oracle, slow). The acceptance / tau
distributions of our loop vs optiq's sampled token-match loop, by two-sample chi-square in their
own family (ALPHA_PARITY), and optiq's reference delta at T > 0 (it samples the logits without the
final softcap). Against DeepSpec's rejection-sampling loop the same comparison is a case of the
dspark pair (`sampled-*`, judged by the harness: spec_parity/sampled.py)."""

import contextlib
import time

import mlx.core as mx
import numpy as np
import pytest

from port import sampling, serve, targets
from spec_parity import checkpoints
from spec_parity.controls import planted
from spec_parity.pairs import dspark as pairs_dspark

from sampling_setup import GAMMA, setup
from stats import POWER, detectable, gof, two_sample

ALPHA_PARITY = pairs_dspark.SAMPLED_ALPHA  # its own family: 6 tests (DeepSpec 2, optiq 3, optiq's softcap delta 1)


OPTIQ_PARITY = {"temperature": 3.0, "gamma": GAMMA, "max_tokens": 10, "runs": 1000, "control_runs": 400}
OPTIQ_MAX_BIAS = 0.33  # each statistic's detectable planted bias at power 0.9 (two_sample) must be below this


def run_statistics(rounds: list[list[tuple[int, int, int]]], gamma: int, max_tokens: int) -> dict[str, np.ndarray]:
    """Per run, from its rounds (drafted, accepted, committed) (independent across runs; rounds
    within a run are not): the accepted length of the first and of the second drafting round,
    and the rounds needed to commit M = max_tokens - gamma - 1 tokens (the prefill's token
    counts). Every round before that point drafts a full gamma in both loops (optiq shrinks its
    last drafts to what is left; the serve loop drafts gamma and drops the excess), so no
    statistic sees the end of a request."""
    M = max_tokens - gamma - 1
    first, second, to_m = [], [], []
    for rs in rounds:
        committed, n = 1, 0
        while committed < M:
            drafted, _, emitted = rs[n]
            assert drafted == gamma, (rs, n)
            committed, n = committed + emitted, n + 1
        first.append(rs[0][1])
        second.append(rs[1][1])
        to_m.append(n)
    return {"first": np.array(first), "second": np.array(second), "rounds_to_M": np.array(to_m)}


def _optiq_pair(softcap: bool):
    """The agreeing target (as built: Gemma-4's final softcap 30; or with it off) and assistant."""
    k = setup("agreeing")[2]
    tdir = checkpoints.build(k["target"][0], 0, k["target"][1] if softcap else
                             {**k["target"][1], "final_logit_softcapping": None})
    return tdir, checkpoints.build(k["assistant"][0], 0, k["assistant"][1]), k["prompt"]


@pytest.mark.oracle
@pytest.mark.slow
def test_optiqs_sampled_loop_samples_the_logits_without_the_softcap(live_oracle):
    """A reference delta at T > 0: optiq projects its verify rows with the head alone
    (`_project_to_logits`, no final softcap; at T = 0 the argmax is the same, REFERENCES.md), so
    it samples softmax(raw / T), not the target's softmax(softcap(raw) / T). Its first sampled
    token (softcapped agreeing target, T = 3, the prompt [3, 4, 51] whose successor's logit is
    large enough for the softcap to matter: total variation 0.11 between the two) fits the
    un-softcapped conditional (gof at ALPHA_PARITY, power stated) and is rejected against the
    target's own."""
    live_oracle("assistant", "optiq")
    from oracles import assistant as oracle

    tdir, ddir, _ = _optiq_pair(softcap=True)
    prompt, T, R = [3, 4, 51], OPTIQ_PARITY["temperature"], 1500
    ref = oracle.optiq_generate_step_sampled(tdir, ddir, np.array([prompt], np.int32), GAMMA, 1, T, list(range(R)))
    target = targets.load(tdir)
    ids = mx.array([prompt], mx.int32)
    raw = target.model.model.embed_tokens.as_linear(target.model.model(ids))[0, -1]
    sampler = sampling.Sampler(T)
    fits = {name: gof(ref["tokens"][:, 0].astype(np.int64), np.array(sampler.probs(row), np.float64))
            for name, row in (("raw", raw), ("softcapped", target.model(ids)[0, -1]))}
    msg = " ".join(f"{n}: p={r['p']:.3g} (detects {detectable(r['P'], R, ALPHA_PARITY):.3f})" for n, r in fits.items())
    print(f"optiq's first token vs the target's conditional, {R} runs: {msg}")
    assert fits["raw"]["p"] >= ALPHA_PARITY, msg
    assert fits["softcapped"]["p"] < ALPHA_PARITY, "optiq samples the softcapped logits after all: " + msg


@pytest.mark.oracle
@pytest.mark.slow
def test_acceptance_and_tau_match_optiqs_sampled_loop(live_oracle):
    """optiq samples too (`assistant_generate_step` with mlx-lm's sampler: greedy drafts, token
    match). On the agreeing assistant pair with the target's softcap off (where optiq samples
    the target's distribution, see the test above) at T = 3, our loop (mode "match") and
    optiq's have the same distribution of the first and the second round's accepted length and
    of the rounds a request needs to commit M tokens (its tau), by `two_sample` at ALPHA_PARITY,
    each with its detectable bias asserted. Controls, planted bugs in our loop the same
    comparisons must tell apart: the bonus token dropped on a full accept (lossless, but fewer
    tokens per round) and the verify sampling the target at T = 1 (`target_no_temperature`)."""
    live_oracle("assistant", "optiq")
    from oracles import assistant as oracle

    tdir, ddir, prompt = _optiq_pair(softcap=False)
    target, provider = targets.load(tdir), setup("agreeing")[1]["assistant"]
    cfg, R = OPTIQ_PARITY, OPTIQ_PARITY["runs"]
    t0 = time.process_time()
    ref = oracle.optiq_generate_step_sampled(tdir, ddir, np.array([prompt], np.int32), cfg["gamma"],
                                             cfg["max_tokens"], cfg["temperature"], list(range(R)))
    t_ref = time.process_time() - t0
    # optiq commits accepted + 1 per round: the correction (or bonus) becomes its pending token
    theirs = run_statistics([[(d, a, a + 1) for d, a in rs] for rs in ref["rounds"]], cfg["gamma"], cfg["max_tokens"])
    assert (theirs["first"] == ref["first_accepted"]).all()       # the per-round read agrees with the old one

    def ours(seed0: int, runs: int = R, control=None) -> dict[str, np.ndarray]:
        rounds = []
        with planted(*control) if control else contextlib.nullcontext():
            for seed in range(seed0, seed0 + runs):
                _, st = serve.generate(target, prompt, cfg["max_tokens"], provider, gamma=cfg["gamma"], eos=set(),
                                       sampler=sampling.Sampler(cfg["temperature"], seed=seed))
                rounds.append(st.trace)
        return run_statistics(rounds, cfg["gamma"], cfg["max_tokens"])

    t0 = time.process_time()
    mine = ours(10_000)
    t_ours = time.process_time() - t0
    controls = {"bonus dropped": ours(20_000, cfg["control_runs"], ("serve", "bonus")),
                "target_no_temperature": ours(30_000, cfg["control_runs"], ("sampling", "target_no_temperature"))}
    lines = [f"optiq {t_ref:.1f}s, ours {t_ours:.1f}s CPU for {R} requests each (controls {cfg['control_runs']}; "
             f"max_tokens {cfg['max_tokens']}, T {cfg['temperature']})"]
    failed, rejected = [], {c: [] for c in controls}
    for stat, theirs_s in theirs.items():
        r = two_sample(theirs_s, mine[stat], ALPHA_PARITY)
        cp = {c: two_sample(theirs_s, v[stat], ALPHA_PARITY)["p"] for c, v in controls.items()}
        lines.append(f"{stat}: p={r['p']:.3g} (df {r['df']}, detects {r['power_delta']:.3f} at power {POWER}); "
                     f"optiq {np.bincount(theirs_s).tolist()} ours {np.bincount(mine[stat]).tolist()}; controls "
                     + " ".join(f"{c}: p={p:.3g}" for c, p in cp.items()))
        if r["p"] < ALPHA_PARITY or r["power_delta"] > OPTIQ_MAX_BIAS:
            failed.append(stat)
        for c, p in cp.items():
            rejected[c].append(p < ALPHA_PARITY)
    print("\n".join(lines))
    assert not failed, f"{failed} differ from optiq or lack power:\n" + "\n".join(lines)
    for c, hits in rejected.items():
        assert any(hits), f"the parity tests cannot tell our loop with {c} apart:\n" + "\n".join(lines)

"""Many seeded requests in lockstep (port/fast/seeded.py) against serve.generate one request at a
time: the same tokens and trace for every seed, under a planted sampling bug too; and the sampled
cases' runner, which uses the lockstep requests only where its cross-checked seeds agree."""

from dataclasses import replace

import numpy as np
import pytest

from spec_parity import controls
from spec_parity.adapters import loop
from spec_parity.port import sampling, serve
from spec_parity.port.fast import seeded
from spec_parity.port.sources.dspark import DeepspecProvider

from sampling_setup import GAMMA, setup

MAX_TOKENS = 12


def one_by_one(target, prompt, provider, sampler, seeds, eos=frozenset(), mode="match"):
    out = []
    for s in seeds:
        tokens, stats = serve.generate(target, prompt, MAX_TOKENS, provider,
                                       serve.ServeOptions(gamma=GAMMA, eos=set(eos), sampler=replace(sampler, seed=s),
                                                          mode=mode))
        out.append((tokens, stats.trace))
    return out


def test_lockstep_requests_are_serve_generate_on_a_few_seeds():
    target, providers, k = setup("agreeing")
    for provider, mode in ((providers["assistant"], "match"), (providers["dspark"], "rejection")):
        plain = one_by_one(target, k["prompt"], provider, k["sampler"], range(6), mode=mode)
        assert seeded.generate(target, k["prompt"], MAX_TOKENS, provider, GAMMA, k["sampler"], list(range(6)),
                               mode=mode) == plain


@pytest.mark.slow
@pytest.mark.parametrize("setup_name,top_k", [("agreeing", 0), ("random", 0), ("agreeing", 8)])
def test_lockstep_requests_are_serve_generate_per_seed(setup_name, top_k):
    """"random" starts past the sliding window: the rotating caches are cut and rebuilt."""
    target, providers, k = setup(setup_name)
    sampler, seeds = replace(k["sampler"], top_k=top_k), list(range(40))
    plain = one_by_one(target, k["prompt"], providers["assistant"], sampler, seeds)
    assert seeded.generate(target, k["prompt"], MAX_TOKENS, providers["assistant"], GAMMA, sampler, seeds) == plain
    # a stop token that ends some requests early, mid-round
    eos = {int(np.bincount([t for toks, _ in plain for t in toks[1:]]).argmax())}
    plain = one_by_one(target, k["prompt"], providers["assistant"], sampler, seeds, eos)
    assert any(len(toks) < MAX_TOKENS - 1 for toks, _ in plain)
    assert seeded.generate(target, k["prompt"], MAX_TOKENS, providers["assistant"], GAMMA, sampler, seeds, eos) == plain


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["accept_wrong_row", "target_no_temperature"])
def test_lockstep_requests_follow_a_planted_sampling_bug(bug):
    """Both paths run port/sampling.py's rule, so a control planted there moves both alike."""
    target, providers, k = setup("agreeing")
    seeds = list(range(30))
    clean = seeded.generate(target, k["prompt"], MAX_TOKENS, providers["assistant"], GAMMA, k["sampler"], seeds)
    with controls.planted("sampling", bug):
        plain = one_by_one(target, k["prompt"], providers["assistant"], k["sampler"], seeds)
        assert seeded.generate(target, k["prompt"], MAX_TOKENS, providers["assistant"], GAMMA, k["sampler"],
                               seeds) == plain
    assert plain != clean


def _requests(target, k, provider, runs):
    options = {"temperature": k["sampler"].temperature, "seed0": 0, "runs": runs}
    return loop.seeded_requests(target, np.array([k["prompt"]]), MAX_TOKENS, provider, GAMMA, options)


@pytest.mark.slow
def test_a_lockstep_that_departs_from_the_loop_is_not_used(monkeypatch):
    """The negative control of the runner's cross-check: a lockstep whose drafter proposes token 0
    every time departs on the checked seeds (a different trace), and every seed runs one by one."""
    target, providers, k = setup("agreeing")
    runs = loop.CROSS_CHECKED + 8
    plain = one_by_one(target, k["prompt"], providers["assistant"], k["sampler"], range(runs))
    assert _requests(target, k, providers["assistant"], runs) == plain
    draft = seeded.AssistantDrafts.draft

    def zeros(self, *args):
        drafts, counts, q = draft(self, *args)
        return 0 * drafts, counts, q

    monkeypatch.setattr(seeded.AssistantDrafts, "draft", zeros)
    assert seeded.generate(target, k["prompt"], MAX_TOKENS, providers["assistant"], GAMMA, k["sampler"],
                           list(range(runs))) != plain
    assert _requests(target, k, providers["assistant"], runs) == plain


@pytest.mark.slow
@pytest.mark.parametrize("setup_name,threshold", [("agreeing", 0.0), ("agreeing", 0.5), ("random", 0.5)])
def test_lockstep_dspark_requests_are_serve_generate_per_seed(setup_name, threshold):
    """Rejection mode: each slot drawn from q through the Markov head, the confidence threshold
    cutting the proposal, every proposal length verified as its own batch."""
    target, providers, k = setup(setup_name)
    provider, seeds = DeepspecProvider(providers["dspark"].path, threshold), list(range(40))
    plain = one_by_one(target, k["prompt"], provider, k["sampler"], seeds, mode="rejection")
    if threshold:
        assert len({n for _, tr in plain for n, _, _ in tr}) > 1     # proposals of several lengths
    assert seeded.generate(target, k["prompt"], MAX_TOKENS, provider, GAMMA, k["sampler"], seeds,
                           mode="rejection") == plain


def test_what_the_lockstep_does_not_run_is_refused():
    target, providers, k = setup("agreeing")
    with pytest.raises(seeded.Unsupported, match="no lockstep draft"):
        seeded.generate(target, k["prompt"], MAX_TOKENS, providers["dflash"], GAMMA, k["sampler"], [0])
    with pytest.raises(seeded.Unsupported, match="'match' mode, not 'rejection'"):
        seeded.generate(target, k["prompt"], MAX_TOKENS, providers["assistant"], GAMMA, k["sampler"], [0],
                        mode="rejection")
    with pytest.raises(seeded.Unsupported, match="T > 0"):
        seeded.generate(target, k["prompt"], MAX_TOKENS, providers["assistant"], GAMMA, sampling.Sampler(), [0])


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["accept_wrong_row", "target_no_temperature"])
def test_lockstep_requests_follow_a_planted_sampling_bug_in_rejection_mode(bug):
    target, providers, k = setup("agreeing")
    seeds = list(range(30))
    with controls.planted("sampling", bug):
        plain = one_by_one(target, k["prompt"], providers["dspark"], k["sampler"], seeds, mode="rejection")
        assert seeded.generate(target, k["prompt"], MAX_TOKENS, providers["dspark"], GAMMA, k["sampler"], seeds,
                               mode="rejection") == plain

"""Sampling at T > 0, layer 2: statistical losslessness end to end through
`spec_parity.port.serve.generate` (port/sampling.py, port/serve.py). For every source and acceptance mode,
the tokens speculative decoding emits have exactly the target's own sampling distribution
(same sampler, same logits processors), tested against the exact distribution (tests/stats.py)
on the tiny Gemma-4 targets of tests/sampling_setup.py (vocab 64 agreeing pair, vocab 16 random
pair) with the assistant, DSpark, DFlash and DSpark-on-DFlash sources in both modes: 2500
requests (one seed each) per test; smoke versions at 200 requests. The controls run where their
bug moves the output (`CONTROLS`). A grammar-style ban (a logits processor) holds with and
without drafting."""

import pytest

from spec_parity.controls import planted
from spec_parity.port import sampling, serve

from sampling_setup import BANNED, GAMMA, PROCESSORS, SOURCES, e2e_tests, setup
from stats import assert_lossless, assert_rejected

E2E_N = {"agreeing": 2500, "random": 2500}   # requests per slow end-to-end test
# every test's detectable planted bias at power 0.9 must be below this: "pit" the PIT test (see
# `pit_power`), "*" the sequence and per-position tests (see `power`)
E2E_MAX_BIAS = {"*": 0.08, "pit": 0.05}
SMOKE_N = 200
# The controls, each where its bug moves the output: in the agreeing pair DFlash scores with the
# target's own head and its q is ~p wherever the two overlap, so a skipped residual barely moves
# its output there (not rejected at 2500 requests); on the random pair it does.
CONTROLS = [("agreeing", "dspark", 400), ("random", "dflash", 800), ("random", "dflash-extras", 800)]
# The rejection rule's controls these first tokens see. Not the bonus ones: a full accept's bonus
# falls inside them too rarely (bonus_wrong_row: min p 0.29, 0.064, 0.020 on the three setups at
# these N; bonus_greedy 0.29 on the agreeing one); the chain tests (tests/test_sampling_accept.py)
# and the pairs' sampled cases (their first round's end token) reject those.
LOOP_BUGS = ("residual_skipped", "residual_unnormalized", "accept_wrong_row", "accept_inverted",
             "target_no_temperature")


E2E_CASES = [("agreeing", None, "match")] + [("agreeing", s, m) for s in SOURCES for m in sampling.MODES] + [
    ("agreeing", "dspark-deterministic", "rejection"), ("random", None, "match"), ("random", "assistant", "rejection"), ("random", "dspark", "match"),
    ("random", "dspark", "rejection"), ("random", "dflash", "rejection"), ("random", "dflash-extras", "rejection")]


@pytest.mark.slow
@pytest.mark.parametrize("setup_name,source,mode", E2E_CASES, ids=["-".join(map(str, c)) for c in E2E_CASES])
def test_speculative_output_has_the_targets_distribution(setup_name, source, mode):
    res, hist, label = e2e_tests(setup_name, source, mode, E2E_N[setup_name], seed0=1000)
    if source is not None:
        assert set(hist) == set(range(GAMMA + 1)), f"{label}: not every accepted length occurred"
    assert_lossless(res, E2E_MAX_BIAS, label)


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_speculative_output_distribution_smoke(source):
    """The cheap version of the test above (default set): agreeing pair, rejection mode."""
    res, hist, label = e2e_tests("agreeing", source, "rejection", SMOKE_N, seed0=50_000)
    assert set(hist) == set(range(GAMMA + 1)), f"{label}: not every accepted length occurred"
    assert_lossless(res, None, label)


@pytest.mark.slow
@pytest.mark.parametrize("setup_name,source,N", CONTROLS, ids=[f"{c[0]}-{c[1]}" for c in CONTROLS])
@pytest.mark.parametrize("bug", LOOP_BUGS)
def test_loop_controls_are_rejected(bug, setup_name, source, N):
    with planted("sampling", bug):
        res, _, label = e2e_tests(setup_name, source, "rejection", N, seed0=2000)
    assert_rejected(res, f"{label} control {bug}")


@pytest.mark.slow
def test_loop_control_temperature_smoke():
    """One control end to end in the default set: the loop's own verify-sampler path."""
    with planted("sampling", "target_no_temperature"):
        res, _, label = e2e_tests("agreeing", "dspark", "rejection", 150, seed0=3000)
    assert_rejected(res, f"{label} control target_no_temperature")


BAN_CASES = [("assistant", "rejection"), ("dspark", "match"), ("dflash", "match"), ("dflash-extras", "rejection")]


@pytest.mark.slow
@pytest.mark.parametrize("source,mode", BAN_CASES)
def test_drafted_path_stays_lossless_under_a_ban(source, mode):
    res, hist, label = e2e_tests("agreeing", source, mode, E2E_N["agreeing"], seed0=4000, processors="ban")
    assert_lossless(res, E2E_MAX_BIAS, label)


# ---------------------------------------------------------------------------------------------
# logits processors: a grammar-style ban


def _ban_runs(setup_name: str, seeds: int, max_tokens: int):
    target, providers, k = setup(setup_name)
    banned = set(BANNED)
    hits_without = 0
    for source in (None, *SOURCES):
        for mode in ("match",) if source is None else ("match", "rejection"):
            for T in (0.0, k["sampler"].temperature):
                plain_greedy = None
                for seed in range(seeds):
                    s = sampling.Sampler(T, seed=seed)
                    prov = providers[source] if source else None
                    toks, st = serve.generate(target, k["prompt"], max_tokens, prov,
                                              serve.ServeOptions(gamma=GAMMA, eos=set(), sampler=s,
                                                                 mode=mode, processors=PROCESSORS["ban"]))
                    assert not banned & set(toks), (source, mode, T, seed, toks)
                    drafted = {t for p in st.proposals for t in p}
                    assert not banned & drafted, f"the ban did not reach {source}'s draft logits: {st.proposals}"
                    if T == 0.0:
                        plain_greedy = plain_greedy or serve.generate(target, k["prompt"], max_tokens, None,
                                                                      serve.ServeOptions(eos=set(),
                                                                                         sampler=s,
                                                                                         processors=PROCESSORS["ban"]))[0]
                        assert toks == plain_greedy, "T=0 with a processor: drafting changed the greedy stream"
                    free, _ = serve.generate(target, k["prompt"], max_tokens, prov,
                                             serve.ServeOptions(gamma=GAMMA, eos=set(), sampler=s,
                                                                mode=mode))
                    hits_without += len(banned & set(free))
    assert hits_without > 0, "the banned tokens never occur without the ban: the test would be vacuous"


@pytest.mark.slow
def test_banned_tokens_are_never_emitted_with_or_without_drafting():
    _ban_runs("agreeing", seeds=3, max_tokens=10)


@pytest.mark.slow
def test_banned_tokens_are_never_emitted_on_a_context_sensitive_target():
    _ban_runs("random", seeds=6, max_tokens=16)


def test_a_ban_of_every_token_is_refused():
    target, _, k = setup("agreeing")
    with pytest.raises(sampling.SamplingError, match="no token the target may emit"):
        serve.generate(target, k["prompt"], 4, None,
                       serve.ServeOptions(sampler=sampling.Sampler(1.0),
                                          processors=[sampling.ban(range(k["V"]))]))

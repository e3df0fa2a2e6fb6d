"""Sampling at T > 0: the sampler (against an independent transcription), the seam between the
serve loop and its sources (`draft` / `draft_sampled`), the loop's defaults and refusals, and
its admission accounting, on the setups of tests/sampling_setup.py."""

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import harness
from spec_parity.port import sampling, serve

from sampling_setup import GAMMA, SOURCES, Deterministic, provider_for, setup


def _reference_probs(logits: np.ndarray, T: float, top_k: int, top_p: float) -> np.ndarray:
    """An independent numpy transcription of temperature -> top-k -> top-p (HF's order)."""
    x = logits.astype(np.float64) / T
    if top_k:
        kth = np.sort(x)[-top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(len(p), bool)
        mass = 0.0
        for i in order:
            keep[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 5, 1.0), (1.0, 0, 0.6),
                                           (0.7, 8, 0.9), (1.3, 1, 1.0), (1.0, 0, 1e-3)])
def test_sampler_probs_match_an_independent_transcription(T, top_k, top_p):
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = (rng.standard_normal(24) * 2).astype(np.float32)
        got = np.array(sampling.Sampler(T, top_k, top_p).probs(mx.array(logits)))
        np.testing.assert_allclose(got, _reference_probs(logits, T, top_k, top_p), atol=2e-6)


def test_greedy_sampler_is_the_argmax_and_a_banned_row_is_empty():
    logits = mx.array([[0.1, 3.0, -1.0, 2.9], [-mx.inf] * 4])
    p = sampling.Sampler(0.0).probs(logits).tolist()
    assert p == [[0.0, 1.0, 0.0, 0.0], [0.0] * 4]
    assert sampling.Sampler(1.0).probs(logits)[1].tolist() == [0.0] * 4


def test_sample_is_the_inverse_cdf():
    p = mx.array([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = mx.array([0.0, 0.2499, 0.25, 0.9999, 0.99999994])
    assert sampling.sample(p, u).tolist() == [1, 1, 3, 3, 3]
    short = mx.array([[0.1, 0.2, 0.0]])                 # unnormalized: the leftover goes to the last nonzero
    assert sampling.sample(short, mx.array([0.9])).tolist() == [1]


@pytest.mark.slow
def test_seeded_requests_are_reproducible():
    target, providers, k = setup("agreeing")
    for source, mode in [(None, "match"), ("dspark", "rejection"), ("assistant", "rejection"),
                         ("dflash", "rejection"), ("dflash-extras", "rejection")]:
        prov = providers[source] if source else None
        runs = [serve.generate(target, k["prompt"], 12, prov,
                               serve.ServeOptions(gamma=GAMMA, eos=set(),
                                                  sampler=sampling.Sampler(3.0, seed=s), mode=mode)) for s in (5, 5, 6)]
        assert runs[0][0] == runs[1][0] and runs[0][1].trace == runs[1][1].trace
        assert runs[0][0] != runs[2][0]


@pytest.mark.parametrize("setup_name", harness.slow_except(["agreeing", "random"], "agreeing"))
def test_temperature_zero_sampling_paths_equal_the_default_greedy_loop(setup_name):
    target, providers, k = setup(setup_name)
    for source in (*SOURCES, "dspark-deterministic", "dflash-deterministic"):
        prov = provider_for(setup_name, source)
        base, st = serve.generate(target, k["prompt"], 12, prov, serve.ServeOptions(gamma=GAMMA, eos=set()))
        for mode in sampling.MODES:
            toks, st2 = serve.generate(target, k["prompt"], 12, prov,
                                       serve.ServeOptions(gamma=GAMMA, eos=set(),
                                                          sampler=sampling.Sampler(0.0, seed=3), mode=mode))
            assert toks == base and st2.trace == st.trace, (source, mode)


class Spy:
    """Records which seam method the loop drafted through."""

    def __init__(self, inner):
        self.inner, self.id, self.weights_bytes, self.trained_gamma, self.calls = (
            inner, inner.id, inner.weights_bytes, None, [])

    def open(self, view):
        src, calls = self.inner.open(view), self.calls

        class Source:
            tap_layers = src.tap_layers
            prefill, commit, dispose = src.prefill, src.commit, src.dispose

            def draft(self, *a):
                calls.append("draft")
                return src.draft(*a)

            def draft_sampled(self, *a):
                calls.append("draft_sampled")
                return src.draft_sampled(*a)

        return Source()

    def dispose(self):
        pass


@pytest.mark.parametrize("source", SOURCES)
def test_default_arguments_draft_through_the_plain_seam(source):
    target, providers, k = setup("agreeing")
    spy = Spy(providers[source])
    serve.generate(target, k["prompt"], 8, spy, serve.ServeOptions(gamma=GAMMA, eos=set()))
    serve.generate(target, k["prompt"], 8, spy,
                   serve.ServeOptions(gamma=GAMMA, eos=set(), sampler=sampling.Sampler(1.0)))
    assert set(spy.calls) == {"draft"}                    # match mode drafts greedily, as the seed did
    spy.calls.clear()
    serve.generate(target, k["prompt"], 8, spy,
                   serve.ServeOptions(gamma=GAMMA, eos=set(), sampler=sampling.Sampler(1.0),
                                      mode="rejection"))
    assert set(spy.calls) == {"draft_sampled"}


def test_a_source_whose_drafts_are_not_its_picks_is_refused():
    target, providers, k = setup("agreeing")
    inner = providers["dspark"]

    class Liar(Deterministic):
        def open(self, view):
            src = inner.open(view)

            class Source:
                tap_layers = src.tap_layers
                prefill, draft, commit, dispose = src.prefill, src.draft, src.commit, src.dispose

                def draft_sampled(self, feed, n, anchor, pick):
                    return [(t + 1) % k["V"] for t in src.draft_sampled(feed, n, anchor, pick)]

            return Source()

    with pytest.raises(sampling.SamplingError, match="not a prefix of its picks"):
        for seed in range(20):
            serve.generate(target, k["prompt"], 8, Liar(inner),
                           serve.ServeOptions(gamma=GAMMA, eos=set(),
                                              sampler=sampling.Sampler(3.0, seed=seed), mode="rejection"))


def test_unknown_mode_and_sampler_values_are_refused():
    target, _, k = setup("agreeing")
    with pytest.raises(sampling.SamplingError, match="unknown acceptance mode"):
        serve.generate(target, k["prompt"], 4, None, serve.ServeOptions(mode="typical"))
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(sampling.SamplingError):
            sampling.Sampler(**bad)


def test_admission_accounting():
    """Stats carry the provider's weight bytes and the request's bytes: the target's K/V caches
    plus what the source holds (DSpark, DFlash: their per-layer context K/V; the assistant:
    nothing)."""
    target, providers, k = setup("random")
    for source in SOURCES:
        prov = providers[source]
        for kw in ({}, {"sampler": sampling.Sampler(2.0), "mode": "rejection"}):
            toks, st = serve.generate(target, k["prompt"], 8, prov,
                                      serve.ServeOptions(gamma=GAMMA, eos=set(), **kw))
            assert st.weights_bytes == prov.weights_bytes > 0
            assert st.target_cache_bytes > 0 and st.request_bytes == st.target_cache_bytes + st.source_bytes
            js = st.to_json()
            assert js["request_bytes"] == st.request_bytes and js["weights_bytes"] == st.weights_bytes
            if source == "assistant":
                assert st.source_bytes == 0
            else:
                a = prov.drafter.args
                rows = len(k["prompt"]) + len(toks) - 1 - 1   # context rows committed before the last draft
                per_row = a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * 4
                assert st.source_bytes >= per_row * rows, (st.source_bytes, per_row, rows)
    _, plain = serve.generate(target, k["prompt"], 8, None, serve.ServeOptions(eos=set()))
    assert plain.weights_bytes == 0 and plain.source_bytes == 0 and plain.target_cache_bytes > 0


"""Sampling at T > 0, layer 3: optiq's reference delta at T > 0 (it samples the logits without the
final softcap), a fact about the reference the assistant pair's sampled case relies on (it turns
the softcap off). The parity of our loop's acceptance / tau distributions with optiq's sampled
loop and DeepSpec's rejection-sampling loop are cases of the pairs (`sampled-*`, judged by the
harness: spec_parity/sampled.py), in the same family (FAMILY_ALPHA)."""


import mlx.core as mx
import numpy as np
import pytest

from spec_parity import checkpoints
from spec_parity.port import sampling, targets
from spec_parity.sampled import FAMILY_ALPHA

from sampling_setup import GAMMA, setup
from stats import detectable, gof

ALPHA_PARITY = FAMILY_ALPHA  # its own family (spec_parity/sampled.py)


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
    (`_project_to_logits`, no final softcap; at T = 0 the argmax is the same, docs/references.md), so
    it samples softmax(raw / T), not the target's softmax(softcap(raw) / T). Its first sampled
    token (softcapped agreeing target, T = 3, the prompt [3, 4, 51] whose successor's logit is
    large enough for the softcap to matter: total variation 0.11 between the two) fits the
    un-softcapped conditional (gof at ALPHA_PARITY, power stated) and is rejected against the
    target's own."""
    live_oracle("assistant", "optiq")
    from spec_parity.oracles import assistant as oracle

    tdir, ddir, _ = _optiq_pair(softcap=True)
    prompt, T, R = [3, 4, 51], 3.0, 1500
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

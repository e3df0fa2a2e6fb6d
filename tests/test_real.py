"""Real checkpoints by path (spec_parity/real.py): the drafter family is read off its config, the
cases that apply run on the two paths against the live references, each labelled by what ran.
Here the "real" checkpoints are the factory's, given by path, and ones the references' own save
paths wrote; SPEC_PARITY_TARGET / SPEC_PARITY_DRAFTER point the same test at real weights."""

import json
import os

import pytest

from spec_parity import checkpoints, harness, real
from spec_parity.drafters.dspark.checkpoints import DSPARK

TARGET, DRAFTER = os.environ.get("SPEC_PARITY_TARGET"), os.environ.get("SPEC_PARITY_DRAFTER")

PAIRS = {  # family -> (target kind, target overrides, drafter kind, drafter overrides)
    "assistant": ("gemma4-target", {}, "gemma4-assistant", {"use_ordered_embeddings": False}),
    "dspark": ("gemma4-target", {}, "dspark-drafter", {}),
    "dflash": ("qwen3-target", {}, "dflash-drafter", {}),
    "dflash-extension": ("qwen3-target", {}, "dflash-drafter",
                         {"dspark_extras": {"markov_rank": 8, "markov_head_type": "vanilla", "confidence": True}}),
}


def _pair(family):
    tk, tov, dk, dov = PAIRS[family]
    return checkpoints.build(tk, 0, tov), checkpoints.build(dk, 0, dov)


def _run(target, drafter):
    cases = real.cases(target, drafter, harness.all_cases())
    assert cases
    out = []
    for case in cases:
        status = harness.pair(case.module).oracle_status(harness.oracle_name(case))
        if status is None or case.tier == "L3":
            out.append((case, harness.evaluate(case, "live")))
    return out


@pytest.mark.parametrize("family", list(PAIRS))
def test_the_drafter_family_is_read_off_its_config(family):
    target, drafter = _pair(family)
    assert real.drafter_family(drafter) == family and real.target_family(target) in ("gemma4", "qwen3")


def test_a_directory_of_no_family_is_named(tmp_path):
    with pytest.raises(real.RealError, match="no config.json"):
        real.target_family(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(real.RealError, match="model_type 'llama' is not a target"):
        real.target_family(tmp_path)
    with pytest.raises(real.RealError, match="not a drafter spec-parity checks"):
        real.drafter_family(tmp_path)


@pytest.mark.oracle
@pytest.mark.parametrize("family", harness.slow_except(list(PAIRS), "dflash"))
def test_every_family_by_path(family, live_oracle):
    live_oracle(family.split("-")[0])
    results = _run(*_pair(family))
    assert results
    for case, r in results:
        assert r.ok, r.message()
        assert " on " in case.name           # labelled by what ran, on which checkpoints


@pytest.mark.oracle
@pytest.mark.slow
def test_checkpoints_the_references_saved(tmp_path, live_oracle):
    """A target written by transformers' save_pretrained and a DSpark drafter written by
    DeepSpec's own save path run by path like any other."""
    from spec_parity.oracles import dspark as deepspec
    from spec_parity.oracles import targets as hf

    live_oracle("targets")
    live_oracle("dspark")
    target, drafter = _pair("dspark")
    hf.load(target).save_pretrained(tmp_path / "target")
    args = {k: v for k, v in DSPARK.items() if k not in ("target_kind", "target_overrides")}
    saved = deepspec.save_via_deepspec(target, drafter, args, tmp_path / "drafter")
    for _, r in _run(tmp_path / "target", saved):
        assert r.ok, r.message()


@pytest.mark.oracle
@pytest.mark.slow
def test_an_assistant_transformers_saved(tmp_path, live_oracle):
    """A Gemma-4 assistant and its target, each written by transformers' save_pretrained (the
    config.json it writes carries every config default), run by path against optiq and
    transformers like the factory's."""
    import torch
    from transformers import AutoModelForCausalLM

    from spec_parity.oracles import targets as hf

    live_oracle("targets")
    live_oracle("assistant")
    target, drafter = _pair("assistant")
    hf.load(target).save_pretrained(tmp_path / "target")
    AutoModelForCausalLM.from_pretrained(drafter, dtype=torch.float32).save_pretrained(tmp_path / "assistant")
    results = _run(tmp_path / "target", tmp_path / "assistant")
    assert len(results) == 3
    for _, r in results:
        assert r.ok, r.message()


@pytest.mark.real
@pytest.mark.oracle
def test_real_checkpoints(live_oracle):
    if not TARGET:
        pytest.skip("set SPEC_PARITY_TARGET=/path/to/target (and SPEC_PARITY_DRAFTER=/path/to/drafter) to run "
                    "the cases that apply on real weights")
    for _, r in _run(TARGET, DRAFTER):
        assert r.ok, r.message()


@pytest.mark.oracle
@pytest.mark.slow
def test_a_dflash_drafter_zlab_saved(tmp_path, live_oracle):
    """A DFlash drafter written by z-lab's own save path (DFlashDraftModel.save_pretrained, torch)
    runs by path against z-lab MLX and torch like the factory's."""
    from spec_parity.oracles import dflash as zlab

    live_oracle("dflash")
    live_oracle("dflash", "zlab-torch")
    target, drafter = _pair("dflash")
    saved = zlab.torch_save(drafter, tmp_path / "drafter")
    results = _run(target, saved)
    assert len(results) == 3
    for _, r in results:
        assert r.ok, r.message()

"""DSpark drafter: port/dspark.py vs DeepSeek's DeepSpec (DEEPSPEC_SRC) at L2.

The cases themselves (golden and, with DEEPSPEC_SRC set, live; each planted bug must fail) run
in tests/test_parity.py."""

import json

import pytest

from spec_parity import checkpoints, harness, shared
from spec_parity.drafters.dspark import pair
from spec_parity.drafters.dspark.checkpoints import DSPARK
from spec_parity.port import dspark, targets
from spec_parity.port.sources.dspark import DeepspecProvider


@pytest.mark.oracle
@pytest.mark.parametrize("variant", ["gemma4", "gemma4-keqv", "qwen3", "gemma4-rnn", "gemma4-dflash"])
def test_factory_config_is_deepspecs_own_config_path(variant, live_oracle):
    """Our tiny drafter's config.json is what DeepSpec's build_draft_config derives from the same
    target and model args, and DeepSpec's from_pretrained loads its tensors with nothing missing."""
    live_oracle("dspark")
    from spec_parity.oracles import dspark as oracle

    ov = pair.VARIANTS[variant]
    args = {**DSPARK, **ov}
    tdir = checkpoints.build(args["target_kind"], 0, args["target_overrides"])
    ours = json.loads((checkpoints.build("dspark-drafter", 0, ov) / "config.json").read_text())
    theirs = oracle.draft_config(tdir, {k: v for k, v in args.items() if k not in ("target_kind", "target_overrides")})
    keys = ["architectures", "num_target_layers", "num_hidden_layers", "block_size", "tie_word_embeddings", "layer_types",
            "mask_token_id", "target_layer_ids", "enable_confidence_head", "markov_rank", "hidden_size",
            "num_attention_heads", "num_key_value_heads", "vocab_size", "final_logit_softcapping", "attention_k_eq_v",
            "confidence_head_with_markov", "markov_head_type", "global_head_dim", "head_dim", "rope_parameters"]
    from deepdiff import DeepDiff

    diff = DeepDiff({k: theirs.get(k) for k in keys}, {k: ours.get(k) for k in keys})
    assert not diff, diff.pretty()
    target, _ = oracle._models(tdir, checkpoints.build("dspark-drafter", 0, ov))
    assert target is not None


def _drafter(ov=None):
    return checkpoints.build("dspark-drafter", 0, ov or {})


def test_a_markov_fed_confidence_head_without_a_markov_head_is_refused():
    """Found by `spec-parity fuzz --module dspark`: DeepSpec asserts on it; the port read the
    hidden state alone."""
    path = _drafter({"markov_rank": 0, "confidence_head_alpha": 1.0, "confidence_head_with_markov": True})
    with pytest.raises(dspark.DSparkError) as e:
        dspark.load(path)
    assert str(e.value).startswith(str(path / "config.json")) and "markov_rank 0" in str(e.value)


def test_wrong_family_target_is_refused_by_name():
    m = dspark.load(_drafter())
    with pytest.raises(dspark.DSparkError, match=r"config.json: .*gemma4 DSpark drafter, which needs a gemma4 target"):
        dspark.check_pairing(m, targets.load(checkpoints.build("qwen3-target", 0, {})))


def test_wrong_depth_target_is_refused_by_name():
    m = dspark.load(_drafter())
    with pytest.raises(dspark.DSparkError, match="num_target_layers 6 != num_hidden_layers 3"):
        dspark.check_pairing(m, targets.load(checkpoints.build(
            "gemma4-target", 0, {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention",
                                                                         "full_attention"]})))


def test_tap_layer_ids_are_validated_at_build():
    with pytest.raises(ValueError, match="strictly increasing"):
        checkpoints.build("dspark-drafter", 0, {"target_layer_ids": [2, 1]})


def test_not_a_dspark_checkpoint_is_named():
    with pytest.raises(dspark.DSparkError, match="not a DeepSpec DSpark drafter"):
        dspark.load(checkpoints.build("gemma4-target", 0, {}))


def test_zero_token_proposal_runs_the_loop():
    """Threshold 1.0 keeps no draft: every round verifies the pending token alone, losslessly."""

    from spec_parity.port import serve

    target = targets.load(checkpoints.build("gemma4-target", 0, {}))
    prov = DeepspecProvider(_drafter(), threshold=1.0)
    tokens, stats = serve.generate(target, list(range(3, 15)), 10, prov,
                                   serve.ServeOptions(gamma=prov.trained_gamma, eos=set()))
    plain, _ = shared.greedy(target.path, list(range(3, 15)), 10, set())
    assert tokens == plain and stats.drafted == 0 and all(d == 0 for d, _, _ in stats.trace)


@pytest.mark.oracle
@pytest.mark.parametrize("variant", ["gemma4", "gemma4-keqv", "qwen3"])
def test_port_loads_what_deepspec_saves(variant, tmp_path, live_oracle):
    """The drafter built through DeepSpec's own config path and saved with its save_pretrained loads
    in the port and drafts exactly what the factory's files draft."""
    live_oracle("dspark")
    import mlx.core as mx
    import numpy as np

    from spec_parity.oracles import dspark as oracle

    ov = pair.VARIANTS[variant]
    args = {**DSPARK, **ov}
    tdir = checkpoints.build(args["target_kind"], 0, args["target_overrides"])
    ddir = checkpoints.build("dspark-drafter", 0, ov)
    saved = oracle.save_via_deepspec(tdir, ddir, {k: v for k, v in args.items()
                                                  if k not in ("target_kind", "target_overrides")}, tmp_path / "ds")
    target = targets.load(tdir)
    trace = targets.forward(target, mx.array([list(range(3, 15))]))
    blocks = []
    for path in (ddir, saved):
        m = dspark.load(path)
        dspark.check_pairing(m, target)
        blocks.append(m.draft_block(5, m.context_kv(m.project(m.taps(trace.hidden)), 0), 12))
    assert blocks[0].tokens == blocks[1].tokens
    assert np.array_equal(np.array(blocks[0].logits), np.array(blocks[1].logits))


def test_a_tap_bug_is_not_blamed_on_a_drafter_layer():
    """The own-error run gives each layer the reference's context K/V as well as its input: a wrong
    tap, on the target's side, leaves every drafter layer's own error in budget (it read layer 0
    while the context came from the port's own taps)."""
    case = next(c for c in harness.all_cases(["dspark"]) if c.name.endswith("control-tap_index"))
    result = harness.evaluate(case, "golden")
    assert result.verdict == "FAIL" and result.metrics["layers"]["first_divergent_layer"] is None, result.message()

"""The published config.json files (fixtures/configs/, sources in its README.md) load as they are:
a random-weight checkpoint built from each exact config, shrunk by the one rule of
spec_parity/checkpoints/published.py, goes through our loader and every reference loader that
runs here, each consuming every tensor."""

import json

import pytest

from spec_parity.checkpoints import published
from spec_parity.port import assistant, checkpoint, dspark, targets

E2B = "assistant/gemma-4-E2B-it-assistant.json"
QWEN3_4B = "targets/Qwen3-4B-Instruct-2507.json"
DSPARK_4B = "dspark/dspark_qwen3_4b_block7.deepspec-derived.json"
FILES = {E2B: "assistant", QWEN3_4B: "qwen3", DSPARK_4B: "dspark-qwen3"}


def test_every_fixture_is_listed_with_its_source():
    readme = (published.ROOT / "README.md").read_text()
    on_disk = {str(p.relative_to(published.ROOT)) for p in published.ROOT.glob("*/*.json")}
    assert on_disk == set(FILES)
    for name in on_disk:
        assert f"`{name}`" in readme, f"{name} has no source in fixtures/configs/README.md"


@pytest.mark.parametrize("name", sorted(FILES))
def test_the_checkpoint_carries_the_published_config_under_the_rule(name):
    """Only the rule's keys change; the family the CLI detects is the published one."""
    raw = published.published_config(name)
    path = published.build_published(name)
    written = json.loads((path / "config.json").read_text())
    assert written == published.shrink(raw)
    changed = {k for k in raw if raw[k] != written[k]} | {
        f"text_config.{k}" for k in raw.get("text_config") or {} if raw["text_config"][k] != written["text_config"][k]}
    allowed = set(published.WIDTH_KEYS) | {"vocab_size", *published.TOKEN_ID_KEYS}
    assert {k.split(".")[-1] for k in changed if k != "text_config"} <= allowed
    assert checkpoint.check_dir(path, "--checkpoint") == FILES[name]


def test_our_loaders_take_each_published_checkpoint():
    e2b = assistant.load(published.build_published(E2B))
    assert e2b.head == "centroid" and e2b.args.sliding_window == 512
    target = targets.load(published.build_published(QWEN3_4B))
    assert target.family == "qwen3" and target.config["num_hidden_layers"] == 36
    drafter = dspark.load(published.build_published(DSPARK_4B))
    assert drafter.args.target_layer_ids == [1, 9, 17, 25, 33] and drafter.args.block_size == 7
    dspark.check_pairing(drafter, target)  # the DeepSpec-derived drafter pairs with its target


def _hf_loads(path):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


@pytest.mark.oracle
@pytest.mark.slow
def test_transformers_loads_each_published_checkpoint(live_oracle):
    live_oracle("assistant", "transformers")
    e2b = _hf_loads(published.build_published(E2B))
    assert e2b.config.get_text_config().sliding_window == 512
    qwen = _hf_loads(published.build_published(QWEN3_4B))
    assert qwen.config.num_hidden_layers == 36


@pytest.mark.oracle
def test_optiq_loads_the_published_assistant(live_oracle):
    live_oracle("assistant", "optiq")
    from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantDrafter

    path = published.build_published(E2B)
    drafter = GemmaAssistantDrafter.from_pretrained(str(path))
    ours = assistant.load(path)
    from mlx.utils import tree_flatten

    def size(model):  # optiq names its parameters its own way: compare how many numbers each holds
        return sum(v.size for k, v in tree_flatten(model.parameters()) if "token_ordering" not in k)

    assert size(drafter) == size(ours)


@pytest.mark.oracle
@pytest.mark.slow
def test_deepspec_loads_the_published_dspark(live_oracle):
    live_oracle("dspark")
    import torch

    from spec_parity.oracles import dspark as deepspec

    deepspec._import()
    from deepspec.modeling.dspark import Qwen3DSparkModel

    path = published.build_published(DSPARK_4B)
    draft, info = Qwen3DSparkModel.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["unexpected_keys"] and not [k for k in info["missing_keys"] if "rotary" not in k], info
    cfg = json.loads((path / "config.json").read_text())
    assert draft.config.target_layer_ids == cfg["target_layer_ids"] and draft.config.markov_rank == cfg["markov_rank"]


def _on_published(module, case_name, target, drafter):
    """The harness case `case_name` with its target and drafter replaced by the given directories."""
    from dataclasses import replace

    from spec_parity import harness

    base = next(c for c in harness.all_cases([module]) if c.name == case_name)
    return replace(base, name=f"{case_name}-published", path=str(target),
                   params=replace(base.params, drafter_path=str(drafter)))


# The E2B assistant's shrunk widths (backbone 96, head dims 16 / 32, 1 KV head, vocab 4096, window
# 512) on a factory Gemma-4 target of the same dims: no verbatim Gemma-4 target config was found.
E2B_TARGET = {"hidden_size": 96, "num_key_value_heads": 1, "vocab_size": 4096, "sliding_window": 512}


@pytest.mark.oracle
@pytest.mark.parametrize("oracle", ["optiq", "transformers"])
@pytest.mark.parametrize("control", ["", "-control-scale", "-control-position", "-control-donor", "-control-ordering"])
def test_the_published_assistant_drafts_like_the_references(live_oracle, oracle, control):
    """The E2B config's drafter: port == optiq (L1) and == transformers (L2) on the case's steps;
    the case's planted bugs (its controls, on the same checkpoints) must fail."""
    from spec_parity import checkpoints, harness

    live_oracle("assistant", oracle)
    target = checkpoints.build("gemma4-target", 0, E2B_TARGET)
    case = _on_published("assistant", f"step-gemma4-centroid-{oracle}{control}", target, published.build_published(E2B))
    r = harness.evaluate(case, "live")
    assert r.ok != bool(control), r.message()


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("bug", ["", "tap_index", "anchor_not_predicting", "rope_on_v"])
def test_the_published_dspark_drafts_like_deepspec(live_oracle, bug):
    """The DeepSpec-derived DSpark Qwen3-4B config on the Qwen3-4B config: port == DeepSpec (L2);
    planted bugs of spec_parity/drafters/dspark/controls.py on the same checkpoints must fail."""
    from dataclasses import replace

    from spec_parity import controls, harness

    live_oracle("dspark")
    case = _on_published("dspark", "mod-qwen3", published.build_published(QWEN3_4B),
                         published.build_published(DSPARK_4B))
    if bug:
        case = replace(case, name=f"{case.name}-control-{bug}", control=controls.case_control("dspark", bug, "mod-qwen3"))
    r = harness.evaluate(case, "live")
    assert r.ok != bool(bug), r.message()

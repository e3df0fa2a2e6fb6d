"""Edge checkpoints: computed the way the reference computes them, or refused by name, never
computed some other way. Each is a factory checkpoint edited in tmp_path."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from spec_parity import checkpoints, harness
from spec_parity.port import assistant, dflash, dspark


def _edit(src, dst, config=None, tensors=None, drop=()):
    """A copy of checkpoint `src` with config keys set and tensors added or dropped."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    t.update(tensors or {})
    for k in drop:
        del t[k]
    save_file(t, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("kind, load, tensor, error", [
    ("gemma4-assistant", assistant.load, "model.layers.2.self_attn.q_norm.weight", assistant.DrafterError),
    ("dflash-drafter", dflash.load, "layers.1.self_attn.k_norm.weight", dflash.DFlashError),
    ("dspark-drafter", dspark.load, "markov_head.markov_w2.weight", dspark.DSparkError),
], ids=["assistant", "dflash", "dspark"])
def test_missing_tensor_is_named(kind, load, tensor, error, tmp_path):
    """A checkpoint one tensor short is refused naming the tensor; control: the full one loads."""
    src = checkpoints.build(kind, 0, {})
    load(src)
    with pytest.raises(error, match=rf"missing tensor\(s\) \['{re.escape(tensor)}'\]"):
        load(_edit(src, tmp_path / "short", drop=[tensor]))


def _untied(tmp_path):
    src = checkpoints.build("gemma4-assistant", 0, {"use_ordered_embeddings": False})
    cfg = json.loads((src / "config.json").read_text())
    H, V = cfg["text_config"]["hidden_size"], cfg["text_config"]["vocab_size"]
    head = np.random.default_rng(5).normal(0, 0.05, (V, H)).astype(np.float32)
    return _edit(src, tmp_path / "untied", {"tie_word_embeddings": False}, {"lm_head.weight": head})


def test_untied_head_scores_with_lm_head(tmp_path):
    m = assistant.load(_untied(tmp_path))
    assert m.head == "untied" and "lm_head" in dict(m.children())


@pytest.mark.oracle
@pytest.mark.parametrize("oracle", ["optiq", "transformers"])
def test_untied_head_matches_the_references(tmp_path, oracle, live_oracle):
    """optiq and transformers score an untied assistant with its lm_head: so does the port, at the
    case's tier (optiq L1, transformers L2)."""
    live_oracle("assistant", oracle)
    base = next(c for c in harness.all_cases(["assistant"]) if c.name == f"step-gemma4-tied-{oracle}")
    case = replace(base, name=base.name + "-untied", params=replace(base.params, drafter_path=str(_untied(tmp_path))))
    r = harness.evaluate(case, "live")
    assert r.ok, r.message()


def test_an_unused_tensor_is_refused_by_name(tmp_path):
    src = checkpoints.build("gemma4-assistant", 0, {"use_ordered_embeddings": False})
    extra = _edit(src, tmp_path / "extra", tensors={"lm_head.weight": np.zeros((128, 32), np.float32)})
    with pytest.raises(assistant.DrafterError, match=r"tensor\(s\) \['lm_head.weight'\] have no place"):
        assistant.load(extra)


def test_dflash_extras_are_left_only_with_extras_off(tmp_path):
    """With extras off z-lab's DFlash reads an extras checkpoint as plain DFlash: the port leaves the
    extension's tensors out as z-lab does; any other unknown tensor is refused."""
    ext = checkpoints.build("dflash-drafter", 0, {"dspark_extras": {"markov_rank": 8, "markov_head_type": "vanilla",
                                                                     "confidence": True}})
    assert "markov_head" not in dflash.load(ext)
    odd = _edit(ext, tmp_path / "odd", tensors={"layers.0.extra.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(dflash.DFlashError, match=r"layers.0.extra.weight"):
        dflash.load(odd)


def test_a_loader_that_drops_unknown_tensors_is_caught(tmp_path, monkeypatch):
    """The control of the rule above: a loader that filters the tensors to the model's (as the
    port's loader did) lets the extra tensor through, and the test that names it fails."""
    from spec_parity.port import checkpoint

    real = checkpoint.load_into
    monkeypatch.setattr(checkpoint, "load_into", lambda model, path, weights, *a, **k: real(
        model, path, {n: w for n, w in weights.items() if n != "lm_head.weight"}, *a, **k))
    src = checkpoints.build("gemma4-assistant", 0, {"use_ordered_embeddings": False})
    extra = _edit(src, tmp_path / "extra", tensors={"lm_head.weight": np.zeros((128, 32), np.float32)})
    assert assistant.load(extra).head == "tied"          # computed some other way: what the rule forbids
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_an_unused_tensor_is_refused_by_name(tmp_path / "again")


def test_a_sliding_window_other_than_the_targets_is_refused():
    from spec_parity.port import targets

    drafter = assistant.load(checkpoints.build("gemma4-assistant", 0, {"text_config": {"sliding_window": 6}}))
    with pytest.raises(assistant.DrafterError, match="text_config.sliding_window 6 != sliding_window 8"):
        assistant.check_pairing(drafter, targets.load(checkpoints.build("gemma4-target", 0, {})))


def _top_level_scales(tmp_path):
    """The gemma4 DFlash drafter with its two scales moved from dflash_config to the top level."""
    case = next(c for c in harness.all_cases(["dflash"]) if c.name == "mod-gemma4")
    src = case.drafter_dir()
    cfg = json.loads((src / "config.json").read_text())
    nested = cfg["dflash_config"]
    moved = {k: nested.pop(k) for k in ("input_embedding_scale", "output_multiplier")}
    dst = _edit(src, tmp_path / "top-level", {**moved, "dflash_config": nested})
    return replace(case, name="mod-gemma4-top-level-scales", params=replace(case.params, drafter_path=str(dst)))


def test_scale_keys_follow_each_reference():
    """z-lab MLX reads the two scales from dflash_config only, z-lab torch from there or the top
    level: the port's `scales` option says which (SCALES), and the case tells it its reference's."""
    c = {"architectures": ["DFlashDraftModel"], "hidden_size": 8, "dflash_config": {"target_layer_ids": [0], "mask_token_id": 1}, "output_multiplier": 0.5}
    base = {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
            "intermediate_size": 8, "vocab_size": 8, "num_target_layers": 2}
    either = dflash.ModelArgs.from_config({**base, **c}, "cfg", "either")
    nested = dflash.ModelArgs.from_config({**base, **c}, "cfg", "nested")
    assert (either.output_multiplier, nested.output_multiplier) == (0.5, 1.0)
    with pytest.raises(dflash.DFlashError, match="unknown scales convention"):
        dflash.ModelArgs.from_config({**base, **c}, "cfg", "top")


@pytest.mark.oracle
def test_top_level_scales_match_zlab_mlx_and_the_other_reading_is_named(tmp_path, live_oracle):
    """On a checkpoint with top-level scales the port (told z-lab MLX's convention) matches live
    z-lab MLX; a port that reads them as z-lab torch does is named by the delta scale-keys."""
    from spec_parity import ports

    live_oracle("dflash")
    case = _top_level_scales(tmp_path)
    assert harness.evaluate(case, "live").ok
    ours = ports.ours().runs["dflash"]
    torchlike = ports.Port("reads-top-level", "0", {"dflash": lambda req: ours(replace(req, options={
        **req.options, "scales": "either"}))}, (__file__,))
    r = harness.evaluate(case, "live", ports.Selection({"dflash": torchlike}))
    assert r.verdict == "DELTA" and r.metrics["delta"]["deltas"] == ["scale-keys"], r.message()

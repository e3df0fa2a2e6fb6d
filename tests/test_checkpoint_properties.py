"""Property tests per checkpoint family (assistant, DSpark, DFlash, Qwen3 and Gemma-4 targets):
over config and tensor mutations of the factory's checkpoints (required keys removed, renamed,
moved between nesting levels; tensors extra, missing, misshaped; mismatched pair dimensions),
our load refuses with one line naming the file and the key or tensor. The
properties are the plain functions of tests/checkpoint_mutations.py; planted-bug controls, applied
from outside product code, show each property fails on the bug it guards against."""

import json

import checkpoint_mutations as m
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_parity import checkpoints
from spec_parity.port import assistant, checkpoint, dflash, dspark, targets

FAMILIES = sorted(m.FAMILIES)
DRAFTERS = sorted(m.NEST)
SPELLINGS = ("{}_", "{}Size", "_{}", "draft_{}")
# Hypothesis draws few examples per property; the fixed sweeps below cover every key and tensor.
FEW = settings(max_examples=12, deadline=None)


@FEW
@given(st.data())
def test_a_required_key_removed_or_moved_between_levels_is_refused_by_name(data):
    family = data.draw(st.sampled_from(FAMILIES))
    key = data.draw(st.sampled_from(m.required_keys(family)))
    moves = (m.check_key_moved,) if family in m.NEST else ()
    data.draw(st.sampled_from((m.check_key_removed, *moves)))(family, key)


@FEW
@given(st.data())
def test_a_renamed_required_key_is_refused_by_name(data):
    family = data.draw(st.sampled_from(FAMILIES))
    key = data.draw(st.sampled_from(m.required_keys(family)))
    m.check_key_renamed(family, key, data.draw(st.sampled_from(SPELLINGS)))


@FEW
@given(st.data())
def test_a_tensor_with_no_place_is_refused_by_name(data):
    family = data.draw(st.sampled_from(FAMILIES))
    names = sorted(m.tensors(family))
    stem = data.draw(st.sampled_from(names)).rsplit(".", 1)[0]
    m.check_tensor_extra(family, stem + "." + data.draw(st.sampled_from(("extra", "bias", "scales"))))


@FEW
@given(st.data())
def test_a_missing_or_misshaped_tensor_is_refused_by_name(data):
    family = data.draw(st.sampled_from(FAMILIES))
    name = data.draw(st.sampled_from(sorted(m.tensors(family))))
    data.draw(st.sampled_from((m.check_tensor_missing, m.check_tensor_misshaped)))(family, name)


@FEW
@given(st.data())
def test_a_mismatched_pair_is_refused_naming_the_dimension(data):
    family = data.draw(st.sampled_from(sorted(m.PAIR_MISMATCHES)))
    m.check_pair_mismatch(family, data.draw(st.sampled_from(sorted(m.PAIR_MISMATCHES[family]))))


OPTIONAL = [(f, k) for f in sorted(m.OPTIONAL) for k in m.OPTIONAL[f]]
OPS = ("removed", "moved", "renamed")


@pytest.mark.oracle
def test_an_optional_key_mutated_is_refused_or_computed_like_the_reference(live_oracle):
    """A key the loaders read with a default (or not at all) removed, moved or renamed: refused by
    name, or the port matches the live reference at the tier of the family's case (optiq L1 for the
    assistant, z-lab MLX L1 for DFlash)."""
    live_oracle("assistant")
    live_oracle("dflash")

    @FEW
    @given(st.sampled_from([(f, k) for f, k in OPTIONAL if f != "dspark"]), st.sampled_from(OPS))
    def prop(family_key, op):
        m.check_optional_key(*family_key, op)

    prop()


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(m.OPTIONAL))
def test_every_optional_key_of_a_family(live_oracle, family):
    """The sweep of the property above, DSpark (DeepSpec, torch) included."""
    live_oracle(family)
    for key in m.OPTIONAL[family]:
        for op in OPS:
            m.check_optional_key(family, key, op)


@pytest.mark.parametrize("key, on, variant", [
    ("markov_head_type", "markov_rank", {"markov_rank": 0, "confidence_head_alpha": 0.0}),
    ("confidence_head_with_markov", "enable_confidence_head", {"confidence_head_alpha": 0.0}),
])
def test_dspark_keys_required_only_when_their_part_is_on(key, on, variant):
    """DeepSpec's rule: markov_head_type only with markov_rank > 0, confidence_head_with_markov only
    with enable_confidence_head. On, the key removed is refused naming config.json, both keys and
    the fix; off (the factory's variant that leaves the part out), the checkpoint loads."""
    assert m.check_optional_key("dspark", key, "removed") == "refused"
    with m.mutated("dspark", lambda cfg: cfg.pop(key)) as p:
        with pytest.raises(checkpoint.CheckpointError) as e:
            m.our_load("dspark", p)
    msg = str(e.value)
    assert "\n" not in msg and all(s in msg for s in (f"{p}/config.json", key, on, "add it")), msg
    off = checkpoints.build("dspark-drafter", 0, variant)
    assert key not in json.loads((off / "config.json").read_text())
    m.our_load("dspark", off)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_required_key_and_tensor_of_a_family(family):
    """The sweep hypothesis samples from: every required key, every tensor, every pair dimension."""
    for key in m.required_keys(family):
        m.check_key_removed(family, key)
        m.check_key_renamed(family, key, SPELLINGS[0])
        if family in m.NEST:
            m.check_key_moved(family, key)
    for name in sorted(m.tensors(family)):
        m.check_tensor_missing(family, name)
        m.check_tensor_misshaped(family, name)
    for dim in m.PAIR_MISMATCHES.get(family, ()):
        m.check_pair_mismatch(family, dim)


# Planted-bug controls: each runs a property over a fixed example set with a bug planted from
# outside (monkeypatch), and must see the property fail.

def _fails(check, examples) -> list[str]:
    caught = []
    for args in examples:
        try:
            check(*args)
        except AssertionError as e:
            caught.append(str(e))
    return caught


EXTRA = [(f, n) for f in DRAFTERS for n in ("model.layers.0.extra.weight", "fc.bias", "lm_head.scales")]


def test_control_a_loader_that_drops_unknown_tensors_is_caught(monkeypatch):
    """The bug the properties found: load_into keeping only the tensors the model declares."""
    honest = checkpoint.load_into

    def lax(model, path, weights, error, hint, unused=()):
        from mlx.utils import tree_flatten

        expected = {k for k, _ in tree_flatten(model.parameters())}
        honest(model, path, {k: v for k, v in weights.items() if k in expected}, error, hint, unused)

    assert not _fails(m.check_tensor_extra, EXTRA)
    monkeypatch.setattr(checkpoint, "load_into", lax)
    assert len(_fails(m.check_tensor_extra, EXTRA)) == len(EXTRA)


def test_control_a_pairing_check_that_passes_everything_is_caught(monkeypatch):
    examples = [(f, d) for f in m.PAIR_MISMATCHES for d in m.PAIR_MISMATCHES[f]]
    assert not _fails(m.check_pair_mismatch, examples)
    for module in (assistant, dspark, dflash):
        monkeypatch.setattr(module, "check_pairing", lambda drafter, target: None)
    assert len(_fails(m.check_pair_mismatch, examples)) == len(examples)


def test_control_a_required_key_left_to_the_loaders_is_caught(monkeypatch):
    """A REQUIRED row that lost its keys: the loaders default them (or stop on a KeyError)."""
    examples = [(f, k) for f in DRAFTERS for k in m.required_keys(f)]
    assert not _fails(m.check_key_removed, examples)
    monkeypatch.setattr(checkpoint, "REQUIRED", {f: () for f in checkpoint.REQUIRED})
    caught = _fails(m.check_key_removed, examples)
    assert caught and all("refused with" in c or "loaded without" in c or "names none" in c for c in caught)


def test_control_a_shape_check_that_is_skipped_is_caught(monkeypatch):
    """load_into without its shape check: mlx's load_weights refuses with no file named."""
    honest = checkpoint.load_into

    def unchecked(model, path, weights, error, hint, unused=()):
        try:
            honest(model, path, weights, error, hint, unused)
        except error as e:
            if "wrong shape" not in str(e):
                raise
            model.load_weights(list(weights.items()), strict=True)

    examples = [(f, sorted(m.tensors(f))[0]) for f in DRAFTERS]
    assert not _fails(m.check_tensor_misshaped, examples)
    monkeypatch.setattr(checkpoint, "load_into", unchecked)
    assert len(_fails(m.check_tensor_misshaped, examples)) == len(examples)


@pytest.mark.oracle
@pytest.mark.parametrize("family, key, row", [
    ("assistant", "centroid_intermediate_top_k", ("num_centroids", "centroid_intermediate_top_k")),
    ("dflash", "rms_norm_eps", ("rms_norm_eps", "max_position_embeddings")),
])
def test_control_the_keys_the_property_made_required_are_load_bearing(monkeypatch, live_oracle, family, key, row):
    """Without the REQUIRED keys this property found, the mutation loads: the port then computes
    another draft than optiq (the assistant's top-k) or z-lab MLX stops on a KeyError (DFlash)."""
    live_oracle(family)
    fam = checkpoint.family(m.config(family))
    assert m.check_optional_key(family, key, "removed") == "refused"
    monkeypatch.setitem(checkpoint.REQUIRED, fam, tuple(k for k in checkpoint.REQUIRED[fam] if k not in row))
    assert _fails(m.check_optional_key, [(family, key, "removed")])


@pytest.mark.oracle
def test_control_a_loader_that_defaults_markov_head_type_is_caught(monkeypatch, live_oracle):
    """The port before REQUIRED_WHEN: a DSpark config with markov_rank > 0 and no markov_head_type
    loaded as a vanilla head, and DeepSpec stops on its assertion; the property must say so."""
    live_oracle("dspark")
    monkeypatch.setattr(checkpoint, "REQUIRED_WHEN", {})
    caught = _fails(m.check_optional_key, [("dspark", "markov_head_type", "removed")])
    assert len(caught) == 1 and "the reference stops" in caught[0], caught


def test_control_a_target_refusal_left_to_mlx_lm_is_caught(monkeypatch):
    """spec_parity.port.targets.load passing mlx-lm's own refusal through (two lines, no file) fails the
    tensor properties for both targets."""
    examples = [(f, "model.layers.0.extra.weight") for f in ("qwen3", "gemma4")]
    assert not _fails(m.check_tensor_extra, examples)
    monkeypatch.setattr(targets, "_tensor_error", lambda path, msg: None)
    assert len(_fails(m.check_tensor_extra, examples)) == len(examples)

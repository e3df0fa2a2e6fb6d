"""Target pair: mlx-lm (port/targets.py) vs transformers (oracles/targets.py), at L2: the layer
walk, the donor layers, and the goldens' own checks. The cases themselves (golden and live; each
control caught at its planted layer) run in tests/test_parity.py."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import checkpoints, controls, goldens, harness
from spec_parity.budgets import budget_for
from spec_parity.drafters.targets import pair
from spec_parity.port import targets as port
from spec_parity.port.checkpoint import CheckpointError

CASES = pair.PAIR.cases()


@pytest.mark.parametrize("case", [c for c in CASES if not c.control], ids=lambda c: c.name)
def test_layer_walk_is_mlx_lm_bit_exact(case):
    """L1: our layer-by-layer walk adds no arithmetic to mlx-lm's own forward."""
    target = port.load(case.checkpoint_dir())
    ids = mx.array(harness.prompt(case))
    assert np.array_equal(np.array(port.forward(target, ids).logits), np.array(target.model(ids)))


def test_layer_walk_control_breaks_bit_exactness():
    case = CASES[0]
    target = port.load(case.checkpoint_dir())
    ids = mx.array(harness.prompt(case))
    before = np.array(port.forward(target, ids).logits)
    with controls.planted("targets", "rope-L1"):
        perturbed = port.load(case.checkpoint_dir())
    assert not np.array_equal(before, np.array(port.forward(perturbed, ids).logits))


def test_donor_layers_are_last_owning_sliding_and_full():
    by_name = {c.name: c for c in CASES}
    assert port.donor_layers(port.load(by_name["gemma4"].checkpoint_dir())) == {"sliding": 4, "full": 5}
    # kv-shared layers 4, 5 own no K/V: donors are the last owners, 3 (sliding) and 2 (full).
    assert port.donor_layers(port.load(by_name["gemma4-ple-kvshared"].checkpoint_dir())) == {"sliding": 3, "full": 2}


def test_a_target_of_full_layers_only_has_no_sliding_donor_and_runs():
    """Found by `spec-parity fuzz --module targets`: the walk looked up a sliding donor every
    Gemma-4 target was assumed to have."""
    full = checkpoints.build("gemma4-target", 0, {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2})
    target = port.load(full)
    assert port.donor_layers(target) == {"full": 1}
    trace = port.forward(target, mx.array([[5, 6, 7]]))
    assert np.isfinite(np.array(trace.logits)).all()


@pytest.mark.parametrize("overrides, named", [
    ({"attention_k_eq_v": True, "num_global_key_value_heads": None}, "num_global_key_value_heads"),
    ({"num_hidden_layers": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
      "num_kv_shared_layers": 1, "hidden_size_per_layer_input": 16}, "num_kv_shared_layers 1 shares ['full_attention']"),
    ({"attention_k_eq_v": True, "num_attention_heads": 3, "num_key_value_heads": 1, "num_global_key_value_heads": 2},
     "num_attention_heads 3 is not a multiple of num_global_key_value_heads 2"),
], ids=["k_eq_v-without-global-kv-heads", "shared-full-without-owner", "heads-not-whole-groups"])
def test_a_gemma4_kv_layout_no_reference_builds_is_refused_in_one_line(overrides, named):
    """Found by `spec-parity fuzz --module targets`: transformers raised on both, mlx-lm ran the
    first with its own fallback and raised a bare KeyError on the second."""
    path = checkpoints.build("gemma4-target", 0, overrides)
    with pytest.raises(CheckpointError) as e:
        port.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path / "config.json")) and named in msg


@pytest.fixture
def fixture_copy(tmp_path, monkeypatch):
    shutil.copytree(goldens.root(), tmp_path / "fixtures")
    monkeypatch.setenv("SPEC_PARITY_FIXTURES", str(tmp_path / "fixtures"))
    return tmp_path / "fixtures" / "targets"


@pytest.mark.golden
def test_stale_golden_names_the_difference_and_the_fix(fixture_copy):
    case = CASES[0]
    mpath = fixture_copy / f"{case.name}.json"
    manifest = json.loads(mpath.read_text())
    manifest["params"]["new_tokens"] = 31
    manifest["checkpoint"]["sha256"] = "0" * 64
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(goldens.GoldenError) as e:
        goldens.load(case)
    msg = str(e.value)
    assert "stale golden" in msg and "new_tokens" in msg and "sha256" in msg
    assert "spec-parity fixtures regen --module targets --case gemma4" in msg


@pytest.mark.golden
def test_edited_golden_fails_its_digest(fixture_copy):
    case = CASES[0]
    t = fixture_copy / f"{case.name}.safetensors"
    data = bytearray(t.read_bytes())
    data[-1] ^= 1
    t.write_bytes(bytes(data))
    with pytest.raises(goldens.GoldenError, match="sha256"):
        goldens.load(case)


def test_missing_golden_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_PARITY_FIXTURES", str(tmp_path))
    with pytest.raises(goldens.GoldenError, match="fixtures regen --module targets"):
        goldens.load(CASES[0])


@pytest.mark.golden
def test_machine_keyed_golden_overrides_shared(fixture_copy):
    case = CASES[0]
    keyed = fixture_copy / goldens.machine_key()
    keyed.mkdir()
    for ext in (".json", ".safetensors"):
        shutil.copy(fixture_copy / f"{case.name}{ext}", keyed / f"{case.name}{ext}")
    assert goldens.locate(case)[0].parent == keyed


@pytest.mark.oracle
def test_goldens_regenerate_byte_identically(fixture_copy, live_oracle):
    """Regeneration is deterministic: two regens on one machine write the same bytes. Against the
    committed goldens it is byte-identical where this CPU computes as the machine that made them
    did; torch's CPU kernels differ in the last bits between CPU models (seen: an AMD EPYC against
    the goldens' machine), so there the arrays are held to the targets' budgets (spec_parity/budgets.py) instead."""
    live_oracle("targets")
    for case in CASES:
        if case.control:
            continue
        before = {ext: (fixture_copy / f"{case.name}{ext}").read_bytes() for ext in (".json", ".safetensors")}
        if json.loads(before[".json"])["device"] != goldens.machine_key():
            pytest.skip(f"committed goldens were made on {json.loads(before['.json'])['device']}")
        committed = goldens.load(case)[0]
        path = harness.regen(case)
        assert path.startswith(str(fixture_copy)), path
        first = {ext: (fixture_copy / f"{case.name}{ext}").read_bytes() for ext in before}
        harness.regen(case)
        for ext, data in first.items():
            assert (fixture_copy / f"{case.name}{ext}").read_bytes() == data, f"{case.name}{ext} changed between regens"
        if first != before:
            regen = goldens.load(case)[0]
            assert set(regen) == set(committed), case.name
            for k, v in committed.items():
                quantity = "stream_logits" if k == "stream.logits" else k.split(".")[0]
                if quantity not in ("final", "hidden", "logits", "donor", "stream_logits"):
                    assert np.array_equal(regen[k], v), f"{case.name}: {k} changed on regen"
                    continue
                b = budget_for("targets", quantity)
                assert np.allclose(regen[k], v, rtol=b.rtol, atol=b.atol), f"{case.name}: {k} moved past {b.describe()}"


@pytest.mark.parametrize("edit, shard, needs", [
    ("add", 2, "has no place in mlx-lm's model; remove it"),
    ("grow", 1, "has shape"),
    ("drop", 2, "is missing (mlx-lm's model needs it)"),
])
def test_a_target_tensor_refusal_names_its_shard(tmp_path, edit, shard, needs):
    """mlx-lm's refusal of a sharded target's tensor (two lines, no file) is one line naming the
    shard that holds it (a missing one: the shard the index assigns it to) and the fix."""
    from safetensors.numpy import load_file, save_file

    t = load_file(str(checkpoints.build("qwen3-target", 0) / "model.safetensors"))
    names = sorted(t)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    index = {"metadata": {}, "weight_map": {n: files[i] for i, half in enumerate(halves) for n in half}}
    name = {"add": "model.layers.1.extra.weight", "grow": halves[0][1], "drop": halves[1][1]}[edit]
    parts = [{n: t[n] for n in half} for half in halves]
    if edit == "add":
        parts[1][name] = np.zeros((4, 4), np.float32)
    elif edit == "grow":
        parts[0][name] = np.concatenate([t[name], t[name][:1]])
    else:
        del parts[1][name]
    for f, part in zip(files, parts):
        save_file(part, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(checkpoints.build("qwen3-target", 0) / "config.json", tmp_path / "config.json")
    with pytest.raises(port.TargetError) as e:
        port.load(tmp_path, lazy=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / files[shard - 1]}: tensor {name}") and needs in msg, msg

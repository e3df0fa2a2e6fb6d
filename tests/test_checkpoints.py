"""The tiny checkpoint factory: deterministic bytes, atomic creation, loadable by the real loaders."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from spec_parity import checkpoints
from spec_parity.drafters.targets.checkpoints import GEMMA4_VARIANTS

VARIANTS = [("gemma4-target", ov) for ov in GEMMA4_VARIANTS.values()] + [("qwen3-target", {})]
TARGETS = VARIANTS + [("gemma4-target-agreeing", {})]
DRAFTERS = [("gemma4-assistant", {}), ("gemma4-assistant", {"use_ordered_embeddings": False}),
            ("gemma4-assistant", {"model_type": "gemma4_unified_assistant", "use_ordered_embeddings": False}),
            ("gemma4-assistant-agreeing", {}), ("gemma4-assistant-agreeing", {"use_ordered_embeddings": False})]


@pytest.mark.parametrize("kind", ["gemma4-target", "gemma4-target-agreeing", "gemma4-assistant-agreeing",
                                  "qwen3-target-agreeing", "dspark-drafter", "dspark-drafter-agreeing"])
def test_same_arguments_same_bytes_in_another_process(kind, tmp_path):
    here = checkpoints.checkpoint_hash(checkpoints.build(kind, 3, {}, root=tmp_path / "a"))
    code = ("import sys; from pathlib import Path; from spec_parity import checkpoints as c; "
            f"print(c.checkpoint_hash(c.build('{kind}', 3, {{}}, root=Path(sys.argv[1]))))")
    there = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert here == there


def test_seed_and_overrides_change_the_bytes(tmp_path):
    h = {checkpoints.checkpoint_hash(checkpoints.build(k, s, ov, root=tmp_path))
         for k, ov in VARIANTS for s in (0, 1)}
    assert len(h) == 2 * len(VARIANTS)


def test_concurrent_builds_are_atomic(tmp_path):
    with ThreadPoolExecutor(4) as ex:
        paths = list(ex.map(lambda _: checkpoints.build("qwen3-target", 5, {}, root=tmp_path), range(8)))
    assert len(set(paths)) == 1
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_bad_kind_and_bad_override_are_named(tmp_path):
    with pytest.raises(KeyError, match="unknown checkpoint kind 'gemma5'"):
        checkpoints.build("gemma5", 0, {}, root=tmp_path)
    with pytest.raises(KeyError, match="hiden_size"):
        checkpoints.build("qwen3-target", 0, {"hiden_size": 32}, root=tmp_path)


def test_norms_and_layer_scalars_are_randomized(tmp_path):
    from safetensors.numpy import load_file

    t = load_file(str(checkpoints.build("gemma4-target", 0, {}, root=tmp_path) / "model.safetensors"))
    for name in ("model.layers.0.layer_scalar", "model.layers.2.input_layernorm.weight", "model.norm.weight"):
        assert len(set(t[name].tolist())) == t[name].size and (t[name] != 1).all(), name


@pytest.mark.parametrize("kind,ov", TARGETS)
def test_mlx_lm_loads_it_strictly(kind, ov, tmp_path):
    from mlx_lm.utils import load_model

    model, config = load_model(Path(checkpoints.build(kind, 0, ov, root=tmp_path)), strict=True)
    assert config["model_type"] in ("gemma4_text", "qwen3")


@pytest.mark.parametrize("kind,ov", DRAFTERS)
def test_port_loads_every_drafter_kind(kind, ov, tmp_path):
    from spec_parity.port import assistant

    d = assistant.load(checkpoints.build(kind, 0, ov, root=tmp_path))
    assert d.head == ("tied" if ov.get("use_ordered_embeddings") is False else "centroid")


def test_agreeing_target_greedy_walks_its_permutation(tmp_path):
    import mlx.core as mx

    from spec_parity.port import targets
    f = checkpoints.agreeing.agreement(0, 0.6).f
    t = targets.load(checkpoints.build("gemma4-target-agreeing", 0, {}, root=tmp_path))
    prompt = [5, 9, 17, 33, 40]
    tokens, logits = targets.greedy(t, mx.array([prompt]), 30, set())
    expect = [int(f[prompt[-1]])]
    while len(expect) < 30:
        expect.append(int(f[expect[-1]]))
    assert tokens == expect
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    assert float(mx.min(top2[:, 1] - top2[:, 0])) > 3.0


@pytest.mark.oracle
@pytest.mark.parametrize("kind,ov", TARGETS + DRAFTERS)
def test_transformers_loads_it_with_no_missing_or_unexpected_keys(kind, ov, tmp_path, live_oracle):
    live_oracle("targets")
    from transformers import AutoModelForCausalLM

    path = checkpoints.build(kind, 0, ov, root=tmp_path)
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert json.loads((path / "config.json").read_text())["architectures"]

"""The tiny checkpoint factory: deterministic bytes, atomic creation, loadable by the real loaders."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from spec_parity import checkpoints
from spec_parity.pairs.targets import GEMMA4

VARIANTS = [("gemma4-target", ov) for ov in GEMMA4.values()] + [("qwen3-target", {})]


def test_same_arguments_same_bytes_in_another_process(tmp_path):
    here = checkpoints.checkpoint_hash(checkpoints.build("gemma4-target", 3, {}, root=tmp_path / "a"))
    code = ("import sys; from pathlib import Path; from spec_parity import checkpoints as c; "
            "print(c.checkpoint_hash(c.build('gemma4-target', 3, {}, root=Path(sys.argv[1]))))")
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


@pytest.mark.parametrize("kind,ov", VARIANTS)
def test_mlx_lm_loads_it_strictly(kind, ov, tmp_path):
    from mlx_lm.utils import load_model

    model, config = load_model(Path(checkpoints.build(kind, 0, ov, root=tmp_path)), strict=True)
    assert config["model_type"] in ("gemma4_text", "qwen3")


@pytest.mark.oracle
@pytest.mark.parametrize("kind,ov", VARIANTS)
def test_transformers_loads_it_with_no_missing_or_unexpected_keys(kind, ov, tmp_path, live_oracle):
    live_oracle("targets")
    from transformers import AutoModelForCausalLM

    path = checkpoints.build(kind, 0, ov, root=tmp_path)
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert json.loads((path / "config.json").read_text())["architectures"]

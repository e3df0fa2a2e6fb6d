"""Config and tensor mutations of the factory's checkpoints, and the property each must satisfy:
our load (the CLI's `check_dir`, then the family's loader, then `check_pairing` for a pair)
refuses the mutated checkpoint with one line naming the file and the key or tensor. Each
`check_*` is a plain function (an AssertionError when the property fails) so the hypothesis tests
and the planted-bug controls of tests/test_checkpoint_properties.py run the same code."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from spec_parity import checkpoints
from spec_parity.port import assistant, checkpoint, dflash, dspark, targets

# family -> (kind, overrides, loader, its error, the target kind it pairs with, the pair check)
FAMILIES = {
    "assistant": ("gemma4-assistant", {}, assistant.load, assistant.DrafterError, "gemma4-target", "assistant"),
    "dspark": ("dspark-drafter", {}, dspark.load, dspark.DSparkError, "gemma4-target", "dspark"),
    "dflash": ("dflash-drafter", {}, dflash.load, dflash.DFlashError, "qwen3-target", "dflash"),
    "qwen3": ("qwen3-target", {}, targets.load, ValueError, None, None),
    "gemma4": ("gemma4-target", {}, targets.load, ValueError, None, None),
}
PAIR_CHECKS = {"assistant": lambda: assistant.check_pairing, "dspark": lambda: dspark.check_pairing,
               "dflash": lambda: dflash.check_pairing}
# Where a key of each family may be moved to (DFlash: dflash_config <-> top level; the assistant:
# text_config -> top level; DSpark: top level -> a nested dflash_config, DFlash's place for it).
NEST = {"assistant": "text_config", "dflash": "dflash_config", "dspark": "dflash_config"}


def base(family: str) -> Path:
    kind, overrides, *_ = FAMILIES[family]
    return checkpoints.build(kind, 0, overrides)


def config(family: str) -> dict:
    return json.loads((base(family) / "config.json").read_text())


def tensors(family: str) -> dict[str, np.ndarray]:
    return load_file(str(base(family) / "model.safetensors"))


def required_keys(family: str) -> list[str]:
    """The REQUIRED row of the family, as key paths (an `a|b` row as its first spelling)."""
    return list(checkpoint.REQUIRED[checkpoint.family(config(family))])


@contextmanager
def mutated(family: str, edit_config=None, edit_tensors=None):
    """A temp copy of the family's base checkpoint, its config and tensors edited in place."""
    tmp = Path(tempfile.mkdtemp(prefix=f"mut-{family}-"))
    try:
        cfg = copy.deepcopy(config(family))
        t = tensors(family)
        if edit_config:
            edit_config(cfg)
        if edit_tensors:
            edit_tensors(t)
        (tmp / "config.json").write_text(json.dumps(cfg))
        save_file(t, str(tmp / "model.safetensors"))
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def our_load(family: str, path: Path):
    checkpoint.check_dir(path, "--checkpoint")
    return FAMILIES[family][2](path)


def _refused(family: str, path: Path, names: tuple[str, ...], what: str, file: str = "") -> str:
    """Refused with one line naming `path` (or its file `file`: a tensor's refusal names the
    safetensors file) and one of `names`."""
    errors = (checkpoint.CheckpointError, FAMILIES[family][3])
    try:
        our_load(family, path)
    except errors as e:
        msg = str(e)
    except Exception as e:  # a traceback-type error: not the one-line refusal the property asks for
        raise AssertionError(f"{what}: refused with {type(e).__name__} ({e}), not a one-line load error") from None
    else:
        raise AssertionError(f"{what}: loaded without an error")
    assert "\n" not in msg, f"{what}: a multi-line message: {msg!r}"
    assert str(path / file) in msg, f"{what}: the message names no file ({path / file}): {msg!r}"
    assert any(n in msg for n in names), f"{what}: the message names none of {names}: {msg!r}"
    return msg


def _pop(cfg: dict, key: str):
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    return node.pop(leaf)


def _leaf(key: str) -> str:
    return key.split("|")[0].split(".")[-1]


def check_key_removed(family: str, key: str) -> None:
    """A required key removed (both spellings of an `a|b` row)."""
    def edit(cfg):
        for alt in key.split("|"):
            if checkpoint._has(cfg, alt):
                _pop(cfg, alt)

    with mutated(family, edit) as p:
        _refused(family, p, (_leaf(key),), f"{family}: {key} removed")


def check_key_renamed(family: str, key: str, spelling: str) -> None:
    """A required key under another name (a typo, camelCase, a suffix): the original is missing."""
    def edit(cfg):
        alt = next((a for a in key.split("|") if checkpoint._has(cfg, a)), None)
        if alt is None:
            return
        value = _pop(cfg, alt)
        node = cfg
        for part in alt.split(".")[:-1]:
            node = node[part]
        node[spelling.format(_leaf(alt))] = value

    with mutated(family, edit) as p:
        _refused(family, p, (_leaf(key),), f"{family}: {key} renamed to {spelling.format(_leaf(key))}")


def check_key_moved(family: str, key: str) -> None:
    """A required key moved between nesting levels: out of its nest to the top level, or from the
    top level into the family's nest."""
    nest = NEST.get(family)

    def edit(cfg):
        alt = next((a for a in key.split("|") if checkpoint._has(cfg, a)), None)
        if alt is None or nest is None:
            return
        value = _pop(cfg, alt)
        if "." in alt:
            cfg[_leaf(alt)] = value
        else:
            cfg.setdefault(nest, {})[alt] = value

    with mutated(family, edit) as p:
        _refused(family, p, (_leaf(key),), f"{family}: {key} moved")


def check_tensor_extra(family: str, name: str) -> None:
    """A tensor the model has no place for."""
    def edit(t):
        t[name] = np.zeros((4, 4), np.float32)

    with mutated(family, edit_tensors=edit) as p:
        _refused(family, p, (name,), f"{family}: extra tensor {name}", "model.safetensors")


def check_tensor_missing(family: str, name: str) -> None:
    with mutated(family, edit_tensors=lambda t: t.pop(name)) as p:
        _refused(family, p, (name,), f"{family}: tensor {name} missing", "model.safetensors")


def check_tensor_misshaped(family: str, name: str) -> None:
    """A tensor with one more row than the config implies."""
    def edit(t):
        a = t[name]
        t[name] = np.concatenate([a, a[:1]]) if a.ndim else a

    with mutated(family, edit_tensors=edit) as p:
        _refused(family, p, (name,), f"{family}: tensor {name} misshaped", "model.safetensors")


# A pair mismatch: the drafter built for a target with these overrides (or drafter overrides),
# paired with the base target; the message must name the dimension.
PAIR_MISMATCHES = {
    "assistant": {
        "hidden": ({"backbone_hidden_size": 96}, ("backbone_hidden_size", "hidden")),
        "vocab": ({"text_config": {"vocab_size": 256}}, ("vocab",)),
        "head dims": ({"text_config": {"head_dim": 8}}, ("head dims", "head_dim")),
        "global head dim": ({"text_config": {"global_head_dim": 16}}, ("head dims", "global_head_dim")),
        "sliding window": ({"text_config": {"sliding_window": 16}}, ("sliding_window",)),
    },
    "dspark": {
        "hidden": ({"target_overrides": {"hidden_size": 96}}, ("hidden",)),
        "vocab": ({"target_overrides": {"vocab_size": 256}}, ("vocab",)),
        "depth": ({"target_overrides": {"num_hidden_layers": 8,
                                        "layer_types": ["sliding_attention", "full_attention"] * 4}}, ("layer",)),
        "tap on the final layer": ({"target_layer_ids": [1, 2, 5]}, ("target_layer_ids", "final layer")),
    },
    "dflash": {
        "hidden": ({"target_overrides": {"hidden_size": 96}}, ("hidden",)),
        "vocab": ({"target_overrides": {"vocab_size": 256}}, ("vocab",)),
        "depth": ({"target_overrides": {"num_hidden_layers": 8}}, ("layer",)),
        "tap on the final layer": ({"target_layer_ids": [1, 3, 5]}, ("target_layer_ids",)),
    },
}


def check_pair_mismatch(family: str, dim: str) -> None:
    kind, _, load, error, target_kind, _ = FAMILIES[family]
    overrides, names = PAIR_MISMATCHES[family][dim]
    drafter_dir = checkpoints.build(kind, 0, overrides)
    target = targets.load(checkpoints.build(target_kind, 0))
    what = f"{family}: pair mismatch ({dim})"
    try:
        PAIR_CHECKS[family]()(load(drafter_dir), target)
    except error as e:
        msg = str(e)
    else:
        raise AssertionError(f"{what}: paired without an error")
    assert "\n" not in msg, f"{what}: a multi-line message: {msg!r}"
    assert str(drafter_dir / "config.json") in msg, f"{what}: the message names not the drafter's config.json: {msg!r}"
    assert any(n in msg for n in names), f"{what}: the message names none of {names}: {msg!r}"


# Keys a loader reads with a default (or not at all): a mutation of one may load, and then the
# port must compute what the reference computes on the same files, at the case's tier.
OPTIONAL = {
    "assistant": ("use_ordered_embeddings", "num_centroids", "centroid_intermediate_top_k", "tie_word_embeddings",
                  "text_config.final_logit_softcapping", "text_config.rms_norm_eps",
                  "text_config.num_key_value_heads", "text_config.attention_k_eq_v", "text_config.global_head_dim",
                  "text_config.num_kv_shared_layers", "text_config.max_position_embeddings"),
    "dflash": ("block_size", "dflash_config.block_size", "dflash_config.output_multiplier",
               "dflash_config.input_embedding_scale", "rms_norm_eps", "sliding_window", "layer_types",
               "max_window_layers", "use_sliding_window", "tie_word_embeddings", "max_position_embeddings"),
    "dspark": ("markov_head_type", "confidence_head_with_markov", "rms_norm_eps",
               "final_logit_softcapping", "attention_k_eq_v", "num_global_key_value_heads", "layer_types",
               "sliding_window", "tie_word_embeddings", "num_anchors"),
}
# markov_head_type and confidence_head_with_markov are required only when markov_rank > 0 /
# enable_confidence_head (spec_parity.port.checkpoint.REQUIRED_WHEN, DeepSpec's rule); the factory's base
# DSpark drafter turns both on, so their mutations must be refused.
# The harness case each family's mutation is compared on (its drafter replaced by the mutated one).
CASES = {"assistant": "step-gemma4-centroid-optiq", "dflash": "mod-gemma4", "dspark": "mod-gemma4"}


def _edit_key(cfg: dict, family: str, key: str, op: str) -> None:
    if not checkpoint._has(cfg, key):
        return
    value = _pop(cfg, key)
    leaf = _leaf(key)
    if op == "moved":
        if "." in key:
            cfg[leaf] = value
        else:
            cfg.setdefault(NEST[family], {})[leaf] = value
    elif op == "renamed":
        node = cfg
        for part in key.split(".")[:-1]:
            node = node[part]
        node[leaf + "_"] = value


def check_optional_key(family: str, key: str, op: str) -> str:
    """An optional key removed, moved or renamed: refused by name, or port == reference at the
    tier of the family's case. Returns which."""
    from dataclasses import replace

    from spec_parity import harness

    case = next(c for c in harness.all_cases([family]) if c.name == CASES[family])
    src = case.drafter_dir()
    what = f"{family}: {key} {op}"
    tmp = Path(tempfile.mkdtemp(prefix=f"opt-{family}-"))
    try:
        cfg = json.loads((src / "config.json").read_text())
        _edit_key(cfg, family, key, op)
        (tmp / "config.json").write_text(json.dumps(cfg))
        shutil.copy(src / "model.safetensors", tmp / "model.safetensors")
        try:
            our_load(family, tmp)
        except (checkpoint.CheckpointError, FAMILIES[family][3]) as e:
            msg = str(e)
            assert "\n" not in msg and str(tmp) in msg and (_leaf(key) in msg or "tensor" in msg), \
                f"{what}: refused as {msg!r}"
            return "refused"
        try:
            r = harness.evaluate(replace(case, name=f"{case.name}-{op}-{_leaf(key)}",
                                         params=replace(case.params, drafter_path=str(tmp))), "live")
        except Exception as e:  # the port read it; the reference could not
            raise AssertionError(f"{what}: loaded, and the reference stops on {type(e).__name__}: {e}") from None
        assert r.ok, f"{what}: loaded, and port vs reference gives {r.verdict}: {r.message()}"
        return "agrees"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""Reading a checkpoint directory: one path for every port, and the checks that run before any
loader (ours, mlx-lm, transformers, optiq, z-lab, DeepSpec) sees the files.

Every parameter the model declares must come from the checkpoint: a missing one would silently
keep its initial value, so it is an error naming the tensors and what to check. A config.json
missing a key the architecture depends on is refused before a loader can default it: loaders
default such keys differently (a Qwen3 rope_theta: transformers' Qwen3Config 1e4, port/dspark.py
1e6), so a defaulted key is a silent difference, not a checkpoint.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as it stands: the message names the file (and
    key or tensor) and the fix."""


# The keys each family's config.json must carry (a|b: either). Per family: the keys our loader
# reads without a default (it would stop mid-run on a KeyError) and the architecture keys that
# the loaders default differently, so that a missing one would compute another model:
#   targets   port/targets.py and mlx-lm's ModelArgs (qwen3: its fields without a default;
#             gemma4_text has a default for every field, transformers another for some)
#   assistant port/assistant.py ModelArgs.from_config (the text_config keys read with []); the
#             centroid head's num_centroids / top-k (transformers defaults 2048 / 32, optiq and the
#             port 0; tests/test_checkpoint_properties.py shows the difference)
#   dspark    port/dspark.py ModelArgs.from_config; num_anchors, markov_rank and enable_confidence_head,
#             which DeepSpec's DSpark models assert (modeling/dspark/*/modeling.py, required_fields)
#   dflash    port/dflash.py ModelArgs.from_config (it checks the same list itself); rms_norm_eps and
#             max_position_embeddings, which z-lab MLX's (mlx-lm's) qwen3 ModelArgs read without a default
_SIZES = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
REQUIRED: dict[str, tuple[str, ...]] = {
    "qwen3": (*_SIZES, "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
              "tie_word_embeddings", "rope_theta|rope_parameters"),
    "gemma4_text": (*_SIZES, "num_key_value_heads", "head_dim", "global_head_dim", "layer_types",
                    "sliding_window", "rope_parameters", "rms_norm_eps", "max_position_embeddings"),
    "assistant": ("model_type", "backbone_hidden_size", "text_config", "text_config.hidden_size",
                  "text_config.intermediate_size", "text_config.num_hidden_layers",
                  "text_config.num_attention_heads", "text_config.head_dim", "text_config.layer_types",
                  "text_config.sliding_window", "text_config.vocab_size", "text_config.rope_parameters",
                  "num_centroids", "centroid_intermediate_top_k"),
    "dspark-gemma4": (*_SIZES, "num_key_value_heads", "global_head_dim", "block_size", "mask_token_id",
                      "target_layer_ids", "num_target_layers", "num_anchors", "markov_rank", "enable_confidence_head",
                      "rope_parameters"),
    "dspark-qwen3": (*_SIZES, "num_key_value_heads", "head_dim", "block_size", "mask_token_id",
                     "target_layer_ids", "num_target_layers", "num_anchors", "markov_rank", "enable_confidence_head",
                     "rope_theta|rope_parameters"),
    "dflash": (*_SIZES, "num_key_value_heads", "head_dim", "num_target_layers", "dflash_config",
               "dflash_config.target_layer_ids", "dflash_config.mask_token_id", "rms_norm_eps",
               "max_position_embeddings", "rope_theta|rope_parameters"),
}
# Keys required only when another key turns their part on, as DeepSpec's DSpark models assert
# them: (key, the key that turns it on, the values it takes). Neither has a default in DeepSpec's
# config class; the port's would be a silent choice of head (a vanilla Markov head).
_DSPARK_WHEN = (("markov_head_type", "markov_rank", "vanilla, gated or rnn"),
                ("confidence_head_with_markov", "enable_confidence_head", "true or false"))
REQUIRED_WHEN: dict[str, tuple[tuple[str, str, str], ...]] = {
    "dspark-gemma4": _DSPARK_WHEN, "dspark-qwen3": _DSPARK_WHEN, "dflash-extension": _DSPARK_WHEN}
LABELS = {"qwen3": "Qwen3 target", "gemma4_text": "Gemma-4 target", "assistant": "Gemma-4 assistant",
          "dspark-gemma4": "DeepSpec DSpark (Gemma-4)", "dspark-qwen3": "DeepSpec DSpark (Qwen3)",
          "dflash": "z-lab DFlash", "dflash-extension": "DSpark-on-DFlash"}
TARGETS = ("qwen3", "gemma4_text")
ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
EXTRAS = ("markov_rank", "enable_confidence_head")   # a DFlash config declaring the DSpark extras


def family(cfg: dict) -> str | None:
    """The REQUIRED row a config belongs to, from its architectures / model_type; None if unknown."""
    arch = cfg.get("architectures") or []
    if "DFlashDraftModel" in arch or "DFlash2DraftModel" in arch:
        return "dflash"
    if "Gemma4DSparkModel" in arch:
        return "dspark-gemma4"
    if "Qwen3DSparkModel" in arch:
        return "dspark-qwen3"
    if cfg.get("model_type") in ASSISTANT_TYPES:
        return "assistant"
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return text.get("model_type") if text.get("model_type") in TARGETS else None


def drafter_kind(cfg: dict) -> str | None:
    """assistant, dspark, dflash or dflash-extension (a DFlash drafter declaring the DSpark extras);
    None for a config that is no drafter the ports read."""
    f = family(cfg)
    if f in ("assistant", "dflash"):
        nested = cfg.get("dflash_config") or {}
        return "dflash-extension" if f == "dflash" and any(nested.get(k, cfg.get(k)) for k in EXTRAS) else f
    return "dspark" if f and f.startswith("dspark") else None


def _has(cfg: dict, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def read_config(path: Path) -> dict:
    """config.json as a dict, or a CheckpointError naming the file."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{f}: missing; point at the checkpoint directory "
                              "(the folder holding config.json and *.safetensors)")
    try:
        cfg = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}); restore the checkpoint's config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: holds a {type(cfg).__name__}, not a JSON object; restore the checkpoint's config.json")
    return cfg


def check_safetensors(f: Path) -> dict:
    """The file's header parses and its tensors end where the file ends (a truncated download or
    a file of another format is named before a loader reads it). Returns the header."""
    fix = "re-download or re-save the checkpoint"
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{f}: not a safetensors file ({size} bytes, no header); {fix}")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise CheckpointError(f"{f}: not a safetensors file (header length {n} > file size {size}); {fix}")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{f}: not a safetensors file (its header is not JSON); {fix}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: not a safetensors file (its header is not a JSON object); {fix}")
    ends = [t["data_offsets"][1] for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict) and len(t.get("data_offsets") or ()) == 2]
    want = 8 + n + max(ends, default=0)
    if want != size:
        what = "truncated" if want > size else "has trailing bytes"
        raise CheckpointError(f"{f}: {what}: its header needs {want} bytes, the file has {size}; {fix}")
    return header


def check_dir(path: str | Path, role: str, families: tuple[str, ...] | None = None) -> str:
    """Refuse a checkpoint directory that no loader should see, with one line naming the file and
    the fix: missing, no or broken config.json, a required key missing, a broken safetensors. Returns
    its family (a REQUIRED key). role names the option (--target) in messages; families, if given,
    are the ones this role takes."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{role} {p}: {'not a directory' if p.exists() else 'no such directory'}; "
                              "give the checkpoint directory (the folder holding config.json)")
    cfg = read_config(p)
    fam = family(cfg)
    if fam is None or (families is not None and fam not in families):
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        seen = (f"model_type {cfg.get('model_type')!r}"
                + (f" (text_config {text.get('model_type')!r})" if text.get("model_type") else "")
                + f", architectures {cfg.get('architectures')}")
        what = f"a {LABELS[fam]} checkpoint, not a {role} one" if fam else "not a checkpoint spec-parity reads"
        raise CheckpointError(f"{p / 'config.json'}: {seen}: {what}; {role} takes a "
                              f"{' or '.join(LABELS[f] for f in families or REQUIRED)}")
    text_level = cfg["text_config"] if fam in TARGETS and isinstance(cfg.get("text_config"), dict) else cfg
    missing = [k for k in REQUIRED[fam] if not any(_has(text_level, alt) for alt in k.split("|"))]
    if missing:
        where = " in text_config" if text_level is not cfg else ""
        keys = ", ".join(k.replace("|", " (or ") + ")" * ("|" in k) for k in missing)
        raise CheckpointError(f"{p / 'config.json'}: this {LABELS[fam]} config lacks {keys}{where}; add it as "
                              "the checkpoint was trained (loaders would default it, each differently)")
    check_required_when(cfg, p, fam)
    check_layer_types(cfg, p, fam)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{p}: no *.safetensors beside config.json; copy the checkpoint's weights there")
    for f in files:
        check_safetensors(f)
    check_index(p)
    return fam


# The layer patterns the references and the port run alike, per family: (key, the layer types
# allowed, whether the last layer must be full_attention, the fix). mlx-lm's Gemma-4 masks know only the
# two types (any other is a KeyError); transformers' Gemma4TextConfig (the target's, and the
# assistant's text_config) rewrites a last layer that is not full_attention to full_attention with
# a warning, while mlx-lm and optiq run it as given; DeepSpec's Qwen3 DSpark attends a
# sliding_attention layer through its window under flash attention and through none under sdpa,
# the port through none (DeepSpec's build_draft_config writes full_attention for every draft
# layer). z-lab DFlash's layer_types are checked by port/dflash.py as z-lab checks them.
_TYPES = ("sliding_attention", "full_attention")
_AS_TRAINED = "set each entry to the type the layer was trained as"
LAYER_PATTERNS: dict[str, tuple[str, tuple[str, ...], bool, str]] = {
    "gemma4_text": ("layer_types", _TYPES, True, _AS_TRAINED),
    "assistant": ("text_config.layer_types", _TYPES, True, _AS_TRAINED),
    "dspark-qwen3": ("layer_types", ("full_attention",), False,
                     "set every entry to full_attention, as DeepSpec's build_draft_config writes it (DeepSpec "
                     "windows a sliding_attention layer under flash attention only, the port never)"),
}


def check_gemma4_kv(cfg: dict, path: Path) -> None:
    """Refuse a Gemma-4 K/V layout transformers cannot build: mlx-lm builds the first its own way
    and fails on the second with a bare KeyError, so no reference defines either."""
    level = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    where = "text_config." if level is not cfg else ""
    f = Path(path) / "config.json"
    if level.get("attention_k_eq_v") and level.get("num_global_key_value_heads") is None:
        raise CheckpointError(f"{f}: {where}attention_k_eq_v is set without {where}num_global_key_value_heads; "
                              "transformers cannot build the full layers without it (mlx-lm falls back to "
                              "num_key_value_heads): set it to the full layers' K/V head count")
    heads = level.get("num_attention_heads")
    for key in ("num_key_value_heads", "num_global_key_value_heads"):
        kv = level.get(key)
        if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
            raise CheckpointError(f"{f}: {where}num_attention_heads {heads} is not a multiple of {where}{key} {kv}; "
                                  "grouped-query attention needs whole groups (transformers and MLX refuse it): "
                                  "fix the head counts")
    types, shared = level.get("layer_types"), level.get("num_kv_shared_layers") or 0
    if isinstance(types, list) and isinstance(shared, int) and 0 < shared < len(types):
        owners = types[: len(types) - shared]
        missing = sorted(set(types[len(owners):]) - set(owners))
        if missing:
            raise CheckpointError(f"{f}: {where}num_kv_shared_layers {shared} shares {missing} K/V that none of "
                                  f"layers 0-{len(owners) - 1} owns; neither transformers nor mlx-lm builds it: "
                                  "lower num_kv_shared_layers, or let an earlier layer of that type own K/V")


def check_layer_types(cfg: dict, path: Path, fam: str) -> None:
    """Refuse a layer pattern the references would not run as written (LAYER_PATTERNS), naming
    config.json, the key and the fix."""
    if fam not in LAYER_PATTERNS:
        return
    key, allowed, last_full, fix = LAYER_PATTERNS[fam]
    level = cfg["text_config"] if fam == "gemma4_text" and isinstance(cfg.get("text_config"), dict) else cfg
    where = ("text_config." if level is not cfg else "") + key
    *parents, leaf = key.split(".")
    for part in parents:
        level = level.get(part) if isinstance(level, dict) else None
    node = level.get(leaf) if isinstance(level, dict) else None
    if node is None:
        return
    size = level.get("num_hidden_layers")
    f = Path(path) / "config.json"
    if not isinstance(node, list) or any(t not in allowed for t in node):
        bad = sorted({t for t in node if t not in allowed}) if isinstance(node, list) else node
        raise CheckpointError(f"{f}: {where} holds {bad!r}; this {LABELS[fam]} runs only {' and '.join(allowed)} "
                              f"layers in the references and the port; {fix}")
    if isinstance(size, int) and len(node) != size:
        raise CheckpointError(f"{f}: {where} has {len(node)} entries for num_hidden_layers {size}; give one "
                              "entry per layer, as transformers' config classes require")
    if last_full and node and node[-1] != "full_attention":
        raise CheckpointError(f"{f}: {where}[-1] is {node[-1]!r}; transformers' Gemma4TextConfig forces the last "
                              "layer to full_attention while mlx-lm and optiq run it as written: the references would "
                              "compute two different models; a Gemma-4 model's last layer is full_attention: "
                              f"set {where}[-1] to \"full_attention\" if that is how it was trained, else no "
                              "reference runs this checkpoint")


INDEX = "model.safetensors.index.json"


def check_index(path: Path) -> None:
    """A sharded checkpoint's index names only shards that are there (a shard missing from a
    download is named before a loader reads the others)."""
    f = Path(path) / INDEX
    if not f.is_file():
        return
    try:
        shards = set(json.loads(f.read_text())["weight_map"].values())
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{f}: not a safetensors index (a JSON object with a weight_map); "
                              "re-download or re-save the checkpoint") from None
    missing = sorted(s for s in shards if not (Path(path) / s).is_file())
    if missing:
        raise CheckpointError(f"{f}: names shard(s) {missing[:3]} that are not in {path}; download every shard "
                              "the index lists")


def files(path: Path) -> list[Path]:
    """The files that make the checkpoint: config.json, the shard index if any, and every
    *.safetensors (one model.safetensors or its shards), in a fixed order."""
    path = Path(path)
    index = [path / INDEX] if (path / INDEX).is_file() else []
    return [path / "config.json", *index, *sorted(path.glob("*.safetensors"))]


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def stored_dtype(path: Path) -> str:
    """The dtype the checkpoint's floating tensors are stored in, read off the safetensors
    headers ("bfloat16"; several: "bfloat16+float32", the most bytes first)."""
    size: dict[str, int] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, t in check_safetensors(f).items():
            if k != "__metadata__" and isinstance(t, dict) and str(t.get("dtype")).startswith(("F", "BF")):
                name = _DTYPES.get(t["dtype"], t["dtype"].lower())
                size[name] = size.get(name, 0) + t["data_offsets"][1] - t["data_offsets"][0]
    return "+".join(sorted(size, key=lambda k: -size[k])) or "float32"


def check_required_when(cfg: dict, path: Path, fam: str) -> None:
    """Refuse a config whose part is turned on (markov_rank > 0) without the key that shapes it
    (markov_head_type), naming config.json, both keys and the fix (REQUIRED_WHEN)."""
    for key, on, values in REQUIRED_WHEN.get(fam, ()):
        if cfg.get(on) and key not in cfg:
            raise CheckpointError(f"{Path(path) / 'config.json'}: {on} is {json.dumps(cfg[on])}, so this {LABELS[fam]} "
                                  f"config needs {key} ({values}), as DeepSpec asserts; add it as the checkpoint "
                                  "was trained (the port would default it)")


def read_tensors(path: Path, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
    """Every tensor of the checkpoint (model.safetensors or its shards); `dtype`: floating ones
    cast to it (the dtype the run computes at; None: as stored)."""
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            check_safetensors(f)  # names what is wrong with the file, if it can
            raise CheckpointError(f"{f}: cannot be read as safetensors ({e}); re-download or re-save the checkpoint") from e
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    return weights


def _tensor_names(f: Path) -> set[str]:
    with safe_open(str(f), "numpy") as fh:
        return set(fh.keys())


def tensor_file(path: Path, name: str, pattern: str = "*.safetensors") -> Path:
    """The safetensors file of `path` holding tensor `name` (or the one key ending like it: mlx-lm's
    sanitize may drop a prefix of the file's key), or the shard the index assigns it to, or the
    only file; else the directory. Error messages name it."""
    path = Path(path)
    files = {f.name: _tensor_names(f) for f in sorted(Path(path).glob(pattern))}
    tail = "." + name.partition(".")[2]
    for match in (lambda k: k == name, lambda k: k.endswith("." + name) or k.endswith(tail)):
        held = [f for f, keys in files.items() if any(match(k) for k in keys)]
        if len(held) == 1:
            return path / held[0]
    index = path / INDEX
    if index.is_file():
        shard = json.loads(index.read_text()).get("weight_map", {}).get(name)
        if shard:
            return path / shard
    return path / next(iter(files)) if len(files) == 1 else path


def config_of(drafter) -> str:
    """The drafter's config.json, for pairing messages (a drafter built in memory names none)."""
    return str(getattr(drafter, "config_file", None) or "the drafter's config.json")


def weights_bytes(path: Path) -> int:
    """On-disk size of the safetensors: the provider's admission accounting."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def load_into(model, path: Path, weights: dict[str, mx.array], error: type[Exception],
              hint: str | Callable[[list[str]], str], unused: tuple[str, ...] = ()) -> None:
    """Load `weights` into `model` strictly; `hint(missing)` (or a string) says what to check.
    Every tensor is consumed: one the model has no parameter for is refused by name (a head or a
    layer the port would silently not compute), except under the prefixes in `unused`, which the
    caller leaves out on purpose as its reference does (e.g. the DSpark extras with extras off)."""
    params = dict(tree_flatten(model.parameters()))
    expected = set(params)
    missing = sorted(expected - set(weights))
    if missing:
        what = hint(missing) if callable(hint) else hint
        raise error(f"{tensor_file(path, missing[0])}: missing tensor(s) {missing[:6]}{' …' if len(missing) > 6 else ''}; {what}")
    extra = sorted(k for k in set(weights) - expected if not (unused and k.startswith(unused)))
    if extra:
        raise error(f"{tensor_file(path, extra[0])}: tensor(s) {extra[:6]}{' …' if len(extra) > 6 else ''} have no place in this "
                    f"port's model; remove them, or fix the config.json keys that declare that part")
    wrong = sorted(k for k in expected if tuple(weights[k].shape) != tuple(params[k].shape))
    if wrong:
        got = ", ".join(f"{k} {list(weights[k].shape)} (expected {list(params[k].shape)})" for k in wrong[:3])
        raise error(f"{tensor_file(path, wrong[0])}: tensor(s) of the wrong shape: {got}{' …' if len(wrong) > 3 else ''}; "
                    "fix the config.json keys that size them, or re-save the checkpoint")
    model.load_weights([(k, v) for k, v in weights.items() if k in expected], strict=True)

"""Target models on the MLX side: mlx-lm's own classes, opened up for parity.

We do not re-write the targets. This file loads them with mlx-lm's loader and walks mlx-lm's
decoder layers one by one so every hidden state (the drafters' taps) and the donor K/V the
Gemma-4 assistant borrows can be read off. The walk is checked bit-exact against mlx-lm's own
`model(ids)` (tests/test_targets.py), so it adds no arithmetic of its own.

Hidden-state convention (same as transformers' `output_hidden_states`, except the last entry):
`hidden[0]` = the input to layer 0 (Gemma-4: the √H-scaled embedding), `hidden[i+1]` = the raw
output of decoder layer i; `final` = the final-normed output.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model

from . import checkpoint
from .compiled import VerifyCache, check_bucket

FAMILIES = {"gemma4_text": "gemma4", "qwen3": "qwen3"}


@dataclass
class Target:
    model: object
    config: dict
    family: str
    path: Path
    compiled: dict = field(default_factory=dict, repr=False, compare=False)  # fast paths' mx.compile'd calls

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]


@dataclass
class Trace:
    logits: mx.array
    hidden: list[mx.array]
    final: mx.array
    donors: dict[str, tuple[mx.array, mx.array]] = field(default_factory=dict)


class TargetError(ValueError):
    """A target checkpoint mlx-lm's loader refuses: one line naming the file, the tensor and the fix."""


def load(path: str | Path, dtype: mx.Dtype | None = None, lazy: bool = False) -> Target:
    """The target at `path` through mlx-lm's `load_model` (lazy: weights not read into memory, the
    CLI's preflight check of its tensors before the first case)."""
    path = Path(path)
    written = checkpoint.read_config(path)
    if written.get("model_type") == "gemma4_text":
        checkpoint.check_gemma4_kv(written, path)
    try:
        model, config = load_model(path, lazy=lazy)
    except ValueError as e:
        raise (_tensor_error(path, str(e)) or e) from e
    except FileNotFoundError as e:
        raise TargetError(f"{path}: no model*.safetensors, the only weight files mlx-lm's loader reads; rename "
                          "the weights model.safetensors (or model-0000i-of-0000n.safetensors shards)") from e
    family = FAMILIES.get(config.get("model_type"))
    if family is None:
        raise TargetError(f"{path / 'config.json'}: model_type {config.get('model_type')!r} is not a supported "
                          f"target; supported: {sorted(FAMILIES)}")
    checkpoint.check_layer_types(config, path, config["model_type"])
    if dtype is not None:
        model.set_dtype(dtype)
    return Target(model, config, family, path)


# mlx-lm's strict load_weights refusals, over several lines and naming no file
_EXTRA = re.compile(r"Received \d+ parameters not in model:\s*(.*)\.$", re.S)
_MISSING = re.compile(r"Missing \d+ parameters:\s*(.*)\.$", re.S)
_SHAPE = re.compile(r"Expected shape (\(.*?\)) but received shape (\(.*?\)) for parameter (\S+)$")


def _tensor_error(path: Path, msg: str) -> TargetError | None:
    """mlx-lm's refusal of a tensor as one line naming the safetensors file that holds it (or
    should), the tensor and the fix; None for another error."""
    where = functools.partial(checkpoint.tensor_file, path, pattern="model*.safetensors")
    if m := _SHAPE.search(msg.strip()):
        want, got, name = m.groups()
        return TargetError(f"{where(name)}: tensor {name} has shape {list(_shape(got))}, mlx-lm's "
                           f"model expects {list(_shape(want))}; fix the config.json keys that size it, or "
                           "re-save the checkpoint")
    for rx, what, fix in ((_EXTRA, "has no place in mlx-lm's model",
                           "remove it, or fix the config.json keys that declare that part"),
                          (_MISSING, "is missing (mlx-lm's model needs it)",
                           "re-download or re-save the complete checkpoint")):
        if m := rx.search(msg.strip()):
            names = [n.strip() for n in m.group(1).split(",") if n.strip()]
            more = f" (and {len(names) - 1} more: {names[1:4]}{' …' if len(names) > 4 else ''})" if len(names) > 1 else ""
            return TargetError(f"{where(names[0])}: tensor {names[0]}{more} {what}; {fix}")
    return None


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def donor_layers(target: Target) -> dict[str, int]:
    """The last sliding and last full attention layer that own K/V (not kv-shared); a kind no
    layer has is absent (a target of full layers only has no sliding donor)."""
    c = target.config
    owners = c["layer_types"][: c["num_hidden_layers"] - c.get("num_kv_shared_layers", 0)]
    return {kind.split("_")[0]: max(i for i, t in enumerate(owners) if t == kind)
            for kind in ("sliding_attention", "full_attention") if kind in owners}


def donor_view(target: Target, caches: list) -> dict[str, tuple[mx.array, mx.array]]:
    """The donor layers' K/V as their mlx-lm caches hold them, chronological (oldest first), keyed
    by layer type. Owner layers have one cache each, in layer order."""
    out = {}
    for name, layer in donor_layers(target).items():
        c = caches[layer]
        if c.keys is None:
            raise RuntimeError("the target cache is empty: prefill before drafting")
        if hasattr(c, "_temporal_order"):
            k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
            n = min(c.offset, k.shape[2])
            k, v = k[..., -n:, :], v[..., -n:, :]
        else:
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        out[f"{name}_attention"] = (k, v)
    return out


def embed_scaled(target: Target, tokens: mx.array) -> mx.array:
    """The target's input embedding of `tokens` [1, T] (Gemma-4: × √H, as the layers see it)."""
    tm = target.model.model
    e = tm.embed_tokens(tokens)
    return e * tm.embed_scale if hasattr(tm, "embed_scale") else e


def block_ids(first: int | mx.array, fill: int, n: int) -> mx.array:
    """[[first, fill x n]] (int32), a draft block's input ids, built by the device: `first` as a 4-byte
    scalar (or a scalar array already there) and the constant fill once per (fill, n). Not `mx.array` of the list: on MLX CUDA a
    host-filled buffer over 8 bytes is managed memory the GPU page-faults on when the embedding Gather
    reads it (H200: 100-280 us of device time per block instead of 3); scalars
    live in MLX's GPU-mapped scalar pool."""
    head = first.reshape(1, 1).astype(mx.int32) if isinstance(first, mx.array) else mx.array([[first]], mx.int32)
    return mx.concatenate([head, _filled(fill, n, str(mx.default_device()))], axis=1)


@lru_cache(maxsize=64)
def _filled(fill: int, n: int, device: str) -> mx.array:
    return mx.full((1, n), fill, mx.int32)


def first_index(mask: mx.array, default: int) -> mx.array:
    """The index of the first True of a 1-D bool mask, else `default`: an int32 scalar, on the device."""
    if not mask.shape[0]:
        return mx.array(default, mx.int32)
    return mx.where(mask, mx.arange(mask.shape[0]), default).min()


def verified_rows(tapped: list, accepted: int) -> mx.array:
    """The verify's tap rows a drafter's context keeps, concatenated: the pending token's and the
    accepted drafts' (the rejected drafts' rows never enter it)."""
    return mx.concatenate(tapped, axis=-1)[:, : accepted + 1]


def first_true(mask: mx.array, default: int) -> int:
    """first_index read as one 4-byte scalar (a `tolist` of the mask would put it in managed
    memory, see block_ids)."""
    return int(first_index(mask, default).item())


def head(target: Target, h: mx.array) -> mx.array:
    """Final-normed hidden -> logits (lm head or tied embedding, then the softcap)."""
    m = target.model
    logits = m.lm_head(h) if hasattr(m, "lm_head") else m.model.embed_tokens.as_linear(h)
    cap = target.config.get("final_logit_softcapping")
    return mx.tanh(logits / cap) * cap if cap else logits


def forward(target: Target, ids: mx.array, layer_inputs: list[mx.array] | None = None,
            caches: list | None = None) -> Trace:
    """One forward over `ids` [1, T], capturing every layer; with `caches` (mlx-lm's, from
    make_prompt_cache, or make_caches' VerifyCaches: each layer then attends over its whole buffer
    under the cache's mask) it appends to them, as a serve loop's prefill and verify do.

    With `layer_inputs` (teacher-forced mode) layer i runs on `layer_inputs[i]` instead of the
    previous layer's output, so its error against a reference is its own, not inherited.
    Donor K/V are read off only in an uncached forward (with caches, see `donor_view`).
    Tests may wrap this function; `walk` is the same forward, never wrapped, for compiled callers.
    """
    return walk(target, ids, layer_inputs, caches)


def walk(target: Target, ids: mx.array, layer_inputs: list[mx.array] | None = None,
         caches: list | None = None) -> Trace:
    """`forward`, never wrapped (port/fast/verify.py traces it)."""
    layers = _walk_gemma4 if target.family == "gemma4" else _walk_qwen3
    n = len(target.model.model.layers)
    caches = list(caches) + [None] * (n - len(caches)) if caches is not None else [None] * n
    hidden, donors = layers(target, ids, layer_inputs, caches)
    final = target.model.model.norm(hidden[-1])
    return Trace(head(target, final), hidden, final, donors)


def _walk_gemma4(target, ids, layer_inputs, caches):
    tm = target.model.model
    emb = tm.embed_tokens(ids)
    h = emb * tm.embed_scale
    per_layer = [None] * len(tm.layers)
    if tm.hidden_size_per_layer_input:
        pli = tm._project_per_layer_inputs(h, tm._get_per_layer_inputs(ids, emb))
        per_layer = [pli[:, :, i, :] for i in range(len(tm.layers))]
    masks = _bucket_masks(tm, h, caches[0]) if isinstance(caches[0], VerifyCache) else tm._make_masks(h, caches)
    shared = [(None, None)] * len(tm.layers)
    hidden = [h]
    for i, layer in enumerate(tm.layers):
        x = h if layer_inputs is None else layer_inputs[i]
        kvs, offset = shared[tm.previous_kvs[i]]
        h, kvs, offset = layer(x, masks[i], caches[i], per_layer_input=per_layer[i], shared_kv=kvs, offset=offset)
        shared[i] = (kvs, offset)
        hidden.append(h)
    donors = {} if caches[0] is not None else {name: shared[i][0] for name, i in donor_layers(target).items()}
    return hidden, donors


def _bucket_masks(tm, h, cache: VerifyCache) -> list:
    """Per layer, its type's mask over the bucketed buffers (every owner cache has the same offset
    and length, and a kv-shared layer attends over its owner's buffer)."""
    n, types = h.shape[1], {layer.layer_type for layer in tm.layers}
    by_type = {t: cache.mask(n, h.dtype, tm.window_size if t == "sliding_attention" else None) for t in types}
    return [by_type[layer.layer_type] for layer in tm.layers]


def _walk_qwen3(target, ids, layer_inputs, caches):
    tm = target.model.model
    h = tm.embed_tokens(ids)
    c = caches[0]
    mask = c.mask(h.shape[1], h.dtype) if isinstance(c, VerifyCache) else create_attention_mask(h, c)
    hidden = [h]
    for i, layer in enumerate(tm.layers):
        h = layer(h if layer_inputs is None else layer_inputs[i], mask, caches[i])
        hidden.append(h)
    return hidden, {}


def make_caches(target: Target, kv_bucket: int | None = None, strict: bool = True) -> list:
    """The request's caches: mlx-lm's own (None), or with `kv_bucket` one VerifyCache per cache
    mlx-lm would make (port/compiled.py: the bucketed verify). A sliding layer's VerifyCache keeps
    every row in time order and masks the window instead of rotating. A target whose caches the
    bucketed verify cannot replace is refused, or with `strict` off keeps mlx-lm's (the same
    computation, unbucketed: spec_parity.port.serve.generate's "auto")."""
    caches = make_prompt_cache(target.model)
    if check_bucket(kv_bucket, ValueError) is None:
        return caches
    for c in caches:
        if type(c) not in (KVCache, RotatingKVCache) or getattr(c, "keep", 0):
            if not strict:
                return caches
            raise ValueError(f"kv_bucket: the bucketed verify replaces mlx-lm's KVCache / RotatingKVCache (keep=0); "
                             f"this target makes a {type(c).__name__}{f' with keep={c.keep}' if getattr(c, 'keep', 0) else ''}: "
                             "use kv_bucket=None")
    return [VerifyCache(kv_bucket) for _ in caches]


def eos_ids(target: Target) -> set[int]:
    eos = target.config.get("eos_token_id")
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def greedy(target: Target, prompt: mx.array, n: int, eos: set[int] | None = None) -> tuple[list[int], mx.array]:
    """Plain greedy decoding with mlx-lm's caches (prefill, then one token per call), up to n
    tokens or EOS (kept, as transformers' generate keeps it).

    Returns the new tokens and the logits each was chosen from [len, V]."""
    model = target.model
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)[:, -1, :]
    tokens, steps = [], []
    eos = eos_ids(target) if eos is None else eos
    for _ in range(n):
        steps.append(logits[0, ...])
        tok = mx.argmax(logits, axis=-1)
        tokens.append(int(tok.item()))
        if tokens[-1] in eos:
            break
        logits = model(tok[:, None], cache=cache)[:, -1, :]
    return tokens, mx.stack(steps)

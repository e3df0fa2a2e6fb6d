"""Tiny z-lab DFlash drafters (`dflash==0.1.0`) in z-lab's on-disk format, for the tiny targets.

A DFlash drafter is a few Qwen3-style decoder layers with NO embedding and NO lm head: it embeds
its block with the TARGET's embedding and scores it with the TARGET's head. Its tensors are
`fc` (taps -> hidden), `hidden_norm`, `layers.*` and `norm`. Its config is a Qwen3 config plus
`dflash_config: {target_layer_ids, mask_token_id, ...}`, `num_target_layers`, `block_size` and
`architectures: ["DFlashDraftModel"]`, the way z-lab's published drafters are written (both
`dflash.model.DFlashDraftModel.from_pretrained` and `dflash.model_mlx.load_draft` read it).

Registered on import by `spec_parity.checkpoints` (its last line). Note: the factory's cache key
hashes checkpoints.py and agreeing.py only; after editing a kind here, clear
`$SPEC_PARITY_CACHE/checkpoints/dflash-drafter-*`.
"""

from __future__ import annotations

import copy

from .checkpoints import KINDS, QWEN_NORMS, Draw, _merge, kind

DFLASH = {
    "target_kind": "qwen3-target",
    "target_overrides": {},
    "target_layer_ids": [1, 2, 3],
    "num_draft_layers": 2,
    "layer_types": None,              # None: all full attention (z-lab's default)
    "sliding_window": None,
    "is_causal": None,                # None: sliding layers causal, full layers not (z-lab)
    "block_size": 8,
    "mask_token_id": 127,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rope_theta": 1000000.0,
    "input_embedding_scale": None,    # None: key absent (z-lab's default 1.0)
    "output_multiplier": None,
    "final_logit_softcapping": "target",  # "target": the target's (Gemma-4: 30), or a number / None
    "dspark_extras": None,            # None: a plain z-lab drafter; a dict: + DSpark extras (below)
}
# The DSpark-on-DFlash extension (port/dflash.py, extras=True): DeepSpec's extras tensors and config
# fields on a DFlash drafter. Keys of the `dspark_extras` override, with their defaults:
EXTRAS = {
    "markov_rank": 8,
    "markov_head_type": "vanilla",       # vanilla | gated | rnn (port.dspark.MarkovHead)
    "markov_gain": 1.0,                  # std of the bias is ~ markov_gain (w1 ~ N(0, 1), w2 ~ gain/sqrt(r))
    "confidence": True,                  # a confidence head
    "confidence_head_with_markov": True,  # its input [h ; W1[prev]] (False: h)
}


def dflash_config(target: dict, a: dict) -> dict:
    n_target, n_draft = target["num_hidden_layers"], a["num_draft_layers"]
    ids = [int(i) for i in a["target_layer_ids"]]
    if not ids or any(b <= b0 for b0, b in zip(ids, ids[1:])) or any(not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {ids} must be strictly increasing in [0, {n_target - 1}]")
    layer_types = a["layer_types"] or ["full_attention"] * n_draft
    if len(layer_types) != n_draft:
        raise ValueError(f"layer_types {layer_types} must have num_draft_layers={n_draft} entries")
    if "sliding_attention" in layer_types and not a["sliding_window"]:
        raise ValueError("sliding_attention layers need a sliding_window")
    if not 0 <= a["mask_token_id"] < target["vocab_size"]:
        raise ValueError(f"mask_token_id {a['mask_token_id']} is outside the target vocab {target['vocab_size']}")
    dflash = {"target_layer_ids": ids, "mask_token_id": a["mask_token_id"], "block_size": a["block_size"]}
    for key in ("input_embedding_scale", "output_multiplier"):
        if a[key] is not None:
            dflash[key] = a[key]
    cap = target.get("final_logit_softcapping") if a["final_logit_softcapping"] == "target" else a["final_logit_softcapping"]
    if cap:
        dflash["final_logit_softcapping"] = cap
    c = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": a["block_size"],
        "dflash_config": dflash,
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": a["intermediate_size"],
        "layer_types": layer_types,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "max_window_layers": n_draft,
        "num_attention_heads": a["num_attention_heads"],
        "num_hidden_layers": n_draft,
        "num_key_value_heads": a["num_key_value_heads"],
        "num_target_layers": n_target,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_scaling": None,
        "rope_theta": a["rope_theta"],
        "sliding_window": a["sliding_window"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": "sliding_attention" in layer_types,
        "vocab_size": target["vocab_size"],
        "eos_token_id": target.get("eos_token_id"),
        "bos_token_id": target.get("bos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "dtype": "float32",
    }
    if a["is_causal"] is not None:
        c["is_causal"] = bool(a["is_causal"])
    return c


@kind("dflash-drafter")
def dflash_drafter(seed: int, overrides: dict):
    """A z-lab DFlash drafter for the tiny target named by `target_kind` ("qwen3-target" or
    "gemma4-target", with `target_overrides`): random weights, random norm weights. The target is
    only read for its config (dims, depth, vocab, softcap); no tensor is copied from it."""
    a = _merge(DFLASH, overrides)
    target_cfg, _ = KINDS[a["target_kind"]](seed, copy.deepcopy(a["target_overrides"]))
    c = dflash_config(target_cfg, a)
    H, hd = c["hidden_size"], c["head_dim"]
    nh, nkv, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    d = Draw(seed)
    d.linear("fc.weight", H, len(c["dflash_config"]["target_layer_ids"]) * H)
    d.scale("hidden_norm.weight", (H,))
    d.scale("norm.weight", (H,))
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        d.attention(p, H, nh, nkv, hd)
        d.mlp(p, H, inter)
        d.norms(p, QWEN_NORMS, H)
    if a["dspark_extras"] is not None:
        add_extras(c, d, a["dspark_extras"])
    return c, d.tensors


def add_extras(c: dict, d: Draw, overrides: dict) -> None:
    """DSpark extras on a DFlash drafter: config fields at the top level (DeepSpec's spelling) and
    random `markov_head.*` / `confidence_head.proj.*` tensors (their own random streams, so the
    base tensors' bytes do not move)."""
    e = _merge(EXTRAS, overrides)
    H, V, r = c["hidden_size"], c["vocab_size"], int(e["markov_rank"])
    if r < 0 or (r == 0 and not e["confidence"]):
        raise ValueError(f"dspark_extras {overrides}: needs markov_rank > 0 and/or confidence")
    with_markov = bool(e["confidence"] and e["confidence_head_with_markov"] and r > 0)
    c.update({"markov_rank": r, "enable_confidence_head": bool(e["confidence"])})
    if r:
        c["markov_head_type"] = e["markov_head_type"]
        d.normal("markov_head.markov_w1.weight", (V, r), 1.0)
        d.linear("markov_head.markov_w2.weight", V, r, gain=float(e["markov_gain"]))
        if e["markov_head_type"] == "gated":
            d.linear("markov_head.gate_proj.weight", r, H + r)
            d.normal("markov_head.gate_proj.bias", (r,), 0.1)
        elif e["markov_head_type"] == "rnn":
            d.linear("markov_head.joint_proj.weight", 3 * r, 2 * r + H)
            d.normal("markov_head.joint_proj.bias", (3 * r,), 0.1)
        elif e["markov_head_type"] != "vanilla":
            raise ValueError(f"markov_head_type {e['markov_head_type']!r}: vanilla, gated or rnn")
    if e["confidence"]:
        c["confidence_head_with_markov"] = with_markov
        d.linear("confidence_head.proj.weight", 1, H + (r if with_markov else 0), gain=4.0)
        d.normal("confidence_head.proj.bias", (1,), 0.5)

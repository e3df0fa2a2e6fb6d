"""Each family's config space as the references accept it, as hypothesis strategies of fuzz.Config.

Every choice lists the built-in case's value first: hypothesis shrinks toward the first option, so
a shrunk failure keeps the built-in value of every key that does not matter to it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from .case import Case
from .checkpoints import GEMMA4_VARIANTS
from .checkpoints.core import GEMMA4_TEXT
from .checkpoints.targets import GEMMA4_TARGET
from .fuzz import Config

SEEDS = (0, 1, 2, 3)
MAX_LAYERS = 7


@dataclass(frozen=True)
class Family:
    references: tuple[str, ...]
    strategy: Callable[[str, tuple[str, ...]], st.SearchStrategy[Config]]
    build: Callable[[Case, Config], Case]


def first(default, *others) -> st.SearchStrategy:
    """`default` (the built-in value, where shrinking ends) or one of `others`. A strategy draws
    every choice whatever the others drew (unused ones ignored): a choice sequence of one length
    shrinks each choice to its first option."""
    return st.sampled_from((default, *[o for o in others if o != default]))


def heads(draw, kv: int = 2, ratio: int = 2) -> dict:
    """Query and key/value heads: the GQA ratio drawn, not the query count."""
    k = draw(first(kv, 1, 4))
    return {"num_key_value_heads": k, "num_attention_heads": k * draw(first(ratio, 1, 3, 4))}


def layer_types(draw, base: list[str], n: int, last_full: bool = False) -> list[str]:
    """n layer types, each the built-in one at its index (full past the built-in's length) first;
    `last_full`: the last one full_attention, as transformers' Gemma-4 configs force it (our port
    refuses any other: port/checkpoint.py LAYER_PATTERNS)."""
    full, sliding = "full_attention", "sliding_attention"
    types = [draw(first(base[i] if i < len(base) else full, full, sliding)) for i in range(MAX_LAYERS)][:n]
    return types[:-1] + [full] if last_full else types


def taps(draw, base: list[int], layers: int) -> list[int]:
    """The target layers tapped: the built-in ones, or 1-4 of the target's layers."""
    picked = [draw(st.integers(0, layers - 1)) for _ in range(4)][:draw(st.integers(1, 4))]
    return sorted(set(picked)) if draw(st.booleans()) else base


# DFlash: z-lab's drafter on a Qwen3 or Gemma-4 target, its module rounds or its loop, against
# z-lab's MLX model (L1) or its torch model (L2).
@st.composite
def dflash_configs(draw, module: str, refs: tuple[str, ...]) -> Config:
    from .pairs.dflash import GEMMA4, TORCH

    ref = draw(st.sampled_from(refs))
    family = draw(first("qwen3", "gemma4"))
    loop = draw(st.booleans())
    base = f"{'loop' if loop else 'mod'}-{family}" + ("-torch" if ref == TORCH else "")
    built_in = GEMMA4 if family == "gemma4" else {}
    n = draw(first(2, 1, 3, 4))
    types = layer_types(draw, built_in.get("layer_types") or [], n)
    ov = {"num_draft_layers": n, "layer_types": types, **heads(draw),
          "head_dim": draw(first(16, 8, 12, 24, 32, 64)),
          "intermediate_size": draw(first(128, 64, 96)),
          "block_size": draw(first(8, 4, 16, 2, 3, 5)),
          "target_layer_ids": taps(draw, [1, 2, 3], 6),
          "is_causal": draw(first(None, True, False)),
          "rope_theta": draw(first(1000000.0, 10000.0)),
          "input_embedding_scale": draw(first(built_in.get("input_embedding_scale"), None, 0.5, 2.0)),
          "output_multiplier": draw(first(built_in.get("output_multiplier"), None, 0.5, 1.5))}
    window = draw(first(built_in.get("sliding_window") or 10, 2, 3, 4, 8, 16, 24))
    if "sliding_attention" in types:
        ov["sliding_window"] = window
    target_kind, target = "qwen3-target", {}
    if family == "gemma4":
        target_kind = ov["target_kind"] = "gemma4-target"
        target = GEMMA4_VARIANTS[draw(first("gemma4", "gemma4-keqv", "gemma4-ple-kvshared"))]
        ov["target_overrides"] = target
    return Config(module, base, target_kind, target, ov, draw(st.sampled_from(SEEDS)))


def dflash_case(base: Case, config: Config) -> Case:
    """The base case on the drawn drafter; against z-lab MLX a sliding drafter runs in its window
    convention (as the built-in cases do: pairs/dflash.py)."""
    from .pairs.dflash import ORACLE

    params = replace(base.params, drafter=("dflash-drafter", config.seed, config.drafter))
    if base.oracle == ORACLE:
        params = replace(params, window="zlab-mlx" if "sliding_attention" in (config.drafter.get("layer_types") or [])
                         else "positional")
    return replace(base, kind=config.target_kind, overrides=config.target, params=params)


# Targets: mlx-lm's Qwen3 and Gemma-4 text models against transformers (L2).
@st.composite
def target_configs(draw, module: str, refs: tuple[str, ...]) -> Config:
    family = draw(first("qwen3", "gemma4"))
    if family == "qwen3":
        ov = {"hidden_size": draw(first(64, 32, 48, 96)), "num_hidden_layers": draw(first(6, 1, 2, 3)),
              **heads(draw), "head_dim": draw(first(16, 8, 12, 24, 32)),
              "intermediate_size": draw(first(128, 64, 96)), "rope_theta": draw(first(1000000.0, 10000.0)),
              "tie_word_embeddings": draw(first(False, True))}
        return Config(module, "qwen3", "qwen3-target", ov, {}, draw(st.sampled_from(SEEDS)))
    variant = draw(first("gemma4", "gemma4-keqv", "gemma4-ple-kvshared"))
    ov = dict(GEMMA4_VARIANTS[variant])
    n = draw(first(6, 2, 3, 4, 5, 7))
    types = layer_types(draw, GEMMA4_TARGET["layer_types"], n, last_full=True)
    rope = GEMMA4_TEXT["rope_parameters"]
    ov.update({"num_hidden_layers": n, "layer_types": types, **heads(draw),
               "head_dim": draw(first(16, 8, 12, 32)), "global_head_dim": draw(first(32, 16, 24, 64)),
               "sliding_window": draw(first(8, 2, 3, 4, 12, 32)),
               "final_logit_softcapping": draw(first(30.0, None, 5.0)),
               "tie_word_embeddings": draw(first(True, False)),
               "rope_parameters": {**rope, "full_attention": {**rope["full_attention"],
                                                              "partial_rotary_factor": draw(first(0.25, 0.5, 1.0))}}})
    shared, global_kv = draw(first(2, 1, 3)), draw(first(1, None, 2))
    if ov.get("num_kv_shared_layers"):
        ov["num_kv_shared_layers"] = min(shared, n - 1)
    if ov.get("attention_k_eq_v"):
        ov["num_global_key_value_heads"] = global_kv
    return Config(module, "gemma4", "gemma4-target", ov, {}, draw(st.sampled_from(SEEDS)))


def target_case(base: Case, config: Config) -> Case:
    return replace(base, kind=config.target_kind, overrides=config.target, seed=config.seed)


# The Gemma-4 assistant: a step of gamma chained drafts on a tiny Gemma-4 target, against optiq (L1,
# in the case's dtype) or transformers (L2). The attention geometry the drafter shares with the
# target (head dims, KV heads, window, RoPE) is drawn once and written into both configs.
@st.composite
def assistant_configs(draw, module: str, refs: tuple[str, ...]) -> Config:
    from .pairs.assistant import HEADS, TARGETS

    ref = draw(st.sampled_from(refs))
    target_name = draw(first("gemma4", "gemma4-keqv", "gemma4-ple-kvshared"))
    head = draw(first("centroid", "tied", "unified", "centroid-untied"))
    rope = GEMMA4_TEXT["rope_parameters"]
    shared = {**heads(draw), "head_dim": draw(first(16, 8, 12, 32)), "global_head_dim": draw(first(32, 16, 24, 64)),
              "sliding_window": draw(first(8, 2, 3, 4, 12, 32)),
              "rope_parameters": {**rope, "full_attention": {**rope["full_attention"],
                                                             "partial_rotary_factor": draw(first(0.25, 0.5, 1.0))}}}
    target = {**TARGETS[target_name], **shared}
    n = draw(first(4, 1, 2, 3))
    text = {**shared, "num_hidden_layers": n, "num_kv_shared_layers": n,
            "layer_types": layer_types(draw, ["sliding_attention"] * 3 + ["full_attention"], n, last_full=True),
            "hidden_size": draw(first(32, 16, 48)), "intermediate_size": draw(first(64, 32, 96))}
    if target.get("attention_k_eq_v"):
        text.update(attention_k_eq_v=True, num_global_key_value_heads=target["num_global_key_value_heads"])
    drafter = {**HEADS[head], "text_config": text}
    centroids, top_k = draw(first(8, 4, 16, 32)), draw(first(2, 1, 4))
    if head.startswith("centroid"):
        drafter.update(num_centroids=centroids, centroid_intermediate_top_k=top_k)
    dtype = draw(first("float32", "bfloat16", "float16"))
    dtype = dtype if ref == "optiq" else "float32"
    return Config(module, f"step-gemma4-centroid-{ref}", "gemma4-target", target,
                  {"drafter": drafter, "dtype": dtype}, draw(st.sampled_from(SEEDS)))


def assistant_case(base: Case, config: Config) -> Case:
    params = replace(base.params, drafter=("gemma4-assistant", config.seed, config.drafter["drafter"]))
    return replace(base, overrides=config.target, params=params, dtype=config.drafter["dtype"])


FAMILIES = {
    "assistant": Family(("optiq", "transformers"), assistant_configs, assistant_case),
    "targets": Family(("transformers",), target_configs, target_case),
    "dflash": Family(("zlab-mlx", "zlab-torch"), dflash_configs, dflash_case),
}

"""The targets' config space for the fuzzer (spec_parity/fuzz.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ...case import Case
from ...fuzz import Config
from ...fuzz_spaces import SEEDS, Family, first, gemma4_rope, heads, layer_types
from .checkpoints import GEMMA4_TARGET, GEMMA4_VARIANTS


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
    ov.update({"num_hidden_layers": n, "layer_types": types, **heads(draw),
               "head_dim": draw(first(16, 8, 12, 32)), "global_head_dim": draw(first(32, 16, 24, 64)),
               "sliding_window": draw(first(8, 2, 3, 4, 12, 32)),
               "final_logit_softcapping": draw(first(30.0, None, 5.0)),
               "tie_word_embeddings": draw(first(True, False)),
               "rope_parameters": gemma4_rope(draw)})
    shared, global_kv = draw(first(2, 1, 3)), draw(first(1, None, 2))
    if ov.get("num_kv_shared_layers"):
        ov["num_kv_shared_layers"] = min(shared, n - 1)
    if ov.get("attention_k_eq_v"):
        ov["num_global_key_value_heads"] = global_kv
    return Config(module, "gemma4", "gemma4-target", ov, {}, draw(st.sampled_from(SEEDS)))


def target_case(base: Case, config: Config) -> Case:
    return replace(base, kind=config.target_kind, overrides=config.target, seed=config.seed)



FAMILY = Family(("transformers",), target_configs, target_case)

"""The Gemma-4 assistant's config space for the fuzzer (spec_parity/fuzz.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ...case import Case
from ...fuzz import Config
from ...fuzz_spaces import SEEDS, Family, first, gemma4_rope, heads, layer_types
from .pair import HEADS, TARGETS


# The Gemma-4 assistant: a step of gamma chained drafts on a tiny Gemma-4 target, against optiq (L1,
# in the case's dtype) or transformers (L2). The attention geometry the drafter shares with the
# target (head dims, KV heads, window, RoPE) is drawn once and written into both configs.
@st.composite
def assistant_configs(draw, module: str, refs: tuple[str, ...]) -> Config:
    ref = draw(st.sampled_from(refs))
    target_name = draw(first("gemma4", "gemma4-keqv", "gemma4-ple-kvshared"))
    head = draw(first("centroid", "tied", "unified", "centroid-untied"))
    shared = {**heads(draw), "head_dim": draw(first(16, 8, 12, 32)), "global_head_dim": draw(first(32, 16, 24, 64)),
              "sliding_window": draw(first(8, 2, 3, 4, 12, 32)),
              "rope_parameters": gemma4_rope(draw)}
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



FAMILY = Family(("optiq", "transformers"), assistant_configs, assistant_case)

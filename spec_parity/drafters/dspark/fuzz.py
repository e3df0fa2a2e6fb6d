"""DSpark's config space for the fuzzer (spec_parity/fuzz.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ...case import Case
from ...fuzz import Config
from ...fuzz_spaces import SEEDS, Family, first, gemma4_rope, heads, taps
from ..targets.checkpoints import GEMMA4_TARGET, GEMMA4_VARIANTS, QWEN3_TARGET
from .checkpoints import DSPARK
from .pair import LOOPS, ORACLE

# The loop cases' thresholds per target family, the built-in first (pair.LOOPS).
THRESHOLDS = {f: sorted({t for v, t in LOOPS if v == f}) for f in ("gemma4", "qwen3")}


# DSpark: DeepSpec's drafter on a Qwen3 or Gemma-4 target, its first round module by module or its
# loop, against DeepSpec (L2). The drafter is the target's text config with DeepSpec's fields
# (checkpoints.dspark_config), so its width, heads, head_dim, MLP, RoPE and softcap are drawn on the
# target and shared; the drafter draws layers, block, taps, mask token and its two heads.
@st.composite
def dspark_configs(draw, module: str, refs: tuple[str, ...]) -> Config:
    family = draw(first("gemma4", "qwen3"))
    variant = draw(first("gemma4", "gemma4-keqv"))
    loop = draw(st.booleans())
    threshold = draw(first(*THRESHOLDS[family]))
    base = f"loop-{family}-t{threshold}" if loop else f"mod-{family}"
    flip_tie = draw(st.booleans())
    shared = {"hidden_size": draw(first(64, 32, 96)), **heads(draw),
              "head_dim": draw(first(16, 8, 12, 24, 32)), "intermediate_size": draw(first(128, 64, 96))}
    qwen = {"rope_theta": draw(first(1000000.0, 10000.0)), "tie_word_embeddings": flip_tie}
    gemma = {"global_head_dim": draw(first(32, 16, 24, 64)), "rope_parameters": gemma4_rope(draw),
             "final_logit_softcapping": draw(first(30.0, None, 5.0)), "tie_word_embeddings": not flip_tie}
    global_kv = draw(first(1, 2))
    if family == "qwen3":
        target_kind, target, built = "qwen3-target", {**shared, **qwen}, QWEN3_TARGET
    else:
        target_kind, target, built = "gemma4-target", {**GEMMA4_VARIANTS[variant], **shared, **gemma}, GEMMA4_TARGET
        if target.get("attention_k_eq_v"):
            target["num_global_key_value_heads"] = global_kv
    # Taps below the target's last layer, which DeepSpec's evaluator refuses (assert_no_final_target_layer).
    tapped = taps(draw, DSPARK["target_layer_ids"], built["num_hidden_layers"] - 1, low=-1)
    drafter = {"target_kind": target_kind, "target_overrides": target, "target_layer_ids": tapped,
               "num_draft_layers": draw(first(2, 1, 3, 4)),
               "block_size": draw(first(7, 1, 2, 3, 4, 8, 16)),
               "mask_token_id": draw(first(0, 3, 127)),
               "markov_rank": draw(first(8, 0, 1, 4, 32)),
               "markov_head_type": draw(first("vanilla", "gated", "rnn")),
               "confidence_head_alpha": draw(first(1.0, 0.0)),
               "confidence_head_with_markov": draw(first(True, False))}
    return Config(module, base, target_kind, target, drafter, draw(st.sampled_from(SEEDS)))


def dspark_case(base: Case, config: Config) -> Case:
    """The base case on the drawn drafter; the target takes the drafter's seed, as the drafter's
    embedding and lm head are copies of that target's (checkpoints.dspark_drafter)."""
    params = replace(base.params, drafter=("dspark-drafter", config.seed, config.drafter))
    return replace(base, kind=config.target_kind, seed=config.seed, overrides=config.target, params=params)


FAMILY = Family((ORACLE,), dspark_configs, dspark_case)

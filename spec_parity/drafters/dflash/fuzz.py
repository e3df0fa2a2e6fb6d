"""DFlash's config space for the fuzzer (spec_parity/fuzz.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ...case import Case
from ...fuzz import Config
from ...fuzz_spaces import SEEDS, Family, first, heads, layer_types, taps
from ..targets.checkpoints import GEMMA4_VARIANTS
from .pair import GEMMA4, ORACLE, TORCH


# DFlash: z-lab's drafter on a Qwen3 or Gemma-4 target, its module rounds or its loop, against
# z-lab's MLX model (L1) or its torch model (L2), both sides at the drawn dtype. Half precision is
# drawn against z-lab MLX only: against torch the target's own half-precision arithmetic already
# differs (transformers vs mlx-lm), so a drafter difference would not show (docs/fuzz.md).
@st.composite
def dflash_configs(draw, module: str, refs: tuple[str, ...]) -> Config:
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
    wider = draw(first(2, 0, 1, -1, 5, 16))     # the window against the block (built-in: 10 over 8)
    if "sliding_attention" in types:
        ov["sliding_window"] = max(2, ov["block_size"] + wider)
    target_kind, target = "qwen3-target", {}
    if family == "gemma4":
        target_kind = ov["target_kind"] = "gemma4-target"
        target = GEMMA4_VARIANTS[draw(first("gemma4", "gemma4-keqv", "gemma4-ple-kvshared"))]
        ov["target_overrides"] = target
    seed = draw(st.sampled_from(SEEDS))
    dtype = draw(first("float32", "bfloat16", "float16"))
    dtype = dtype if ref == ORACLE else "float32"
    if dtype != "float32":      # left out at the default: fuzz-config.json files without one stay valid
        ov["dtype"] = dtype
    return Config(module, base, target_kind, target, ov, seed)


def dflash_case(base: Case, config: Config) -> Case:
    """The base case on the drawn drafter at the drawn dtype (not a checkpoint override: the
    checkpoints are built as stored, each side casts them); against z-lab MLX a sliding drafter
    runs in its window convention (as the built-in cases do: pairs/dflash.py)."""
    drafter = {k: v for k, v in config.drafter.items() if k != "dtype"}
    params = replace(base.params, drafter=("dflash-drafter", config.seed, drafter))
    if base.oracle == ORACLE:
        params = replace(params, window="zlab-mlx" if "sliding_attention" in (config.drafter.get("layer_types") or [])
                         else "positional")
    return replace(base, kind=config.target_kind, overrides=config.target, params=params,
                   dtype=config.drafter.get("dtype", "float32"))



FAMILY = Family((ORACLE, TORCH), dflash_configs, dflash_case)

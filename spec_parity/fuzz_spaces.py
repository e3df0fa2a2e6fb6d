"""What every family's config space (spec_parity/drafters/<name>/fuzz.py: FAMILY) is drawn with:
hypothesis strategies of fuzz.Config.

Every choice lists the built-in case's value first: hypothesis shrinks toward the first option, so
a shrunk failure keeps the built-in value of every key that does not matter to it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from .case import Case
from .checkpoints.core import GEMMA4_TEXT
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


def taps(draw, base: list[int], layers: int, low: int = 0) -> list[int]:
    """The target layers tapped: the built-in ones, or 1-4 of layers low..layers - 1 (DeepSpec's
    -1 is the embedding output)."""
    picked = [draw(st.integers(low, layers - 1)) for _ in range(4)][:draw(st.integers(1, 4))]
    return sorted(set(picked)) if draw(st.booleans()) else base


def gemma4_rope(draw) -> dict:
    """Gemma-4's rope_parameters with the full layers' partial rotary factor drawn."""
    rope = GEMMA4_TEXT["rope_parameters"]
    return {**rope, "full_attention": {**rope["full_attention"], "partial_rotary_factor": draw(first(0.25, 0.5, 1.0))}}

"""Typed case parameters, one class per kind of case.

A case's parameters were a free dict read back by key deep in a run, so a misspelt or missing one
was a KeyError there. Each kind of case now has its frozen dataclass: an unknown or missing field
is a TypeError where the case is built. `as_dict()` is what goldens' manifests and the port's
options (the file protocol's request.json included) hold: the set fields, tuples as lists, and
the marker of a loop or extension case (`"loop": true`, `"extension": true`) as the dicts had it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

Drafter = tuple[str, int, dict]   # a factory drafter checkpoint: (kind, seed, overrides)
MARKED = ("loop", "extension")


def _tuple(v):
    return tuple(_tuple(x) for x in v) if isinstance(v, list | tuple) else v


def _list(v):
    return [_list(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True, kw_only=True)
class Params:
    """What every case may carry: its drafter, as a factory checkpoint (`drafter`) or a path on
    disk (`drafter_path`, a real drafter's); neither for a target case."""

    KIND: ClassVar[str] = ""        # the protocol kind its port run follows (spec_parity/protocol.py)

    drafter: Drafter | None = None
    drafter_path: str | None = None

    def __init_subclass__(cls, kind: str = "", **kw):
        super().__init_subclass__(**kw)
        cls.KIND = kind or cls.KIND

    def __post_init__(self):
        for f in fields(self):      # lists frozen to tuples: a case's parameters never change
            object.__setattr__(self, f.name, _tuple(getattr(self, f.name)))

    def as_dict(self) -> dict:
        """The parameters as JSON: unset (None) fields left out."""
        out = {self.KIND: True} if self.KIND in MARKED else {}
        out.update({f.name: _list(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None})
        return out

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None or self.drafter_path is not None


@dataclass(frozen=True, kw_only=True)
class Bench(Params):
    """A bench case (spec_parity/bench/shapes.py): its drafter; its shapes are the Case's."""

    drafter: Drafter


@dataclass(frozen=True, kw_only=True)
class TargetForward(Params, kind="forward"):
    """targets: the forward on the prompt, then a greedy stream of `new_tokens`."""

    prompt_len: int = 20
    new_tokens: int = 32


@dataclass(frozen=True, kw_only=True)
class AssistantStep(Params, kind="step"):
    """assistant: `gamma` chained draft steps after prefill, in a reference's `convention`
    (drafters/assistant/adapter.py CONVENTIONS); `head_rows` None: the reference's (drafters/assistant/pair.py)."""

    prompt_len: int = 20
    gamma: int = 4
    convention: str = "optiq"
    head_rows: str | None = None


@dataclass(frozen=True, kw_only=True)
class AssistantLoop(Params, kind="loop"):
    """assistant: the serve loop, `gamma` drafts a round, `max_tokens` or stop token `eos` (-1: none)."""

    prompt_len: int = 12
    gamma: int
    max_tokens: int = 40
    eos: int = -1


@dataclass(frozen=True, kw_only=True)
class DflashConventions(Params):
    """dflash: the reference's conventions the port follows (deltas.py: window-ring,
    block-embed-scale, prefill-split, scale-keys); `scales` None: the pair's (drafters/dflash/pair.py)."""

    window: str = "positional"
    embed: str = "scaled"
    prefill: str = "split"
    scales: str | None = None


@dataclass(frozen=True, kw_only=True)
class DflashRounds(DflashConventions, kind="modules"):
    """dflash: module rounds after prefill, each committing its forced `accepts` entry."""

    prompt_len: int = 12
    accepts: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class DflashLoop(DflashConventions, kind="loop"):
    """dflash: the serve loop, `max_tokens` or a stop token in `eos`."""

    prompt_len: int = 12
    max_tokens: int = 40
    eos: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DflashExtension(Params, kind="extension"):
    """dflash (L3): the DSpark-on-DFlash serve loop, pruning at `thresholds`."""

    prompt_len: int = 12
    max_tokens: int = 40
    thresholds: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class DsparkRounds(Params, kind="modules"):
    """dspark: the first draft round after prefill, its prefix and proposal at each of `thresholds`."""

    prompt_len: int = 12
    thresholds: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class DsparkLoop(Params, kind="loop"):
    """dspark: the serve loop to `max_new_tokens`, pruning at `threshold`."""

    prompt_len: int = 12
    max_new_tokens: int = 24
    threshold: float



@dataclass(frozen=True, kw_only=True)
class DsparkSampled(Params, kind="sampled"):
    """dspark: the serve loop at `temperature` (rejection sampling) to `max_new_tokens`, pruning at
    `threshold`, once per seed: `runs` requests from `seed0` on our side, from `ref_seed0` on the
    reference's (independent draws)."""

    prompt_len: int = 12
    max_new_tokens: int = 5
    threshold: float
    temperature: float
    runs: int
    seed0: int = 10_000
    ref_seed0: int = 0


@dataclass(frozen=True, kw_only=True)
class AssistantSampled(Params, kind="sampled"):
    """assistant: the serve loop at `temperature` (token match, greedy drafts) on the fixed
    `prompt`, `gamma` drafts a round, to `max_tokens`, once per seed: `runs` requests from `seed0`
    on our side, from `ref_seed0` on the reference's."""

    prompt: tuple[int, ...]
    gamma: int
    max_tokens: int
    temperature: float
    runs: int
    seed0: int = 10_000
    ref_seed0: int = 0

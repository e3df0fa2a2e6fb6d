"""The one case type. Every module's comparisons are lists of these."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from . import checkpoints
from .params import Params


def vocab_size(path: Path) -> int:
    """A checkpoint's vocabulary, from its config.json (top level or text_config)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


@dataclass(frozen=True)
class Shapes:
    """What a bench case (spec_parity/bench) measures beyond its checkpoints: the size it stands
    for (`tiny`: the factory's checkpoints on disk; `real`: real shapes, random weights in memory),
    the context it drafts after and the drafts per call."""

    size: str                  # "tiny" | "real"
    label: str                 # what the case stands for, for the tables
    ctx: int                   # context length: donor K/V (assistant) or context rows (blocks)
    gamma: int                 # assistant: chained steps per draft call; blocks: drafts per block
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Case:
    """What to compare: a checkpoint (factory kind + seed + overrides, or a real path), the
    parameters of the run (spec_parity.params: one type per kind of case), the tier it is held to,
    and, for a negative control, the planted perturbation (`control`) that the comparison must
    catch. A bench case carries its `shapes` (module = its draft source, params.drafter its
    drafter, as for the drafter pairs)."""

    module: str
    name: str
    tier: str
    kind: str
    seed: int = 0
    overrides: dict = field(default_factory=dict, hash=False)
    params: Params = field(default_factory=Params, hash=False)
    dtype: str = "float32"
    control: dict | None = field(default=None, hash=False)
    path: str | None = None
    oracle: str = ""
    shapes: Shapes | None = field(default=None, hash=False)

    @property
    def id(self) -> str:
        return f"{self.module}/{self.name}"

    @property
    def expect(self) -> str:
        return "FAIL" if self.control else "PASS"

    @property
    def golden_name(self) -> str:
        """Controls compare against their base case's golden: the reference did not change."""
        return self.control["base"] if self.control else self.name

    def checkpoint_dir(self) -> Path:
        if self.path:
            return Path(self.path)
        return checkpoints.build(self.kind, self.seed, self.overrides)

    def drafter_dir(self) -> Path:
        """Drafter pairs: the drafter checkpoint (params.drafter = (kind, seed, overrides))."""
        if self.params.drafter_path:
            return Path(self.params.drafter_path)
        kind, seed, overrides = self.params.drafter
        return checkpoints.build(kind, seed, overrides)

    def prompt(self, salt: int, high: int | None = 128) -> np.ndarray:
        """Deterministic prompt ids [1, prompt_len] in 3..high-1 (never the special ids 0-2);
        high None: no bound but the vocabulary's (128 on a factory checkpoint). On a real one the
        bound is also within the target's and the drafter's vocabularies: an id past either is no
        token of the pair. `salt` is the pair's."""
        if self.path:
            dirs = [self.checkpoint_dir()] + ([self.drafter_dir()] if self.params.has_drafter else [])
            high = min([high or np.inf, *(vocab_size(d) for d in dirs)])
        elif high is None:
            high = 128
        rng = np.random.default_rng([self.seed, salt])
        return rng.integers(3, high, (1, self.params.prompt_len)).astype(np.int32)

    def manifest(self) -> dict:
        """The fields a golden must agree with to be used for this case."""
        return json.loads(json.dumps({
            "module": self.module, "case": self.golden_name, "tier": self.tier, "dtype": self.dtype,
            "oracle": self.oracle,
            "params": self.params.as_dict(),
            "checkpoint": {"kind": self.kind, "seed": self.seed, "overrides": self.overrides,
                           "sha256": checkpoints.checkpoint_hash(self.checkpoint_dir())},
            **({"drafter_sha256": checkpoints.checkpoint_hash(self.drafter_dir())} if self.params.drafter else {}),
        }, sort_keys=True))

    def on_path(self, path: str, name_suffix: str = "real") -> Case:
        """The same case on a real checkpoint given by path (no golden: live oracle only)."""
        return replace(self, path=str(path), name=f"{self.name}-{name_suffix}")

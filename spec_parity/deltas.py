"""Reference deltas as data: where two references of one module disagree, by convention.

Each delta is a port option of ours with two values, one per reference (docs/references.md says
what each reference does and where). Our port implements both values, and the twin cases hold
each value to its own reference. So when a plug-in port fails a case (its output contract kept),
the harness runs our port with the delta's other value and judges the plug-in port against that,
at the case's tier (L1: bit-exact): a match means the port follows the other reference's
convention. Only a delta that changes, in our port, an array the first failing check read can be
named: one that changes nothing there is no cause. The verdict is then DELTA, naming the delta; the
report counts such cases apart from failures. A port that matches neither convention keeps its
FAIL. Serve-loop cases are not explained this way (their module cases show the delta).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations

import numpy as np

from .compare import Result


@dataclass(frozen=True)
class Delta:
    name: str
    module: str
    option: str
    values: tuple[str, str]        # the option's value for each reference
    references: tuple[str, str]
    what: str


DELTAS = (
    Delta("window-ring", "dflash", "window", ("zlab-mlx", "positional"), ("z-lab MLX", "z-lab torch"),
          "sliding window after a one-row context update on a full ring (ring index vs position)"),
    Delta("block-embed-scale", "dflash", "embed", ("scaled", "raw"), ("z-lab MLX", "z-lab torch"),
          "the block embedding: sqrt(H)-scaled (Gemma-4) vs the raw embedding rows"),
    Delta("prefill-split", "dflash", "prefill", ("split", "whole"), ("z-lab MLX", "z-lab torch"),
          "the prompt's last token prefilled on its own vs in one forward"),
    Delta("scale-keys", "dflash", "scales", ("nested", "either"), ("z-lab MLX", "z-lab torch"),
          "input_embedding_scale / output_multiplier at the config's top level: not read vs read"),
    Delta("draft-position", "assistant", "convention", ("optiq", "hfpos"), ("optiq", "transformers"),
          "draft step k at position P+k vs every step at P"),
    Delta("donor-window", "assistant", "convention", ("optiq", "hfwin"), ("optiq", "transformers"),
          "the donor sliding view: newest W-1 entries vs transformers' own mask (W+1)"),
    Delta("centroid-rows", "assistant", "head_rows", ("embed", "lm_head"), ("optiq", "transformers"),
          "an untied centroid head's candidates scored on the embedding's rows vs lm_head's"),
)


def applicable(case, opts: dict) -> list[tuple[Delta, str]]:
    """(delta, the other value) for each delta whose option the case runs with one of its values
    (`opts`: what the port is told, harness.options)."""
    out = []
    for d in DELTAS:
        v = opts.get(d.option)
        if d.module == case.module and v in d.values:
            out.append((d, d.values[1 - d.values.index(v)]))
    return out


def explain(case, opts: dict, port: dict, ours, judge, failed: set[str]) -> tuple[list[Delta], Result] | None:
    """The smallest set of deltas under which `port` matches our port (`ours(variant)`: our arrays
    on a case) at the case's own tier, judged by `judge(variant, port, arrays, result)`; None if no
    set explains it. `failed`: the port arrays the original judgement's first failing check read;
    a set explains only if its other convention changes one of them in our port (a delta that
    changes nothing there cannot be the cause). Deltas on one option are exclusive, so each set
    flips each option once."""
    found = applicable(case, opts)
    base = ours(case) if found else {}
    for n in range(1, len(found) + 1):
        for combo in combinations(found, n):
            if len({d.option for d, _ in combo}) < n:
                continue
            params = replace(case.params, **{d.option: other for d, other in combo})
            variant = replace(case, params=params, name=f"{case.name}~{'+'.join(d.name for d, _ in combo)}")
            other = ours(variant)
            if not any(_changed(base, other, k) for k in failed):
                continue
            trial = Result(case.module, variant.name, "our port", case.tier)
            judge(variant, _no_layers(port), _no_layers(other), trial)
            if trial.ok:
                return [d for d, _ in combo], trial
    return None


def _changed(a: dict, b: dict, key: str) -> bool:
    """Whether array `key` differs between two runs of our port (in one and not the other, or bytes)."""
    if key not in a or key not in b:
        return (key in a) != (key in b)
    x, y = np.asarray(a[key]), np.asarray(b[key])
    return x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes()


def _no_layers(arrays: dict) -> dict:
    """Without the per-layer arrays: `own.*` are run on the real reference's layers, so against our
    port under another convention only the layer outputs' consequences are compared, not the layers."""
    return {k: v for k, v in arrays.items() if not k.startswith(("layer.", "own."))}


def describe(deltas: list[Delta], opts: dict) -> str:
    parts = []
    for d in deltas:
        here = d.values.index(opts[d.option])
        parts.append(f"differs from {d.references[here]}, matches {d.references[1 - here]}: delta {d.name} "
                     f"({d.what}; {d.option}={d.values[1 - here]})")
    return "; ".join(parts)

"""Real checkpoints by path: which cases apply to a (target, drafter) pair, labelled by what runs.

The drafter's family comes from its config.json: a Gemma-4 assistant (model_type), DSpark
(architectures Gemma4DSparkModel / Qwen3DSparkModel), DFlash (DFlashDraftModel), and
DSpark-on-DFlash (a DFlash drafter whose config declares the extras). The cases are the built-in
ones of that family, one per thing checked (the factory's variants of a family are one case on a
real checkpoint: its config is what it is), on the two paths, against the live references.

A case runs at its built-in twin's dtype (float32) whatever dtype the weights are stored in (one
file or shards): every loader casts them, exactly, and the case's name says so.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .case import Case
from .params import DflashConventions


class RealError(ValueError):
    """A directory that is not a checkpoint of a family spec-parity checks; names the file and fix."""


def _config(path: Path, what: str) -> dict:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise RealError(f"{f}: no config.json; --{what} must be a checkpoint directory (config.json + *.safetensors)")
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise RealError(f"{f}: not readable JSON ({e}); fix or re-save the checkpoint") from e


def target_family(path: Path) -> str:
    cfg = _config(path, "target")
    model_type = (cfg.get("text_config") or cfg).get("model_type", cfg.get("model_type", ""))
    for family in ("gemma4", "qwen3"):
        if str(model_type).startswith(family):
            return family
    raise RealError(f"{Path(path) / 'config.json'}: model_type {model_type!r} is not a target spec-parity "
                    "checks (gemma4, qwen3)")


def drafter_family(path: Path) -> str:
    from spec_parity.port.checkpoint import ASSISTANT_TYPES, drafter_kind

    cfg = _config(path, "drafter")
    kind = drafter_kind(cfg)
    if kind is None:
        raise RealError(f"{Path(path) / 'config.json'}: not a drafter spec-parity checks (model_type "
                        f"{cfg.get('model_type')!r}, architectures {cfg.get('architectures')}); expected a Gemma-4 "
                        f"assistant ({', '.join(ASSISTANT_TYPES)}), DSpark (Gemma4DSparkModel, Qwen3DSparkModel) or "
                        "DFlash (DFlashDraftModel)")
    return kind


# Per family: (module, built-in case to take its run parameters from, label of what it checks).
PLAN = {
    "targets": [("targets", "{t}", "forward, layers and greedy stream vs transformers")],
    "assistant": [("assistant", "step-gemma4-tied-optiq", "draft steps vs optiq"),
                  ("assistant", "step-gemma4-tied-transformers", "draft steps vs transformers"),
                  ("assistant", "loop-random-tied-g4", "serve loop vs optiq's spec_generate")],
    "dspark": [("dspark", "mod-{t}", "first round, module by module, vs DeepSpec"),
               ("dspark", "loop-{t}-t0.0", "serve loop vs DeepSpec's")],
    "dflash": [("dflash", "mod-{t}", "forced-commit rounds vs z-lab MLX"),
               ("dflash", "mod-{t}-torch", "forced-commit rounds vs z-lab torch"),
               ("dflash", "loop-{t}", "serve loop vs z-lab MLX's stream_generate")],
    "dflash-extension": [("dflash", "ext-{t}", "the DSpark-on-DFlash extension (L3)")],
}


def cases(target: str | Path, drafter: str | Path | None, builtin: list[Case]) -> list[Case]:
    """The cases that apply to the pair, on its paths, named `<module>/<what ran>`."""
    t = target_family(target)
    family = drafter_family(drafter) if drafter else "targets"
    if family == "assistant" and t != "gemma4":
        raise RealError(f"{drafter}: a Gemma-4 assistant drafts for a Gemma-4 target; {target} is {t}")
    by_id = {c.id: c for c in builtin if not c.control}
    out = []
    for module, name, label in PLAN[family]:
        base = by_id.get(f"{module}/{name.format(t=t)}")
        if base is None:
            continue
        params = replace(base.params, drafter=None, drafter_path=str(drafter) if drafter else None)
        if isinstance(params, DflashConventions):
            params = replace(params, window=_dflash_window(drafter, base))
        what = f"{label} on {Path(target).name}" + (f" + {Path(drafter).name}" if drafter else "")
        out.append(replace(base, path=str(target), params=params, name=what + _dtype_note(target, drafter, base.dtype)))
    return out


def _dtype_note(target, drafter, run: str) -> str:
    """What a case on weights stored in another dtype runs at, for its name (every report shows
    it): every loader, the references' and the port's, casts them to the case's dtype, so a bf16
    or fp16 checkpoint computes at float32 (exactly its weights) and the float32 budgets hold."""
    from spec_parity.port.checkpoint import stored_dtype

    t, d = stored_dtype(target), stored_dtype(drafter) if drafter else None
    if {t, d} - {None} == {run}:
        return ""
    return f" (weights {t}, run at {run})" if d in (None, t) else f" (target {t}, drafter {d}, run at {run})"


def _dflash_window(drafter, base: Case) -> str:
    """z-lab MLX's window convention where the drafter has sliding layers (drafters/dflash/pair.py window)."""
    if base.params.window == "positional" and base.oracle != "zlab-mlx":
        return "positional"
    cfg = _config(drafter, "drafter")
    return "zlab-mlx" if "sliding_attention" in (cfg.get("layer_types") or []) else "positional"


def check_pair(target: str | Path, drafter: str | Path | None) -> None:
    """Load the target (lazily) and the drafter as the cases will, and pair them: a tensor the
    loaders refuse or a (target, drafter) mismatch is bad input, refused before the first case
    (otherwise each case would report it as its ERROR)."""
    from spec_parity.port import assistant, dflash, dspark, targets

    t = targets.load(target, lazy=True)
    if drafter is None:
        return
    kind = drafter_family(drafter)
    module = {"assistant": assistant, "dspark": dspark, "dflash": dflash, "dflash-extension": dflash}[kind]
    module.check_pairing(module.load(drafter), t)
    if kind == "dflash-extension":
        dflash.load_extension(drafter)

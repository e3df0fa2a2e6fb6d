"""Negative controls: the planted bugs every comparison must catch, applied to the port from outside.

One mechanism for every module. A control is a named set of swaps: attributes of port classes or
modules (a method, a function) replaced by a buggy variant for the duration of a `with` block and
restored after; the port has no switch for any of them. A drafter's controls are written in its
folder, spec_parity/drafters/<module>/controls.py, the serve loop's, the sampler's, the bench's and
the A/B's in spec_parity/controls/<module>.py; each registers its own by key with a one-line
description:

    @control("dspark", "no_embed_scale", "the sqrt(H) embedding scale missing")
    def _(case):
        return {(dspark.Model, "embed"): lambda self, ids: self.embed_tokens(ids)}

Each controls module declares its seam, the port names its controls may swap, in one place:
`SEAMS = ("spec_parity.port.dspark:Model.embed", ...)` (module:attribute). A control that swaps a name its
module does not declare is refused when planted, and tests/test_controls.py resolves every
declared name against the port, so a renamed port internal fails a test naming the seam instead
of a control planting nothing. `case` is the case the control is applied to (None when a test
plants it); only a control that perturbs a case's inputs reads it. A pair's case names its control (`case_control`), the harness
runs the port under `applied(case)`, and a test plants one with `planted(module, key)`. Only what is
built while a control is applied carries it: load (and compile) the model inside the block.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType

from .. import drafters

MODULES = (*drafters.DRAFTERS, "serve", "sampling", "bench", "ab")


class ControlError(ValueError):
    pass


@dataclass(frozen=True)
class Control:
    module: str
    key: str
    what: str
    swaps: Callable  # (case or None) -> {(owner, attribute): buggy value}


_REGISTRY: dict[tuple[str, str], Control] = {}


def control(module: str, key: str, what: str):
    """Register the decorated swaps function as control `key` of `module`."""
    def register(swaps):
        _REGISTRY[(module, key)] = Control(module, key, what, swaps)
        return swaps
    return register


def source(module: str) -> ModuleType:
    """The controls module of `module` (a drafter's in its folder), imported: its controls registered."""
    if module not in MODULES:
        raise ControlError(f"unknown control module {module!r}; known: {list(MODULES)}")
    if module in drafters.DRAFTERS:
        return drafters.piece(module, "controls")
    return importlib.import_module(f"{__name__}.{module}")


def path(module: str) -> str:
    """Where `module`'s controls are written, as messages name it."""
    return drafters.path(module, "controls") if module in drafters.DRAFTERS else f"spec_parity/controls/{module}.py"


def registry(module: str) -> dict[str, Control]:
    """The controls of `module` by key."""
    source(module)
    return {k: c for (m, k), c in _REGISTRY.items() if m == module}


def get(module: str, key: str) -> Control:
    known = registry(module)
    if key not in known:
        raise ControlError(f"no control {key!r} in {path(module)}; known: {sorted(known)}")
    return known[key]


def seams(module: str) -> tuple[str, ...]:
    """The port names `module`'s controls may swap: its SEAMS."""
    return source(module).SEAMS


def seam_name(owner, attribute: str) -> str:
    """How SEAMS names a swap: `module:attribute` of a module, `module:Class.attribute` of a class."""
    if isinstance(owner, type):
        return f"{owner.__module__}:{owner.__qualname__}.{attribute}"
    return f"{owner.__name__}:{attribute}"


def resolve(seam: str):
    """What a SEAMS entry names in the port; ControlError naming the seam where the port has it no more."""
    module, _, path = seam.partition(":")
    try:
        found = importlib.import_module(module)
        for part in path.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        raise ControlError(f"seam {seam}: {e}; rename it in SEAMS and in the control that swaps it, "
                           "or drop the control") from e
    return found


def undeclared(module: str, swaps: dict) -> list[str]:
    """The swaps outside `module`'s SEAMS."""
    declared = set(seams(module))
    return [name for name in (seam_name(owner, a) for owner, a in swaps) if name not in declared]


def case_control(module: str, key: str, base: str, **extra) -> dict:
    """A case's `control` field: the base case it perturbs, the description, the key and the
    controls module (when it is not the case's own, e.g. a serve-loop control of a pair)."""
    return {"base": base, "what": get(module, key).what, "bug": key, "module": module, **extra}


@contextmanager
def swapped(swaps: dict):
    """Each (owner, attribute) set to its value inside the block; the old values back after (an
    attribute the owner only inherited is removed again)."""
    missing = object()
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name in swaps]
    try:
        for (owner, name), value in swaps.items():
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, old in reversed(saved):
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


LAYER_SCALE = 1.01   # one drafter layer's output x this (a wrong layer scalar): a bug in that layer alone


def one_layer_scaled(owner, loader: str, layers_of, case):
    """Swaps `owner.loader` for a loader whose model's drafter layer case.control["layer"] (1 when a
    test plants it) returns its output x LAYER_SCALE. Gemma-style layers norm their attention and
    MLP outputs, so a scaled MLP would vanish; a scaled layer output joins the residual stream. The
    first divergent layer must name that layer, none before it."""
    load, layer = getattr(owner, loader), (case.control["layer"] if case else 1)

    def perturbed(*args, **kwargs):
        model = load(*args, **kwargs)
        target = layers_of(model)[layer]
        plain = type(target)
        target.__class__ = type(f"Scaled{plain.__name__}", (plain,),
                                {"__call__": lambda self, *a, **kw: plain.__call__(self, *a, **kw) * LAYER_SCALE})
        return model

    return {(owner, loader): perturbed}


_ACTIVE: list[tuple[str, str]] = []


@contextmanager
def planted(module: str, key: str, case=None):
    """The control `key` of `module` as a context manager; refused where it swaps a name its
    module's SEAMS does not declare."""
    swaps = get(module, key).swaps(case)
    if undeclared(module, swaps):
        raise ControlError(f"control {module}/{key} swaps {', '.join(undeclared(module, swaps))}, not in "
                           f"SEAMS of {path(module)}; declare it there")
    with swapped(swaps):
        _ACTIVE.append((module, key))
        try:
            yield
        finally:
            _ACTIVE.pop()


def active() -> tuple:
    """The (module, key) of every control planted now: part of the key of a run that is shared
    across cases (drafters/dflash/adapter.py), so no normal case reads a planted run or the reverse."""
    return tuple(_ACTIVE)


def applied(case):
    """The case's control as a context manager (nothing for a normal case)."""
    if not case.control:
        return nullcontext()
    return planted(case.control.get("module", case.module), case.control["bug"], case)

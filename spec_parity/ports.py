"""Ports: who answers a case. Our own ports are one implementation of the protocol among others,
registered the way any port is: the entry-point group `spec_parity.ports`, or a spec given on the
command line (`--port dflash=pkg.module:make_port`, the same option for pytest).

A factory `make_port()` returns a `Port`. Its identity (name, version, digest of its source) keys
every cached port result, so two ports in one process never share one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from .protocol import MODULES

GROUP = "spec_parity.ports"
OURS = "spec-parity"
OURS_SPEC = "spec_parity.adapters:make_port"


class PortError(ValueError):
    """A port spec that cannot be resolved; the message names it and the fix."""


class Declined(Exception):
    """Raised by a port's run for a case it does not implement (a kind, or a checkpoint variant
    it has no counterpart for). The case reads DECLINED with the port's reason: counted apart,
    never as a pass. Through the file protocol, a command declines by exiting with DECLINE_EXIT."""


DECLINE_EXIT = 3


@dataclass(frozen=True)
class Port:
    """name/version: how the report names it; runs: module -> (Request -> dict of arrays);
    sources: the files whose bytes are its digest (default: the factory's package)."""

    name: str
    version: str
    runs: Mapping[str, Callable] = field(hash=False)
    sources: tuple[str, ...] = ()

    @functools.cached_property
    def files(self) -> tuple[Path, ...]:
        return tuple(sorted({p for s in self.sources for p in _files(Path(s))}))

    @functools.cached_property
    def digest(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(str(f.name).encode() + f.read_bytes())
        return h.hexdigest()

    @property
    def identity(self) -> str:
        """A port with no files to hash says so rather than show the digest of nothing."""
        return f"{self.name} {self.version} ({self.digest[:12] if self.files else 'no files hashed'})"

    @property
    def ours(self) -> bool:
        return self.name == OURS


def _files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []


def package_dir(module_name: str) -> str:
    """The directory of package `module_name` (the file of a plain module), for Port.sources."""
    f = Path(getattr(importlib.import_module(module_name), "__file__", "") or "")
    return str(f.parent if f.name == "__init__.py" else f)


def load(spec: str) -> Port:
    """A port from `pkg.module:factory`, or by the name it is registered under in `spec_parity.ports`."""
    if ":" not in spec:
        found = {e.name: e.value for e in importlib.metadata.entry_points(group=GROUP)}
        found.setdefault(OURS, OURS_SPEC)
        if spec not in found:
            raise PortError(f"no port named {spec!r} in the {GROUP} entry points (known: {sorted(found)}); "
                            f"give it as pkg.module:make_port")
        spec = found[spec]
    mod, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise PortError(f"port {spec!r} cannot be imported ({e}); check the module is on PYTHONPATH "
                        f"and defines {attr}()") from e
    try:
        port = factory()
    except ImportError as e:            # the package the port wraps is not installed
        raise PortError(f"port {spec!r}: {attr}() cannot import the package it runs ({e}); install it beside "
                        f"spec-parity (the adapter's docstring names the pip command)") from e
    if not isinstance(port, Port):
        raise PortError(f"port {spec!r}: {attr}() returned {type(port).__name__}, not spec_parity.ports.Port")
    if not port.sources:
        port = Port(port.name, port.version, port.runs, (package_dir(mod.split(".")[0]),))
    return port


def check(assignments: Iterable[str] | None, cmd: bool, modules: Iterable[str],
          selected_by: str = "") -> dict[str, str]:
    """--port MODULE=SPEC assignments as {module: spec}, refused (PortError) where the run would
    ignore a port the user named or answer its module with ours: a module given twice, a module
    none of the run's cases belong to (`modules`, chosen by `selected_by`, e.g. "--module dflash"),
    or one --port-cmd (`cmd`, which answers every module of the run) answers too. Nothing is loaded."""
    modules = list(dict.fromkeys(modules))
    chosen: dict[str, str] = {}
    for a in assignments or []:
        module, sep, spec = a.partition("=")
        if not sep or not module or not spec:
            raise PortError(f"--port {a!r}: expected MODULE=pkg.module:make_port (e.g. dflash=mypkg.adapter:make_port)")
        if module not in MODULES:
            raise PortError(f"--port {a!r}: no module {module!r}; give one of {', '.join(MODULES)}")
        if module in chosen:
            raise PortError(f"--port {module}={chosen[module]} and --port {a}: one port per module; "
                            f"drop one of them")
        chosen[module] = spec
    for module, spec in chosen.items():
        if module not in modules:
            by = f" ({selected_by})" if selected_by else ""
            fix = (f"give a --drafter whose cases are {module}'s" if "--target" in selected_by
                   else f"name a {module} case in --case" if "--case" in selected_by
                   else f"select its cases with --module {module}")
            raise PortError(f"--port {module}={spec}: the run selects no {module} case{by}, so that port "
                            f"would never run; {fix}, or drop the --port")
        if cmd:
            raise PortError(f"--port {module}={spec} and --port-cmd both answer {module} (--port-cmd answers "
                            f"every module the run selects); run them apart: --module {module} --port "
                            f"{module}={spec}, and --module OTHER --port-cmd CMD")
    return chosen


def select(assignments: list[str]) -> dict[str, Port]:
    """`MODULE=SPEC` assignments (from --port) as {module: the port that answers its cases}."""
    chosen = {}
    for module, spec in check(assignments, False, MODULES).items():
        port = load(spec)
        if module not in port.runs:
            raise PortError(f"--port {module}={spec}: port {port.name} implements {sorted(port.runs)}, not {module}")
        chosen[module] = port
    return chosen


@functools.cache
def ours() -> Port:
    return load(OURS)


@dataclass(frozen=True, eq=False)
class Selection:
    """Who answers each module's cases: the ports a run chose (--port, --port-cmd), ours for the
    rest. Built once by the CLI or pytest and handed down; `Selection()` is ours everywhere."""

    chosen: Mapping[str, Port] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "chosen", MappingProxyType(dict(self.chosen)))

    def port(self, module: str) -> Port:
        return self.chosen.get(module) or ours()

    def theirs(self) -> tuple[str, ...]:
        """The modules a port other than ours answers."""
        return tuple(m for m in MODULES if not self.port(m).ours)

    def describe(self) -> str:
        return ", ".join(f"{m}={p.identity}" for m, p in sorted(self.chosen.items())) or f"{OURS} (all modules)"


OURS_ONLY = Selection()


def configure(assignments: list[str] | None, cmd_port: Port | None = None, modules=None,
              selected_by: str = "") -> Selection:
    """What --port and --port-cmd say (the CLI's and pytest's): `cmd_port` (exchange.command_port)
    answers every one of `modules` (default every module); check() refuses a combination that
    would leave a named port unused."""
    modules = list(modules or MODULES)
    check(assignments, cmd_port is not None, modules, selected_by)
    chosen = select(assignments or [])
    if cmd_port is not None:
        chosen.update(dict.fromkeys(modules, cmd_port))
    return Selection(chosen)


def where(port: Port, error: BaseException) -> str:
    """The frame nearest `error` in the port's own files (its sources), as `file:line in function`
    with the file relative to its source folder's parent; "" when no frame is the port's."""
    roots = [Path(s).resolve() for s in port.sources]
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        f = Path(frame.filename).resolve()
        for root in roots:
            if f == root or root in f.parents:
                return f"{f.relative_to(root.parent)}:{frame.lineno} in {frame.name}"
    return ""

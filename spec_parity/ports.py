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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

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
    def digest(self) -> str:
        h = hashlib.sha256()
        for f in sorted({p for s in self.sources for p in _files(Path(s))}):
            h.update(str(f.name).encode() + f.read_bytes())
        return h.hexdigest()

    @property
    def identity(self) -> str:
        return f"{self.name} {self.version} ({self.digest[:12]})"

    @property
    def ours(self) -> bool:
        return self.name == OURS


def _files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []


def package_dir(module_name: str) -> str:
    """The directory (or file) of a module's top-level package, for Port.sources."""
    top = importlib.import_module(module_name.split(".")[0])
    f = Path(getattr(top, "__file__", "") or "")
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
    port = factory()
    if not isinstance(port, Port):
        raise PortError(f"port {spec!r}: {attr}() returned {type(port).__name__}, not spec_parity.ports.Port")
    if not port.sources:
        port = Port(port.name, port.version, port.runs, (package_dir(mod),))
    return port


_SELECTED: dict[str, Port] = {}


def select(assignments: list[str]) -> None:
    """`MODULE=SPEC` assignments (from --port): that port answers that module's cases."""
    for a in assignments:
        module, sep, spec = a.partition("=")
        if not sep or not module or not spec:
            raise PortError(f"--port {a!r}: expected MODULE=pkg.module:make_port (e.g. dflash=mypkg.adapter:make_port)")
        port = load(spec)
        if module not in port.runs:
            raise PortError(f"--port {a!r}: port {port.name} implements {sorted(port.runs)}, not {module}")
        _SELECTED[module] = port


def configure(assignments: list[str] | None, cmd_port: Port | None = None, modules=None) -> None:
    """What --port and --port-cmd say (the CLI's and pytest's): `cmd_port` (exchange.command_port)
    answers `modules` (default every module) that no --port names."""
    select(assignments or [])
    if cmd_port is not None:
        for module in modules or MODULES:
            _SELECTED.setdefault(module, cmd_port)


def reset() -> None:
    _SELECTED.clear()


@functools.cache
def ours() -> Port:
    return load(OURS)


def for_module(module: str) -> Port:
    return _SELECTED.get(module) or ours()


def describe() -> str:
    return ", ".join(f"{m}={p.identity}" for m, p in sorted(_SELECTED.items())) or f"{OURS} (all modules)"

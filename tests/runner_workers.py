"""Cases and case runners the runner tests hand to spawned workers (a helper module: no tests
here; a worker imports it by name, so what it builds must be module-level)."""

from __future__ import annotations

import os
from types import SimpleNamespace


def case(name: str, base: str | None = None, kind: str = "loop"):
    return SimpleNamespace(module="fake", name=name, id=f"fake/{name}", control={"base": base} if base else None,
                           params=SimpleNamespace(KIND=kind))


CASES = [case("a"), case("a-control", "a"), case("b", kind="sampled"), case("c"), case("dies")]


def affinity(c) -> str:
    return c.control["base"] if c.control else c.name


def run_one(c):
    if c.name == "dies":
        os._exit(3)
    return SimpleNamespace(verdict="PASS", shown_verdict="PASS", pid=os.getpid(), name=c.name)


def prepare():
    return lambda i: run_one(CASES[i])

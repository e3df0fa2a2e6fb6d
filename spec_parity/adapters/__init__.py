"""Our own ports behind the port protocol (spec_parity.protocol): the first implementation,
registered as any other is (pyproject's `spec_parity.ports` entry point `spec-parity`)."""

from __future__ import annotations

from .. import __version__
from ..ports import Port, package_dir


def make_port() -> Port:
    from . import assistant, dflash, dspark, targets

    runs = {"targets": targets.run, "assistant": assistant.run, "dspark": dspark.run, "dflash": dflash.run}
    return Port("spec-parity", __version__, runs, (package_dir("spec_parity.port"), package_dir("spec_parity") + "/adapters",
                                                    package_dir("spec_parity.oracles") + "/layers.py"))


"""Our own ports behind the port protocol (spec_parity.protocol): the first implementation,
registered as any other is (pyproject's `spec_parity.ports` entry point `spec-parity`). Each
drafter's adapter is in its folder (spec_parity/drafters/<name>/adapter.py); `loop` is the serve
loop runner they share."""

from __future__ import annotations

from .. import __version__
from ..drafters import DRAFTERS, piece
from ..ports import Port, package_dir


def make_port() -> Port:
    runs = {d: piece(d, "adapter").run for d in DRAFTERS}
    here = package_dir("spec_parity")
    return Port("spec-parity", __version__, runs, (package_dir("spec_parity.port"), here + "/adapters",
                                                    *(f"{here}/drafters/{d}/adapter.py" for d in DRAFTERS),
                                                    package_dir("spec_parity.oracles") + "/layers.py"))

"""The drafters, each with its harness pieces in one folder, spec_parity/drafters/<name>/:

  pair.py         the pair (spec_parity.pair.Pair): cases, reference, what to check
  adapter.py      our port (port/<name>.py) behind the port protocol: run(request) -> arrays
  checkpoints.py  its tiny checkpoint kinds (@kind, spec_parity.checkpoints)
  controls.py     its planted bugs and their SEAMS (spec_parity.controls)
  fuzz.py         its config space for `spec-parity fuzz` (FAMILY; spec_parity.fuzz), where it has one
  README.md       what the pair compares, against which reference, on which cases

DRAFTERS is the one registry: the harness's pairs, our port's runs, the checkpoint kinds and the
control modules are all read from it. A new drafter is a copied folder and one name here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

DRAFTERS = ("targets", "assistant", "dspark", "dflash")


def piece(drafter: str, name: str) -> ModuleType:
    """The module `name` (pair, adapter, checkpoints, controls) of `drafter`'s folder."""
    return importlib.import_module(f"{__name__}.{drafter}.{name}")


def path(drafter: str, name: str) -> str:
    """Where that module is written, as error messages name it."""
    return f"spec_parity/drafters/{drafter}/{name}.py"

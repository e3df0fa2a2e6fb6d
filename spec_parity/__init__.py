"""The parity harness. Its fp32 budgets are full-fp32 budgets (measured on the CPU), so it keeps
MLX's float32 matmuls at full precision where MLX would otherwise run them as TF32 (CUDA, Apple
M5): there a batched verify and a one-row decode of the same tokens differ by ~1e-2 in the
logits (measured on an H200, docs/benchmarks.md). Set MLX_ENABLE_TF32=1 yourself to measure TF32.

The port and its oracles are `spec_parity.port` and `spec_parity.oracles`: installed, folders of
this package (setup.py); in a checkout, the repository's top folders port/ and oracles/, found by
`_Checkout`."""

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"


class _Checkout(importlib.abc.MetaPathFinder):
    """Finds spec_parity.port / spec_parity.oracles in the checkout's top folders, and nothing
    else: extending __path__ with the checkout would make its every folder a subpackage."""

    def __init__(self, top: Path, names: tuple[str, ...]):
        self.top, self.names = top, {f"{__name__}.{n}": n for n in names}

    def find_spec(self, fullname, path=None, target=None):
        folder = self.names.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, self.top / folder / "__init__.py",
                                                      submodule_search_locations=[str(self.top / folder)])


def _checkout_finder() -> None:
    here = Path(__file__).resolve().parent
    names = tuple(n for n in ("port", "oracles")
                  if (here.parent / n / "__init__.py").is_file() and not (here / n).exists())
    if names and not any(isinstance(f, _Checkout) and f.top == here.parent for f in sys.meta_path):
        sys.meta_path.insert(0, _Checkout(here.parent, names))   # before an editable install's own finder


_checkout_finder()

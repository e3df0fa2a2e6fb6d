"""Reading a drafter checkpoint into an MLX model: one path for every port.

Every parameter the model declares must come from the checkpoint: a missing one would silently
keep its initial value, so it is an error naming the tensors and what to check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten


def read_tensors(path: Path) -> dict[str, mx.array]:
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def weights_bytes(path: Path) -> int:
    """On-disk size of the safetensors: the provider's admission accounting."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def load_into(model, path: Path, weights: dict[str, mx.array], error: type[Exception],
              hint: str | Callable[[list[str]], str], unused: tuple[str, ...] = ()) -> None:
    """Load `weights` into `model` strictly; `hint(missing)` (or a string) says what to check.
    Every tensor is consumed: one the model has no parameter for is refused by name (a head or a
    layer the port would silently not compute), except under the prefixes in `unused`, which the
    caller leaves out on purpose as its reference does (e.g. the DSpark extras with extras off)."""
    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - set(weights))
    if missing:
        what = hint(missing) if callable(hint) else hint
        raise error(f"{path}: missing tensor(s) {missing[:6]}{' …' if len(missing) > 6 else ''}; {what}")
    extra = sorted(k for k in set(weights) - expected if not (unused and k.startswith(unused)))
    if extra:
        raise error(f"{path}: tensor(s) {extra[:6]}{' …' if len(extra) > 6 else ''} have no place in this "
                    f"port's model; remove them, or fix the config.json keys that declare that part")
    model.load_weights([(k, v) for k, v in weights.items() if k in expected], strict=True)

"""Each drafter layer's output in a reference's first draft call, observed from outside.

The reference's code runs unchanged: MLX layers (z-lab MLX, optiq) are swapped, for the duration,
for callables that call them and record what they return; torch layers (transformers, DeepSpec,
z-lab torch) get forward hooks. Only the first call of each layer is kept: the harness localizes
on the first draft (block or step), where every layer's input is known on both sides.
"""

from __future__ import annotations

import contextlib


def _first(out: dict, i: int, y) -> None:
    y = y[0] if isinstance(y, tuple) else y
    out.setdefault(f"layer.{i}", y.detach().clone() if hasattr(y, "detach") else y)


@contextlib.contextmanager
def mlx_recorded(layers: list, out: dict):
    """out["layer.i"] = layer i's output ([1, n, H] as the reference returns it)."""
    saved = list(layers)

    def wrap(i, layer):
        def call(*args, **kw):
            y = layer(*args, **kw)
            _first(out, i, y)
            return y
        return call

    layers[:] = [wrap(i, layer) for i, layer in enumerate(saved)]
    try:
        yield out
    finally:
        layers[:] = saved


@contextlib.contextmanager
def torch_recorded(layers, out: dict):
    """The same through forward hooks on a torch ModuleList."""
    handles = [layer.register_forward_hook(lambda module, args, y, i=i: _first(out, i, y))
               for i, layer in enumerate(layers)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def as_numpy(recorded: dict, rows=None) -> dict:
    """Recorded layer outputs as float32 numpy [n, H] (batch dropped; `rows` a slice to keep)."""
    import numpy as np

    out = {}
    for k, y in recorded.items():
        if hasattr(y, "detach"):
            a = y.float().numpy()
        else:
            import mlx.core as mx

            a = np.array(y.astype(mx.float32))
        out[k] = a[0] if rows is None else a[0][rows]
    return out

"""Each drafter layer's output in a first draft call, observed from outside the model.

The model's code runs unchanged: MLX layers (z-lab MLX, optiq, and our own ports in their
adapters) are swapped, for the duration, for stand-ins that call them and record what they
return; torch layers (transformers, DeepSpec, z-lab torch) get forward hooks. Only the first call
of each layer is kept: the harness localizes on the first draft (block or step), where every
layer's input is known on both sides.
"""

from __future__ import annotations

import contextlib


def _first(out: dict, key: str, y) -> None:
    y = y[0] if isinstance(y, tuple) else y
    out.setdefault(key, y.detach().clone() if hasattr(y, "detach") else y)


class _Recording:
    """Stands in for one layer: calls it, records, and answers every attribute as the layer does
    (a model's loop may read `layer.layer_type`)."""

    def __init__(self, layer, key: str, out: dict, feed):
        self._layer, self._key, self._out, self._feed = layer, key, out, feed

    def __call__(self, *args, **kw):
        y = self._layer(*args, **kw)
        first = self._key not in self._out
        _first(self._out, self._key, y)
        if not first or self._feed is None:
            return y
        import mlx.core as mx

        head = y[0] if isinstance(y, tuple) else y          # a layer may return (h, k, v): feed h
        fed = mx.array(self._feed)[None].astype(head.dtype)
        return (fed, *y[1:]) if isinstance(y, tuple) else fed

    def __getattr__(self, name):
        return getattr(self._layer, name)


@contextlib.contextmanager
def mlx_recorded(layers: list, out: dict, prefix: str = "layer", feed: dict | None = None):
    """out[f"{prefix}.i"] = layer i's first output ([1, n, H] as the model returns it). With `feed`
    (the reference's layer.i [n, H]), that first call hands on feed["layer.i"] instead of its own
    output, so layer i+1 runs on the reference's input: its error is its own (the port's
    own-error run)."""
    saved = list(layers)
    layers[:] = [_Recording(layer, f"{prefix}.{i}", out, None if feed is None else feed[f"layer.{i}"])
                 for i, layer in enumerate(saved)]
    try:
        yield out
    finally:
        layers[:] = saved


@contextlib.contextmanager
def torch_recorded(layers, out: dict):
    """The same through forward hooks on a torch ModuleList."""
    handles = [layer.register_forward_hook(lambda module, args, y, i=i: _first(out, f"layer.{i}", y))
               for i, layer in enumerate(layers)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def to_numpy(a):
    """An MLX or torch array as numpy, every half type (bfloat16 and float16) through float32,
    which holds it exactly: the protocol's arrays are float32 whatever the case's dtype (numpy has
    no bfloat16, and a float16 left as it is would be compared in float16)."""
    import numpy as np

    if hasattr(a, "detach"):
        a = a.detach()
        return a.float().numpy() if a.is_floating_point() else a.numpy()
    import mlx.core as mx

    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


def as_numpy(recorded: dict) -> dict:
    """Recorded layer outputs as float32 numpy [n, H] (batch dropped; `to_numpy`)."""
    return {k: to_numpy(y)[0] for k, y in recorded.items()}

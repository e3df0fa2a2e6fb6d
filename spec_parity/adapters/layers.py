"""Our drafters' per-layer outputs, observed from outside the port (protocol `layer.*`, `own.*`).

For the duration of one draft, each entry of a model's `layers` list is swapped for a callable
that runs the layer and keeps its first output. The own-error run also hands on the reference's
output of that layer (`layer.i`, fed by the pair) instead of ours, so layer i+1 runs on the
reference's input: its error is its own, not inherited.
"""

from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def recorded(layers: list, out: dict, prefix: str = "layer", feed: dict | None = None):
    saved = list(layers)

    def wrap(i, layer):
        def call(*args, **kw):
            y = layer(*args, **kw)
            key = f"{prefix}.{i}"
            if key in out:
                return y
            out[key] = y
            if feed is None:
                return y
            import mlx.core as mx

            return mx.array(feed[f"layer.{i}"])[None].astype(y.dtype)
        return call

    layers[:] = [wrap(i, layer) for i, layer in enumerate(saved)]
    try:
        yield out
    finally:
        layers[:] = saved


def as_numpy(out: dict) -> dict:
    """[1, n, H] MLX arrays -> float32 numpy [n, H] (bf16 through fp32, which holds it exactly)."""
    import mlx.core as mx

    return {k: np.array(v[0].astype(mx.float32)) for k, v in out.items()}


def fed(inputs: dict) -> dict | None:
    """The reference's layer outputs among a request's inputs, or None when none are fed."""
    got = {k: v for k, v in inputs.items() if k.startswith("layer.")}
    return got or None

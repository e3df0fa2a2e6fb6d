"""The bucketed verify as one compiled call (port.serve.generate's `verify`, the default wherever
the verify is bucketed).

On the bucketed verify (port/compiled.py VerifyCache) a round's target forward has the same shapes
as the last round's until the buffers grow by a bucket; only the offset moves. Here the offset enters
as an int32 array and mlx-lm's own decoder layers are traced once per buffer length and row count
(mx.compile), so a round replays one graph instead of building the whole target in Python: about 25
ops a layer, 36 layers for Qwen3-4B, each host time while the GPU waits (the verify is most of a
serve round on MLX CUDA, docs/benchmarks.md). Nothing is re-written: the traced function is
targets.walk over BufferViews, the same layers, masks and head; the writes and the mask read the
offset array where the plain caches read an int (Gemma-4's kv-shared layers take it from their
owner's, its sliding layers' window is in the mask). Bit for bit the plain bucketed verify on the
CPU, Qwen3 and Gemma-4 targets (tests/test_bucketed_verify.py).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .. import compiled as pieces
from .. import targets

FAMILIES = ("qwen3", "gemma4")   # the walks of port/targets.py, each held by the tests


class BufferView(pieces.VerifyCache):
    """One layer's VerifyCache inside the traced verify: its buffers and offset (an int32 scalar
    array) are the compiled call's inputs, and a write is a scatter at that offset (compiled.written).
    The offset does not move here (each view is one layer's, written once); `forward` moves the
    caches'."""

    def __init__(self, keys, values, offset, bucket: int):
        super().__init__(bucket)
        self.keys, self.values, self.offset = keys, values, offset

    def length_after(self, n: int) -> int:
        return self.keys.shape[2]

    def update_and_fetch(self, keys, values):
        self.keys, self.values = pieces.written(self.keys, self.values, keys, values, self.offset)
        return self.keys, self.values


def unsupported(target: targets.Target, kv_bucket: int | None) -> str | None:
    """Why a request's verify cannot be compiled (None: it can): no bucketed verify, another family,
    or mlx-lm's attention replaced in this process (dflash-mlx's loader hooks mlx-lm's Qwen3
    Attention class; its hook reads the cache's offset as an int, which a trace cannot give)."""
    if kv_bucket is None:
        return "it needs a bucketed verify (kv_bucket)"
    if target.family not in FAMILIES:
        return f"it takes targets of {FAMILIES} (this one: {target.family})"
    for layer in target.model.model.layers:
        cls = type(layer.self_attn)
        if getattr(cls.__call__, "__module__", cls.__module__) != cls.__module__:
            return f"{cls.__module__}.{cls.__name__} is replaced in this process by {cls.__call__.__module__}"
    return None


def ready(caches: list) -> bool:
    """VerifyCaches that hold their buffers (every forward after the prefill)."""
    return bool(caches) and all(isinstance(c, pieces.VerifyCache) and c.keys is not None for c in caches)


def traced(target: targets.Target, bucket: int, ids, offset, keys, values):
    """The verify over the buffers at `offset`: (logits, final, hidden, keys, values)."""
    views = [BufferView(k, v, offset, bucket) for k, v in zip(keys, values)]
    trace = targets.walk(target, ids, caches=views)
    return trace.logits, trace.final, trace.hidden, [v.keys for v in views], [v.values for v in views]


def forward(target: targets.Target, ids, caches: list) -> targets.Trace:
    """targets.forward(target, ids, caches=caches) for `ready` caches, as one compiled call (traced
    again only for a new buffer length or row count); the caches' buffers are handed over, so the
    writes can be in place."""
    trace = forward_at(target, ids, caches, mx.array(caches[0].offset, mx.int32))
    for c in caches:
        c.offset += ids.shape[1]
    return trace


def forward_at(target: targets.Target, ids, caches: list, offset: mx.array) -> targets.Trace:
    """`forward` with the rows written at `offset`, an int32 array the host need not know (the
    pipelined loop's, port/serve.py); the caches' own offset is a bound on it, for their room, and
    does not move."""
    n, bucket = ids.shape[1], caches[0].step
    for c in caches:
        c.reserve(n, c.keys.shape[:2] + (c.keys.shape[3], c.values.shape[3]), c.keys.dtype)
    key = ("verify", bucket)
    if key not in target.compiled:
        target.compiled[key] = mx.compile(partial(traced, target, bucket), inputs=[target.model.state])
    logits, final, hidden = pieces.over_buffers(caches, partial(target.compiled[key], ids, offset))
    return targets.Trace(logits, hidden, final)

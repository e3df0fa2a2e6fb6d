"""The bucketed verify as one compiled call (spec_parity.port.serve.generate's `verify`, the default wherever
the verify is bucketed).

On the bucketed verify (port/compiled.py VerifyCache) a round's target forward has the same shapes
as the last round's until the buffers grow by a bucket; only the offset moves. Here the offset enters
as an int32 array and mlx-lm's own decoder layers are traced once per buffer length and row count
(mx.compile), so a round replays one graph instead of building the whole target in Python: about 25
ops a layer, 36 layers for Qwen3-4B, each host time while the GPU waits (the verify is most of a
serve round on MLX CUDA: docs/benchmarks.md, "Serving beside every peer's own loop"). Nothing
is re-written: the traced function is targets.walk over BufferViews, the same layers, masks and
head; the writes and the mask read the offset array where the plain caches read an int (Gemma-4's
kv-shared layers take it from their owner's, its sliding layers' window is in the mask). Bit for
bit the plain bucketed verify on the CPU, Qwen3 and Gemma-4 targets (tests/test_bucketed_verify.py).

With `attention="kernel"` (spec_parity.port.serve.generate's verify="kernel": the default on MLX CUDA with
bf16 Qwen3 targets) the attention is port/fast/kernels.py's instead of mx.fast's over the whole
buffer: on MLX CUDA 0.32.4 that one is a cuDNN launch of ~51 us a layer for 16 rows over 2304 keys
whose K/V read takes ~4 us (tools/verify_device_time.py). The kernels read the buffer in place
up to the offset and mask by position, so no mask is built either: 41% less attention time on the
GPU, and its loop 1.03-1.41x the compiled verify's in serving (docs/benchmarks.md, "The kernel
verify against the compiled one"). mlx-lm's layer cannot take another attention, so
`traced_kernel` calls its modules itself, in its order: held bit for bit to `traced` on the CPU
with mlx-lm's attention put back, and on MLX CUDA no further from the fp32 verify than mx.fast's
bf16 attention by 1.5x (tests/test_bucketed_verify.py).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .. import compiled as pieces
from .. import targets
from . import kernels

FAMILIES = ("qwen3", "gemma4")   # the walks of port/targets.py, each held by the tests


class BufferView(pieces.VerifyCache):
    """One layer's VerifyCache inside the traced verify: its buffers and offset (an int32 scalar
    array) are the compiled call's inputs, and a write is a scatter at `rows` (compiled.rows_at of
    the offset, one array for every layer). The offset does not move here (each view is one
    layer's, written once); `forward` moves the caches'."""

    def __init__(self, keys, values, offset, bucket: int, rows):
        super().__init__(bucket)
        self.keys, self.values, self.offset, self.rows = keys, values, offset, rows

    def length_after(self, n: int) -> int:
        return self.keys.shape[2]

    def update_and_fetch(self, keys, values):
        self.keys, self.values = pieces.written(self.keys, self.values, keys, values, self.rows)
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


def kernel_unsupported(target: targets.Target, kv_bucket: int | None) -> str | None:
    """Why the compiled verify cannot take the kernels' attention (None: it can): `unsupported`,
    a family other than qwen3 (the layers traced_kernel walks), or kernels that do not run here or
    not on tensor cores (compute capability 8.0 or newer, bf16 activations, head_dim <= 128; their
    fp32 path is slower than mx.fast's)."""
    if why := unsupported(target, kv_bucket):
        return why
    if target.family != "qwen3":
        return f"its attention kernels are wired into qwen3 layers only (this target: {target.family})"
    if not kernels.available():
        return "its attention kernels run on MLX's CUDA backend only"
    proj = target.model.model.layers[0].self_attn.q_proj
    dtype, head_dim = getattr(proj, "scales", proj.weight).dtype, target.config["head_dim"]
    if why := kernels.tensor_core_refusal(dtype, head_dim):
        return f"its attention kernels {why}"
    if not kernels.fits(head_dim):
        return f"its attention kernels take a head_dim that is a multiple of 16 (this target: {head_dim})"
    return None


def ready(caches: list) -> bool:
    """VerifyCaches that hold their buffers (every forward after the prefill)."""
    return bool(caches) and all(isinstance(c, pieces.VerifyCache) and c.keys is not None for c in caches)


def traced(target: targets.Target, bucket: int, ids, offset, keys, values):
    """The verify over the buffers at `offset`: (logits, final, hidden, keys, values)."""
    rows = pieces.rows_at(offset, ids.shape[1])
    views = [BufferView(k, v, offset, bucket, rows) for k, v in zip(keys, values)]
    trace = targets.walk(target, ids, caches=views)
    return trace.logits, trace.final, trace.hidden, [v.keys for v in views], [v.values for v in views]


def kernel_attention(q, keys, values, k, v, valid, scale: float):
    """The new rows' attention by port/fast/kernels.py: the buffer's rows below valid[0] (the
    offset, as kernels.device_valid makes it) as the context, the new rows k, v (written there) as
    a causal block."""
    return kernels.attention(q, keys, values, k, v, valid, scale, causal=True)


def traced_kernel(target: targets.Target, bucket: int, ids, offset, keys, values):
    """`traced` on a qwen3 target, its attention kernel_attention: (logits, final, hidden, keys, values)."""
    tm = target.model.model
    h = tm.embed_tokens(ids)
    hidden, keys, values = [h], list(keys), list(values)
    valid, rows = kernels.device_valid(offset), pieces.rows_at(offset, ids.shape[1])
    for i, layer in enumerate(tm.layers):
        view = BufferView(keys[i], values[i], offset, bucket, rows)
        h = _qwen3_layer(layer, h, view, valid)
        hidden.append(h)
        keys[i], values[i] = view.keys, view.values
    final = tm.norm(h)
    return targets.head(target, final), final, hidden, keys, values


def _qwen3_layer(layer, x, view: BufferView, valid):
    """mlx-lm's Qwen3 decoder layer (TransformerBlock, Attention) over `view`, its attention kernel_attention."""
    a = layer.self_attn
    B, L, _ = x.shape
    y = layer.input_layernorm(x)
    q = a.q_norm(a.q_proj(y).reshape(B, L, a.n_heads, -1)).transpose(0, 2, 1, 3)
    k = a.k_norm(a.k_proj(y).reshape(B, L, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v = a.v_proj(y).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = a.rope(q, offset=view.offset), a.rope(k, offset=view.offset)
    keys, values = view.update_and_fetch(k, v)
    o = kernel_attention(q, keys, values, k, v, valid, a.scale)
    h = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def forward(target: targets.Target, ids, caches: list, attention: str = "sdpa") -> targets.Trace:
    """targets.forward(target, ids, caches=caches) for `ready` caches, as one compiled call (traced
    again only for a new buffer length or row count); the caches' buffers are handed over, so the
    writes can be in place. `attention`: "sdpa" (mlx-lm's layers as they are) or "kernel"
    (traced_kernel, qwen3 targets)."""
    trace = forward_at(target, ids, caches, mx.array(caches[0].offset, mx.int32), attention)
    for c in caches:
        c.offset += ids.shape[1]
    return trace


def forward_at(target: targets.Target, ids, caches: list, offset: mx.array, attention: str = "sdpa") -> targets.Trace:
    """`forward` with the rows written at `offset`, an int32 array the host need not know (the
    pipelined loop's, port/serve.py); the caches' own offset is a bound on it, for their room, and
    does not move."""
    n, bucket = ids.shape[1], caches[0].step
    for c in caches:
        c.reserve(n, c.keys.shape[:2] + (c.keys.shape[3], c.values.shape[3]), c.keys.dtype)
    key = ("verify", bucket, attention)
    if key not in target.compiled:
        target.compiled[key] = mx.compile(partial(traced_kernel if attention == "kernel" else traced, target, bucket), inputs=[target.model.state])
    logits, final, hidden = pieces.over_buffers(caches, partial(target.compiled[key], ids, offset))
    return targets.Trace(logits, hidden, final)

"""Compiled step pieces, shared by the drafter ports.

A draft step or block is split where its shapes change: the attention over the context / donor
K/V (whose length grows every round) runs outside mx.compile, the shape-stable pieces between
two attentions run through it. Positions and token ids enter as arrays, so a new round does not
retrace. The plain pieces are the same functions uncompiled (`model.compiled = False`), and the
tests hold the two bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

from .fast import kernels


class Pieces:
    """A model's pieces, compiled once on first use with the module's parameters as compile inputs
    (a weight replaced later is seen, not a stale constant). A plain object, so it is not part of
    the module's state."""

    def __init__(self):
        self.compiled = None

    def get(self, model, build):
        """build() -> (plain, reads): `plain` (a tuple / list tree of functions) as is, or its
        compiled twin when `model.compiled` (build runs once then, not on every call). `reads`: the
        same tree, each piece's list of the modules it reads (their parameters its compile inputs,
        flattened at every call: fewer is less host time); None: the whole model for every piece."""
        if not model.compiled:
            return build()[0]
        if self.compiled is None:
            plain, reads = build()
            reads = tree_map(lambda _: [model.state], plain) if reads is None else reads
            self.compiled = tree_map(lambda fn, inputs: mx.compile(fn, inputs=inputs), plain, reads)
        return self.compiled


class PiecesBy:
    """Pieces per key (e.g. the target whose parts a block reads)."""

    def __init__(self):
        self.by: dict = {}

    def get(self, model, key, build):
        return self.by.setdefault(key, Pieces()).get(model, build)


def position(model, value: int):
    """A position for the pieces: an array when compiled (no retrace per value), else the int."""
    return mx.array(value, mx.int32) if model.compiled else value


# ---- the bucketed path (`kv_bucket`; the serve loop's default for DSpark and DFlash) ------------
#
# On MLX CUDA an attention with several query rows plans its kernel once per key length (~60 ms of
# host time on an H200, MLX 0.32.4), and the pieces above split a block at every attention because
# the context grows each round. With a bucket the context K/V is presented at its buffer's length,
# a multiple of the bucket, with the unused tail masked, so every shape of a block is constant
# within a bucket: the whole block runs as one compiled call that retraces only when the buffer
# grows. The valid length enters as an array. Attention (`bucket_attention`; AUTO, the default:
# "kernel" on MLX CUDA with bf16 weights, else "sdpa"): "sdpa",
# mx.fast.scaled_dot_product_attention over [context buffer | block] joined with a float mask: one
# fused kernel on the GPU, but a copy of the context per layer and call; measured bit-exact with
# the default path on the CPU backend (fp32 and bf16), not guaranteed on the GPU (another kernel
# over a padded key range). "two-segment": no copy, more ops, a softmax summed in another order
# (fp32: within tolerance; bf16: the two PV products round apart, measured up to 0.16 on tiny
# logits). "kernel" (MLX CUDA only): port/fast/kernels.py, two custom kernels that read the buffer in
# place up to the valid length and mask by position, two launches a layer. Held to the plain path
# within fp32 tolerance (bit-exact on the CPU with "sdpa").


BUCKET_ATTENTIONS = ("sdpa", "two-segment", "kernel")
BUCKET = 256   # rows: mlx-lm KVCache's own growth step; the providers' and serve loop's default
AUTO = "auto"  # a provider's / the serve loop's kv_bucket default: BUCKET wherever the path holds


def check_attention(attention: str, error, head_dim: int | None = None) -> str:
    """The bucketed attention: AUTO (resolve_attention) or one of BUCKET_ATTENTIONS ("kernel":
    MLX CUDA only, and a head_dim the kernels take)."""
    if attention == AUTO:
        return attention
    if attention not in BUCKET_ATTENTIONS:
        raise error(f"bucket_attention={attention!r}: expected one of {BUCKET_ATTENTIONS}")
    if attention == "kernel":
        if not kernels.available():
            raise error("bucket_attention='kernel' runs on MLX's CUDA backend only (mx.cuda.is_available() is "
                        "False or the default device is the CPU); use bucket_attention='sdpa'")
        if head_dim is not None:
            kernels.check(head_dim, error)
    return attention


def resolve_attention(attention: str, head_dim: int, dtype: mx.Dtype) -> str:
    """AUTO: "kernel" where the kernels beat mx.fast's attention (MLX CUDA, bf16 weights: their
    tensor-core path, docs/benchmarks.md "The draft step"; on fp32 their FMA path is the slower
    one), else "sdpa"."""
    if attention != AUTO:
        return attention
    return "kernel" if kernels.available() and kernels.fits(head_dim) and dtype == mx.bfloat16 else "sdpa"


class ResolvedAttention:
    """A bucketed block's `bucket_attention`: the one asked for (`self.attention`), AUTO resolved
    by its weights' dtype as they are now (a mixin of DSpark's and DFlash's Bucketed)."""

    @property
    def bucket_attention(self) -> str:
        return resolve_attention(self.attention, self.args.head_dim, self.layers[0].self_attn.q_proj.weight.dtype)


def check_bucket(kv_bucket, error) -> int | None:
    """A bucket is None (off) or a positive int number of rows."""
    if kv_bucket is None:
        return None
    if isinstance(kv_bucket, bool) or not isinstance(kv_bucket, int) or kv_bucket < 1:
        raise error(f"kv_bucket={kv_bucket!r}: expected a positive number of context rows (e.g. 256, mlx-lm "
                    "KVCache's growth step) or None (off)")
    return kv_bucket


class BucketCache(KVCache):
    """mlx-lm's KVCache whose buffer is always a whole number of buckets long (mlx-lm's own growth
    slices the buffer to the rows written before it grows, so its length drifts off the step).
    `buffers()` is the whole buffer, valid rows first; rows past `offset` are zeros or stale."""

    def __init__(self, bucket: int):
        super().__init__()
        self.step = bucket

    def length_after(self, n: int) -> int:
        """The buffer's length once n more rows are written."""
        have = 0 if self.keys is None else self.keys.shape[2]
        return max(have, -(-(self.offset + n) // self.step) * self.step)

    def reserve(self, n: int, heads: tuple, dtype: mx.Dtype):
        """Room for n rows past offset, heads = (B, kv heads, key dim, value dim) (zeros appended a
        bucket at a time); offset stays."""
        have = 0 if self.keys is None else self.keys.shape[2]
        if self.offset + n <= have:
            return
        grow = self.length_after(n) - have
        B, h, dk, dv = heads
        new_k = mx.zeros((B, h, grow, dk), dtype)
        new_v = mx.zeros((B, h, grow, dv), dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def update_and_fetch(self, keys, values):
        self.reserve(keys.shape[2], keys.shape[:2] + (keys.shape[3], values.shape[3]), keys.dtype)
        prev = self.offset
        self.offset += keys.shape[2]
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys_and_values()

    def buffers(self):
        return self.keys, self.values

    def hand_over(self):
        """The whole buffers, and the cache lets go of them: nothing else holds them, so MLX
        donates them to a write (in place, no copy); `take` gets them back."""
        keys, values = self.keys, self.values
        self.keys = self.values = None
        return keys, values

    def take(self, keys, values):
        """The buffers back (written to past offset)."""
        self.keys, self.values = keys, values


class VerifyCache(BucketCache):
    """A target layer's cache on the bucketed verify (spec_parity.port.serve.generate's `kv_bucket`): mlx-lm's
    layer gets the WHOLE buffer from update_and_fetch and `mask`'s additive mask, so the attention
    kernel sees a key length that changes only when the buffer grows by a bucket. Trimming (the
    serve loop's rejected drafts) only moves offset, as KVCache's does; rows past it are masked
    until they are overwritten."""

    def keys_and_values(self):
        return self.keys, self.values

    def mask(self, n: int, dtype: mx.Dtype, window: int | None = None) -> mx.array:
        """[1, 1, n, S] for the n rows about to be written at offset (S: the buffer's length after
        them): row i sees keys j <= offset + i (causal over the new rows), -inf past them; with a
        `window` only the newest `window` of those (mlx-lm's sliding mask)."""
        j, pos = mx.arange(self.length_after(n))[None], mx.arange(n)[:, None] + self.offset  # offset: int or array
        seen = (j <= pos) if window is None else (j <= pos) & (j > pos - window)
        return additive_mask(seen, dtype)[None, None]


def over_buffers(caches: list, fn, *args):
    """fn(*args, keys, values) over the caches' whole buffers, handed over (BucketCache.hand_over)
    and taken back from fn's last two outputs (lists per cache), or as they were if fn raises.
    fn's other outputs."""
    keys, values = zip(*(cache.hand_over() for cache in caches))
    try:
        *out, keys, values = fn(*args, list(keys), list(values))
    finally:
        for cache, k, v in zip(caches, keys, values, strict=True):
            cache.take(k, v)
    return out


def rows_at(at, n: int) -> mx.array:
    """The buffer rows at, at + 1, ..., at + n - 1 (`at` an int32 scalar array: where the host need
    not know it) as `written` takes them, [1, 1, n, 1]. Made once for every layer's write at the same
    offset: mx.compile does not merge the same arange-and-add made per layer, and on MLX CUDA each
    is two launches, host time in a host-bound round."""
    return (at + mx.arange(n, dtype=mx.int32)).reshape(1, 1, -1, 1)


def written(keys, values, k, v, rows):
    """K/V rows k, v [B, H, T, D] written into the buffers keys / values at `rows` (rows_at(at, T)):
    the buffers after. A scatter of the T rows, not mx.slice_update at an array start: on MLX CUDA
    (0.32.4) that one launches a thread per element of the whole buffer (copy_gg_dynamic over
    out.size(), the writes repeated modulo the rows), 22 us a write into 2304 rows on an H200,
    where the scatter's threads are the rows'."""
    return mx.put_along_axis(keys, rows, k, axis=2), mx.put_along_axis(values, rows, v, axis=2)


def additive_mask(seen, dtype: mx.Dtype) -> mx.array:
    """0 where `seen` (bool), -inf elsewhere: the float mask mx.fast's attention adds to its scores."""
    return mx.where(seen, mx.array(0, dtype), mx.array(-mx.inf, dtype))


def two_segment_attention(q, ctx_k, ctx_v, blk_k, blk_v, mask, scale: float):
    """softmax(q [ctx | block]^T * scale) [ctx | block] without joining the keys (no copy of the
    context): scores over each segment, masked (`mask` = (ctx_seen, blk_seen): bool, broadcast to
    [L, S] per query row, or None), one softmax over both, then p_ctx V_ctx + p_blk V_blk. GQA by
    folding the query heads of one KV head into its rows. q [B, Hq, L, D], K/V [B, Hkv, S, D]."""
    B, Hq, L, D = q.shape
    n_kv = ctx_k.shape[1]
    rep = Hq // n_kv
    if scale != 1.0:
        q = q * mx.array(scale, q.dtype)
    q = q.reshape(B, n_kv, rep * L, D)

    def scores(k, seen):
        s = (q @ k.swapaxes(-1, -2)).reshape(B, n_kv, rep, L, k.shape[2])
        return s if seen is None else mx.where(seen, s, mx.array(-mx.inf, s.dtype))

    S = ctx_k.shape[2]
    ctx_seen, blk_seen = mask
    p = mx.softmax(mx.concatenate([scores(ctx_k, ctx_seen), scores(blk_k, blk_seen)], axis=-1), axis=-1,
                   precise=True)
    p = p.reshape(B, n_kv, rep * L, -1)
    o = p[..., :S] @ ctx_v + p[..., S:] @ blk_v
    return o.reshape(B, Hq, L, -1)


def joined_sdpa(q, ctx_k, ctx_v, blk_k, blk_v, mask, scale: float):
    """The same attention as two_segment_attention through mx.fast.scaled_dot_product_attention
    over the keys joined (a copy of the context per call) with an additive float mask over [ctx |
    block] (joined_mask): one fused kernel on the GPU, planned once per bucket there (its key
    length is constant within one)."""
    keys = mx.concatenate([ctx_k, blk_k], axis=2)
    values = mx.concatenate([ctx_v, blk_v], axis=2)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def joined_mask(ctx_seen, blk_seen, L: int, S: int, dtype: mx.Dtype) -> mx.array:
    """joined_sdpa's additive mask [L, S + L] from the context's and the block's bool masks."""
    blk = mx.ones((L, L), mx.bool_) if blk_seen is None else mx.broadcast_to(blk_seen, (L, L))
    return additive_mask(mx.concatenate([mx.broadcast_to(ctx_seen, (L, S)), blk], axis=-1), dtype)


def bucketed_mask(how: str, valid, L: int, S: int, dtype: mx.Dtype, window: int | None = None,
                  causal: bool = False):
    """The mask bucketed_attention takes, built once for every layer that shares it. Block row i
    (at position valid + i) sees context row j when j < valid and, with a `window`, valid + i - j <
    window; block row m when not `causal` or m <= i. "sdpa": joined_sdpa's additive mask;
    "two-segment": two_segment_attention's pair of bool masks; "kernel": the kernels' arguments
    (they mask by position themselves)."""
    if how == "kernel":
        return kernels.device_valid(valid), window, causal
    seen = valid_rows(valid, S)
    if window is not None:
        seen = seen & (valid + mx.arange(L)[:, None] - mx.arange(S) < window)
    blk_seen = mx.arange(L)[None] <= mx.arange(L)[:, None] if causal else None
    return joined_mask(seen, blk_seen, L, S, dtype) if how == "sdpa" else (seen, blk_seen)


def bucketed_attention(how: str, q, ctx_k, ctx_v, blk_k, blk_v, mask, scale: float):
    """joined_sdpa, two_segment_attention or the kernels (BUCKET_ATTENTIONS), same arguments;
    `mask` from bucketed_mask."""
    if how == "kernel":
        valid, window, causal = mask
        return kernels.attention(q, ctx_k, ctx_v, blk_k, blk_v, valid, scale, window, causal)
    return (joined_sdpa if how == "sdpa" else two_segment_attention)(q, ctx_k, ctx_v, blk_k, blk_v, mask, scale)


def valid_rows(valid, S: int):
    """[S] bool: buffer rows below `valid` (a scalar array)."""
    return mx.arange(S) < valid


class Bucketed:
    """One compiled call per model (and per what it closes over, e.g. DFlash's target), with the
    module's parameters (and the target's) as compile inputs; plain when `model.compiled` is
    off. `traces` counts the traces (the traced function bumps it; it runs only while tracing)."""

    def __init__(self):
        self.fns: dict = {}
        self.traces = 0

    def get(self, model, key, fn, inputs):
        if not model.compiled:
            return fn
        if key not in self.fns:
            self.fns[key] = mx.compile(fn, inputs=inputs)
        return self.fns[key]

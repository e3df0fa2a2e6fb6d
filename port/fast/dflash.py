"""Fast paths of the DFlash port (port/dflash.py), subclasses of its plain Model.

Compiled (the plain fast path, `kv_bucket=None`): the block is split where its shapes change: the
attention over the growing context runs outside mx.compile, the shape-stable pieces between two
attentions through it (port/compiled.py). Bit for bit the plain forward (tests/test_speed.py).

Bucketed (`kv_bucket`; the provider's default, port/sources/dflash.py): every layer keeps every
context row in a buffer a whole number of buckets long (port/compiled.py BucketCache; sliding layers
mask the window instead of rotating), presented whole with the tail masked, and the block
(embedding, layers, final norm, the target's head) is one compiled call that retraces only when the
buffer grows (or the block length changes); mx.fast's attention over [context | block] joined with a
float mask, or (bucket_attention="two-segment") a two-segment softmax. Held to the plain forward
within fp32 tolerance (bit-exact on the CPU backend with "sdpa", measured: tests/test_bucketed.py).
window="zlab-mlx" (a quirk of the ring's buffer order) is refused with it."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx

from .. import compiled as pieces
from .. import dflash, targets


def enter(m: dflash.Model, h, block_at):
    """Layer 0's block Q, K, V."""
    return m.layers[0].qkv(h, block_at)


def between(m: dflash.Model, i: int, h, o, block_at):
    """Layer i's output and layer i+1's block Q, K, V."""
    h = m.layers[i].finish(h, m.layers[i].self_attn.output(o))
    return (h,) + m.layers[i + 1].qkv(h, block_at)


def leave(m: dflash.Model, h, o):
    """The last layer's output -> final norm over block rows 1..n."""
    return m.norm(m.layers[-1].finish(h, m.layers[-1].self_attn.output(o))[:, 1:])


class Compiled(dflash.Model):
    """`compiled` (default on) compiles the pieces; off, the same pieces run plain."""

    def __init__(self, a: dflash.ModelArgs, window: str = "positional", embed: str = "scaled",
                 compiled: bool = True):
        super().__init__(a, window, embed)
        self.compiled = compiled
        self._pieces = pieces.Pieces()

    def attend(self, attn: dflash.Attention, q, bk, bv, ctx, cache):
        return attn.attend(q, bk, bv, ctx, cache)

    def pieces(self) -> tuple:
        """(enter, [between_i], exit), plain or compiled."""
        n = len(self.layers)
        return self._pieces.get(self, (partial(enter, self), [partial(between, self, i) for i in range(n - 1)],
                                       partial(leave, self)))

    def __call__(self, h, ctx, caches):
        first, middle, last = self.pieces()
        at = [pieces.position(self, p) for p in self.block_positions(ctx, caches)]
        q, bk, bv = first(h, at[0])
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            o = self.attend(layer.self_attn, q, bk, bv, ctx, cache)
            if i < len(middle):
                h, q, bk, bv = middle[i](h, o, at[i + 1])
        return last(h, o)


class RowsAsHeads(Compiled):
    """Compiled, with the block rows of a layer whose rows all see every key (full attention, not
    causal: DFlash's default) folded into the query heads: a one-row query over the exact keys,
    which MLX CUDA attends with its vector kernel (or cuDNN's decode plan, one per 256-row buffer)
    rather than planning a multi-row attention per key length."""

    def attend(self, attn: dflash.Attention, q, bk, bv, ctx, cache):
        keys, values, n_ctx = attn.join(bk, bv, ctx, cache)
        mask = attn.mask(n_ctx, q.shape[2])
        if mask is not None:
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
        o = mx.fast.scaled_dot_product_attention(rows_as_heads(q), keys, values, scale=attn.scale)
        return o.reshape(q.shape[:3] + o.shape[-1:])


def rows_as_heads(q):
    """[B, H, L, D] -> [B, H * L, 1, D]: head h's row l becomes query head h * L + l, whose KV head
    under GQA, (h * L + l) // (L * H / H_kv), is head h's own, h // (H / H_kv)."""
    B, H, L, D = q.shape
    return q.reshape(B, H * L, 1, D)


class Bucketed(Compiled):
    """The bucketed block over one BucketCache per layer (`make_caches`); `compiled` off runs the
    same block function plain (the trace counter's control)."""

    def __init__(self, a: dflash.ModelArgs, window: str = "positional", embed: str = "scaled",
                 kv_bucket: int = 256, attention: str = "sdpa", compiled: bool = True):
        super().__init__(a, window, embed, compiled)
        self.kv_bucket = pieces.check_bucket(kv_bucket, attention, dflash.DFlashError)
        if window == "zlab-mlx" and "sliding_attention" in a.layer_types:
            raise dflash.DFlashError("kv_bucket with window='zlab-mlx': that window follows the rotating buffer's "
                                     "order, which a bucketed context (every row, in time order) does not have; use "
                                     "window='positional' (z-lab torch's semantics) or kv_bucket=None")
        self.bucket_attention = attention
        self._bucketed = pieces.Bucketed()

    def make_caches(self) -> list:
        """Every layer every context row, in a BucketCache."""
        return [pieces.BucketCache(self.kv_bucket) for _ in self.args.layer_types]

    def block(self, target: targets.Target, anchor: int, n: int, ctx_rows, caches: list) -> dflash.Block:
        """The new context rows join the buffers (plain ops: their count varies per round), then
        the compiled block over the whole buffers."""
        ids, c = self.block_inputs(anchor, n, ctx_rows)
        if not all(isinstance(cache, pieces.BucketCache) for cache in caches):
            raise dflash.DFlashError("kv_bucket: the caches must be BucketCaches (Model.make_caches makes them)")
        for layer, cache in zip(self.layers, caches):
            cache.update_and_fetch(*layer.self_attn.context_kv(c, cache.offset))
        fn = self._bucketed.get(self, (id(target), self.bucket_attention), partial(self.bucketed, target),
                                [self.state, self.borrowed(target)])
        room = ids.shape[1] if self.bucket_attention == "in-place" else 0
        return dflash.Block(*pieces.over_buffers(caches, room, fn, ids, mx.array(caches[0].offset, mx.int32)))

    def bucketed(self, target: targets.Target, ids, valid, keys, values):
        """The whole block over the bucketed buffers (rows from `valid` masked), as arrays:
        hidden, logits, tokens, and the buffers after it."""
        self._bucketed.traces += 1
        h = self.embed(target, ids)
        q, bk, bv = enter(self, h, valid)
        keys, values = list(keys), list(values)
        for i, layer in enumerate(self.layers):
            o, keys[i], values[i] = attend(layer.self_attn, self.bucket_attention, q, bk, bv, keys[i], values[i],
                                           valid)
            if i < len(self.layers) - 1:
                h, q, bk, bv = between(self, i, h, o, valid)
        hidden = leave(self, h, o)
        logits = self.logits(target, hidden)
        return hidden[0, ...], logits[0, ...], mx.argmax(logits[0, ...], axis=-1), keys, values


def attend(attn: dflash.Attention, how: str, q, bk, bv, keys, values, valid):
    """Attention.attend over a bucketed context buffer (every context row kept, in time order: row
    j is position j; rows from `valid` on masked; the block sits at valid..): full layers see every
    valid row, sliding layers those within the window of each block row (window="positional");
    the block rows see each other (causal: the earlier ones only). The attention and the buffers
    after it (pieces.bucketed_attention)."""
    L = q.shape[2]
    seen = pieces.valid_rows(valid, keys.shape[2])
    if attn.sliding:
        seen = seen & (valid + mx.arange(L)[:, None] - mx.arange(keys.shape[2]) < attn.a.sliding_window)
    causal = mx.arange(L)[None] <= mx.arange(L)[:, None] if attn.causal else None
    return pieces.bucketed_attention(how, q, keys, values, seen, bk, bv, causal, attn.scale, valid)


EXACT_ATTENTIONS = ("block", "rows-as-heads")


def load(path: str | Path, window: str = "positional", embed: str = "scaled", compiled: bool = True,
         kv_bucket: int | str | None = None, bucket_attention: str = "sdpa", scales: str = "either",
         exact_attention: str = "block") -> Compiled:
    """The drafter on a fast path: Compiled (RowsAsHeads with exact_attention="rows-as-heads"), or
    Bucketed with a `kv_bucket` (pieces.AUTO: pieces.BUCKET rows unless window="zlab-mlx" meets
    sliding layers, which only Compiled holds)."""
    if exact_attention not in EXACT_ATTENTIONS:
        raise dflash.DFlashError(f"exact_attention={exact_attention!r}: expected one of {EXACT_ATTENTIONS}")

    def build(a: dflash.ModelArgs, w: str, e: str) -> Compiled:
        rows = kv_bucket
        if rows == pieces.AUTO:
            rows = None if w == "zlab-mlx" and "sliding_attention" in a.layer_types else pieces.BUCKET
        if pieces.check_bucket(rows, bucket_attention, dflash.DFlashError) is None:
            return (RowsAsHeads if exact_attention == "rows-as-heads" else Compiled)(a, w, e, compiled)
        return Bucketed(a, w, e, rows, bucket_attention, compiled)

    return dflash.load(path, window, embed, scales, build)

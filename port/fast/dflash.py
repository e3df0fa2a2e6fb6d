"""Fast paths of the DFlash port (port/dflash.py), subclasses of its plain Model.

Compiled (the plain fast path, `kv_bucket=None`): the block is split where its shapes change: the
attention over the growing context runs outside mx.compile, the shape-stable pieces between two
attentions through it (port/compiled.py). Bit for bit the plain forward (tests/test_speed.py).

Bucketed (`kv_bucket`; the provider's default, port/sources/dflash.py): every layer keeps every
context row in a buffer a whole number of buckets long (port/compiled.py BucketCache; sliding layers
mask the window instead of rotating), presented whole with the tail masked, and the block
(embedding, layers, final norm, the target's head) is one compiled call that retraces only when the
buffer grows (or the block length changes). Its attention (`bucket_attention`, default AUTO:
"kernel" on MLX CUDA with bf16 weights, else "sdpa"): mx.fast's over [context | block] joined with
a float mask, the custom CUDA kernels of port/fast/kernels.py (the buffer read in place up to the
valid length, two launches a layer; tests/test_kernels.py), or "two-segment", a two-segment
softmax. It builds few graph nodes, each host time on MLX CUDA: 2-D rows, projections on
transposed weight views (fusion.Transposed), one mask per layer kind. Held to the plain forward
within fp32 tolerance (bit-exact on the CPU backend with "sdpa", measured: tests/test_bucketed.py).
window="zlab-mlx" (a quirk of the ring's buffer order) is refused with it.

Exact (`kv_bucket` with bucket_attention="exact", opt-in; full non-causal layers only): the block
rows folded into the query heads over a view of the buffers at the exact key length, one cuDNN
plan per buffer length on MLX CUDA, no mask; the writes into the buffers in place. Bit for bit the
compiled block on the CPU (tests/test_speed.py); measured on an H200, not faster than the default
there, so not the default."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .. import compiled as pieces
from .. import dflash, targets
from . import fusion


def enter(m: dflash.Model, h, block_at):
    """Layer 0's block Q, K, V."""
    return m.layers[0].qkv(h, block_at)


def between(m: dflash.Model, i: int, h, o, block_at):
    """Layer i's output and layer i+1's block Q, K, V."""
    h = m.layers[i].finish(h, m.layers[i].self_attn.output(o))
    return (h,) + m.layers[i + 1].qkv(h, block_at)


def leave(m: dflash.Model, h, o):
    """The last layer's output -> final norm over block rows 1..n."""
    return m.norm(m.layers[-1].finish(h, m.layers[-1].self_attn.output(o))[..., 1:, :])


class Compiled(dflash.Model):
    """`compiled` (default on) compiles the pieces; off, the same pieces run plain."""

    def __init__(self, a: dflash.ModelArgs, window: str = "positional", embed: str = "scaled",
                 compiled: bool = True):
        super().__init__(a, window, embed)
        self.compiled = compiled
        self._pieces = pieces.Pieces()

    def pieces(self) -> tuple:
        """(enter, [between_i], exit), plain or compiled."""
        n, layers = len(self.layers), self.layers
        return self._pieces.get(self, lambda: (
            (partial(enter, self), [partial(between, self, i) for i in range(n - 1)], partial(leave, self)),
            ([layers[0]], [[layers[i], layers[i + 1]] for i in range(n - 1)], [layers[-1], self.norm])))

    def __call__(self, h, ctx, caches):
        first, middle, last = self.pieces()
        at = [pieces.position(self, p) for p in self.block_positions(ctx, caches)]
        q, bk, bv = first(h, at[0])
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            o = layer.self_attn.attend(q, bk, bv, ctx, cache)
            if i < len(middle):
                h, q, bk, bv = middle[i](h, o, at[i + 1])
        return last(h, o)


def rows_as_heads(q):
    """[B, H, L, D] -> [B, H * L, 1, D]: head h's row l becomes query head h * L + l, whose KV head
    under GQA, (h * L + l) // (L * H / H_kv), is head h's own, h // (H / H_kv)."""
    B, H, L, D = q.shape
    return q.reshape(B, H * L, 1, D)


def heads_as_rows(o, heads: int):
    """rows_as_heads undone on the attention's output."""
    return o.reshape(o.shape[0], heads, -1, o.shape[-1])


def exact_context(m: dflash.Model, rows, offset, keys, values):
    """The new context rows' K/V (projected from their raw taps) written into every layer's buffer
    at `offset`."""
    c = m.project(rows)
    keys, values, at = list(keys), list(values), pieces.rows_at(offset, rows.shape[1])
    for i, layer in enumerate(m.layers):
        keys[i], values[i] = pieces.written(keys[i], values[i], *layer.self_attn.context_kv(c, offset), at)
    return [keys, values]


def exact_enter(m: dflash.Model, target, ids, at, k, v):
    """The block's embedding; layer 0's query (rows as heads) and its K/V written at `at`."""
    h = m.embed(target, ids)
    q, bk, bv = m.layers[0].qkv(h, at)
    return (h, rows_as_heads(q)) + pieces.written(k, v, bk, bv, pieces.rows_at(at, bk.shape[2]))


def exact_between(m: dflash.Model, i: int, h, o, at, k, v):
    """Layer i's output; layer i+1's query (rows as heads) and its K/V written at `at`."""
    h = m.layers[i].finish(h, m.layers[i].self_attn.output(heads_as_rows(o, m.layers[i].self_attn.n_heads)))
    q, bk, bv = m.layers[i + 1].qkv(h, at)
    return (h, rows_as_heads(q)) + pieces.written(k, v, bk, bv, pieces.rows_at(at, bk.shape[2]))


def exact_leave(m: dflash.Model, target, h, o):
    """The last layer's output -> hidden, logits and tokens (Block's arrays)."""
    hidden = leave(m, h, heads_as_rows(o, m.layers[-1].self_attn.n_heads))
    logits = m.logits(target, hidden)
    return hidden[0, ...], logits[0, ...], mx.argmax(logits[0, ...], axis=-1)


class Exact(Compiled):
    """The exact block (`bucket_attention="exact"`): every layer full attention and not causal
    (z-lab's default), so every block row sees every key and the rows fold into the query heads
    (rows_as_heads): a one-row query over the exact keys, a view of a BucketCache buffer, which
    MLX CUDA attends with cuDNN's decode plan, one per buffer length (a multiple of 256 rows: with
    another bucket, MLX's slower vector kernel) rather than one multi-row plan per key length. No
    mask and no padded keys; the context rows and the block's K/V are written into the buffers,
    handed over so that MLX can donate them to the writes (in place on the CPU, measured; on MLX
    CUDA not measurable by peak memory). The pieces between the attentions are compiled, the attentions
    and their views not (the key length changes every round)."""

    def __init__(self, a: dflash.ModelArgs, window: str = "positional", embed: str = "scaled",
                 kv_bucket: int = pieces.BUCKET, compiled: bool = True):
        super().__init__(a, window, embed, compiled)
        if any(layer.self_attn.sliding or layer.self_attn.causal for layer in self.layers):
            raise dflash.DFlashError("bucket_attention='exact' needs every layer full attention and not causal "
                                     f"(this drafter's layer_types {a.layer_types}, is_causal {a.is_causal}); "
                                     "use bucket_attention='sdpa'")
        self.kv_bucket = pieces.check_bucket(kv_bucket, dflash.DFlashError)
        self._exact = pieces.PiecesBy()

    def make_caches(self) -> list:
        return [pieces.BucketCache(self.kv_bucket) for _ in self.args.layer_types]

    def exact_pieces(self, target: targets.Target) -> tuple:
        """(context, enter, [between_i], leave), plain or compiled, for `target`."""
        def build():
            n, layers, borrowed = len(self.layers), self.layers, self.borrowed(target)
            plain = (partial(exact_context, self), partial(exact_enter, self, target),
                     [partial(exact_between, self, i) for i in range(n - 1)], partial(exact_leave, self, target))
            reads = ([self.fc, self.hidden_norm] + [layer.self_attn for layer in layers], [layers[0]] + borrowed,
                     [[layers[i], layers[i + 1]] for i in range(n - 1)], [layers[-1], self.norm] + borrowed)
            return plain, reads

        return self._exact.get(self, id(target), build)

    def block(self, target: targets.Target, anchor: int, n: int, ctx_rows, caches: list) -> dflash.Block:
        self.check_rows(ctx_rows)
        if not all(isinstance(cache, pieces.BucketCache) for cache in caches):
            raise dflash.DFlashError("bucket_attention='exact': the caches must be BucketCaches (Model.make_caches)")
        ids = targets.block_ids(anchor, self.args.mask_token_id, n)
        S, L, offset = ctx_rows.shape[1], ids.shape[1], caches[0].offset
        heads = (1, self.layers[0].self_attn.n_kv, self.args.head_dim, self.args.head_dim)
        for cache in caches:
            cache.reserve(S + L, heads, self.fc.weight.dtype)
        context, first, middle, last = self.exact_pieces(target)
        at, end = mx.array(offset + S, mx.int32), offset + S + L

        def run(keys, values):
            keys, values = context(ctx_rows, mx.array(offset, mx.int32), keys, values)
            h, q, keys[0], values[0] = first(ids, at, keys[0], values[0])
            for i, layer in enumerate(self.layers):
                o = mx.fast.scaled_dot_product_attention(q, keys[i][..., :end, :], values[i][..., :end, :],
                                                         scale=layer.self_attn.scale)
                if i < len(middle):
                    h, q, keys[i + 1], values[i + 1] = middle[i](h, o, at, keys[i + 1], values[i + 1])
            return last(h, o) + (keys, values)

        out = pieces.over_buffers(caches, run)
        for cache in caches:
            cache.offset += S
        return dflash.Block(*out)


class Bucketed(pieces.ResolvedAttention, Compiled):
    """The bucketed block over one BucketCache per layer (`make_caches`); `compiled` off runs the
    same block function plain (the trace counter's control)."""

    def __init__(self, a: dflash.ModelArgs, window: str = "positional", embed: str = "scaled",
                 kv_bucket: int = 256, attention: str = pieces.AUTO, compiled: bool = True):
        super().__init__(a, window, embed, compiled)
        self.kv_bucket = pieces.check_bucket(kv_bucket, dflash.DFlashError)
        self.attention = pieces.check_attention(attention, dflash.DFlashError, a.head_dim)
        if window == "zlab-mlx" and "sliding_attention" in a.layer_types:
            raise dflash.DFlashError("kv_bucket with window='zlab-mlx': that window follows the rotating buffer's "
                                     "order, which a bucketed context (every row, in time order) does not have; use "
                                     "window='positional' (z-lab torch's semantics) or kv_bucket=None")
        self._bucketed = pieces.Bucketed()
        self._weights = None

    def make_caches(self) -> list:
        """Every layer every context row, in a BucketCache."""
        return [pieces.BucketCache(self.kv_bucket) for _ in self.args.layer_types]

    def weights(self) -> dict:
        """Every projection's weight transposed (fusion.Transposed): "fc", and per layer i "q{i}",
        "k{i}", "v{i}", "o{i}", "gate{i}", "up{i}", "down{i}"."""
        if self._weights is None:
            owners = {"fc": self.fc}
            for i, layer in enumerate(self.layers):
                a = layer.self_attn
                owners.update({f"q{i}": a.q_proj, f"k{i}": a.k_proj, f"v{i}": a.v_proj, f"o{i}": a.o_proj,
                               **fusion.mlp_weights(i, layer.mlp)})
            self._weights = fusion.Transposed(owners)
        return self._weights.current()

    def block(self, target: targets.Target, anchor: int, n: int, ctx_rows, caches: list) -> dflash.Block:
        """The new context rows join the buffers (plain ops: their count varies per round), then
        the compiled block over the whole buffers. Rows are 2-D [T, H] and every projection is
        `rows @ weight.T` on a transposed view (weights()): a 3-D input adds a Flatten and an
        Unflatten node per product, nn.Linear a Transpose."""
        self.check_rows(ctx_rows)
        if not all(isinstance(cache, pieces.BucketCache) for cache in caches):
            raise dflash.DFlashError("kv_bucket: the caches must be BucketCaches (Model.make_caches makes them)")
        w = self.weights()
        ids = targets.block_ids(anchor, self.args.mask_token_id, n).reshape(-1)
        c = self.hidden_norm(ctx_rows.reshape(-1, ctx_rows.shape[-1]) @ w["fc"])
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            cache.update_and_fetch(*layer.self_attn.kv_heads(c @ w[f"k{i}"], c @ w[f"v{i}"], cache.offset))
        keys, values = zip(*(cache.buffers() for cache in caches))
        fn = self._bucketed.get(self, (id(target), self.bucket_attention), partial(self.bucketed, target),
                                [self.state, self.borrowed(target)])
        return dflash.Block(*fn(ids, mx.array(caches[0].offset, mx.int32), list(keys), list(values), w))

    def block_at(self, target: targets.Target, ids, rows, at, valid, room: int, caches: list) -> dflash.Block:
        """`block` where the host knows neither where the new context rows go nor how many of them
        count (the pipelined loop, port/serve.py): every row of `rows` [1, R, H] is written at
        `at` and the block attends the rows before `valid` (int32 arrays; rows from `valid` on are
        masked, and the next join overwrites them). `room`: a bound on `at`, for the buffers' room.
        One compiled call, the join with the block, traced once per buffer length."""
        for cache in caches:
            cache.offset = room
            cache.reserve(rows.shape[1], (1, self.layers[0].self_attn.n_kv, self.args.head_dim, self.args.head_dim),
                          self.fc.weight.dtype)
        fn = self._bucketed.get(self, ("joined", id(target), self.bucket_attention), partial(self.joined, target),
                                [self.state, self.borrowed(target)])
        return dflash.Block(*pieces.over_buffers(caches, fn, ids, rows.reshape(-1, rows.shape[-1]), at, valid,
                                                 self.weights()))

    def joined(self, target: targets.Target, ids, rows, at, valid, w, keys, values):
        """The rows' K/V written at `at` into every layer's buffer, then `bucketed` over them: its
        arrays and the buffers."""
        c, written_at = self.hidden_norm(rows @ w["fc"]), pieces.rows_at(at, rows.shape[0])
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv_heads(c @ w[f"k{i}"], c @ w[f"v{i}"], at)
            keys[i], values[i] = pieces.written(keys[i], values[i], k, v, written_at)
        return self.bucketed(target, ids, valid, keys, values, w) + (keys, values)

    def bucketed(self, target: targets.Target, ids, valid, keys, values, w):
        """The whole block over the bucketed buffers (rows from `valid` masked), as arrays:
        hidden, logits, tokens."""
        self._bucketed.traces += 1
        h = self.embed(target, ids)
        masks: dict = {}
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q, bk, bv = a.block_heads(x @ w[f"q{i}"], x @ w[f"k{i}"], x @ w[f"v{i}"], valid)
            o = attend(a, self.bucket_attention, q, bk, bv, keys[i], values[i], valid, masks)
            # mlx-lm's Qwen3 MLP: down(silu(gate(x)) * up(x))
            h = layer.finish(h, a.rows(o) @ w[f"o{i}"], partial(fusion.gated_mlp, nn.silu, w, i))
        hidden = self.norm(h[1:])
        logits = self.logits(target, hidden)
        return hidden, logits, mx.argmax(logits, axis=-1)


def attend(attn: dflash.Attention, how: str, q, bk, bv, keys, values, valid, masks: dict):
    """Attention.attend over a bucketed context buffer (every context row kept, in time order: row
    j is position j; rows from `valid` on masked; the block sits at valid..): full layers see every
    valid row, sliding layers those within the window of each block row (window="positional");
    the block rows see each other (causal: the earlier ones only). `masks`: the block's masks by
    layer kind, built once per kind (mx.compile does not merge the layers' equal mask graphs)."""
    kind = (attn.sliding, attn.causal)
    if kind not in masks:
        window = attn.a.sliding_window if attn.sliding else None
        masks[kind] = pieces.bucketed_mask(how, valid, q.shape[2], keys.shape[2], q.dtype, window, attn.causal)
    return pieces.bucketed_attention(how, q, keys, values, bk, bv, masks[kind], attn.scale)


EXACT = "exact"   # bucket_attention: the Exact block (DFlash only)


def load(path: str | Path, window: str = "positional", embed: str = "scaled", compiled: bool = True,
         kv_bucket: int | str | None = None, bucket_attention: str = pieces.AUTO, scales: str = "either",
         dtype: mx.Dtype | None = None) -> Compiled:
    """The drafter on a fast path: Compiled, or with a `kv_bucket` Bucketed (Exact with
    bucket_attention="exact"); pieces.AUTO: pieces.BUCKET rows unless window="zlab-mlx" meets
    sliding layers, which only Compiled holds. `dtype` as in dflash.load."""

    def build(a: dflash.ModelArgs, w: str, e: str) -> Compiled:
        rows = kv_bucket
        if rows == pieces.AUTO:
            rows = None if w == "zlab-mlx" and "sliding_attention" in a.layer_types else pieces.BUCKET
        if bucket_attention == EXACT:
            if rows is None:
                raise dflash.DFlashError("bucket_attention='exact' needs a kv_bucket (e.g. 256: the buffers' rows)")
            return Exact(a, w, e, rows, compiled)
        pieces.check_attention(bucket_attention, dflash.DFlashError)
        if pieces.check_bucket(rows, dflash.DFlashError) is None:
            return Compiled(a, w, e, compiled)
        return Bucketed(a, w, e, rows, bucket_attention, compiled)

    return dflash.load(path, window, embed, scales, build, dtype)

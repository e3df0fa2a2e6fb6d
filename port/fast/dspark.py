"""Fast paths of the DSpark port (port/dspark.py), subclasses of its plain Model.

Compiled (the plain fast path, `kv_bucket=None`): the block is split where its shapes change: the
attention over the growing context runs outside mx.compile, the shape-stable pieces between two
attentions (and the greedy Markov / confidence tail) through it (port/compiled.py). Bit for bit the
plain forward (tests/test_speed.py).

Bucketed (`kv_bucket`; the provider's default, port/sources/dspark.py): the context K/V is presented
at its buffer's length (a multiple of the bucket, port/compiled.py BucketCache) with the tail
masked, and the whole block (embedding, layers, final norm, logits, Markov chain, confidence) is one
compiled call that retraces only when the buffer grows; the attention (`bucket_attention`, default
AUTO: "kernel" on MLX CUDA with bf16 weights, else "sdpa") is mx.fast's over [context | block]
joined with a float mask, the custom CUDA kernels of port/fast/kernels.py (the buffer read in place
up to the valid length, two launches a layer), or (bucket_attention="two-segment") a two-segment
softmax. Held to the plain forward within fp32 tolerance (bit-exact on the CPU backend with "sdpa",
measured: tests/test_bucketed.py; the kernels on the H200: tests/test_kernels.py).

Fused (the provider's default; `fused=False` is Bucketed): the bucketed block on stacked projections
(port/fast/fusion.py), fewer matmul launches for the same products; bit for bit Bucketed on the CPU
backend (tests/test_fused.py)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx

from .. import compiled as pieces
from .. import dspark, targets
from . import fusion


def enter(m: dspark.Model, ids, start):
    """The block's embedding and layer 0's Q, K, V."""
    h = m.embed(ids)
    return (h,) + m.layers[0].qkv(h, start)


def between(m: dspark.Model, i: int, h, o, start):
    """Layer i's output and layer i+1's Q, K, V."""
    h = m.layers[i].finish(h, m.layers[i].self_attn.output(o))
    return (h,) + m.layers[i + 1].qkv(h, start)


def leave(m: dspark.Model, h, o):
    """The last layer's output -> Model.final."""
    return m.final(m.layers[-1].finish(h, m.layers[-1].self_attn.output(o)))


def greedy_tail(m: dspark.Model, hidden, base, anchor):
    """The plain Model's tail as arrays only (rows, tokens[, confidence]): what mx.compile returns."""
    rows, tokens, conf = dspark.Model.tail(m, hidden, base, anchor)
    return (rows, tokens) + ((conf,) if conf is not None else ())


class Compiled(dspark.Model):
    """`compiled` (default on) compiles the pieces; off, the same pieces run plain."""

    def __init__(self, a: dspark.ModelArgs, compiled: bool = True):
        super().__init__(a)
        self.compiled = compiled
        self._pieces = pieces.Pieces()

    def pieces(self) -> tuple:
        """(enter, [between_i], exit, greedy tail), plain or compiled."""
        n = len(self.layers)
        return self._pieces.get(self, lambda: ((partial(enter, self), [partial(between, self, i) for i in range(n - 1)],
                                                partial(leave, self), partial(greedy_tail, self)), None))

    def __call__(self, ids, ctx, start):
        first, middle, last, _ = self.pieces()
        pos = pieces.position(self, start)
        h, q, k, v = first(ids, pos)
        for i, (layer, c) in enumerate(zip(self.layers, ctx)):
            o = layer.self_attn.attend(q, *layer.self_attn.join(c, k, v))
            if i < len(middle):
                h, q, k, v = middle[i](h, o, pos)
        return last(h, o)

    def tail(self, hidden, base, anchor, pick=None):
        """The greedy tail compiled; a host `pick` runs the plain one."""
        if pick is not None:
            return super().tail(hidden, base, anchor, pick)
        rows, tokens, *conf = self.pieces()[3](hidden, base, anchor)
        return rows, tokens, conf[0] if conf else None


class Bucketed(pieces.ResolvedAttention, Compiled):
    """The bucketed block over one BucketCache per layer (`make_cache`); `compiled` off runs the
    same block function plain (the trace counter's control)."""

    def __init__(self, a: dspark.ModelArgs, kv_bucket: int, attention: str = pieces.AUTO, compiled: bool = True):
        super().__init__(a, compiled)
        self.kv_bucket = pieces.check_bucket(kv_bucket, dspark.DSparkError)
        if self.kv_bucket is None:
            raise dspark.DSparkError("kv_bucket=None: the bucketed path needs a bucket (the plain Model has none)")
        self.attention = pieces.check_attention(attention, dspark.DSparkError, a.head_dim)
        self._bucketed = pieces.Bucketed()

    def make_cache(self) -> pieces.BucketCache:
        return pieces.BucketCache(self.kv_bucket)

    def block(self, greedy: bool, ids, start, valid, keys, values, weights):
        """The whole block over the bucketed context buffers keys / values (per layer, rows past
        `valid` masked); greedy: with the Markov chain and confidence, else up to the base logits
        (a host `pick` chains the tail after)."""
        self._bucketed.traces += 1
        h, q, k, v = enter(self, ids, start)
        mask = self.mask(q, keys[0], valid)
        for i in range(len(self.layers)):
            o = self.attend(i, q, keys[i], values[i], mask, k, v)
            if i < len(self.layers) - 1:
                h, q, k, v = between(self, i, h, o, start)
        return self.outputs(greedy, ids, *leave(self, h, o))

    def mask(self, q, keys, valid):
        """Every layer's mask (the same for all: rows past `valid` off, the block unmasked), built
        once (mx.compile does not merge the layers' equal mask graphs)."""
        L, S = q.shape[2], keys.shape[2]
        return pieces.bucketed_mask(self.bucket_attention, valid, L, S, q.dtype)

    def attend(self, i: int, q, keys, values, mask, k, v):
        return pieces.bucketed_attention(self.bucket_attention, q, keys, values, k, v, mask,
                                         self.layers[i].self_attn.scale)

    def outputs(self, greedy: bool, ids, hidden, base):
        if not greedy:
            return hidden, base
        return (hidden, base) + greedy_tail(self, hidden, base, ids[0, :1].astype(mx.uint32))

    def weights(self) -> dict:
        """Arrays the block reads besides the module's state (Fused: its stacks)."""
        return {}

    def block_at(self, anchor, ctx, rows, at, valid, room: int) -> dspark.Block:
        """`draft_block` where the host knows neither where the new context rows go nor how many
        of them count (the pipelined loop, port/serve.py): the tap rows [1, R, taps * H] are
        written at `at` into every layer's buffer and the greedy block at `valid` attends the rows
        before it (int32 arrays; rows from `valid` on are masked, the next join overwrites them).
        `room`: a bound on `at`, for the buffers' room. One compiled call, the join with the
        block, traced once per buffer length."""
        for c in ctx:
            c.offset = room
            c.reserve(rows.shape[1], c.keys.shape[:2] + (c.keys.shape[3], c.values.shape[3]), c.keys.dtype)
        ids = targets.block_ids(anchor, self.args.mask_token_id, self.args.block_size - 1)
        fn = self._bucketed.get(self, ("joined", self.bucket_attention), self.joined, [self.state])
        hidden, base, logits, tokens, *conf = pieces.over_buffers(ctx, fn, ids, valid, rows, at, self.weights())
        return dspark.Block(hidden, base, logits, tokens, conf[0] if conf else None)

    def joined(self, ids, valid, rows, at, weights, keys, values):
        """The rows' K/V written at `at`, then the greedy `block` at `valid` over the buffers: its
        arrays and the buffers."""
        written_at = pieces.rows_at(at, rows.shape[1])
        for i, (k, v) in enumerate(self.stacked_kv(self.project(rows), at, weights)):
            keys[i], values[i] = pieces.written(keys[i], values[i], k, v, written_at)
        return self.block(True, ids, valid, valid, keys, values, weights) + (keys, values)

    def stacked_kv(self, c, offset, weights) -> list:
        """context_kv with the arrays of weights() passed in (a compiled call's inputs)."""
        return self.context_kv(c, offset)

    def draft_block(self, anchor: int, ctx, start: int, pick=None) -> dspark.Block:
        if not all(isinstance(c, pieces.BucketCache) for c in ctx):
            raise dspark.DSparkError("kv_bucket: draft_block needs the context as one BucketCache per layer "
                                     "(Model.make_cache; DeepspecSource makes them), not (k, v) pairs or a KVCache")
        a = self.args
        ids = targets.block_ids(anchor, a.mask_token_id, a.block_size - 1)
        keys, values = zip(*(c.buffers() for c in ctx))
        greedy = pick is None
        fn = self._bucketed.get(self, (greedy, self.bucket_attention), partial(self.block, greedy), [self.state])
        out = fn(ids, mx.array(start, mx.int32), mx.array(ctx[0].offset, mx.int32), list(keys), list(values),
                 self.weights())
        hidden, base = out[:2]
        if greedy:
            rows, tokens, *conf = out[2:]
            conf = conf[0] if conf else None
        else:
            rows, tokens, conf = dspark.Model.tail(self, hidden, base, mx.array([anchor], mx.uint32), pick)
        return dspark.Block(hidden, base, rows, tokens, conf)


class Fused(Bucketed):
    """The bucketed block on stacked projections (port/fast/fusion.py): one batched matmul for
    every layer's context K and one for their V (on commit); per layer one for the block's K and
    V and one for the MLP's gate and up: on Qwen3-4B's 5 layers 18 fewer matmuls a round."""

    def __init__(self, a: dspark.ModelArgs, kv_bucket: int, attention: str = pieces.AUTO, compiled: bool = True):
        super().__init__(a, kv_bucket, attention, compiled)
        self._stacks = fusion.Stacks()

    def weights(self) -> dict:
        """The stacks, built at load (`load`) and rebuilt when a weight is replaced. The context
        K / V and gate / up stacks adopt their weights (views); the block's K/V stacks are copies
        (the context stacks own those weights): the K and V weights are held twice.
        attention_k_eq_v: K alone (V is K)."""
        if not self._stacks.entries:
            attn = [layer.self_attn for layer in self.layers]
            self._stacks.add("ctx_k", [a.k_proj for a in attn], adopt=True)
            if not self.args.attention_k_eq_v:
                self._stacks.add("ctx_v", [a.v_proj for a in attn], adopt=True)
            for i, (layer, a) in enumerate(zip(self.layers, attn)):
                if not self.args.attention_k_eq_v:
                    self._stacks.add(f"kv{i}", [a.k_proj, a.v_proj])
                self._stacks.add(f"gate_up{i}", [layer.mlp.gate_proj, layer.mlp.up_proj], adopt=True)
        return self._stacks.current()

    def draft_block(self, anchor: int, ctx, start: int, pick=None) -> dspark.Block:
        return self.watched(super().draft_block, anchor, ctx, start, pick)

    def block_at(self, anchor, ctx, rows, at, valid, room: int) -> dspark.Block:
        return self.watched(super().block_at, anchor, ctx, rows, at, valid, room)

    def watched(self, call, *args):
        """call(*args), the stacks told after one that traced (Stacks.seen)."""
        traces = self._bucketed.traces
        out = call(*args)
        if self._bucketed.traces != traces:
            self._stacks.seen()
        return out

    def context_kv(self, c, offset: int) -> list:
        return self.stacked_kv(c, offset, self.weights())

    def stacked_kv(self, c, offset, weights) -> list:
        k = fusion.project(c, weights["ctx_k"])
        v = fusion.project(c, weights["ctx_v"]) if "ctx_v" in weights else None
        return [layer.self_attn.heads_kv(k[i:i + 1], None if v is None else v[i:i + 1], offset)
                for i, layer in enumerate(self.layers)]

    def block(self, greedy: bool, ids, start, valid, keys, values, weights):
        self._bucketed.traces += 1
        h = self.embed(ids)
        mask = None
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.block_q(x, start)
            mask = self.mask(q, keys[0], valid) if mask is None else mask
            if f"kv{i}" in weights:
                k, v = a.heads_kv(*fusion.parts(fusion.project(x, weights[f"kv{i}"])), start)
            else:
                k, v = a.heads_kv(a.k_proj(x), None, start)
            o = self.attend(i, q, keys[i], values[i], mask, k, v)
            h = layer.finish(h, a.output(o), partial(fused_mlp, layer.mlp, weights[f"gate_up{i}"]))
        return self.outputs(greedy, ids, *self.final(h))


def fused_mlp(mlp: dspark.MLP, gate_up, x):
    return mlp.combine(*fusion.parts(fusion.project(x, gate_up)))


def load(path: str | Path, compiled: bool = True, kv_bucket: int | str | None = None,
         bucket_attention: str = pieces.AUTO, fused: bool = True, dtype: mx.Dtype | None = None) -> Compiled:
    """The drafter on a fast path: Compiled, or with a `kv_bucket` Fused (Bucketed with `fused`
    off); pieces.AUTO: pieces.BUCKET rows (every DSpark variant holds it). `dtype` as in dspark.load."""
    kv_bucket = pieces.BUCKET if kv_bucket == pieces.AUTO else kv_bucket
    pieces.check_bucket(kv_bucket, dspark.DSparkError)
    pieces.check_attention(bucket_attention, dspark.DSparkError)
    if kv_bucket is None:
        return dspark.load(path, lambda a: Compiled(a, compiled), dtype)
    m = dspark.load(path, lambda a: (Fused if fused else Bucketed)(a, kv_bucket, bucket_attention, compiled), dtype)
    m.weights()   # Fused: the stacks, built here rather than on the first round
    return m

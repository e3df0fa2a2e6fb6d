"""Fast paths of the Gemma-4 assistant port (port/assistant.py), subclasses of its plain Model.

Compiled (the serve loop's default): the step's shape-stable pieces run through mx.compile, the
attention over the donor K/V (whose length changes every round) outside it; the row 2-D and the
projections on transposed weight views (fusion.Transposed: fewer graph nodes); bit for bit the plain
step (tests/test_speed.py). `repeat_kv=False` lets the attention kernel map the query heads onto
the donor K/V heads (no copy); on the CPU the same bits, on MLX CUDA 1 ulp off optiq's repeat.

Bucketed (opt-in): the donor K/V are the target's mlx-lm cache buffers as they are (KVCache: rows
past its offset masked; RotatingKVCache: the ring, every slot but the window's entries masked,
whatever its order; a bucketed verify's sliding buffer, compiled.VerifyCache: every row in time
order, all but the window's masked), so a step's shapes change only when a buffer does, and the
whole step (pre-projection, the 4 layers with their attention, norm, head, post-projection) is one
compiled call. The window's slots are found from the ring's (write index, offset) as mlx-lm's own
temporal order lays them out; they enter as arrays. Within fp32 tolerance of the plain step (the
softmax sums the same entries in ring order), not bit-exact (tests/test_bucketed.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .. import assistant, targets
from .. import compiled as pieces
from . import fusion


def enter(m: assistant.Model, emb, hidden_in, position, w):
    """pre_projection and layer 0's Q, the row 2-D [1, H] from here on; `w`: Compiled.weights()."""
    h = mx.concatenate([emb, hidden_in], axis=-1).reshape(1, -1) @ w["pre"]
    return h, query(m, 0, h, position, w)


def between(m: assistant.Model, i: int, h, o, position, w):
    """Layer i's output and layer i+1's Q."""
    h = finish(m, i, h, o, w)
    return h, query(m, i + 1, h, position, w)


def leave(m: assistant.Model, h, o, w):
    """The last layer's output -> Model.final."""
    return m.final(finish(m, len(m.model.layers) - 1, h, o, w))


def query(m: assistant.Model, i: int, h, position, w):
    """DecoderLayer.query of layer i on the transposed weights."""
    layer = m.model.layers[i]
    return layer.self_attn.query_heads(layer.input_layernorm(h) @ w[f"q{i}"], position)


def finish(m: assistant.Model, i: int, h, o, w):
    """DecoderLayer.finish of layer i (the attention's output projected) on the transposed weights."""
    layer = m.model.layers[i]
    # assistant.MLP: down(gelu_approx(gate(x)) * up(x))
    return layer.finish(h, layer.self_attn.rows(o) @ w[f"o{i}"], partial(fusion.gated_mlp, nn.gelu_approx, w, i))


class Compiled(assistant.Model):
    """`compiled` (default on) compiles the pieces; off, the same pieces run plain."""

    def __init__(self, args: assistant.ModelArgs, compiled: bool = True, repeat_kv: bool = True):
        super().__init__(args)
        self.compiled, self.repeat_kv = compiled, repeat_kv
        self._pieces = pieces.Pieces()
        self._weights = None

    def weights(self) -> dict:
        """The step's projections transposed (fusion.Transposed): "pre", and per layer i "q{i}",
        "o{i}", "gate{i}", "up{i}", "down{i}"; with 2-D rows, a projection is one matmul node (nn.Linear
        on a 3-D row adds a Transpose, a Flatten and an Unflatten; the step is host-bound on MLX CUDA)."""
        if self._weights is None:
            owners = {"pre": self.pre_projection}
            for i, layer in enumerate(self.model.layers):
                a = layer.self_attn
                owners.update({f"q{i}": a.q_proj, f"o{i}": a.o_proj, **fusion.mlp_weights(i, layer.mlp)})
            self._weights = fusion.Transposed(owners)
        return self._weights.current()

    def pieces(self) -> tuple:
        """(enter, [between_i], exit), plain or compiled; each compiled with the modules it reads as
        its inputs (not the whole model's state: flattened at every call, 5 calls a step)."""
        n, layers = len(self.model.layers), self.model.layers
        head = [self.model.norm, self.post_projection, self.model.embed_tokens]
        head += [getattr(self, k) for k in ("lm_head", "masked_embedding") if hasattr(self, k)]
        return self._pieces.get(self, lambda: (
            (partial(enter, self), [partial(between, self, i) for i in range(n - 1)], partial(leave, self)),
            ([self.pre_projection, layers[0]], [[layers[i], layers[i + 1]] for i in range(n - 1)],
             [layers[-1]] + head)))

    def __call__(self, emb, hidden_in, views: dict, position):
        first, middle, last = self.pieces()
        pos, w = pieces.position(self, position), self.weights()
        h, q = first(emb, hidden_in, pos, w)
        for i, layer in enumerate(self.model.layers):
            o = layer.self_attn.attend(q, *views[layer.layer_type])
            if i < len(middle):
                h, q = middle[i](h, o, pos, w)
        return last(h, o, w)

    def repeat(self, views: dict) -> dict:
        return super().repeat(views) if self.repeat_kv else views


class Bucketed(Compiled):
    """The whole step as one compiled call over the target's cache buffers (`donors`: donor_buffers);
    `compiled` off runs the same step function plain (the trace counter's control). `kv_bucket`:
    the serve loop's bucketed verify it wants (the buffers it reads)."""

    kv_bucket = pieces.BUCKET

    def __init__(self, args: assistant.ModelArgs, compiled: bool = True, repeat_kv: bool = True):
        super().__init__(args, compiled, repeat_kv)
        self._bucketed = pieces.Bucketed()

    def donors(self, target, caches: list, window: str | int = "optiq") -> dict:
        return donor_buffers(target, caches, window)

    def views(self, donors: dict, window: str | int = "optiq") -> dict:
        """The buffers as they are: the window is in their masks."""
        return donors

    def step(self, emb, hidden_in, donors, position: int, window: str = "optiq", pick=None,
             views: dict | None = None) -> assistant.Step:
        if not isinstance(donors.get("sliding_attention"), dict):
            raise assistant.DrafterError("bucketed: the donors must be fast.assistant.donor_buffers(target, caches, "
                                         "window), not targets.donor_view's sliced K/V")
        fn = self._bucketed.get(self, "step", self.whole_step, [self.state])
        logits, next_hidden, token, *cand = fn(emb, hidden_in, mx.array(position, mx.int32),
                                               {t: d["kv"] for t, d in donors.items()}, self.weights())
        if pick is not None:
            token = mx.array([[int(pick(logits))]])
        return assistant.Step(token, logits, next_hidden, cand[0] if cand else None)

    def whole_step(self, emb, hidden_in, position, donors, w):
        """The whole step over donor buffers {layer type: (k, v, where)} (donor_seen)."""
        self._bucketed.traces += 1
        masks = {t: pieces.additive_mask(seen, emb.dtype) for t, (_, _, seen) in donor_seen(donors).items()}
        h, q = enter(self, emb, hidden_in, position, w)
        for i, layer in enumerate(self.model.layers):
            k, v, _ = donors[layer.layer_type]
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=layer.self_attn.scale, mask=masks[layer.layer_type])
            if i < len(self.model.layers) - 1:
                h, q = between(self, i, h, o, position, w)
        return leave(self, h, o, w)


def donor_buffers(target, caches: list, window: str | int = "optiq") -> dict:
    """The donor layers' K/V as their mlx-lm caches' whole buffers, with what a step may see, for
    `bucketed`: per layer type {"kv": (k, v, where), "ring": bool}. Full (KVCache): where = [offset]
    (rows below it). Sliding (RotatingKVCache, keep 0): where = [rot, lo, hi]: slot j has temporal
    rank (j - rot) mod S in mlx-lm's _temporal_order and is seen iff lo <= rank < hi, the newest
    entries of the window (targets.donor_view + sliding_view pick the same ones, in time order)."""
    out = {}
    for name, layer in targets.donor_layers(target).items():
        c = caches[layer]
        if c.keys is None:
            raise RuntimeError("the target cache is empty: prefill before drafting")
        S = c.keys.shape[2]
        if not hasattr(c, "_temporal_order"):
            if name == "sliding":   # a bucketed verify's buffer (compiled.VerifyCache): every row, in time order
                seen = min(c.offset, assistant.window_keep(target.config["sliding_window"], window))
                where, ring = [0, c.offset - seen, c.offset], True
            else:
                where, ring = [c.offset], False
        else:
            if c.keep:
                raise assistant.DrafterError(f"bucketed: a RotatingKVCache with keep={c.keep} (sink rows) is not supported; "
                                   "use bucketed=False")
            rot, total = (c._idx, S) if c._idx < c.offset and c._idx != S else (0, S if c._idx == S else c._idx)
            seen = min(c.offset, total, assistant.window_keep(target.config["sliding_window"], window))
            where, ring = [rot, total - seen, total], True
        # one scalar array per bound, not mx.array(where): a host-filled 12-byte buffer is one the GPU
        # page-faults on (targets.block_ids), and where[0] of it a Gather
        out[f"{name}_attention"] = {"kv": (c.keys, c.values, tuple(mx.array(w, mx.int32) for w in where)),
                                    "ring": ring}
    return out


def donor_seen(donors: dict) -> dict:
    """{layer type: (k, v, seen [S] bool)} from donor_buffers' "kv" entries (inside the step)."""
    out = {}
    for t, (k, v, where) in donors.items():
        j = mx.arange(k.shape[2])
        if len(where) == 1:
            seen = j < where[0]
        else:
            rank = (j + k.shape[2] - where[0]) % k.shape[2]
            seen = (rank >= where[1]) & (rank < where[2])
        out[t] = (k, v, seen)
    return out


def load(path: str | Path, dtype: mx.Dtype | None = None, compiled: bool = True, bucketed: bool = False,
         repeat_kv: bool = True) -> Compiled:
    """The drafter on a fast path: Compiled, or Bucketed."""
    return assistant.load(path, dtype, lambda a: (Bucketed if bucketed else Compiled)(a, compiled, repeat_kv))

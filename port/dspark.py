"""DeepSeek's DSpark drafter (DeepSpec `deepspec/modeling/dspark`) in MLX, Gemma-4 and Qwen3.

One draft round, from the target's hidden states:

    x  = concat(hidden_states[l + 1] for l in target_layer_ids)      taps (-1: the embedding)
    c  = hidden_norm(fc(x))                                          context projection
    per draft layer: K = RoPE(k_norm(k_proj(c))), V = v_norm(v_proj(c))   (Qwen3: V = v_proj(c))
         at the rows' absolute positions, cached; only context rows persist
    block ids [anchor, MASK x (bs-1)] at positions start..start+bs-1; Q from the block only;
         keys [context | block], no mask; scale 1.0 (Gemma-4) or head_dim^-0.5 (Qwen3)
    final norm -> own lm head -> Gemma-4 softcap -> Markov head (added after the softcap,
         sequentially: prev_0 = anchor, prev_k = draft k-1) -> greedy tokens
    confidence sigmoid(w . [h_k ; W1[prev_k]]): the proposal stops at the first k below the
         threshold (per step, not the cumulative product); 0 tokens is possible

`kv_bucket` (opt-in, default None): the context K/V is presented at its buffer's length (a
multiple of the bucket, port/compiled.py BucketCache) with the tail masked, and the whole block
(embedding, layers, final norm, logits, Markov chain, confidence) is one compiled call that
retraces only when the buffer grows; the attention is mx.fast's over [context | block] joined with
a float mask, or (bucket_attention="two-segment") a two-segment softmax (port/compiled.py). Held
to the default within fp32 tolerance (bit-exact on the CPU backend with "sdpa", measured).

The negative controls (planted bugs) live outside the port, in spec_parity/controls/dspark.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from . import checkpoint, targets
from . import compiled as compiled_pieces


class DSparkError(ValueError):
    pass


@dataclass
class ModelArgs:
    family: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rope: dict
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = None
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_config(cls, c: dict, path: Path) -> ModelArgs:
        arch = (c.get("architectures") or [""])[0]
        family = {"Gemma4DSparkModel": "gemma4", "Qwen3DSparkModel": "qwen3"}.get(arch)
        if family is None:
            raise DSparkError(f"{path}: architectures {c.get('architectures')} is not a DeepSpec DSpark drafter "
                              "(expected Gemma4DSparkModel or Qwen3DSparkModel)")
        gemma = family == "gemma4"
        keqv = bool(gemma and c.get("attention_k_eq_v"))
        if gemma:
            rope = dict(c["rope_parameters"]["full_attention"])
        else:
            rp = c.get("rope_parameters") or {}
            rope = {"rope_type": rp.get("rope_type", "default"), "rope_theta": rp.get("rope_theta", c.get("rope_theta", 1e6))}
        return cls(
            family=family, hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_global_key_value_heads"] if keqv else c["num_key_value_heads"],
            head_dim=c["global_head_dim"] if gemma else c["head_dim"], vocab_size=c["vocab_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6), block_size=c["block_size"], mask_token_id=c["mask_token_id"],
            target_layer_ids=list(c["target_layer_ids"]), num_target_layers=c["num_target_layers"], rope=rope,
            attention_k_eq_v=keqv, final_logit_softcapping=c.get("final_logit_softcapping") if gemma else None,
            markov_rank=c.get("markov_rank", 0), markov_head_type=c.get("markov_head_type", "vanilla"),
            enable_confidence_head=c.get("enable_confidence_head", False),
            confidence_head_with_markov=c.get("confidence_head_with_markov", False),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
        )


def rms_norm(x, weight, eps):
    return mx.fast.rms_norm(x, weight, eps)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        H = a.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        if not a.attention_k_eq_v:
            self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
        rope = a.rope
        self.rope = initialize_rope(self.head_dim, traditional=False, base=rope.get("rope_theta", 10000.0),
                                    scaling_config=rope if rope.get("rope_type", "default") != "default" else None,
                                    max_position_embeddings=a.max_position_embeddings)
        self.scale = 1.0 if a.family == "gemma4" else self.head_dim ** -0.5

    def kv(self, x, offset: int):
        """K/V of rows x [1, T, H] at positions offset..offset+T-1, as [1, n_kv, T, D]."""
        B, T, _ = x.shape
        k_raw = self.k_proj(x).reshape(B, T, self.n_kv, self.head_dim)
        v = k_raw if self.a.attention_k_eq_v else self.v_proj(x).reshape(B, T, self.n_kv, self.head_dim)
        k = self.rope(self.k_norm(k_raw).transpose(0, 2, 1, 3), offset=offset)
        if self.a.family == "gemma4":
            v = rms_norm(v, None, self.a.rms_norm_eps)
        return k, v.transpose(0, 2, 1, 3)

    def block_qkv(self, x, offset):
        """Q, K, V of the block rows x [1, T, H] at offset.. (an int or a scalar array)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        return (self.rope(q, offset=offset),) + self.kv(x, offset)

    @staticmethod
    def join(ctx, k, v):
        """Keys [context | block]. ctx: the context K/V as a (k, v) pair (the block's rows are
        concatenated to it) or a cache that holds it (mlx-lm's KVCache: the block's rows are
        written after the context and trimmed off again, so the context is never copied)."""
        if isinstance(ctx, tuple):
            return mx.concatenate([ctx[0], k], axis=2), mx.concatenate([ctx[1], v], axis=2)
        keys, values = ctx.update_and_fetch(k, v)
        ctx.trim(k.shape[2])
        return keys, values

    def attend(self, q, keys, values):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale)

    def output(self, o):
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gemma = a.family == "gemma4"
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def __call__(self, x):
        g = self.gate_proj(x)
        return self.down_proj((nn.gelu_approx(g) if self.gemma else nn.silu(g)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gemma = a.family == "gemma4"
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        H, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        if self.gemma:
            self.pre_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
            self.layer_scalar = mx.ones((1,))

    def qkv(self, x, offset):
        return self.self_attn.block_qkv(self.input_layernorm(x), offset)

    def finish(self, x, o):
        """The layer's output from its input x and the attention heads o."""
        attn = self.self_attn.output(o)
        if not self.gemma:
            h = x + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class MarkovHead(nn.Module):
    """Vanilla: bias = W2(W1[prev]); gated: W2(sigmoid(G[h; W1[prev]]) * W1[prev]);
    rnn: a GRU-like state over the block, bias = W2(tanh(output))."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.kind, r, H = a.markov_head_type, a.markov_rank, a.hidden_size
        self.markov_w1 = nn.Embedding(a.vocab_size, r)
        self.markov_w2 = nn.Linear(r, a.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)
        elif self.kind != "vanilla":
            raise DSparkError(f"unsupported markov_head_type {self.kind!r} (vanilla, gated, rnn)")

    def step(self, prev, h, state):
        """Bias for one slot given the previous token [1] and hidden [1, H]; returns (bias, state)."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            return self.markov_w2(mx.sigmoid(self.gate_proj(mx.concatenate([h, e], axis=-1))) * e), state
        state = mx.zeros_like(e) if state is None else state
        g, cand, out = mx.split(self.joint_proj(mx.concatenate([state, e, h], axis=-1)), 3, axis=-1)
        g = mx.sigmoid(g)
        return self.markov_w2(mx.tanh(out)), g * state + (1.0 - g) * mx.tanh(cand)


class ConfidenceHead(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.proj = nn.Linear(dims, 1)


def markov_chain(head: MarkovHead | None, hidden, base, anchor: mx.array, pick=None):
    """Rows and tokens of a block through a Markov head: row_k = base_k + bias(prev_k, h_k) (after
    the softcap), prev_0 = the anchor ([1] uint32), prev_k = token k-1. Greedy (pick None) the
    tokens stay on the device, chained into the next slot's bias; `pick(row)` chooses each on the
    host instead. Returns (rows [n, V], tokens [n] uint32, on the device)."""
    if head is None and pick is None:
        return base, mx.argmax(base, axis=-1)
    rows, tokens, prev, state = [], [], anchor, None  # rows: base[k, ...], see port/dflash.py Model.block
    for k in range(hidden.shape[0]):
        if head is not None:
            bias, state = head.step(prev, hidden[k:k + 1], state)
            row = base[k, ...] + bias[0, ...]
        else:
            row = base[k, ...]
        rows.append(row)
        prev = mx.argmax(row, keepdims=True) if pick is None else mx.array([int(pick(row))])
        tokens.append(prev.astype(mx.uint32))
    return mx.stack(rows), mx.concatenate(tokens)


def previous_tokens(anchor: mx.array, tokens: mx.array) -> mx.array:
    """prev_k of each slot: [anchor, token_0 .. token_{n-2}] (the Markov head's inputs)."""
    return mx.concatenate([anchor, tokens[:-1]])


@dataclass
class Block:
    """One draft block: per-slot hidden, base and Markov-corrected logits, tokens, confidence."""

    hidden: mx.array          # [bs, H]
    base_logits: mx.array     # [bs, V]
    logits: mx.array          # [bs, V] after the Markov head
    token_ids: mx.array       # [bs], on the device
    confidence: mx.array | None  # [bs] logits (pre-sigmoid)

    @property
    def tokens(self) -> list[int]:
        return self.token_ids.tolist()


class Model(nn.Module):
    """`compiled` (default on): the block's shape-stable pieces run through mx.compile, the
    attention over the growing context outside it (port/compiled.py); `compiled=False` is the
    plain path, held to it bit for bit. `kv_bucket` (rows, default None): the bucketed path
    (module docstring); `compiled` then compiles (or not) its one block function."""

    def __init__(self, a: ModelArgs, compiled: bool = True, kv_bucket: int | None = None,
                 bucket_attention: str = "sdpa"):
        super().__init__()
        self.args = a
        self.compiled = compiled
        self.kv_bucket = compiled_pieces.check_bucket(kv_bucket, bucket_attention, DSparkError)
        self.bucket_attention = bucket_attention
        self._pieces = compiled_pieces.Pieces()
        self._bucketed = compiled_pieces.Bucketed()
        H = a.hidden_size
        self.embed_tokens = nn.Embedding(a.vocab_size, H)
        self.layers = [DecoderLayer(a) for _ in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=a.rms_norm_eps)
        self.fc = nn.Linear(len(a.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=a.rms_norm_eps)
        self.lm_head = nn.Linear(H, a.vocab_size, bias=False)
        if a.markov_rank > 0:
            self.markov_head = MarkovHead(a)
        if a.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H + (a.markov_rank if a.confidence_head_with_markov else 0))

    def tap_layers(self) -> list[int]:
        """The target layers whose outputs the drafter reads (hidden_states[l + 1]; -1 = embedding)."""
        ids = self.args.target_layer_ids
        return list(ids)

    def taps(self, hidden: list) -> mx.array:
        """Concatenated taps from a target's hidden states (hidden[0] = the embedding output)."""
        return mx.concatenate([hidden[i + 1] for i in self.tap_layers()], axis=-1)

    def project(self, x):
        return self.hidden_norm(self.fc(x))

    def context_kv(self, c, offset: int) -> list[tuple[mx.array, mx.array]]:
        return [layer.self_attn.kv(c, offset) for layer in self.layers]

    def embed(self, ids):
        e = self.embed_tokens(ids)
        if self.args.family == "gemma4":
            e = e * mx.array(math.sqrt(self.args.hidden_size), dtype=e.dtype)
        return e

    def logits(self, h):
        """The lm head, then the Gemma-4 softcap (the Markov bias joins after it)."""
        out = self.lm_head(h)
        cap = self.args.final_logit_softcapping
        return mx.tanh(out / cap) * cap if cap else out

    def _enter(self, ids, start):
        """The block's embedding and layer 0's Q, K, V."""
        h = self.embed(ids)
        return (h,) + self.layers[0].qkv(h, start)

    def _between(self, i: int, h, o, start):
        """Layer i's output and layer i+1's Q, K, V."""
        h = self.layers[i].finish(h, o)
        return (h,) + self.layers[i + 1].qkv(h, start)

    def _exit(self, h, o):
        """The last layer's output -> final norm -> per-slot hidden and base logits."""
        hidden = self.norm(self.layers[-1].finish(h, o))[0, ...]
        return hidden, self.logits(hidden)

    def _tail(self, hidden, base, anchor, pick=None):
        """Markov chain (rows, tokens) and the confidence logits of every slot."""
        a = self.args
        rows, tokens = markov_chain(self.markov_head if a.markov_rank > 0 else None, hidden, base, anchor, pick)
        if not a.enable_confidence_head:
            return rows, tokens
        feats = hidden
        if a.confidence_head_with_markov:
            feats = mx.concatenate([hidden, self.markov_head.markov_w1(previous_tokens(anchor, tokens))], axis=-1)
        return rows, tokens, self.confidence_head.proj(feats)[:, 0]

    def pieces(self) -> tuple:
        """(enter, [between_i], exit, greedy tail), plain or compiled (port/compiled.py)."""
        n = len(self.layers)
        return self._pieces.get(self, (self._enter, [partial(self._between, i) for i in range(n - 1)], self._exit,
                                       self._tail))

    def make_cache(self) -> KVCache:
        """One layer's context K/V store: mlx-lm's KVCache, or a BucketCache with kv_bucket."""
        return KVCache() if self.kv_bucket is None else compiled_pieces.BucketCache(self.kv_bucket)

    def _block_bucketed(self, greedy: bool, ids, start, valid, keys, values):
        """The whole block over the bucketed context buffers keys / values (per layer, rows past
        `valid` masked); greedy: with the Markov chain and confidence (the _tail), else up to the
        base logits (a host `pick` chains the tail after)."""
        self._bucketed.traces += 1
        h, q, k, v = self._enter(ids, start)
        for i, layer in enumerate(self.layers):
            seen = compiled_pieces.valid_rows(valid, keys[i].shape[2])
            o = compiled_pieces.bucketed_attention(self.bucket_attention, q, keys[i], values[i], seen, k, v, None,
                                                   layer.self_attn.scale)
            if i < len(self.layers) - 1:
                h, q, k, v = self._between(i, h, o, start)
        hidden, base = self._exit(h, o)
        if not greedy:
            return hidden, base
        return (hidden, base) + tuple(self._tail(hidden, base, ids[0, :1].astype(mx.uint32)))

    def _draft_bucketed(self, ids, anchor_id, ctx, start: int, pick) -> Block:
        if not all(isinstance(c, compiled_pieces.BucketCache) for c in ctx):
            raise DSparkError("kv_bucket: draft_block needs the context as one BucketCache per layer "
                              "(Model.make_cache; DeepspecSource makes them), not (k, v) pairs or a KVCache")
        keys, values = zip(*(c.buffers() for c in ctx))
        greedy = pick is None
        fn = self._bucketed.get(self, (greedy, self.bucket_attention), partial(self._block_bucketed, greedy),
                                [self.state])
        out = fn(ids, mx.array(start, mx.int32), mx.array(ctx[0].offset, mx.int32), list(keys), list(values))
        hidden, base = out[:2]
        rows, tokens, *conf = out[2:] if greedy else self._tail(hidden, base, anchor_id, pick)
        return Block(hidden, base, rows, tokens, conf[0] if conf else None)

    def draft_block(self, anchor: int, ctx, start: int, pick=None) -> Block:
        """One block at positions start..; ctx per layer: a (k, v) pair or a cache of it
        (Attention.join; kv_bucket: a BucketCache). Each slot's token is the argmax of its
        Markov-corrected row, or `pick(row)` (the serve loop's sampler: DeepSpec's T > 0 draws it
        from softmax(row / T)), and the next slot's Markov head reads that token."""
        a = self.args
        ids = targets.block_ids(anchor, a.mask_token_id, a.block_size - 1)
        if self.kv_bucket is not None:
            return self._draft_bucketed(ids, mx.array([anchor], mx.uint32), ctx, start, pick)
        enter, between, leave, tail = self.pieces()
        pos = compiled_pieces.position(self, start)
        h, q, k, v = enter(ids, pos)
        for i, (layer, c) in enumerate(zip(self.layers, ctx)):
            o = layer.self_attn.attend(q, *layer.self_attn.join(c, k, v))
            if i < len(between):
                h, q, k, v = between[i](h, o, pos)
        hidden, base = leave(h, o)
        anchor_id = mx.array([anchor], mx.uint32)
        rows, tokens, *conf = tail(hidden, base, anchor_id) if pick is None else self._tail(hidden, base, anchor_id,
                                                                                              pick)
        return Block(hidden, base, rows, tokens, conf[0] if conf else None)

    def prefix_length(self, confidence, threshold: float) -> int:
        """Draft tokens kept: up to the first slot whose sigmoid(confidence) < threshold."""
        if confidence is None or threshold <= 0.0:
            return self.args.block_size
        return targets.first_true(mx.sigmoid(confidence) < threshold, self.args.block_size)


def load(path: str | Path, compiled: bool = True, kv_bucket: int | None = None,
         bucket_attention: str = "sdpa") -> Model:
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    a = ModelArgs.from_config(cfg, path)
    model = Model(a, compiled, kv_bucket, bucket_attention)
    checkpoint.load_into(model, path, checkpoint.read_tensors(path), DSparkError,
                         "is this a complete DeepSpec DSpark checkpoint?")
    mx.eval(model.parameters())
    return model


def check_pairing(drafter: Model, target: targets.Target) -> None:
    """A DSpark drafter reads one target's hidden states: refuse a target it was not built on."""
    a, c = drafter.args, target.config
    if a.family != target.family:
        raise DSparkError(f"a {a.family} DSpark drafter needs a {a.family} target; {target.path} is "
                          f"{c.get('model_type')!r}")
    if a.num_target_layers != c["num_hidden_layers"]:
        raise DSparkError(f"drafter was built on a {a.num_target_layers}-layer target; {target.path} has "
                          f"{c['num_hidden_layers']} layers (tap layers {a.target_layer_ids} would read the wrong depth)")
    if a.hidden_size != c["hidden_size"] or a.vocab_size != c["vocab_size"]:
        raise DSparkError(f"drafter hidden/vocab {(a.hidden_size, a.vocab_size)} != target's "
                          f"{(c['hidden_size'], c['vocab_size'])}")
    if c["num_hidden_layers"] - 1 in a.target_layer_ids:
        raise DSparkError(f"target_layer_ids {a.target_layer_ids} include the final layer: its hidden state is "
                          "the final-normed one in transformers, not a raw layer output")


class DeepspecSource:
    """DSpark behind the serve-loop seam. It owns the per-layer context K/V: prefill queues the
    tapped prompt rows, each draft first appends the queued rows (projected, at their absolute
    positions), and commit queues only the anchor + accepted rows of the verify."""

    def __init__(self, drafter: Model, view, threshold: float = 0.0):
        check_pairing(drafter, view.target)
        self.m, self.threshold = drafter, threshold
        self.tap_layers = drafter.tap_layers()
        self.cache: list[KVCache] | None = None  # per draft layer, preallocated (grows in steps)
        self.length = 0
        self.pending = None
        self.last_block: Block | None = None

    def prefill(self, prompt_ids, tapped) -> None:
        self.pending = mx.concatenate(tapped, axis=-1)

    @property
    def nbytes(self) -> int:
        """Bytes of this request's context K/V (all draft layers) and queued tap rows."""
        kv = sum(c.nbytes for c in self.cache) if self.cache is not None else 0
        return kv + (self.pending.nbytes if self.pending is not None else 0)

    def draft(self, feed: list[int], n: int, anchor_hidden) -> list[int]:
        return self.draft_device(feed, n, anchor_hidden).tolist()

    def draft_device(self, feed: list[int], n: int, anchor_hidden) -> mx.array:
        """The greedy proposal as a lazy array; it syncs only for a confidence threshold (the
        proposal's length)."""
        block = self._block(feed, None)
        return block.token_ids[: min(self.m.prefix_length(block.confidence, self.threshold), n)]

    def draft_sampled(self, feed: list[int], n: int, anchor_hidden, pick) -> list[int]:
        """`draft` with each slot's token chosen by `pick(row)` (None: argmax), chained through
        the Markov head and the confidence head as DeepSpec's sampled proposal is."""
        block = self._block(feed, pick)
        return block.tokens[: min(self.m.prefix_length(block.confidence, self.threshold), n)]

    def _block(self, feed: list[int], pick) -> Block:
        rows = self.pending
        kv = self.m.context_kv(self.m.project(rows), self.length)
        if self.cache is None:
            self.cache = [self.m.make_cache() for _ in kv]
        for c, (k, v) in zip(self.cache, kv):
            c.update_and_fetch(k, v)
        self.length += rows.shape[1]
        self.pending = None
        self.last_block = self.m.draft_block(feed[-1], self.cache, self.length, pick)
        return self.last_block

    def commit(self, n_drafted: int, accepted: int, tapped) -> None:
        self.pending = targets.verified_rows(tapped, accepted)

    def dispose(self) -> None:
        self.cache = None


class DeepspecProvider:
    """`kv_bucket`: the bucketed path (module docstring); None (default) is the parity path."""

    def __init__(self, path: str | Path, threshold: float = 0.0, kv_bucket: int | None = None):
        self.path = Path(path)
        self.id = self.path.name
        self.drafter = load(self.path, kv_bucket=kv_bucket)
        self.weights_bytes = checkpoint.weights_bytes(self.path)
        self.trained_gamma = self.drafter.args.block_size
        self.threshold = threshold

    def open(self, view) -> DeepspecSource:
        return DeepspecSource(self.drafter, view, self.threshold)

    def dispose(self) -> None:
        self.drafter = None

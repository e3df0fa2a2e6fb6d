"""z-lab's DFlash drafter (`dflash==0.1.0`, github z-lab/dflash) in MLX, and its serve-loop source.

One draft round, from the target's hidden states:

    x   = concat(hidden_states[l + 1] for l in target_layer_ids)      the verify's taps (new rows only)
    c   = hidden_norm(fc(x))                                          projected context
    per draft layer (Qwen3-style: pre-norm attention + SwiGLU MLP, q_norm / k_norm per head):
        context K/V = RoPE(k_norm(k_proj(c))), v_proj(c) at the rows' absolute positions; these
        are the ONLY state that persists between rounds (full layers: every row; sliding layers:
        the newest W-1 rows, in mlx-lm's rotating cache)
        block: ids [anchor, MASK x (bs-1)] at positions start..start+bs-1, embedded with the
        TARGET's embedding x (its embed scale x input_embedding_scale); Q and the block's own K/V
        (k_norm too) from the block rows; keys [context ; block]; scale head_dim^-0.5
        mask: full layers none (bidirectional), sliding layers causal within the block and the
        window over the context (config `is_causal` overrides the causal default for every layer)
    final norm over block rows 1..bs-1 -> the TARGET's lm head x output_multiplier -> softcap
    -> greedy tokens: row k predicts the token at start + k (the anchor row predicts nothing)

Reference deltas (z-lab's own MLX and torch models disagree), port options:
  window="positional" (default; z-lab torch's semantics): a sliding layer's context keys are used
      in time order, so the window drops the OLDEST rows;
  window="zlab-mlx": z-lab MLX's: it feeds mlx-lm's RotatingKVCache buffer to the attention as
      returned. After a one-row context update on a full ring that buffer is not in time order (the
      newest row sits at the write index) while its mask is by buffer index: block rows then lose
      the newest context rows instead of the oldest. The two agree bit for bit until that happens.
  (Both keep the block itself unwindowed, as z-lab MLX does; z-lab torch's mask would also window
  the block rows against each other, which differs only when block_size > sliding_window.)
  embed="scaled" (default; z-lab MLX): the block embedding is the target's embedding x the
      target's embed scale (Gemma-4: sqrt(H)) x input_embedding_scale;
  embed="raw" (z-lab torch): the raw embedding rows x input_embedding_scale (its
      `_raw_input_embeddings` reads the weight, skipping Gemma's scale). Same on Qwen3 targets.

DSpark-on-DFlash extension (L3, no oracle: mlx-bun 0.0.11 `dflash-source.ts`), opt-in with
`DflashProvider(path, extras=True, thresholds=None)`. It needs a checkpoint with the DSpark extras
(DeepSpec names: `markov_head.*`, `confidence_head.proj.*`; config `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`, read from
dflash_config first, then the top level). Its definition:
  Markov head: after the softcap, sequentially: row_k = base_k + markov_bias(prev_k, h_k),
      prev_0 = the anchor, prev_k = the draft token k-1 (port.dspark.MarkovHead); the draft token k
      is argmax(row_k) (sampling: the serve loop's pick(row_k), `DflashSource.draft_sampled`). The
      base rows (the L2 logits) are kept on the block as `base_logits`.
  Confidence: c_k = confidence_head.proj([h_k ; W1[prev_k]] or h_k) (port.dspark.ConfidenceHead);
      the proposal is cut at the first k with sigmoid(c_k) < tau_k (per step; 0 tokens possible).
  Thresholds tau, first found wins: the `thresholds` argument (a list; [] = no pruning), the env
      var SPEC_PARITY_STS_THRESHOLDS (comma-separated floats), the checkpoint's calibration.json
      (port.calibration.read_calibration), else none (no pruning, fixed-length drafts). One value
      applies to every position; positions past the list's end are never pruned.
With extras off (the default) nothing of this is built or read: the source is the L2 one.

`kv_bucket` (opt-in, default None): every layer keeps every context row in a buffer a whole number
of buckets long (port/compiled.py BucketCache; sliding layers mask the window instead of rotating),
presented whole with the tail masked, and the block (embedding, layers, final norm, the target's
head, the extension's greedy tail) is one compiled call that retraces only when the buffer grows
(or the block length changes); mx.fast's attention over [context | block] joined with a float
mask, or (bucket_attention="two-segment") a two-segment softmax (port/compiled.py). Held to the
default within fp32 tolerance (bit-exact on the CPU backend with "sdpa", measured).
window="zlab-mlx" (a quirk of the ring's buffer order) is refused with it.

The negative controls (planted bugs) live outside the port, in spec_parity/controls/dflash.py.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from . import checkpoint, heads, targets
from . import compiled as compiled_pieces

# Where input_embedding_scale and output_multiplier are read: "either" (z-lab torch, the default):
# dflash_config first, then the config's top level; "nested" (z-lab MLX): dflash_config only, a
# top-level key is not read. The two agree on every checkpoint that nests them.
SCALES = ("either", "nested")

EXTRAS_ENV = "SPEC_PARITY_STS_THRESHOLDS"
WINDOWS = ("positional", "zlab-mlx")
EMBEDS = ("scaled", "raw")


class DFlashError(ValueError):
    pass


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    layer_types: list[str]
    sliding_window: int | None
    is_causal: bool | None
    final_logit_softcapping: float | None
    input_embedding_scale: float
    output_multiplier: float
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    @classmethod
    def from_config(cls, c: dict, path: Path, scales: str = "either") -> ModelArgs:
        """scales: where input_embedding_scale and output_multiplier are read (SCALES)."""
        if scales not in SCALES:
            raise DFlashError(f"unknown scales convention {scales!r}; known: {SCALES}")
        arch = c.get("architectures") or []
        if "DFlash2DraftModel" in arch:
            raise DFlashError(f"{path}: DFlash2DraftModel (grouped causal convolutions + candidate selector) "
                              "is not ported; only DFlashDraftModel is")
        if "DFlashDraftModel" not in arch:
            raise DFlashError(f"{path}: architectures {arch} is not a z-lab DFlash drafter (expected DFlashDraftModel)")
        d = c.get("dflash_config")
        if not isinstance(d, dict) or "target_layer_ids" not in d or "mask_token_id" not in d:
            raise DFlashError(f"{path}: config.json needs dflash_config with target_layer_ids and mask_token_id")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                               "head_dim", "intermediate_size", "vocab_size", "num_target_layers") if k not in c]
        if missing:
            raise DFlashError(f"{path}: config.json lacks {missing}")
        n = c["num_hidden_layers"]
        layer_types = list(c.get("layer_types") or ["full_attention"] * n)
        if len(layer_types) != n:
            raise DFlashError(f"{path}: layer_types has {len(layer_types)} entries for {n} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise DFlashError(f"{path}: unsupported layer_types {sorted(unknown)} (full_attention, sliding_attention)")
        if "sliding_attention" in layer_types and not c.get("sliding_window"):
            raise DFlashError(f"{path}: sliding_attention layers need a sliding_window")
        rope = c.get("rope_parameters") or c.get("rope_scaling")

        def opt(name, default=None):  # z-lab torch: dflash_config first, then the top level
            return d.get(name, c.get(name, default))

        def scale(name):
            return float(d.get(name, c.get(name, 1.0) if scales == "either" else 1.0))

        cap = opt("final_logit_softcapping")
        return cls(
            hidden_size=c["hidden_size"], num_hidden_layers=n, num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
            intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=c.get("rope_theta", (rope or {}).get("rope_theta", 10000.0)), rope_scaling=rope,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            block_size=int(opt("block_size", 16)), target_layer_ids=[int(i) for i in d["target_layer_ids"]],
            num_target_layers=c["num_target_layers"], mask_token_id=int(d["mask_token_id"]),
            layer_types=layer_types, sliding_window=c.get("sliding_window"), is_causal=c.get("is_causal"),
            final_logit_softcapping=float(cap) if cap else None,
            input_embedding_scale=scale("input_embedding_scale"), output_multiplier=scale("output_multiplier"),
            markov_rank=int(opt("markov_rank", 0) or 0), markov_head_type=str(opt("markov_head_type", "vanilla")),
            enable_confidence_head=bool(opt("enable_confidence_head", False)),
            confidence_head_with_markov=bool(opt("confidence_head_with_markov", False)),
        )


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int, window: str):
        super().__init__()
        self.a, self.window = a, window
        H, hd = a.hidden_size, a.head_dim
        self.n_heads, self.n_kv = a.num_attention_heads, a.num_key_value_heads
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=a.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=a.rms_norm_eps)
        self.scale = hd ** -0.5
        self.sliding = a.layer_types[layer] == "sliding_attention"
        self.causal = self.sliding if a.is_causal is None else bool(a.is_causal)

    def _heads(self, x, n, norm=None):
        B, T, _ = x.shape
        x = x.reshape(B, T, n, -1)
        return (norm(x) if norm is not None else x).transpose(0, 2, 1, 3)

    def block_qkv(self, x, block_at, rope):
        """Q, K (k_norm too) and V of the block rows x [1, L, H] (after input_layernorm), at
        positions block_at.. (an int or a scalar array)."""
        q = rope(self._heads(self.q_proj(x), self.n_heads, self.q_norm), offset=block_at)
        bk = rope(self._heads(self.k_proj(x), self.n_kv, self.k_norm), offset=block_at)
        return q, bk, self._heads(self.v_proj(x), self.n_kv)

    def context_kv(self, ctx, offset, rope):
        """K (k_norm, RoPE at offset..) and V of the projected context rows ctx [1, S, H]."""
        return rope(self._heads(self.k_proj(ctx), self.n_kv, self.k_norm), offset=offset), \
            self._heads(self.v_proj(ctx), self.n_kv)

    def attend(self, q, bk, bv, ctx, cache, rope):
        """The block rows' attention heads over [context ; block]. ctx: the new projected context
        rows [1, S, H]; they join `cache` first, at their absolute positions."""
        L, S = q.shape[2], ctx.shape[1]
        if self.sliding and S > self.a.sliding_window - 1:
            # Only the newest W-1 context rows can be seen by any block row; the dropped ones still
            # count for the positions (mlx-lm's cache offset is the number of rows seen).
            skip = S - (self.a.sliding_window - 1)
            ctx, S = ctx[:, skip:], S - skip
            cache.offset += skip
        keys, values = cache.update_and_fetch(*self.context_kv(ctx, cache.offset, rope))
        n_ctx = keys.shape[2]
        if isinstance(cache, RotatingKVCache):
            if self.sliding and self.window == "positional":
                keys, values = cache._temporal_order(keys), cache._temporal_order(values)
            keys = mx.concatenate([keys, bk], axis=2)
            values = mx.concatenate([values, bv], axis=2)
        else:
            # The block's rows go after the context in the preallocated buffer and are trimmed off
            # again: the same keys as the concatenation, without copying the context.
            keys, values = cache.update_and_fetch(bk, bv)
            cache.trim(L)
        mask = None
        if self.sliding:
            qpos = n_ctx + mx.arange(L)[:, None]
            kpos = mx.arange(n_ctx + L)[None]
            seen_ctx = (kpos < n_ctx) & (qpos - kpos < self.a.sliding_window)
            seen_block = kpos >= n_ctx
            if self.causal:
                seen_block = seen_block & (kpos <= qpos)
            mask = seen_ctx | seen_block
        elif self.causal:
            mask = create_causal_mask(L, offset=n_ctx)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)

    def attend_bucketed(self, how: str, q, bk, bv, keys, values, valid):
        """`attend` over a bucketed context buffer (every context row kept, in time order: row j is
        position j; rows from `valid` on masked; the block sits at valid..): full layers see every
        valid row, sliding layers those within the window of each block row (window="positional");
        the block rows see each other (causal: the earlier ones only)."""
        L = q.shape[2]
        seen = compiled_pieces.valid_rows(valid, keys.shape[2])
        if self.sliding:
            seen = seen & (valid + mx.arange(L)[:, None] - mx.arange(keys.shape[2]) < self.a.sliding_window)
        causal = mx.arange(L)[None] <= mx.arange(L)[:, None] if self.causal else None
        return compiled_pieces.bucketed_attention(how, q, keys, values, seen, bk, bv, causal, self.scale)

    def output(self, o):
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(1, o.shape[2], -1))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer: int, window: str):
        super().__init__()
        self.a = a
        self.self_attn = Attention(a, layer, window)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)

    def qkv(self, x, block_at, rope):
        return self.self_attn.block_qkv(self.input_layernorm(x), block_at, rope)

    def attend(self, q, bk, bv, ctx, cache, rope):
        """The block rows' attention; the context rows enter K/V without the input_layernorm."""
        return self.self_attn.attend(q, bk, bv, ctx, cache, rope)

    def finish(self, x, o):
        """The layer's output from its input x and the attention heads o."""
        h = x + self.self_attn.output(o)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class Block:
    """One draft block: the final-normed hidden, logits and greedy tokens of rows 1..bs-1."""

    hidden: mx.array   # [bs-1, H]
    logits: mx.array   # [bs-1, V] (extras: after the Markov head)
    token_ids: mx.array  # [bs-1], on the device
    base_logits: mx.array | None = None  # extras: the rows before the Markov head
    confidence: mx.array | None = None   # extras: [n] confidence logits (pre-sigmoid)

    @property
    def tokens(self) -> list[int]:
        return self.token_ids.tolist()


class Model(nn.Module):
    def __init__(self, a: ModelArgs, window: str = "positional", embed: str = "scaled", extras: bool = False,
                 compiled: bool = True, kv_bucket: int | None = None, bucket_attention: str = "sdpa"):
        super().__init__()
        self.compiled = compiled  # the block's shape-stable pieces through mx.compile (port/compiled.py)
        self._pieces = compiled_pieces.Pieces()
        self.kv_bucket = compiled_pieces.check_bucket(kv_bucket, bucket_attention, DFlashError)
        self.bucket_attention = bucket_attention
        self._bucketed = compiled_pieces.Bucketed()
        if window not in WINDOWS:
            raise DFlashError(f"window {window!r}: expected one of {WINDOWS}")
        if kv_bucket is not None and window == "zlab-mlx" and "sliding_attention" in a.layer_types:
            raise DFlashError("kv_bucket with window='zlab-mlx': that window follows the rotating buffer's order, "
                              "which a bucketed context (every row, in time order) does not have; use "
                              "window='positional' (z-lab torch's semantics) or kv_bucket=None")
        if embed not in EMBEDS:
            raise DFlashError(f"embed {embed!r}: expected one of {EMBEDS}")
        self.args, self.window, self.embed_mode = a, window, embed
        H = a.hidden_size
        self.fc = nn.Linear(len(a.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=a.rms_norm_eps)
        self.layers = [DecoderLayer(a, i, window) for i in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=a.rms_norm_eps)
        self._rope = initialize_rope(a.head_dim, base=a.rope_theta, traditional=False, scaling_config=a.rope_scaling,
                                     max_position_embeddings=a.max_position_embeddings)
        self.extras = extras
        if extras:
            if a.markov_rank <= 0 and not a.enable_confidence_head:
                raise DFlashError("extras=True needs a checkpoint with DSpark extras (markov_rank > 0 and/or "
                                  "enable_confidence_head in its config); this one has none")
            if a.confidence_head_with_markov and a.markov_rank <= 0:
                raise DFlashError("confidence_head_with_markov needs markov_rank > 0")
            for name, head in heads.build(a.markov_rank, a.markov_head_type, a.enable_confidence_head,
                                          a.confidence_head_with_markov, H, a.vocab_size).items():
                setattr(self, name, head)

    def _enter(self, h, block_at):
        """Layer 0's block Q, K, V."""
        return self.layers[0].qkv(h, block_at, self._rope)

    def _between(self, i: int, h, o, block_at):
        """Layer i's output and layer i+1's block Q, K, V."""
        h = self.layers[i].finish(h, o)
        return (h,) + self.layers[i + 1].qkv(h, block_at, self._rope)

    def _exit(self, h, o):
        """The last layer's output -> final norm over block rows 1..n."""
        return self.norm(self.layers[-1].finish(h, o)[:, 1:])

    def pieces(self) -> tuple:
        """(enter, [between_i], exit), plain or compiled (port/compiled.py)."""
        n = len(self.layers)
        return self._pieces.get(self, (self._enter, [partial(self._between, i) for i in range(n - 1)], self._exit))

    @property
    def all_sliding(self) -> bool:
        return all(t == "sliding_attention" for t in self.args.layer_types)

    def make_caches(self) -> list:
        """Per layer, the context K/V store: full layers keep every row, sliding layers W-1
        (kv_bucket: every layer every row, in a BucketCache)."""
        if self.kv_bucket is not None:
            return [compiled_pieces.BucketCache(self.kv_bucket) for _ in self.args.layer_types]
        return [RotatingKVCache(max_size=self.args.sliding_window - 1, keep=0) if t == "sliding_attention"
                else KVCache() for t in self.args.layer_types]

    def taps(self, hidden: list) -> mx.array:
        """Concatenated taps from a target's hidden states (hidden[0] = the embedding output)."""
        return mx.concatenate([hidden[i + 1] for i in self.args.target_layer_ids], axis=-1)

    def project(self, x):
        return self.hidden_norm(self.fc(x))

    def embed(self, target: targets.Target, ids: mx.array) -> mx.array:
        """The target's embedding x (its embed scale x input_embedding_scale), one multiply;
        embed="raw": without the target's embed scale."""
        tm = target.model.model
        scale = getattr(tm, "embed_scale", 1.0) if self.embed_mode == "scaled" else 1.0
        return tm.embed_tokens(ids) * (scale * self.args.input_embedding_scale)

    def head(self, target: targets.Target, h: mx.array) -> mx.array:
        """The target's lm head (tied: its embedding) x output_multiplier: the logits before the
        softcap (the extension's Markov bias joins after it)."""
        m = target.model
        out = m.lm_head(h) if hasattr(m, "lm_head") else m.model.embed_tokens.as_linear(h)
        return out * self.args.output_multiplier

    def logits(self, target: targets.Target, h: mx.array) -> mx.array:
        """`head`, then the softcap."""
        out = self.head(target, h)
        cap = self.args.final_logit_softcapping
        return mx.tanh(out / cap) * cap if cap else out

    def extend(self, target: targets.Target, anchor: int, hidden: mx.array, base: mx.array, pick=None) -> Block:
        """The extension on one block: hidden [n, H] (final-normed rows 1..n), base [n, V] (after
        the softcap). Markov bias added to row k after the softcap, chained on the row's token:
        its argmax (on the device), or `pick(row)` (the serve loop's sampler); then the confidence
        logits of every row."""
        anchor = anchor if isinstance(anchor, mx.array) else mx.array([anchor], mx.uint32)
        rows, tokens, conf = heads.extend(self, hidden, base, anchor, pick)
        return Block(hidden, rows, tokens, base_logits=base, confidence=conf)

    def block(self, target: targets.Target, anchor: int, n: int, ctx_rows: mx.array | None, caches: list) -> Block:
        """Draft n tokens after `anchor`: block [anchor, MASK x n]; `ctx_rows` are the raw taps of the
        context rows not yet in `caches` (they are projected and appended there)."""
        a = self.args
        ids = targets.block_ids(anchor, a.mask_token_id, n)
        if ctx_rows is None or ctx_rows.shape[1] == 0:
            raise DFlashError("a draft needs the new context rows (the prompt's or the last verify's taps): "
                              "commit the previous verify first")
        c = self.project(ctx_rows)
        if self.kv_bucket is not None:
            return self._block_bucketed(target, ids, c, caches)
        h = self.embed(target, ids)
        enter, between, leave = self.pieces()
        # the block sits after every context row seen (sliding layers count the skipped ones too)
        at = [compiled_pieces.position(self, cache.offset + c.shape[1]) for cache in caches]
        q, bk, bv = enter(h, at[0])
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            o = layer.attend(q, bk, bv, c, cache, self._rope)
            if i < len(between):
                h, q, bk, bv = between[i](h, o, at[i + 1])
        hidden = leave(h, o)
        logits = self.logits(target, hidden)
        # x[k, ...], not x[k]: MLX makes a lone integer index a Gather (on MLX CUDA one over a block's
        # logits costs 22-257 us of device time), the slice is a view (tests/test_bench.py)
        if self.extras:
            return self.extend(target, anchor, hidden[0, ...], logits[0, ...])
        return Block(hidden[0, ...], logits[0, ...], mx.argmax(logits[0, ...], axis=-1))

    def _block_bucketed(self, target: targets.Target, ids, c, caches) -> Block:
        """`block` on the bucketed path: the new context rows c join the buffers (plain ops: their
        count varies per round), then the compiled block over the whole buffers."""
        if not all(isinstance(cache, compiled_pieces.BucketCache) for cache in caches):
            raise DFlashError("kv_bucket: the caches must be BucketCaches (Model.make_caches makes them)")
        for layer, cache in zip(self.layers, caches):
            cache.update_and_fetch(*layer.self_attn.context_kv(c, cache.offset, self._rope))
        keys, values = zip(*(cache.buffers() for cache in caches))
        fn = self._bucketed.get(self, (id(target), self.bucket_attention), partial(self._bucketed_fn, target),
                                [self.state, target.model.state])
        out = fn(ids, mx.array(caches[0].offset, mx.int32), list(keys), list(values))
        if not self.extras:
            return Block(*out)
        return Block(*out[:3], base_logits=out[3], confidence=out[4] if len(out) > 4 else None)

    def _bucketed_fn(self, target: targets.Target, ids, valid, keys, values):
        """The whole block over the bucketed buffers (rows from `valid` masked), as arrays: hidden,
        logits, tokens (extras: then the base rows and the confidence)."""
        self._bucketed.traces += 1
        h = self.embed(target, ids)
        q, bk, bv = self._enter(h, valid)
        for i, layer in enumerate(self.layers):
            o = layer.self_attn.attend_bucketed(self.bucket_attention, q, bk, bv, keys[i], values[i], valid)
            if i < len(self.layers) - 1:
                h, q, bk, bv = self._between(i, h, o, valid)
        hidden = self._exit(h, o)
        logits = self.logits(target, hidden)
        if not self.extras:
            return hidden[0, ...], logits[0, ...], mx.argmax(logits[0, ...], axis=-1)
        b = self.extend(target, ids[0, :1].astype(mx.uint32), hidden[0, ...], logits[0, ...])
        return (b.hidden, b.logits, b.token_ids, b.base_logits) + ((b.confidence,) if b.confidence is not None else ())


def load(path: str | Path, window: str = "positional", embed: str = "scaled", extras: bool = False,
         compiled: bool = True, kv_bucket: int | None = None, bucket_attention: str = "sdpa",
         scales: str = "either") -> Model:
    path = Path(path)
    if not (path / "config.json").exists():
        raise DFlashError(f"{path}: no config.json")
    a = ModelArgs.from_config(json.loads((path / "config.json").read_text()), path, scales)
    model = Model(a, window, embed, extras, compiled, kv_bucket, bucket_attention)
    checkpoint.load_into(model, path, checkpoint.read_tensors(path), DFlashError, lambda missing: (
        "does it carry the DSpark extras its config declares?"
        if extras and all(k.startswith(("markov_head.", "confidence_head.")) for k in missing)
        else "is this a complete z-lab DFlash checkpoint?"),
        unused=() if extras else ("markov_head.", "confidence_head."))  # extras off: z-lab's DFlash, as z-lab reads it
    mx.eval(model.parameters())
    return model


def check_pairing(drafter: Model, target: targets.Target) -> None:
    """A DFlash drafter reads one target's hidden states and borrows its embedding and head:
    refuse a target it was not built on."""
    a, c = drafter.args, target.config
    name = target.path
    if a.num_target_layers != c["num_hidden_layers"]:
        raise DFlashError(f"drafter was built on a {a.num_target_layers}-layer target; {name} has "
                          f"{c['num_hidden_layers']} layers (tap layers {a.target_layer_ids} would read the wrong depth)")
    if a.hidden_size != c["hidden_size"]:
        raise DFlashError(f"drafter hidden size {a.hidden_size} != target's {c['hidden_size']} ({name}): it embeds "
                          "with the target's embedding and scores with the target's head")
    if a.vocab_size != c["vocab_size"]:
        raise DFlashError(f"drafter vocab {a.vocab_size} != target's {c['vocab_size']} ({name})")
    if not 0 <= a.mask_token_id < c["vocab_size"]:
        raise DFlashError(f"mask_token_id {a.mask_token_id} is not a row of the target's embedding ({c['vocab_size']})")
    bad = [i for i in a.target_layer_ids if not 0 <= i < c["num_hidden_layers"] - 1]
    if bad:
        raise DFlashError(f"target_layer_ids {a.target_layer_ids}: {bad} outside [0, {c['num_hidden_layers'] - 2}] "
                          "(the final layer's hidden state is the final-normed one in transformers, not a raw output)")


class DflashSource:
    """DFlash behind the serve-loop seam. It owns the per-layer context K/V; prefill queues the
    tapped prompt rows, each draft projects the queued rows into the K/V (at their absolute
    positions) while drafting, and commit queues only the pending + accepted rows of the verify.

    `max_tokens` (optional) reproduces z-lab's last block: with n tokens emitted it drafts at most
    max_tokens - n (z-lab shrinks the block to what is left; the serve loop would draft a full
    block and drop the excess)."""

    def __init__(self, drafter: Model, view, max_tokens: int | None = None, thresholds: list[float] | None = None,
                 samples: list | None = None):
        check_pairing(drafter, view.target)
        self.m, self.target, self.max_tokens = drafter, view.target, max_tokens
        self.thresholds = list(thresholds) if thresholds else None  # extras only
        self.samples = samples  # extras: a list to append (pos, sigmoid(conf), accepted) per verified draft
        self.tap_layers = list(drafter.args.target_layer_ids)
        self.caches = drafter.make_caches()
        self.pending: mx.array | None = None
        self.emitted = 0
        self.last_block: Block | None = None

    def _queue(self, rows: mx.array) -> None:
        self.pending = rows if self.pending is None else mx.concatenate([self.pending, rows], axis=1)

    def prefill(self, prompt_ids, tapped) -> None:
        x = mx.concatenate(tapped, axis=-1)
        if self.m.all_sliding and x.shape[1] > self.m.args.sliding_window - 1:
            # No layer can see more than the newest W-1 prompt rows: project only those.
            skip = x.shape[1] - (self.m.args.sliding_window - 1)
            x = x[:, skip:]
            for c in self.caches:
                c.offset = skip
        self._queue(x)
        self.emitted = 1

    @property
    def nbytes(self) -> int:
        """Bytes of this request's context K/V (all draft layers) and queued tap rows."""
        kv = sum(c.nbytes for c in self.caches) if self.caches is not None else 0
        return kv + (self.pending.nbytes if self.pending is not None else 0)

    def draft(self, feed: list[int], n: int, anchor_hidden) -> list[int]:
        return self.draft_device(feed, n, anchor_hidden).tolist()

    def draft_device(self, feed: list[int], n: int, anchor_hidden) -> mx.array:
        """The drafts as a lazy array: no host sync (extras with thresholds: one, for the length)."""
        return self._draft(feed, n, None)

    def draft_sampled(self, feed: list[int], n: int, anchor_hidden, pick) -> list[int]:
        """`draft` with each row's token chosen by `pick(row)`. The block's rows come from one
        forward over the mask tokens, so plain DFlash picks every row on its own (row order); with
        the extension the Markov head chains on the picked token and the confidence head reads it
        (as DSpark's sampled proposal does)."""
        return self._draft(feed, n, pick).tolist()

    def _draft(self, feed: list[int], n: int, pick) -> mx.array:
        n = min(n, self.m.args.block_size - 1)
        if self.max_tokens is not None:
            n = min(n, self.max_tokens - self.emitted)
        if n <= 0:
            self.last_block = None
            return mx.array([], mx.uint32)
        block = self.m.block(self.target, feed[-1], n, self.pending, self.caches)
        self.pending = None
        if pick is not None:
            block = (self.m.extend(self.target, feed[-1], block.hidden, block.base_logits, pick) if self.m.extras
                     else Block(block.hidden, block.logits, mx.array([int(pick(row)) for row in block.logits], mx.uint32)))
        self.last_block = block
        if block.confidence is not None and self.thresholds:
            return block.token_ids[: prune_length(block.confidence, self.thresholds)]
        return block.token_ids

    def commit(self, n_drafted: int, accepted: int, tapped) -> None:
        self._queue(targets.verified_rows(tapped, accepted))
        self.emitted += accepted + 1
        block = self.last_block
        if self.samples is not None and block is not None and block.confidence is not None and n_drafted:
            from .calibration import ConfSample

            conf = mx.sigmoid(block.confidence[:n_drafted]).tolist()
            self.samples += [ConfSample(k, float(c), k < accepted) for k, c in enumerate(conf)]

    def dispose(self) -> None:
        self.caches = None
        self.pending = None


def prune_length(confidence: mx.array, thresholds: list[float]) -> int:
    """Draft tokens kept: up to the first position k whose sigmoid(confidence_k) < thresholds[k]
    (one threshold: every position; past the list's end: never pruned). Compared on the device
    against the thresholds rounded up to float32, which for a float32 confidence decides c < t
    exactly as the float64 threshold does; one 4-byte read."""
    n = confidence.shape[0]
    return targets.first_true(mx.sigmoid(confidence) < _cuts(tuple(float(t) for t in thresholds), n), n)


@lru_cache(maxsize=64)
def _cuts(thresholds: tuple[float, ...], n: int) -> mx.array:
    """Per position the smallest float32 >= its threshold (-inf past the list's end), built once
    per (thresholds, n): a host-filled array is managed memory on MLX CUDA."""
    th = thresholds * n if len(thresholds) == 1 else thresholds[:n]
    up = [np.nextafter(np.float32(t), np.float32(np.inf)) if float(np.float32(t)) < t else np.float32(t) for t in th]
    return mx.array(np.array(up + [-np.inf] * (n - len(up)), np.float32))


def parse_thresholds(text: str, what: str = EXTRAS_ENV) -> list[float]:
    try:
        th = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise DFlashError(f"{what}={text!r}: expected comma-separated floats ({e})") from None
    if not th or not all(math.isfinite(t) for t in th):
        raise DFlashError(f"{what}={text!r}: expected one or more finite comma-separated floats")
    return th


def resolve_thresholds(path: str | Path, thresholds=None) -> tuple[list[float] | None, str | None]:
    """The extension's thresholds and where they came from: the argument, else the env var, else
    the checkpoint's calibration.json, else (None, None): no pruning. An explicit [] means none."""
    if thresholds is not None:
        th = [float(t) for t in thresholds]
        if not all(math.isfinite(t) for t in th):
            raise DFlashError(f"thresholds {thresholds!r}: expected finite numbers")
        return (th or None), "argument"
    env = os.environ.get(EXTRAS_ENV)
    if env is not None and env.strip():
        return parse_thresholds(env), "env"
    from .calibration import read_calibration

    th = read_calibration(path)
    return (th, "calibration") if th is not None else (None, None)


class DflashProvider:
    """`extras=True` turns on the DSpark-on-DFlash extension (module docstring); `thresholds`
    overrides the env var and the checkpoint's calibration; `collect_samples` gathers, over every
    request, the (position, sigmoid(confidence), accepted) samples of each verified draft in
    `self.samples` (what port.calibration.fit_sts_thresholds fits); `kv_bucket`: the bucketed path
    (module docstring), None (default) the parity one."""

    def __init__(self, path: str | Path, window: str = "positional", max_tokens: int | None = None,
                 embed: str = "scaled", extras: bool = False, thresholds=None, collect_samples: bool = False,
                 kv_bucket: int | None = None, scales: str = "either"):
        self.path = Path(path)
        self.id = self.path.name
        self.drafter = load(self.path, window, embed, extras, kv_bucket=kv_bucket, scales=scales)
        self.weights_bytes = checkpoint.weights_bytes(self.path)
        self.trained_gamma = self.drafter.args.block_size - 1
        self.max_tokens = max_tokens
        self.extras = extras
        self.thresholds, self.threshold_source = (resolve_thresholds(self.path, thresholds) if extras
                                                  else (None, None))
        self.samples: list | None = [] if extras and collect_samples else None

    def open(self, view) -> DflashSource:
        if not self.extras:
            return DflashSource(self.drafter, view, self.max_tokens)
        return DflashSource(self.drafter, view, self.max_tokens, self.thresholds, self.samples)

    def dispose(self) -> None:
        self.drafter = None

"""z-lab's DFlash drafter (`dflash==0.1.0`, github z-lab/dflash) in MLX.

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
  Both keep the block itself unwindowed, as z-lab MLX does; z-lab torch's mask also windows the
  block rows against each other, which differs when block_size > sliding_window: such a drafter
  is refused (check_window).
  embed="scaled" (default; z-lab MLX): the block embedding is the target's embedding x the
      target's embed scale (Gemma-4: sqrt(H)) x input_embedding_scale;
  embed="raw" (z-lab torch): the raw embedding rows x input_embedding_scale (its
      `_raw_input_embeddings` reads the weight, skipping Gemma's scale). Same on Qwen3 targets.

DSpark-on-DFlash extension (L3, no oracle: mlx-bun 0.0.11 `dflash-source.ts`): DeepSpec's Markov
and confidence heads (port/heads.py) on the block's rows, loaded by `load_extension` from a
checkpoint with the DSpark extras (DeepSpec names: `markov_head.*`, `confidence_head.proj.*`;
config `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`,
read from dflash_config first, then the top level). The source applies it
(port/sources/dflash.py, `DflashProvider(path, extras=True)`), its thresholds come from
port/calibration.py. `load` alone reads such a checkpoint as z-lab's DFlash does: extras ignored.

Fast paths (the compiled pieces, the bucketed block) are subclasses of Model in
port/fast/dflash.py; the serve-loop source and provider are in port/sources/dflash.py.

The negative controls (planted bugs) live outside the port, in spec_parity/drafters/dflash/controls.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from . import checkpoint, heads, targets

# Where input_embedding_scale and output_multiplier are read: "either" (z-lab torch, the default):
# dflash_config first, then the config's top level; "nested" (z-lab MLX): dflash_config only, a
# top-level key is not read. The two agree on every checkpoint that nests them.
SCALES = ("either", "nested")

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
        check_window(c, path, int(d.get("block_size", c.get("block_size", 16))), layer_types)
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
        self.rope = initialize_rope(hd, base=a.rope_theta, traditional=False, scaling_config=a.rope_scaling,
                                    max_position_embeddings=a.max_position_embeddings)

    def __call__(self, x, ctx, cache, block_at):
        """The block rows x [1, L, H] (input-normed) at positions block_at.. over [context ;
        block]; ctx: the new projected context rows (they join `cache`, see attend)."""
        q, bk, bv = self.block_qkv(x, block_at)
        return self.output(self.attend(q, bk, bv, ctx, cache))

    def _heads(self, x, n, norm=None):
        """Rows x [1, T, n * hd] or [T, n * hd] -> heads [1, n, T, hd]."""
        x = x.reshape(1, x.shape[-2], n, -1)
        return (norm(x) if norm is not None else x).transpose(0, 2, 1, 3)

    def block_qkv(self, x, block_at):
        """Q, K (k_norm too) and V of the block rows x [1, L, H] or [L, H] (after
        input_layernorm), at positions block_at.. (an int or a scalar array)."""
        return self.block_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), block_at)

    def block_heads(self, q, k, v, block_at):
        """block_qkv from the block's projected rows q, k, v."""
        return (self.rope(self._heads(q, self.n_heads, self.q_norm), offset=block_at),) + self.kv_heads(k, v, block_at)

    def context_kv(self, ctx, offset):
        """K (k_norm, RoPE at offset..) and V of the projected context rows ctx [1, S, H] or [S, H]."""
        return self.kv_heads(self.k_proj(ctx), self.v_proj(ctx), offset)

    def kv_heads(self, k, v, offset):
        """K (k_norm, RoPE at offset..) and V heads from projected rows k, v."""
        return self.rope(self._heads(k, self.n_kv, self.k_norm), offset=offset), self._heads(v, self.n_kv)

    def attend(self, q, bk, bv, ctx, cache):
        """The block rows' attention heads over [context ; block]. ctx: the new projected context
        rows [1, S, H]; they join `cache` first, at their absolute positions."""
        keys, values, n_ctx = self.join(bk, bv, ctx, cache)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale,
                                                    mask=self.mask(n_ctx, q.shape[2]))

    def join(self, bk, bv, ctx, cache):
        """Keys and values [context ; block] (ctx joins `cache` first) and the context's length."""
        L, S = bk.shape[2], ctx.shape[1]
        if self.sliding and S > self.a.sliding_window - 1:
            # Only the newest W-1 context rows can be seen by any block row; the dropped ones still
            # count for the positions (mlx-lm's cache offset is the number of rows seen).
            skip = S - (self.a.sliding_window - 1)
            ctx, S = ctx[:, skip:], S - skip
            cache.offset += skip
        keys, values = cache.update_and_fetch(*self.context_kv(ctx, cache.offset))
        n_ctx = keys.shape[2]
        if isinstance(cache, RotatingKVCache):
            if self.sliding and self.window == "positional":
                keys, values = cache._temporal_order(keys), cache._temporal_order(values)
            return mx.concatenate([keys, bk], axis=2), mx.concatenate([values, bv], axis=2), n_ctx
        # The block's rows go after the context in the preallocated buffer and are trimmed off
        # again: the same keys as the concatenation, without copying the context.
        keys, values = cache.update_and_fetch(bk, bv)
        cache.trim(L)
        return keys, values, n_ctx

    def mask(self, n_ctx: int, L: int):
        """The block rows' mask over [context (n_ctx rows) ; block (L)]; None: every row sees all."""
        if self.sliding:
            qpos = n_ctx + mx.arange(L)[:, None]
            kpos = mx.arange(n_ctx + L)[None]
            seen_ctx = (kpos < n_ctx) & (qpos - kpos < self.a.sliding_window)
            seen_block = kpos >= n_ctx
            if self.causal:
                seen_block = seen_block & (kpos <= qpos)
            return seen_ctx | seen_block
        return create_causal_mask(L, offset=n_ctx) if self.causal else None

    def output(self, o):
        return self.o_proj(self.rows(o))

    @staticmethod
    def rows(o):
        """Heads [1, n, L, hd] -> rows [L, n * hd]: 2-D, so the projection is one matmul node (a
        3-D input adds a flatten and an unflatten, host time on every call)."""
        return o.transpose(0, 2, 1, 3).reshape(o.shape[2], -1)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer: int, window: str):
        super().__init__()
        self.a = a
        self.self_attn = Attention(a, layer, window)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)

    def __call__(self, x, ctx, cache, block_at):
        """The context rows ctx enter K/V without the input_layernorm."""
        return self.finish(x, self.self_attn(self.input_layernorm(x), ctx, cache, block_at))

    def qkv(self, x, block_at):
        """The block's Q, K, V from the layer input x (the fast paths split the layer here)."""
        return self.self_attn.block_qkv(self.input_layernorm(x), block_at)

    def finish(self, x, attn, mlp=None):
        """The layer's output from its input x and the attention's output attn (`mlp`: what runs
        as the MLP, default self.mlp; a fast path's on transposed weights)."""
        h = x + attn
        return h + (mlp or self.mlp)(self.post_attention_layernorm(h))


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
    """The plain block forward, the parity path: port/fast/dflash.py holds the fast ones."""

    def __init__(self, a: ModelArgs, window: str = "positional", embed: str = "scaled"):
        super().__init__()
        if window not in WINDOWS:
            raise DFlashError(f"window {window!r}: expected one of {WINDOWS}")
        if embed not in EMBEDS:
            raise DFlashError(f"embed {embed!r}: expected one of {EMBEDS}")
        self.args, self.window, self.embed_mode = a, window, embed
        H = a.hidden_size
        self.fc = nn.Linear(len(a.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=a.rms_norm_eps)
        self.layers = [DecoderLayer(a, i, window) for i in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=a.rms_norm_eps)

    def __call__(self, h, ctx, caches):
        """The embedded block h [1, L, H] over the context: ctx the new projected context rows
        (they join `caches`) -> the final-normed block rows 1..L-1 [1, L-1, H]."""
        at = self.block_positions(ctx, caches)
        for layer, cache, block_at in zip(self.layers, caches, at):
            h = layer(h, ctx, cache, block_at)
        return self.norm(h[:, 1:])

    @staticmethod
    def block_positions(ctx, caches) -> list[int]:
        """Per layer the block's first position: after every context row seen (sliding layers
        count the skipped ones too)."""
        return [cache.offset + ctx.shape[1] for cache in caches]

    @property
    def all_sliding(self) -> bool:
        return all(t == "sliding_attention" for t in self.args.layer_types)

    def make_caches(self) -> list:
        """Per layer, the context K/V store: full layers keep every row, sliding layers W-1."""
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

    def borrowed(self, target: targets.Target) -> list:
        """The state of the target modules `embed` and `head` read: what a compiled block takes as
        inputs from the target (not its whole state: a compiled call flattens every input array,
        about 0.35 us each, on each call)."""
        m = target.model
        return [m.model.embed_tokens.state] + ([m.lm_head.state] if hasattr(m, "lm_head") else [])

    def logits(self, target: targets.Target, h: mx.array) -> mx.array:
        """`head`, then the softcap."""
        out = self.head(target, h)
        cap = self.args.final_logit_softcapping
        return mx.tanh(out / cap) * cap if cap else out

    @staticmethod
    def check_rows(ctx_rows: mx.array | None) -> None:
        if ctx_rows is None or ctx_rows.shape[1] == 0:
            raise DFlashError("a draft needs the new context rows (the prompt's or the last verify's taps): "
                              "commit the previous verify first")

    def block_inputs(self, anchor: int, n: int, ctx_rows: mx.array | None):
        """The block ids [anchor, MASK x n] and the projected new context rows."""
        self.check_rows(ctx_rows)
        return targets.block_ids(anchor, self.args.mask_token_id, n), self.project(ctx_rows)

    def block(self, target: targets.Target, anchor: int, n: int, ctx_rows: mx.array | None, caches: list) -> Block:
        """Draft n tokens after `anchor`: block [anchor, MASK x n]; `ctx_rows` are the raw taps of the
        context rows not yet in `caches` (they are projected and appended there)."""
        ids, c = self.block_inputs(anchor, n, ctx_rows)
        hidden = self(self.embed(target, ids), c, caches)
        logits = self.logits(target, hidden)
        # x[0, ...], not x[0]: MLX makes a lone integer index a Gather (on MLX CUDA one over a block's
        # logits costs 22-257 us of device time), the slice is a view (tests/test_bench.py)
        return Block(hidden[0, ...], logits[0, ...], mx.argmax(logits[0, ...], axis=-1))


def load(path: str | Path, window: str = "positional", embed: str = "scaled", scales: str = "either",
         model=Model, dtype: mx.Dtype | None = None) -> Model:
    """The drafter at `path` as z-lab reads it (DSpark extras left unread: load_extension);
    `model` (ModelArgs, window, embed -> a Model) builds it (a fast path's subclass); `dtype`:
    its floating weights cast to it (None: as stored)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise DFlashError(f"{path}: no config.json")
    a = ModelArgs.from_config(json.loads((path / "config.json").read_text()), path, scales)
    m = model(a, window, embed)
    m.config_file = path / "config.json"
    checkpoint.load_into(m, path, checkpoint.read_tensors(path, dtype), DFlashError,
                         "is this a complete z-lab DFlash checkpoint?", unused=EXTRAS)
    mx.eval(m.parameters())
    return m


EXTRAS = ("markov_head.", "confidence_head.")


def load_extension(path: str | Path, dtype: mx.Dtype | None = None) -> heads.Extension:
    """The DSpark extras of the checkpoint at `path` (the Markov and confidence heads its config
    declares), for the DSpark-on-DFlash extension; `dtype` as in load."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    a = ModelArgs.from_config(cfg, path)
    checkpoint.check_required_when({**cfg, **cfg.get("dflash_config", {})}, path, "dflash-extension")
    if a.markov_rank <= 0 and not a.enable_confidence_head:
        raise DFlashError("extras=True needs a checkpoint with DSpark extras (markov_rank > 0 and/or "
                          "enable_confidence_head in its config); this one has none")
    if a.confidence_head_with_markov and a.markov_rank <= 0:
        raise DFlashError("confidence_head_with_markov needs markov_rank > 0")
    ext = heads.Extension(a.markov_rank, a.markov_head_type, a.enable_confidence_head, a.confidence_head_with_markov,
                          a.hidden_size, a.vocab_size)
    weights = {k: v for k, v in checkpoint.read_tensors(path, dtype).items() if k.startswith(EXTRAS)}
    checkpoint.load_into(ext, path, weights, DFlashError, "does it carry the DSpark extras its config declares?")
    mx.eval(ext.parameters())
    return ext


def check_window(c: dict, path: Path, block: int, layer_types: list[str]) -> None:
    """Refuse a sliding window the references do not run alike: narrower than the block, z-lab
    torch windows the block rows against each other and z-lab MLX does not (two models); under 3,
    mlx-lm's RotatingKVCache cannot hold its W-1 = 1 row (z-lab MLX fails on it as well)."""
    window = c.get("sliding_window")
    if "sliding_attention" not in layer_types:
        return
    if window < 3:
        raise DFlashError(f"{path / 'config.json'}: sliding_window {window}: a sliding layer keeps W-1 context rows, and mlx-lm's "
                          "RotatingKVCache (z-lab MLX's and the port's) cannot hold fewer than 2; no MLX reference "
                          "runs it")
    if window < block:
        raise DFlashError(f"{path / 'config.json'}: sliding_window {window} < block_size {block}: z-lab torch windows the block "
                          "rows against each other, z-lab MLX does not, so the references compute two different "
                          "models; the port refuses rather than pick one (a window of at least the block agrees)")


def check_pairing(drafter: Model, target: targets.Target) -> None:
    """A DFlash drafter reads one target's hidden states and borrows its embedding and head:
    refuse a target it was not built on, naming the drafter's config.json, the key and the fix."""
    a, c = drafter.args, target.config
    f, t = checkpoint.config_of(drafter), f"{target.path / 'config.json'}"
    fix = "pair the drafter with the target it was trained on"
    if a.num_target_layers != c["num_hidden_layers"]:
        raise DFlashError(f"{f}: num_target_layers {a.num_target_layers} != num_hidden_layers {c['num_hidden_layers']} "
                          f"of {t} (tap layers {a.target_layer_ids} would read the wrong depth); {fix}")
    if a.hidden_size != c["hidden_size"]:
        raise DFlashError(f"{f}: hidden_size {a.hidden_size} != hidden_size {c['hidden_size']} of {t}: it embeds "
                          f"with the target's embedding and scores with the target's head; {fix}")
    if a.vocab_size != c["vocab_size"]:
        raise DFlashError(f"{f}: vocab_size {a.vocab_size} != vocab_size {c['vocab_size']} of {t}; {fix}")
    if not 0 <= a.mask_token_id < c["vocab_size"]:
        raise DFlashError(f"{f}: dflash_config.mask_token_id {a.mask_token_id} is not a row of the embedding of {t} "
                          f"(vocab_size {c['vocab_size']}); set it to the mask token the drafter was trained with")
    bad = [i for i in a.target_layer_ids if not 0 <= i < c["num_hidden_layers"] - 1]
    if bad:
        raise DFlashError(f"{f}: dflash_config.target_layer_ids {a.target_layer_ids}: {bad} outside "
                          f"[0, {c['num_hidden_layers'] - 2}] for {t}: the final layer's hidden state is the "
                          "final-normed one in transformers and z-lab torch (z-lab MLX accepts it, reading the raw "
                          "output; the port refuses rather than pick one); tap layers below the last")

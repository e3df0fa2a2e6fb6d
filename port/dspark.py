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

Fast paths (the compiled pieces, the bucketed block) are subclasses of Model in
port/fast/dspark.py; the serve-loop source and provider are in port/sources/dspark.py.

The negative controls (planted bugs) live outside the port, in spec_parity/drafters/dspark/controls.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from . import checkpoint, heads, targets


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
        checkpoint.check_required_when(c, path, f"dspark-{family}")
        if c.get("enable_confidence_head") and c.get("confidence_head_with_markov") and not c.get("markov_rank"):
            raise DSparkError(f"{path / 'config.json'}: confidence_head_with_markov with markov_rank 0: the confidence "
                              "head reads the Markov head's W1[prev] and there is none (DeepSpec asserts); set "
                              "markov_rank > 0, or confidence_head_with_markov false")
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
        return self.heads_kv(self.k_proj(x), None if self.a.attention_k_eq_v else self.v_proj(x), offset)

    def heads_kv(self, k, v, offset):
        """kv from the projected rows k, v [1, T, n_kv * D] (v None: attention_k_eq_v)."""
        B, T, _ = k.shape
        k_raw = k.reshape(B, T, self.n_kv, self.head_dim)
        v = k_raw if v is None else v.reshape(B, T, self.n_kv, self.head_dim)
        k = self.rope(self.k_norm(k_raw).transpose(0, 2, 1, 3), offset=offset)
        if self.a.family == "gemma4":
            v = rms_norm(v, None, self.a.rms_norm_eps)
        return k, v.transpose(0, 2, 1, 3)

    def block_qkv(self, x, offset):
        """Q, K, V of the block rows x [1, T, H] at offset.. (an int or a scalar array)."""
        return (self.block_q(x, offset),) + self.kv(x, offset)

    def block_q(self, x, offset):
        """Q of the block rows x [1, T, H] at offset.. (q_norm, RoPE), as [1, n_heads, T, D]."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        return self.rope(q, offset=offset)

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

    def __call__(self, x, ctx, offset):
        """The block rows x [1, T, H] (input-normed) at offset.., over [context | block]."""
        q, k, v = self.block_qkv(x, offset)
        return self.output(self.attend(q, *self.join(ctx, k, v)))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gemma = a.family == "gemma4"
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def __call__(self, x):
        return self.combine(self.gate_proj(x), self.up_proj(x))

    def combine(self, g, u):
        """down(act(gate) * up) from the gate and up projections."""
        return self.down_proj((nn.gelu_approx(g) if self.gemma else nn.silu(g)) * u)


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

    def __call__(self, x, ctx, offset):
        return self.finish(x, self.self_attn(self.input_layernorm(x), ctx, offset))

    def qkv(self, x, offset):
        """The attention's Q, K, V of the layer input x (the fast paths split the layer here)."""
        return self.self_attn.block_qkv(self.input_layernorm(x), offset)

    def finish(self, x, attn, mlp=None):
        """The layer's output from its input x and the attention's output attn (`mlp`: what runs
        as the MLP, default self.mlp; a fast path's fused projections)."""
        mlp = mlp or self.mlp
        if not self.gemma:
            h = x + attn
            return h + mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


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
    """The plain block forward, the parity path: port/fast/dspark.py holds the fast ones."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        H = a.hidden_size
        self.embed_tokens = nn.Embedding(a.vocab_size, H)
        self.layers = [DecoderLayer(a) for _ in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=a.rms_norm_eps)
        self.fc = nn.Linear(len(a.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=a.rms_norm_eps)
        self.lm_head = nn.Linear(H, a.vocab_size, bias=False)
        for name, head in heads.build(a.markov_rank, a.markov_head_type, a.enable_confidence_head,
                                      a.confidence_head_with_markov, H, a.vocab_size).items():
            setattr(self, name, head)

    def __call__(self, ids, ctx, start):
        """The block ids [1, bs] at positions start.. over the context K/V (per layer, see
        Attention.join) -> per-slot final-normed hidden [bs, H] and base logits [bs, V]."""
        h = self.embed(ids)
        for layer, c in zip(self.layers, ctx):
            h = layer(h, c, start)
        return self.final(h)

    def final(self, h):
        """The last layer's output -> final norm -> per-slot hidden and base logits."""
        hidden = self.norm(h)[0, ...]
        return hidden, self.logits(hidden)

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

    def tail(self, hidden, base, anchor, pick=None):
        """Markov chain (rows, tokens) and the confidence logits (or None) of every slot."""
        return heads.extend(self.get("markov_head"), self.get("confidence_head"), self.args.confidence_head_with_markov,
                            hidden, base, anchor, pick)

    def make_cache(self) -> KVCache:
        """One layer's context K/V store (mlx-lm's KVCache)."""
        return KVCache()

    def draft_block(self, anchor: int, ctx, start: int, pick=None) -> Block:
        """One block at positions start..; ctx per layer: a (k, v) pair or a cache of it
        (Attention.join). Each slot's token is the argmax of its Markov-corrected row, or
        `pick(row)` (the serve loop's sampler: DeepSpec's T > 0 draws it from softmax(row / T)),
        and the next slot's Markov head reads that token."""
        a = self.args
        ids = targets.block_ids(anchor, a.mask_token_id, a.block_size - 1)
        hidden, base = self(ids, ctx, start)
        rows, tokens, conf = self.tail(hidden, base, mx.array([anchor], mx.uint32), pick)
        return Block(hidden, base, rows, tokens, conf)

    def prefix_length(self, confidence, threshold: float) -> int:
        """Draft tokens kept: up to the first slot whose sigmoid(confidence) < threshold."""
        if confidence is None or threshold <= 0.0:
            return self.args.block_size
        return targets.first_true(mx.sigmoid(confidence) < threshold, self.args.block_size)


def load(path: str | Path, model=Model, dtype: mx.Dtype | None = None) -> Model:
    """The drafter at `path`; `model` (ModelArgs -> a Model) builds it (a fast path's subclass);
    `dtype`: its floating weights cast to it (None: as stored)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    a = ModelArgs.from_config(cfg, path)
    model = model(a)
    model.config_file = path / "config.json"
    checkpoint.load_into(model, path, checkpoint.read_tensors(path, dtype), DSparkError,
                         "is this a complete DeepSpec DSpark checkpoint?")
    mx.eval(model.parameters())
    return model


def check_pairing(drafter: Model, target: targets.Target) -> None:
    """A DSpark drafter reads one target's hidden states: refuse a target it was not built on,
    naming the drafter's config.json, the key and the fix."""
    a, c = drafter.args, target.config
    f, t = checkpoint.config_of(drafter), f"{target.path / 'config.json'}"
    fix = "pair the drafter with the target it was trained on"
    if a.family != target.family:
        raise DSparkError(f"{f}: its architectures make it a {a.family} DSpark drafter, which needs a {a.family} target; {t} has "
                          f"model_type {c.get('model_type')!r}; {fix}")
    if a.num_target_layers != c["num_hidden_layers"]:
        raise DSparkError(f"{f}: num_target_layers {a.num_target_layers} != num_hidden_layers {c['num_hidden_layers']} "
                          f"of {t} (tap layers {a.target_layer_ids} would read the wrong depth); {fix}")
    if a.hidden_size != c["hidden_size"] or a.vocab_size != c["vocab_size"]:
        raise DSparkError(f"{f}: hidden_size/vocab_size {(a.hidden_size, a.vocab_size)} != "
                          f"{(c['hidden_size'], c['vocab_size'])} of {t}; {fix}")
    if c["num_hidden_layers"] - 1 in a.target_layer_ids:
        raise DSparkError(f"{f}: target_layer_ids {a.target_layer_ids} include the final layer "
                          f"{c['num_hidden_layers'] - 1} of {t}: its hidden state is the final-normed one in "
                          "transformers (DeepSpec's), not a raw layer output; tap layers below the last")

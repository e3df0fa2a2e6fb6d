"""Gemma-4 "-assistant" drafter (gemma4_assistant / gemma4_unified_assistant) in MLX.

A draft step reads no cache of its own: it takes the target's √B-scaled embedding of the last
token, a hidden state in the target's space, and the target's donor K/V (last sliding and last
full attention layer, chronological), and returns (token, logits, next hidden):

    h = pre_projection([e ‖ h_in])                 2B -> D
    4 Q-only layers over the donor K/V             attention scale 1.0, q_norm then RoPE
    h = norm(h); logits = head(h)                  centroid head or tied embedding head
    next_hidden = post_projection(h)               D -> B

Conventions where the two references differ (docs/references.md, "Reference deltas") are
options: `position` is whatever the caller passes (optiq: P+k per draft step, HF: P for every
step), `window` picks how the sliding donor K/V is cut ("optiq" attends to the newest W-1
entries, "hf" to the newest W+1), and `head_rows` which matrix an untied centroid head scores
its candidates on ("embed": optiq's embedding rows, "lm_head": transformers' lm_head rows).

Fast paths (the compiled pieces, the bucketed step over the target's cache buffers, the
kernel's own GQA mapping) are subclasses of Model in port/fast/assistant.py; the serve-loop source
and provider are in port/sources/assistant.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from . import checkpoint, targets

MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
HEADS = ("centroid", "tied", "untied")
HEAD_ROWS = ("embed", "lm_head")   # optiq's, transformers' candidate rows of an untied centroid head


class DrafterError(ValueError):
    pass


@dataclass
class ModelArgs:
    model_type: str
    backbone_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    global_head_dim: int
    layer_types: list[str]
    sliding_window: int
    vocab_size: int
    rms_norm_eps: float
    rope_parameters: dict = field(default_factory=dict)
    use_ordered_embeddings: bool = False
    num_centroids: int = 0
    centroid_intermediate_top_k: int = 0
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, cfg: dict, path: Path) -> ModelArgs:
        if cfg.get("model_type") not in MODEL_TYPES:
            raise DrafterError(f"{path}: model_type {cfg.get('model_type')!r} is not a Gemma-4 assistant "
                               f"drafter (expected one of {MODEL_TYPES})")
        t = cfg["text_config"]
        return cls(
            model_type=cfg["model_type"], backbone_hidden_size=cfg["backbone_hidden_size"],
            hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
            num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
            head_dim=t["head_dim"], global_head_dim=t.get("global_head_dim") or t["head_dim"],
            layer_types=list(t["layer_types"]), sliding_window=t["sliding_window"],
            vocab_size=t["vocab_size"], rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            rope_parameters=t["rope_parameters"],
            use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
            num_centroids=cfg.get("num_centroids", 0),
            centroid_intermediate_top_k=cfg.get("centroid_intermediate_top_k", 0),
            # optiq reads the top level, then text_config (its GemmaAssistantConfig)
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", True))),
        )


class RMSNorm(nn.Module):
    """Gemma-4 RMSNorm: the weight is a raw scale (no +1), computed in fp32."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x.astype(mx.float32), self.weight, self.eps).astype(x.dtype)


class Attention(nn.Module):
    """Q-only attention over the target's donor K/V, scale 1.0 (q and k are RMS-normed)."""

    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        full = layer_type == "full_attention"
        self.head_dim = args.global_head_dim if full else args.head_dim
        self.n_heads = args.num_attention_heads
        self.scale = 1.0
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        rope = dict(args.rope_parameters[layer_type])
        self.rope = initialize_rope(self.head_dim, traditional=False, base=rope.get("rope_theta", 10000.0),
                                    scaling_config=rope if rope.get("rope_type") != "default" else None)

    def query(self, x, position):
        """Q of the (input-normed) rows x [1, L, D] or [L, D] at `position` (an int or a scalar array)."""
        return self.query_heads(self.q_proj(x), position)

    def query_heads(self, q, position):
        """`query` from the projected rows q [1, L, n * hd] or [L, n * hd] (q_norm, RoPE)."""
        q = self.q_norm(q.reshape(1, q.shape[-2], self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        return self.rope(q, offset=position)

    def attend(self, q, keys, values):
        """Over the donor K/V as Model.views cut them (their heads repeated onto q's, or GQA)."""
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale)

    def output(self, o):
        return self.o_proj(self.rows(o))

    @staticmethod
    def rows(o):
        """Heads [1, n, L, hd] -> rows [L, n * hd]: 2-D, so the projection is one matmul node (a
        3-D input adds a Flatten and an Unflatten, host time on every call)."""
        return o.transpose(0, 2, 1, 3).reshape(o.shape[2], -1)

    def __call__(self, x, kv, position):
        """The (input-normed) rows x at `position` over the donor K/V kv = (keys, values)."""
        return self.output(self.attend(self.query(x, position), *kv))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(args, layer_type)
        self.mlp = MLP(args)
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, kv, position):
        return self.finish(x, self.self_attn(self.input_layernorm(x), kv, position))

    def query(self, x, position):
        """The attention's Q of the layer input x (the fast paths split the layer here)."""
        return self.self_attn.query(self.input_layernorm(x), position)

    def finish(self, x, attn, mlp=None):
        """The layer's output from its input x and the attention's output attn: x + attention,
        then the MLP (`mlp`: what runs as the MLP, default self.mlp; a fast path's on transposed
        weights)."""
        h = x + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm((mlp or self.mlp)(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class Inner(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, t) for t in args.layer_types]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class MaskedEmbedding(nn.Module):
    """Centroid head: score the centroids, keep the top-k, score only their tokens."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.centroids = nn.Linear(args.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((args.vocab_size,), dtype=mx.int64)


@dataclass
class Step:
    token_id: mx.array      # [1, 1], on the device: the next step embeds it without a host trip
    logits: mx.array        # [V]; centroid head: -1e30 outside the selected candidates
    next_hidden: mx.array   # [1, 1, B]
    candidates: mx.array | None = None  # centroid head: the scored token ids

    @property
    def token(self) -> int:
        return int(self.token_id.item())


class Model(nn.Module):
    """The plain step, the parity path: port/fast/assistant.py holds the fast ones."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Inner(args)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, args.backbone_hidden_size, bias=False)
        self.head_rows = "embed"
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, emb, hidden_in, views: dict, position):
        """One step from the token's embedding and the hidden in, over the donor views (per layer
        type, `views`) -> logits, next hidden, argmax token (+ the centroid head's candidates)."""
        h = self.pre_projection(mx.concatenate([emb, hidden_in], axis=-1))
        for layer in self.model.layers:
            h = layer(h, views[layer.layer_type], position)
        return self.final(h)

    def final(self, h):
        """Final norm of the row h ([1, 1, H] or [1, H]) -> logits [V], next hidden [1, 1, B],
        argmax [1, 1] (+ candidates)."""
        h = self.model.norm(h)
        logits, cand = self.logits(h)
        out = (logits, self.post_projection(h).reshape(1, 1, -1), mx.argmax(logits).reshape(1, 1))
        return out if cand is None else out + (cand,)

    @property
    def head(self) -> str:
        a = self.args
        return "centroid" if a.use_ordered_embeddings else "tied" if a.tie_word_embeddings else "untied"

    def logits(self, h) -> tuple[mx.array, mx.array | None]:
        a = self.args
        if not a.use_ordered_embeddings:
            head = self.model.embed_tokens.as_linear if a.tie_word_embeddings else self.lm_head
            return head(h).reshape(-1), None
        # reshape, not [0, 0]: a view, where integer indices are gathers
        scores = self.masked_embedding.centroids(h).reshape(-1)
        k = a.centroid_intermediate_top_k
        top = mx.argpartition(-scores, kth=k - 1, axis=-1)[:k]
        per = a.vocab_size // a.num_centroids
        cand = self.masked_embedding.token_ordering.reshape(a.num_centroids, per)[top].reshape(-1)
        cand_logits = (h.reshape(1, -1) * self.candidate_rows()[cand]).sum(axis=-1)
        full = mx.full((a.vocab_size,), -1e30, dtype=h.dtype)
        return mx.put_along_axis(full, cand.astype(mx.int32), cand_logits.astype(full.dtype), axis=-1), cand

    def candidate_rows(self) -> mx.array:
        """The matrix whose rows score the centroid head's candidates: lm_head's where the head is
        untied and `head_rows` is "lm_head" (transformers' masked embedder reads lm_head.weight),
        else the embedding (optiq reads it whatever the tying; tied, the two are one matrix)."""
        if self.head_rows == "lm_head" and not self.args.tie_word_embeddings:
            return self.lm_head.weight
        return self.model.embed_tokens.weight

    def donors(self, target, caches: list, window: str | int = "optiq") -> dict:
        """The donor K/V a chain reads from the target's caches (targets.donor_view)."""
        return targets.donor_view(target, caches)

    def views(self, donors: dict, window: str | int = "optiq") -> dict:
        """What each layer type's attention reads: the sliding donor's window (sliding_view) and
        the K/V heads repeated onto the query heads, as optiq repeats them (the kernel's own GQA
        mapping, port/fast/assistant.py NativeGQA, is the same bits on the CPU but 1 ulp off on
        MLX CUDA: docs/benchmarks.md). A chain cuts them once: the donors are frozen for the
        chain, and optiq's repeat per layer per step is 6 copies of 8 MiB a 12B step on the H200."""
        views = dict(donors)
        views["sliding_attention"] = sliding_view(*donors["sliding_attention"], self.args.sliding_window, window)
        return self.repeat(views)

    def repeat(self, views: dict) -> dict:
        heads = self.args.num_attention_heads
        return {t: (k, v) if k.shape[1] == heads else
                (mx.repeat(k, heads // k.shape[1], axis=1), mx.repeat(v, heads // v.shape[1], axis=1))
                for t, (k, v) in views.items()}

    def step(self, emb, hidden_in, donors, position: int, window: str = "optiq", pick=None,
             views: dict | None = None) -> Step:
        """One draft step; the token is the argmax (left on the device), or `pick(logits)` (the
        serve loop's sampler, a host int). `views`: self.views(donors, window), cut once per chain
        (default: cut here)."""
        logits, next_hidden, token, *cand = self(emb, hidden_in, views or self.views(donors, window), position)
        if pick is not None:
            token = mx.array([[int(pick(logits))]])
        return Step(token, logits, next_hidden, cand[0] if cand else None)


def window_keep(window: int, convention: str | int = "optiq") -> int:
    """How many of the newest sliding donor entries a draft query attends to: optiq W-1 (the query
    stands for the token not yet in the cache, which makes W with it), transformers' assistant
    W+1, or the int given."""
    return {"optiq": window - 1, "hf": window + 1}[convention] if isinstance(convention, str) else convention


def sliding_view(k, v, window: int, convention: str | int = "optiq"):
    """The sliding donor entries one draft query attends to (chronological K/V [1, H, T, D])."""
    keep = window_keep(window, convention)
    return k[..., -keep:, :], v[..., -keep:, :]


def load(path: str | Path, dtype: mx.Dtype | None = None, model=Model, head_rows: str = "embed") -> Model:
    """The drafter at `path` (weights cast to `dtype`); `model` (ModelArgs -> a Model) builds it
    (a fast path's subclass); `head_rows` (HEAD_ROWS) is the reference convention of an untied
    centroid head (Model.candidate_rows)."""
    if head_rows not in HEAD_ROWS:
        raise DrafterError(f"head_rows {head_rows!r} is not one of {HEAD_ROWS}")
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    checkpoint.check_layer_types(cfg, path, "assistant")
    args = ModelArgs.from_config(cfg, path)
    if args.use_ordered_embeddings and dtype is not None and dtype == mx.float16:
        raise DrafterError(f"{path / 'config.json'}: a centroid head (use_ordered_embeddings) in float16: its mask "
                           "-1e30 overflows float16 to -inf (optiq's too), and -inf logits are no score; run it in "
                           "bfloat16 or float32")
    model = model(args)
    model.config_file = path / "config.json"
    model.head_rows = head_rows
    weights = checkpoint.read_tensors(path)
    if not args.tie_word_embeddings and "lm_head.weight" not in weights:
        raise DrafterError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight; "
                           f"unsupported head (supported: {HEADS})")
    if not args.use_ordered_embeddings and "masked_embedding.centroids.weight" in weights:
        raise DrafterError(f"{path}: carries a centroid head but use_ordered_embeddings is false; "
                           "set use_ordered_embeddings in config.json")
    checkpoint.load_into(model, path, weights, DrafterError, "is this a complete Gemma-4 assistant checkpoint?")
    if dtype is not None:
        model.set_dtype(dtype)
    norms_in_fp32(model)
    mx.eval(model.parameters())
    return model


def norms_in_fp32(model: nn.Module) -> None:
    """RMSNorm weights held in fp32: the norms compute in fp32 (as optiq's), and mx.fast.rms_norm
    casts a bf16 weight to fp32 on every call, a kernel launch per norm per step (21 of a 12B
    step's 143 on MLX CUDA). The cast is exact, so the arithmetic is the same bits."""
    for _, m in model.named_modules():
        if isinstance(m, RMSNorm):
            m.weight = m.weight.astype(mx.float32)


def check_pairing(drafter: Model, target) -> None:
    """A drafter is trained against one backbone: refuse a target it cannot read, naming the
    drafter's config.json, the key and the fix."""
    f, t = checkpoint.config_of(drafter), f"{target.path / 'config.json'}"
    fix = "pair the drafter with the target it was trained on"
    if target.family != "gemma4":
        raise DrafterError(f"{f}: a Gemma-4 assistant drafter needs a Gemma-4 target; {t} has model_type "
                           f"{target.config.get('model_type')!r}; {fix}")
    a, c = drafter.args, target.config
    if a.backbone_hidden_size != c["hidden_size"]:
        raise DrafterError(f"{f}: backbone_hidden_size {a.backbone_hidden_size} != hidden_size {c['hidden_size']} "
                           f"of {t}: this drafter belongs to another Gemma-4 size; {fix}")
    if (a.head_dim, a.global_head_dim) != (c["head_dim"], c["global_head_dim"]):
        raise DrafterError(f"{f}: text_config head dims (head_dim, global_head_dim) {(a.head_dim, a.global_head_dim)} "
                           f"!= {(c['head_dim'], c['global_head_dim'])} of {t}: it cannot read the target's K/V; {fix}")
    if a.vocab_size != c["vocab_size"]:
        raise DrafterError(f"{f}: text_config.vocab_size {a.vocab_size} != vocab_size {c['vocab_size']} of {t}; {fix}")
    if a.sliding_window != c["sliding_window"]:
        raise DrafterError(f"{f}: text_config.sliding_window {a.sliding_window} != sliding_window {c['sliding_window']} "
                           f"of {t}: optiq cuts the donor view at the target's window and the port at the drafter's; "
                           "set the drafter's text_config.sliding_window to the target's")


def draft_chain(drafter: Model, target, donors: dict, token: int, hidden, position: int, n: int,
                positions: str = "optiq", window: str = "optiq", pick=None) -> list[Step]:
    """n draft steps against a frozen donor snapshot. Step 0 reads the last emitted token and the
    target hidden that predicted it; step k>0 chains the previous draft token and next_hidden.
    positions: "optiq" = position + k, "hf" = position for every step. `pick` (logits -> token)
    replaces the argmax, e.g. to sample drafts from q. Greedy, the chain never leaves the device;
    `token` may be a scalar array (port/fast/seeded.py vmaps the chain over requests)."""
    steps = []
    token_id = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[token]])
    views = None if n == 0 else drafter.views(donors, window)
    for k in range(n):
        emb = targets.embed_scaled(target, token_id)
        pos = position + k if positions == "optiq" else position
        s = drafter.step(emb, hidden, donors, pos, window, pick, views)
        steps.append(s)
        token_id, hidden = s.token_id, s.next_hidden
    return steps

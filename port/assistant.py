"""Gemma-4 "-assistant" drafter (gemma4_assistant / gemma4_unified_assistant) in MLX.

A draft step reads no cache of its own: it takes the target's √B-scaled embedding of the last
token, a hidden state in the target's space, and the target's donor K/V (last sliding and last
full attention layer, chronological), and returns (token, logits, next hidden):

    h = pre_projection([e ‖ h_in])                 2B -> D
    4 Q-only layers over the donor K/V             attention scale 1.0, q_norm then RoPE
    h = norm(h); logits = head(h)                  centroid head or tied embedding head
    next_hidden = post_projection(h)               D -> B

Conventions where the two references differ (REFERENCES.md, "Reference deltas") are options:
`position` is whatever the caller passes (optiq: P+k per draft step, HF: P for every step), and
`window` picks how the sliding donor K/V is cut: "optiq" attends to the newest W-1 entries,
"hf" to the newest W+1.

`bucketed` (opt-in, default off): the donor K/V are the target's mlx-lm cache buffers as they
are (KVCache: rows past its offset masked; RotatingKVCache: the ring, every slot but the window's
entries masked, whatever its order; a bucketed verify's sliding buffer, compiled.VerifyCache:
every row in time order, all but the window's masked), so a step's shapes change only when a buffer does, and the
whole step (pre-projection, the 4 layers with their attention, norm, head, post-projection) is
one compiled call. The window's slots are found from the ring's (write index, offset) as
mlx-lm's own temporal order lays them out; they enter as arrays. Within fp32 tolerance of the
default (the softmax sums the same entries in ring order), not bit-exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from . import checkpoint, targets
from . import compiled as compiled_pieces

MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
HEADS = ("centroid", "tied")


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
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
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
        """Q of the (input-normed) rows x [1, L, D] at `position` (an int or a scalar array)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        return self.rope(q, offset=position)

    def attend(self, q, keys, values):
        """Over the donor K/V as Model.views cut them (their heads repeated onto q's, or GQA)."""
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale)

    def output(self, o):
        B, _, L, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


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

    def query(self, x, position):
        return self.self_attn.query(self.input_layernorm(x), position)

    def finish(self, x, o):
        """The layer's output from its input x and the attention heads o: x + attention, then the MLP."""
        h = x + self.post_attention_layernorm(self.self_attn.output(o))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
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
    """`compiled` (default on): the step's shape-stable pieces run through mx.compile, the
    attention over the donor K/V (whose length changes every round) outside it; bit-identical to
    the plain path (tests/test_speed.py), which `compiled=False` selects. `repeat_kv=False` lets
    the attention kernel map the query heads onto the donor K/V heads (no copy; see attend)."""

    def __init__(self, args: ModelArgs, compiled: bool = True, bucketed: bool = False, repeat_kv: bool = True):
        super().__init__()
        self.args = args
        self.bucketed = bucketed
        self._bucketed = compiled_pieces.Bucketed()
        self.model = Inner(args)
        self.repeat_kv = repeat_kv
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, args.backbone_hidden_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args)
        self.compiled = compiled
        self._pieces = compiled_pieces.Pieces()

    @property
    def head(self) -> str:
        return "centroid" if self.args.use_ordered_embeddings else "tied"

    def logits(self, h) -> tuple[mx.array, mx.array | None]:
        a = self.args
        if not a.use_ordered_embeddings:
            return self.model.embed_tokens.as_linear(h)[0, 0], None
        scores = self.masked_embedding.centroids(h)[0, 0]
        k = a.centroid_intermediate_top_k
        top = mx.argpartition(-scores, kth=k - 1, axis=-1)[:k]
        per = a.vocab_size // a.num_centroids
        cand = self.masked_embedding.token_ordering.reshape(a.num_centroids, per)[top].reshape(-1)
        cand_logits = (h[0, 0][None, :] * self.model.embed_tokens.weight[cand]).sum(axis=-1)
        full = mx.full((a.vocab_size,), -1e30, dtype=h.dtype)
        return mx.put_along_axis(full, cand.astype(mx.int32), cand_logits.astype(full.dtype), axis=-1), cand

    def _enter(self, emb, hidden_in, position):
        """pre_projection and layer 0's Q."""
        h = self.pre_projection(mx.concatenate([emb, hidden_in], axis=-1))
        return h, self.model.layers[0].query(h, position)

    def _between(self, i: int, h, o, position):
        """Layer i's output and layer i+1's Q."""
        h = self.model.layers[i].finish(h, o)
        return h, self.model.layers[i + 1].query(h, position)

    def _exit(self, h, o):
        """The last layer's output -> final norm -> logits, next hidden, argmax (+ candidates)."""
        h = self.model.norm(self.model.layers[-1].finish(h, o))
        logits, cand = self.logits(h)
        out = (logits, self.post_projection(h), mx.argmax(logits).reshape(1, 1))
        return out if cand is None else out + (cand,)

    def pieces(self) -> tuple:
        """(enter, [between_i], exit), plain or compiled (port/compiled.py)."""
        n = len(self.model.layers)
        return self._pieces.get(self, (self._enter, [partial(self._between, i) for i in range(n - 1)], self._exit))

    def _step_bucketed(self, emb, hidden_in, position, donors):
        """The whole step over donor buffers {layer type: (k, v, seen [S] bool)}."""
        self._bucketed.traces += 1
        masks = {t: compiled_pieces.additive_mask(seen, emb.dtype) for t, (_, _, seen) in donor_seen(donors).items()}
        h, q = self._enter(emb, hidden_in, position)
        for i, layer in enumerate(self.model.layers):
            k, v, _ = donors[layer.layer_type]
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=layer.self_attn.scale, mask=masks[layer.layer_type])
            if i < len(self.model.layers) - 1:
                h, q = self._between(i, h, o, position)
        return self._exit(h, o)

    def views(self, donors: dict, window: str | int = "optiq") -> dict:
        """What each layer type's attention reads: the sliding donor's window (sliding_view) and,
        with repeat_kv, the K/V heads repeated onto the query heads, as optiq repeats them (the
        kernel's own GQA mapping, repeat_kv=False, is the same bits on the CPU but 1 ulp off on MLX
        CUDA: docs/benchmarks.md). A chain cuts them once: the donors are frozen for the chain,
        and optiq's repeat per layer per step is 6 copies of 8 MiB a 12B step on the H200."""
        views = dict(donors)
        views["sliding_attention"] = sliding_view(*donors["sliding_attention"], self.args.sliding_window, window)
        if self.repeat_kv:
            heads = self.args.num_attention_heads
            views = {t: (k, v) if k.shape[1] == heads else
                     (mx.repeat(k, heads // k.shape[1], axis=1), mx.repeat(v, heads // v.shape[1], axis=1))
                     for t, (k, v) in views.items()}
        return views

    def step(self, emb, hidden_in, donors, position: int, window: str = "optiq", pick=None,
             views: dict | None = None) -> Step:
        """One draft step; the token is the argmax (left on the device), or `pick(logits)` (the
        serve loop's sampler, a host int). `views`: self.views(donors, window), cut once per chain
        (default: cut here). `bucketed`: donors are `donor_buffers` (the window is in them)."""
        if self.bucketed:
            if not isinstance(donors.get("sliding_attention"), dict):
                raise DrafterError("bucketed: the donors must be assistant.donor_buffers(target, caches, window), "
                                   "not targets.donor_view's sliced K/V")
            fn = self._bucketed.get(self, "step", self._step_bucketed, [self.state])
            out = fn(emb, hidden_in, mx.array(position, mx.int32), {t: d["kv"] for t, d in donors.items()})
        else:
            views = views or self.views(donors, window)
            enter, between, leave = self.pieces()
            pos = compiled_pieces.position(self, position)
            h, q = enter(emb, hidden_in, pos)
            for i, layer in enumerate(self.model.layers):
                o = layer.self_attn.attend(q, *views[layer.layer_type])
                if i < len(between):
                    h, q = between[i](h, o, pos)
            out = leave(h, o)
        logits, next_hidden, token, *cand = out
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
                seen = min(c.offset, window_keep(target.config["sliding_window"], window))
                where, ring = [0, c.offset - seen, c.offset], True
            else:
                where, ring = [c.offset], False
        else:
            if c.keep:
                raise DrafterError(f"bucketed: a RotatingKVCache with keep={c.keep} (sink rows) is not supported; "
                                   "use bucketed=False")
            rot, total = (c._idx, S) if c._idx < c.offset and c._idx != S else (0, S if c._idx == S else c._idx)
            seen = min(c.offset, total, window_keep(target.config["sliding_window"], window))
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
         repeat_kv: bool = True) -> Model:
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    args = ModelArgs.from_config(cfg, path)
    model = Model(args, compiled, bucketed, repeat_kv)
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
    """A drafter is trained against one backbone: refuse a target it cannot read."""
    if target.family != "gemma4":
        raise DrafterError(f"the Gemma-4 assistant drafter needs a Gemma-4 target; {target.path} is "
                           f"{target.config.get('model_type')!r}")
    a, c = drafter.args, target.config
    if a.backbone_hidden_size != c["hidden_size"]:
        raise DrafterError(f"drafter backbone_hidden_size {a.backbone_hidden_size} != target hidden_size "
                           f"{c['hidden_size']}: this drafter belongs to another Gemma-4 size")
    if (a.head_dim, a.global_head_dim) != (c["head_dim"], c["global_head_dim"]):
        raise DrafterError(f"drafter head dims {(a.head_dim, a.global_head_dim)} != target's "
                           f"{(c['head_dim'], c['global_head_dim'])}: it cannot read the target's K/V")
    if a.vocab_size != c["vocab_size"]:
        raise DrafterError(f"drafter vocab {a.vocab_size} != target vocab {c['vocab_size']}")


def draft_chain(drafter: Model, target, donors: dict, token: int, hidden, position: int, n: int,
                positions: str = "optiq", window: str = "optiq", pick=None) -> list[Step]:
    """n draft steps against a frozen donor snapshot. Step 0 reads the last emitted token and the
    target hidden that predicted it; step k>0 chains the previous draft token and next_hidden.
    positions: "optiq" = position + k, "hf" = position for every step. `pick` (logits -> token)
    replaces the argmax, e.g. to sample drafts from q. Greedy, the chain never leaves the device."""
    steps, token_id = [], mx.array([[token]])
    views = None if drafter.bucketed or n == 0 else drafter.views(donors, window)
    for k in range(n):
        emb = targets.embed_scaled(target, token_id)
        pos = position + k if positions == "optiq" else position
        s = drafter.step(emb, hidden, donors, pos, window, pick, views)
        steps.append(s)
        token_id, hidden = s.token_id, s.next_hidden
    return steps


@dataclass(frozen=True)
class Chain:
    """One round's draft steps, read like a block drafter's last block (`logits` [n, V], built only
    when read: the serve loop never reads it)."""

    steps: tuple[Step, ...]
    confidence = None

    @property
    def logits(self) -> mx.array:
        return mx.stack([s.logits for s in self.steps])


class AssistantSource:
    """The assistant drafter behind the serve-loop seam. It owns no cache: every draft reads the
    target's live donor K/V and the anchor hidden, and the loop's cache trim is its rollback."""

    tap_layers = None
    nbytes = 0  # no cache of its own: the request's bytes are the target's caches

    def __init__(self, drafter: Model, view, positions: str = "optiq", window: str | int = "optiq"):
        check_pairing(drafter, view.target)
        self.drafter, self.view = drafter, view
        self.positions, self.window = positions, window
        self.last_block: Chain | None = None

    def prefill(self, prompt_ids, tapped) -> None:
        pass

    def draft(self, feed: list[int], n: int, anchor_hidden) -> list[int]:
        return self.draft_device(feed, n, anchor_hidden).tolist()

    def draft_device(self, feed: list[int], n: int, anchor_hidden) -> mx.array:
        """The greedy drafts as a lazy [n] array: no host sync."""
        steps = self._chain(feed, n, anchor_hidden, None)
        return mx.concatenate([s.token_id.reshape(-1) for s in steps]) if steps else mx.array([], mx.int32)

    def draft_sampled(self, feed: list[int], n: int, anchor_hidden, pick) -> list[int]:
        """`draft` with each token chosen by `pick(logits)` (None: argmax); the chain feeds the
        picked token to the next step. q = what pick drew from (the loop records it)."""
        return [s.token for s in self._chain(feed, n, anchor_hidden, pick)]

    def _chain(self, feed: list[int], n: int, anchor_hidden, pick) -> list[Step]:
        # The pending token feed[-1] is not in the cache yet: it sits at position offset.
        position = self.view.caches[0].offset
        donors = (donor_buffers(self.view.target, self.view.caches, self.window) if self.drafter.bucketed
                  else targets.donor_view(self.view.target, self.view.caches))
        steps = draft_chain(self.drafter, self.view.target, donors, feed[-1], anchor_hidden, position, n,
                            self.positions, self.window, pick)
        self.last_block = Chain(tuple(steps))
        return steps

    def commit(self, n_drafted: int, accepted: int, tapped) -> None:
        pass

    def dispose(self) -> None:
        pass


class AssistantProvider:
    """A loaded assistant drafter; `open` binds it to one request's target view."""

    trained_gamma = None

    def __init__(self, path: str | Path, bucketed: bool = False, **options):
        self.path = Path(path)
        self.id = self.path.name
        self.drafter = load(self.path, bucketed=bucketed)
        self.weights_bytes = checkpoint.weights_bytes(self.path)
        self.options = options

    def open(self, view) -> AssistantSource:
        return AssistantSource(self.drafter, view, **self.options)

    def dispose(self) -> None:
        self.drafter = None

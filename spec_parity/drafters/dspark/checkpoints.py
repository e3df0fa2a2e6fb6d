"""The DeepSpec DSpark drafter kinds (Gemma-4 or Qwen3 family), random and agreeing.

Agreeing DSpark ("dspark-drafter-agreeing"): the random "dspark-drafter" backbone (taps, fc,
layers) on the agreeing target, with three heads set:
 * base logits bounded: the final norm weight is scaled so |base logit| <= BASE_BOUND for any
   hidden (|rmsnorm(x) * w| <= max|w| sqrt(H)); the lm head / embedding stay the target's.
 * Markov head W1[t] = R_m [sqrt(beta) code_t ; MEMBER s_t ; 0], W2[j] = R_m [sqrt(beta)
   code_{h^-1(j)} ; 0 ; 0], code_t a harmonic frame over the cycle index of t in the first
   2P = 2 floor((r - 1) / 2) dims (low coherence mu), s_t = +1 on the agreeing set else -1,
   R_m a random rotation. So the Markov bias of prev = t is beta <code_t, code_{h^-1(j)}>: h(t)
   wins by beta (1 - mu) > 2 BASE_BOUND whatever the backbone does, and the draft chain at
   T=0 is anchor -> h(anchor) -> h(h(anchor)) ... Gated head: gate ~ 1 (bias GATE_BIAS);
   RNN head: output chunk a R_m P_code R_m^T W1 / sqrt(beta) through tanh (near-linear, a set
   so |input| <= RNN_TANH), W2 scaled by 1/a; the state never reaches the bias.
 * confidence sigmoid(w . [h_k ; W1[prev_k]]) with w reading the membership coordinate:
   logit +-CONF_LOGIT (sigma ~0.95 / ~0.05) plus a random part bounded by 2 CONF_NOISE. So at a
   threshold in (0.1, 0.9) the proposal stops at the first slot whose previous token leaves
   the agreeing set: every proposed draft is accepted and empty proposals happen.
The agreeing set is laid out as `dspark_ladder(block_size)` runs (0, bs, 1, bs - 1, ...) plus
fillers, so every accepted length 0..bs occurs somewhere on the cycle. At threshold 0 every
round ends one step after a token outside the set, so over a full cycle the acceptance is at
most agree_frac / ((1 - agree_frac) bs) (0.21 for 0.6 and bs 7); agree_frac 1.0 gives h = f
and tau = bs + 1.
DeepSpec's DFlash variant (markov_rank 0) has no Markov head to carry h: not offered.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from ...checkpoints.agreeing import (
    _orthogonal,
    _rng,
    _stable,
    agreement,
    dspark_ladder,
    frequencies,
    target_kind,
)
from ...checkpoints.core import GEMMA_NORMS, KINDS, QWEN_NORMS, _merge, draw, kind

DSPARK = {
    "target_kind": "gemma4-target",
    "target_overrides": {},
    "target_layer_ids": [1, 2, 4],
    "num_draft_layers": 2,
    "block_size": 7,
    "mask_token_id": 0,
    "num_anchors": 64,
    "markov_rank": 8,
    "markov_head_type": "vanilla",
    "confidence_head_alpha": 1.0,
    "confidence_head_with_markov": True,
}
# The agreeing drafter's construction (module docstring):
AGREE_MARKOV_RANK = 32       # the DSpark drafter's default markov_rank (DSPARK's 8 is too coherent)
MARKOV_BETA = 40.0           # Markov bias of the proposed token
MEMBER = 1.0                 # |membership coordinate| of W1
CONF_LOGIT = math.log(0.95 / 0.05)   # confidence logit on / off the agreeing set
CONF_NOISE = 0.25            # bound on each random part (hidden, code dims) of a confidence logit
BASE_BOUND = 3.0             # bound on |base logit| of the DSpark drafter
MARKOV_MARGIN = 4.0          # required Markov margin beyond 2 BASE_BOUND
GATE_BIAS = 12.0             # gated Markov head: gate pre-activation ~ this (gate ~ 1)
RNN_TANH = 0.35              # RNN Markov head: bound on |tanh input| of the output chunk


def dspark_config(target: dict, args: dict) -> dict:
    """The draft config DeepSpec's `build_draft_config` derives from a target config (its config
    path is checked against this one in the oracle tests): the target's text config with the
    draft's layer count, all-full layers, an untied head and the DSpark fields."""
    c = copy.deepcopy(target)
    n_target = c["num_hidden_layers"]
    ids = [int(i) for i in args["target_layer_ids"]]
    if any(b <= a for a, b in zip(ids, ids[1:])) or any(i != -1 and not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {ids} must be strictly increasing in {{-1}} U [0, {n_target - 1}]")
    gemma = c["model_type"] == "gemma4_text"
    c.update({
        "architectures": ["Gemma4DSparkModel" if gemma else "Qwen3DSparkModel"],
        "num_target_layers": n_target,
        "num_hidden_layers": args["num_draft_layers"],
        "block_size": args["block_size"],
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * args["num_draft_layers"],
        "mask_token_id": args["mask_token_id"],
        "target_layer_ids": ids,
        "num_anchors": args["num_anchors"],
        "enable_confidence_head": args["confidence_head_alpha"] > 0,
        "markov_rank": args["markov_rank"],
    })
    if gemma:
        c["target_model_type"], c["target_text_model_type"] = "gemma4", "gemma4_text"
    elif "rope_theta" in c:  # transformers 5 writes Qwen3's RoPE as rope_parameters
        c["rope_parameters"] = {"rope_theta": c.pop("rope_theta"), "rope_type": "default"}
    if c["enable_confidence_head"]:
        c["confidence_head_with_markov"] = bool(args["confidence_head_with_markov"])
    if args["markov_rank"] > 0:
        c["markov_head_type"] = args["markov_head_type"]
    c.pop("torch_dtype", None)
    c["dtype"] = "float32"
    return c


@kind("dspark-drafter")
def dspark_drafter(seed: int, overrides: dict):
    """A DeepSpec DSpark drafter (Gemma-4 or Qwen3 family, by `target_kind`) in DeepSpec's own
    format: the state-dict names and config its `save_pretrained` writes. Its embedding and lm head
    are the target's (DeepSpec copies them at training start), so the target is built first.
    markov_rank 0 and confidence_head_alpha 0 give DeepSpec's DFlash variant."""
    a = _merge(DSPARK, overrides)
    target_cfg, target_tensors = KINDS[a["target_kind"]](a.get("target_seed", seed), a["target_overrides"])
    c = dspark_config(target_cfg, a)
    d = draw(seed)
    d.tensors["embed_tokens.weight"] = target_tensors["model.embed_tokens.weight"]
    d.tensors["lm_head.weight"] = target_tensors.get("lm_head.weight", target_tensors["model.embed_tokens.weight"])
    draw_dspark(c, d)
    return c, d.tensors


def draw_dspark(c: dict, d) -> None:
    """DeepSpec's state dict for config `c` but the embedding and lm head (the kind's and the
    published configs' writer): fc, norms, draft layers, the Markov and confidence heads."""
    gemma = c["model_type"] == "gemma4_text"
    H, V, r = c["hidden_size"], c["vocab_size"], c.get("markov_rank", 0)
    d.linear("fc.weight", H, len(c["target_layer_ids"]) * H)
    d.scale("hidden_norm.weight", (H,))
    d.scale("norm.weight", (H,))
    if gemma:
        hd = c["global_head_dim"]
        kv = c["num_global_key_value_heads"] if c["attention_k_eq_v"] else c["num_key_value_heads"]
    else:
        hd, kv = c["head_dim"], c["num_key_value_heads"]
    nh = c["num_attention_heads"]
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        d.attention(p, H, nh, kv, hd, v=not (gemma and c["attention_k_eq_v"]))
        d.mlp(p, H, c["intermediate_size"])
        d.norms(p, GEMMA_NORMS if gemma else QWEN_NORMS, H)
        if gemma:
            d.scale(p + "layer_scalar", (1,))
    if r:
        d.markov_head(H, V, r, c["markov_head_type"], gain=2.0)
    if c["enable_confidence_head"]:
        d.confidence_head(H + (r if c.get("confidence_head_with_markov") else 0))


def _markov_bias(kind_name: str, W1, W2, out_map=None) -> np.ndarray:
    """[prev, j] Markov bias of the constructed head (gate taken as 1; RNN state irrelevant)."""
    if kind_name == "rnn":
        return np.tanh(W1 @ out_map.T) @ W2.T
    return W1 @ W2.T


@kind("dspark-drafter-agreeing")
def dspark_drafter_agreeing(seed: int, overrides: dict):
    """DeepSpec DSpark drafter (DeepSpec's format, as "dspark-drafter") on an agreeing target
    (`target_kind` "gemma4-target-agreeing" (default) or "qwen3-target-agreeing", built with
    `target_seed` (default: this seed) and `target_overrides`). At T=0 it drafts h(prev) (see
    `agreement(target_seed, agree_frac, V, H, dspark_ladder(block_size))`) on a share
    `agree_frac` (default 0.6) of the cycle; its confidence is ~0.95 when the previous token
    is in the agreeing set and ~0.05 otherwise. Takes the "dspark-drafter" overrides; markov_rank
    defaults to AGREE_MARKOV_RANK."""
    ov = dict(overrides)
    agree_frac = float(ov.pop("agree_frac", 0.6))
    target_seed = int(ov.pop("target_seed", seed))
    ov.setdefault("target_kind", "gemma4-target-agreeing")
    ov.setdefault("markov_rank", AGREE_MARKOV_RANK)
    a = _merge(DSPARK, ov)
    target_kind(a["target_kind"], "dspark-drafter-agreeing")
    r, mtype = int(a["markov_rank"]), a["markov_head_type"]
    if r <= 0:
        raise ValueError("dspark-drafter-agreeing: markov_rank 0 (DeepSpec's DFlash variant) has no Markov "
                         "head to carry the agreement; this variant is not offered")
    if a["confidence_head_alpha"] > 0 and not a["confidence_head_with_markov"]:
        raise ValueError("dspark-drafter-agreeing: a confidence head without the Markov features cannot see "
                         "the previous token; set confidence_head_with_markov True (or confidence_head_alpha 0)")
    if mtype not in ("vanilla", "gated", "rnn"):
        raise ValueError(f"unsupported markov_head_type {mtype!r}")
    c, t = dspark_drafter(seed, ov)
    tt = KINDS[a["target_kind"]](target_seed, a["target_overrides"])[1] if target_seed != seed else None
    H, V, bs = c["hidden_size"], c["vocab_size"], c["block_size"]
    ag = agreement(target_seed, agree_frac, V, H, dspark_ladder(bs))
    fr = ag.frame
    N, P = len(fr.order), (r - 1) // 2
    if P < 1 or P > (N - 1) // 2:
        raise ValueError(f"markov_rank {r} must be in [3, {2 * ((N - 1) // 2) + 1}] for a cycle of {N}")
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    if tt is not None:
        t["embed_tokens.weight"] = tt["model.embed_tokens.weight"]
        t["lm_head.weight"] = tt.get("lm_head.weight", tt["model.embed_tokens.weight"])
    head, embed = t["lm_head.weight"], t["embed_tokens.weight"]
    # Base logits: |lm_head[y] . (w * x / rms(x))| <= |lm_head[y]| max|w| sqrt(H) <= BASE_BOUND.
    row_max = float(np.linalg.norm(f64(head), axis=1).max())
    w_rand = f64(t["norm.weight"])
    w_norm = w_rand * (BASE_BOUND / (row_max * w_rand.max() * math.sqrt(H)))
    t["norm.weight"] = w_norm
    h_max = float(w_norm.max()) * math.sqrt(H)          # |final hidden| bound
    # Markov codes (cycle-index harmonic frame), membership coordinate, random rotation.
    freqs = frequencies(N, P)
    angle = 2 * np.pi * np.outer(np.arange(N), freqs) / N
    code = np.zeros((V, r))
    code[np.ix_(fr.order, 2 * np.arange(P))] = np.cos(angle) / math.sqrt(P)
    code[np.ix_(fr.order, 2 * np.arange(P) + 1)] = np.sin(angle) / math.sqrt(P)
    member = 2 * P
    R_m = _orthogonal(_rng(seed, "markov-basis"), r)
    sb = math.sqrt(MARKOV_BETA)
    w1_pre = sb * code
    w1_pre[:, member] = MEMBER * np.where(ag.agree, 1.0, -1.0)
    pre_h = np.argsort(ag.h)                             # pre_h[j] = h^-1(j)
    W1 = w1_pre @ R_m.T
    w2_pre = MARKOV_BETA / sb * code[pre_h]
    out_map = None
    if mtype == "rnn":
        code_only = np.diag((np.arange(r) < member).astype(float))
        scale = RNN_TANH / np.abs(code @ R_m.T).max()
        out_map = scale / sb * (R_m @ code_only @ R_m.T)      # out = scale R_m [code_t ; 0]
        w2_pre = MARKOV_BETA / scale * code[pre_h]        # bias = beta <code_{h^-1(j)}, code_t> + O(tanh)
        joint = f64(t["markov_head.joint_proj.weight"])
        bias = f64(t["markov_head.joint_proj.bias"])
        joint[2 * r:] = 0.0
        joint[2 * r:, r:2 * r] = out_map
        bias[2 * r:] = 0.0
        t["markov_head.joint_proj.weight"], t["markov_head.joint_proj.bias"] = joint, bias
    elif mtype == "gated":
        # |gate pre-activation - GATE_BIAS| <= 2: rows of unit norm over [h / h_max ; e / e_max].
        e_max = float(np.linalg.norm(W1, axis=1).max())
        g = _rng(seed, "markov-gate").standard_normal((r, H + r))
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        g[:, :H] /= h_max
        g[:, H:] /= e_max
        t["markov_head.gate_proj.weight"] = g
        t["markov_head.gate_proj.bias"] = np.full(r, GATE_BIAS)
    W2 = w2_pre @ R_m.T
    t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"] = W1, W2
    # The margin is a property of the construction: check it for every non-special prev.
    B = _markov_bias(mtype, W1, W2, out_map)[fr.order]
    want = ag.h[fr.order]
    top = B[np.arange(N), want]
    B[np.arange(N), want] = -np.inf
    margin = float((top - B.max(axis=1)).min())
    slack = 0.05 * MARKOV_BETA if mtype == "gated" else 0.0
    if margin - slack < 2 * BASE_BOUND + MARKOV_MARGIN:
        raise ValueError(f"markov_rank {r}: Markov margin {margin:.2f} < {2 * BASE_BOUND + MARKOV_MARGIN + slack:.1f} "
                         f"(codes too coherent); use a larger markov_rank, e.g. {AGREE_MARKOV_RANK}")
    if c["enable_confidence_head"]:
        rng = _rng(seed, "confidence")
        w_h = rng.standard_normal(H)
        w_h *= CONF_NOISE / (np.linalg.norm(w_h) * h_max)
        w_e_pre = np.zeros(r)
        noise = rng.standard_normal(member)
        w_e_pre[:member] = noise * CONF_NOISE / (np.linalg.norm(noise) * sb)
        w_e_pre[member] = CONF_LOGIT / MEMBER
        t["confidence_head.proj.weight"] = np.concatenate([w_h, R_m @ w_e_pre])[None, :]
        t["confidence_head.proj.bias"] = np.zeros(1)
    t = _stable(t)
    t["embed_tokens.weight"], t["lm_head.weight"] = embed, head   # bit-exact copies of the target's
    return c, t

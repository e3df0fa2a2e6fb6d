"""Tiny z-lab DFlash drafters (`dflash==0.1.0`) in z-lab's on-disk format, for the tiny targets:
random, with optional DSpark extras, and agreeing.

A DFlash drafter is a few Qwen3-style decoder layers with NO embedding and NO lm head: it embeds
its block with the TARGET's embedding and scores it with the TARGET's head. Its tensors are
`fc` (taps -> hidden), `hidden_norm`, `layers.*` and `norm`. Its config is a Qwen3 config plus
`dflash_config: {target_layer_ids, mask_token_id, ...}`, `num_target_layers`, `block_size` and
`architectures: ["DFlashDraftModel"]`, the way z-lab's published drafters are written (both
`dflash.model.DFlashDraftModel.from_pretrained` and `dflash.model_mlx.load_draft` read it).

Agreeing DFlash ("dflash-drafter-agreeing"), on either agreeing target. The block is [anchor, MASK
x (bs - 1)] and slot k (1..bs-1) must draft h^k(anchor). Layer 0 does it with one attention head
per slot offset (head k-1 reads the block row k back):
 * content-free q / k: q_proj and k_proj read only the constant direction u of the target's
   embedding, so after q_norm / k_norm every block row has the same key and head k-1 the same
   query; their RoPE pairs are set so the score depends only on the offset d between query and
   key, A (sum_i w_i cos((d - k) theta_i) - b): +SLOT_GAP at d = k, <= -SLOT_GAP elsewhere.
 * the context (fc projected off u, hidden_norm uniform and small) has keys ~0 and values ~0:
   a sink for the heads whose offset points before the block.
 * v_proj keeps only the target's cycle subspace (the mask token is a special id: value 0);
   head k-1's o_proj maps the anchor's cycle code c_a to SLOT_WRITE x the code of the token
   whose target-head logit is h^k(a) (f^-1 h^k(a) for the untied Qwen3 head, h^k(a) for the
   tied Gemma-4 one): a least-squares linear map on the cycle codes, exact when the codes'
   only linear relation is sum_a c_a = 0 (hidden_size >= vocab_size), checked by its margin.
 * every other write (layer 0's MLP, later layers) is scaled x DFLASH_WRITE_SCALE; the final
   norm weight undoes the target's (Qwen3) or sets the logit scale (Gemma-4).
h, f and the agreeing set come from `agreement(target_seed, agree_frac, V, H,
dspark_ladder(block_size - 1))`: every accepted length 0..bs-1 occurs along the cycle.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from ...checkpoints.agreeing import (
    ALPHA2,
    SPECIALS,
    TARGET_LOGIT,
    _stable,
    agreement,
    dspark_ladder,
    target_kind,
)
from ...checkpoints.core import KINDS, QWEN_NORMS, Draw, _merge, draw, kind

DFLASH = {
    "target_kind": "qwen3-target",
    "target_overrides": {},
    "target_layer_ids": [1, 2, 3],
    "num_draft_layers": 2,
    "layer_types": None,              # None: all full attention (z-lab's default)
    "sliding_window": None,
    "is_causal": None,                # None: sliding layers causal, full layers not (z-lab)
    "block_size": 8,
    "mask_token_id": 127,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rope_theta": 1000000.0,
    "input_embedding_scale": None,    # None: key absent (z-lab's default 1.0)
    "output_multiplier": None,
    "final_logit_softcapping": "target",  # "target": the target's (Gemma-4: 30), or a number / None
    "dspark_extras": None,            # None: a plain z-lab drafter; a dict: + DSpark extras (below)
}
# The DSpark-on-DFlash extension (port/dflash.py, extras=True): DeepSpec's extras tensors and config
# fields on a DFlash drafter. Keys of the `dspark_extras` override, with their defaults:
EXTRAS = {
    "markov_rank": 8,
    "markov_head_type": "vanilla",       # vanilla | gated | rnn (spec_parity.port.heads.MarkovHead)
    "markov_gain": 1.0,                  # std of the bias is ~ markov_gain (w1 ~ N(0, 1), w2 ~ gain/sqrt(r))
    "confidence": True,                  # a confidence head
    "confidence_head_with_markov": True,  # its input [h ; W1[prev]] (False: h)
}


def dflash_config(target: dict, a: dict) -> dict:
    n_target, n_draft = target["num_hidden_layers"], a["num_draft_layers"]
    ids = [int(i) for i in a["target_layer_ids"]]
    if not ids or any(b <= b0 for b0, b in zip(ids, ids[1:])) or any(not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {ids} must be strictly increasing in [0, {n_target - 1}]")
    layer_types = a["layer_types"] or ["full_attention"] * n_draft
    if len(layer_types) != n_draft:
        raise ValueError(f"layer_types {layer_types} must have num_draft_layers={n_draft} entries")
    if "sliding_attention" in layer_types and not a["sliding_window"]:
        raise ValueError("sliding_attention layers need a sliding_window")
    if not 0 <= a["mask_token_id"] < target["vocab_size"]:
        raise ValueError(f"mask_token_id {a['mask_token_id']} is outside the target vocab {target['vocab_size']}")
    dflash = {"target_layer_ids": ids, "mask_token_id": a["mask_token_id"], "block_size": a["block_size"]}
    for key in ("input_embedding_scale", "output_multiplier"):
        if a[key] is not None:
            dflash[key] = a[key]
    cap = target.get("final_logit_softcapping") if a["final_logit_softcapping"] == "target" else a["final_logit_softcapping"]
    if cap:
        dflash["final_logit_softcapping"] = cap
    c = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": a["block_size"],
        "dflash_config": dflash,
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": a["intermediate_size"],
        "layer_types": layer_types,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "max_window_layers": n_draft,
        "num_attention_heads": a["num_attention_heads"],
        "num_hidden_layers": n_draft,
        "num_key_value_heads": a["num_key_value_heads"],
        "num_target_layers": n_target,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_scaling": None,
        "rope_theta": a["rope_theta"],
        "sliding_window": a["sliding_window"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": "sliding_attention" in layer_types,
        "vocab_size": target["vocab_size"],
        "eos_token_id": target.get("eos_token_id"),
        "bos_token_id": target.get("bos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "dtype": "float32",
    }
    if a["is_causal"] is not None:
        c["is_causal"] = bool(a["is_causal"])
    return c


@kind("dflash-drafter")
def dflash_drafter(seed: int, overrides: dict):
    """A z-lab DFlash drafter for the tiny target named by `target_kind` ("qwen3-target" or
    "gemma4-target", with `target_overrides`): random weights, random norm weights. The target is
    only read for its config (dims, depth, vocab, softcap); no tensor is copied from it."""
    a = _merge(DFLASH, overrides)
    target_cfg, _ = KINDS[a["target_kind"]](seed, copy.deepcopy(a["target_overrides"]))
    c = dflash_config(target_cfg, a)
    H, hd = c["hidden_size"], c["head_dim"]
    nh, nkv, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    d = draw(seed)
    d.linear("fc.weight", H, len(c["dflash_config"]["target_layer_ids"]) * H)
    d.scale("hidden_norm.weight", (H,))
    d.scale("norm.weight", (H,))
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        d.attention(p, H, nh, nkv, hd)
        d.mlp(p, H, inter)
        d.norms(p, QWEN_NORMS, H)
    if a["dspark_extras"] is not None:
        add_extras(c, d, a["dspark_extras"])
    return c, d.tensors


def add_extras(c: dict, d: Draw, overrides: dict) -> None:
    """DSpark extras on a DFlash drafter: config fields at the top level (DeepSpec's spelling) and
    random `markov_head.*` / `confidence_head.proj.*` tensors (their own random streams, so the
    base tensors' bytes do not move)."""
    e = _merge(EXTRAS, overrides)
    H, V, r = c["hidden_size"], c["vocab_size"], int(e["markov_rank"])
    if r < 0 or (r == 0 and not e["confidence"]):
        raise ValueError(f"dspark_extras {overrides}: needs markov_rank > 0 and/or confidence")
    with_markov = bool(e["confidence"] and e["confidence_head_with_markov"] and r > 0)
    c.update({"markov_rank": r, "enable_confidence_head": bool(e["confidence"])})
    if r:
        c["markov_head_type"] = e["markov_head_type"]
        d.markov_head(H, V, r, e["markov_head_type"], gain=float(e["markov_gain"]))
    if e["confidence"]:
        c["confidence_head_with_markov"] = with_markov
        d.confidence_head(H + (r if with_markov else 0))


DFLASH_AGREE = {"agree_frac": 0.6, "target_seed": None, "target_kind": "qwen3-target-agreeing",
                "target_overrides": {"hidden_size": 128}, "num_draft_layers": 2, "block_size": 8,
                "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": None,
                "mask_token_id": 0}
SLOT_GAP = 24.0              # attention score of the read offset (+) and of any other (<= -)
SLOT_WRITE = 30.0            # |o_proj write| / |block embedding|
DFLASH_WRITE_SCALE = 0.02    # layer 0's MLP and the later layers' o_proj / down_proj x this
CTX_NORM = 0.05              # hidden_norm weight (uniform): context keys / values stay small
DFLASH_MARGIN = 4.0          # required logit margin of every (anchor, slot) draft


def _slot_weights(thetas: np.ndarray, span: int) -> tuple[np.ndarray, float, float]:
    """Weights w >= 0 (sum 1) on the RoPE frequencies minimising max_{1<=|d|<=span} sum_i w_i
    cos(d theta_i) (a small LP); returns (w, that max c, bias b = (1 + c) / 2)."""
    from scipy.optimize import linprog

    n = len(thetas)
    d = np.concatenate([np.arange(1, span + 1), -np.arange(1, span + 1)])
    cos = np.cos(np.outer(d, thetas))                      # [2 span, n]
    # variables [w ; t]: minimise t, cos w - t <= 0, sum w = 1
    res = linprog(np.r_[np.zeros(n), 1.0], A_ub=np.c_[cos, -np.ones(len(d))], b_ub=np.zeros(len(d)),
                  A_eq=np.r_[np.ones(n), 0.0][None, :], b_eq=[1.0], bounds=[(0, None)] * n + [(None, None)],
                  method="highs")
    if not res.success:
        raise ValueError(f"dflash-drafter-agreeing: slot weights LP failed ({res.message})")
    w = np.round(np.clip(res.x[:n], 0, None), 6)
    w /= w.sum()
    c = float((cos @ w).max())
    return w, c, (1 + c) / 2


@kind("dflash-drafter-agreeing")
def dflash_drafter_agreeing(seed: int, overrides: dict):
    """z-lab DFlash drafter (format of "dflash-drafter") on an agreeing target (`target_kind`
    "qwen3-target-agreeing" (default) or "gemma4-target-agreeing", `target_overrides`, default
    hidden_size 128, built with `target_seed` (default: this seed)): at T=0 block slot k drafts
    h^k(anchor), h from `agreement(target_seed, agree_frac, V, H, dspark_ladder(block_size - 1))`.
    Other keys: the "dflash-drafter" overrides; head_dim None means hidden_size."""
    a = _merge({**DFLASH, **DFLASH_AGREE}, overrides)
    agree_frac, target_seed = float(a.pop("agree_frac")), a.pop("target_seed")
    target_seed = seed if target_seed is None else int(target_seed)
    target_kind(a["target_kind"], "dflash-drafter-agreeing")
    tc, tt = KINDS[a["target_kind"]](target_seed, dict(a["target_overrides"]))
    H, V, bs = tc["hidden_size"], tc["vocab_size"], int(a["block_size"])
    if a["head_dim"] is None:
        a["head_dim"] = H
    hd, nh, nkv = int(a["head_dim"]), int(a["num_attention_heads"]), int(a["num_key_value_heads"])
    if hd != H or nh < bs - 1 or nkv != 1 or a["num_draft_layers"] < 1:
        raise ValueError("dflash-drafter-agreeing needs head_dim = hidden_size, num_attention_heads >= "
                         "block_size - 1, num_key_value_heads 1 and at least one layer")
    if a["mask_token_id"] >= SPECIALS or (a["layer_types"] and a["layer_types"][0] != "full_attention"):
        raise ValueError("dflash-drafter-agreeing needs a special mask_token_id (< 3) and a full-attention layer 0")
    c, t = dflash_drafter(seed, {k: v for k, v in a.items() if k in DFLASH})
    ag = agreement(target_seed, agree_frac, V, H, dspark_ladder(bs - 1))
    fr = ag.frame
    N, P = len(fr.order), len(fr.freqs)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    gemma = a["target_kind"] == "gemma4-target-agreeing"
    E = f64(tt["model.embed_tokens.weight"])
    E_norm = float(np.linalg.norm(E[fr.order[0]]))
    embed_scale = (math.sqrt(H) if gemma else 1.0) * (a["input_embedding_scale"] or 1.0)
    u = fr.u
    # Cycle codes in the target basis: row k of B is R c_{order[k]} (unit); E[x] ~ alpha u + beta B.
    cols = SPECIALS + 1 + np.arange(2 * P)
    Rc = fr.R[:, cols]                                      # [H, 2P]
    C = fr.E0[np.ix_(fr.order, cols)]                       # [N, 2P], beta c_k
    beta = float(np.linalg.norm(C[0]))
    C = C / beta
    p0 = "layers.0.self_attn."
    # input_layernorm weight 1: x = sqrt(H) E[t] / |E|, <u, x> = sqrt(H) alpha / |E| = sqrt(H ALPHA2).
    t["layers.0.input_layernorm.weight"] = np.ones(H)
    ux = math.sqrt(H * ALPHA2)
    # q / k: RoPE pairs (i, i + hd/2) at theta_i = base^(-2i/hd); the lowest frequency carries the bias.
    half = hd // 2
    thetas = float(a["rope_theta"]) ** (-2 * np.arange(half) / hd)
    w, cmax, b = _slot_weights(thetas[: half - 1], 2 * (bs - 1))
    amp = SLOT_GAP / ((1 - cmax) / 2)                       # A: score = A (sum w cos - b)
    s_qk = math.sqrt(amp / math.sqrt(hd))                   # q_norm = k_norm weight, both uniform
    kz = np.r_[np.sqrt(w), math.sqrt(b)]                    # key: real pair amplitudes
    key = np.r_[kz, np.zeros(half)]
    q_rows = np.zeros((nh * hd, H))
    for k in range(1, bs):
        z = np.sqrt(w) * np.exp(-1j * k * thetas[: half - 1])
        q = np.r_[z.real, -math.sqrt(b), z.imag, 0.0]
        q_rows[(k - 1) * hd:k * hd] = np.outer(q, u) / ux
    for k in range(bs, nh + 1):                             # spare heads: the offset-1 query, no write
        q_rows[(k - 1) * hd:k * hd] = q_rows[:hd]
    norm_kq = math.sqrt(1 + b)                              # |q| = |key| = sqrt(1 + b) before the norms
    t[p0 + "q_proj.weight"] = q_rows / norm_kq
    t[p0 + "k_proj.weight"] = np.outer(key, u) / (ux * norm_kq)
    t[p0 + "q_norm.weight"] = np.full(hd, s_qk)
    t[p0 + "k_norm.weight"] = np.full(hd, s_qk)
    # v: the cycle code of the row, v = R_c R_c^T x |E| / (sqrt(H) beta) = R c_t (0 for specials).
    t[p0 + "v_proj.weight"] = Rc @ Rc.T * (E_norm / (math.sqrt(H) * beta))
    # o: head k-1 writes SLOT_WRITE |embed| R c_{pi_k(a)}; pi_k(a) = f^-1 h^k (a) (Qwen3) or h^k (a) (Gemma-4).
    pre_f = np.argsort(fr.f)
    o = np.zeros((H, nh * hd))
    write = SLOT_WRITE * E_norm * embed_scale
    hk = fr.order.copy()
    margins = []
    for k in range(1, bs):
        hk = ag.h[hk]
        want = hk if gemma else pre_f[hk]
        Ct = C[fr.index[want]]
        M = np.linalg.lstsq(C, Ct, rcond=None)[0].T        # M c_a ~ c_{pi_k(a)}
        o[:, (k - 1) * hd:k * hd] = write * (Rc @ M @ Rc.T)
        out = C @ M.T                                       # [N, 2P] written codes
        score = out @ C.T                                   # by cycle index of the logit's preimage
        top = score[np.arange(N), fr.index[want]]
        score[np.arange(N), fr.index[want]] = -np.inf
        margins.append(float((top - score.max(axis=1)).min()))
    t[p0 + "o_proj.weight"] = o
    # Final norm: the Qwen3 head row f(x) is g E[x] / w_F (undo w_F); the Gemma-4 head is tied.
    g_logit = TARGET_LOGIT / math.sqrt(H)
    if gemma:
        t["norm.weight"] = np.full(H, g_logit / beta)
    else:
        t["norm.weight"] = f64(tt["model.norm.weight"])
    if min(margins) * TARGET_LOGIT < DFLASH_MARGIN * (1 + 2 / SLOT_WRITE):
        raise ValueError(f"dflash-drafter-agreeing: the slot maps are not exact enough (code margin "
                         f"{min(margins):.3f}); use a target hidden_size >= vocab_size")
    # Context: fc off u, hidden_norm uniform and small.
    t["fc.weight"] = f64(t["fc.weight"]) - np.outer(u, u @ f64(t["fc.weight"]))
    t["hidden_norm.weight"] = np.full(H, CTX_NORM)
    t["layers.0.mlp.down_proj.weight"] = f64(t["layers.0.mlp.down_proj.weight"]) * DFLASH_WRITE_SCALE
    for i in range(1, c["num_hidden_layers"]):
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            t[f"layers.{i}.{n}.weight"] = f64(t[f"layers.{i}.{n}.weight"]) * DFLASH_WRITE_SCALE
    return c, _stable(t)

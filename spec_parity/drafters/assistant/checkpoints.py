"""The Gemma-4 assistant drafter kinds, random and agreeing.

Agreeing assistant ("gemma4-assistant-agreeing"), for "gemma4-target-agreeing". It proposes h(t)
for the token t it is fed, with h = f on a subset A of the cycle and h = f(rho(t)) off A (rho a
cyclic shift of the non-A tokens, so h is a permutation and h(t) != f(t) there). A draft is
accepted exactly while the chain stays in A. A is laid out along the cycle as runs of lengths 0, 3,
1, 4, 2 (interleaved with filler runs near the mean) so every accepted length 0..4 and full accepts
occur within any ~40 tokens. The drafter is built from the same target embedding (recomputed from
`target_seed`): pre_projection's embedding half maps sqrt(H) E[t] to D_n^-1 phi(t), where phi(t) =
R_d P_sel E0[t] keeps 16 of the target's frequency planes (including m = 1) in a random drafter
basis R_d, and D_n is the drafter's final norm weight (undone); the hidden half is small. Its four
layers write x0.03 (post norms), so the final hidden is ~phi(t) whatever the donor K/V hold. The
drafter's own embedding (its head) has row E_d[h(t)] = sigma phi(t), so the head's argmax is h(t).
Centroid head: cluster c holds the 16 tokens y whose preimage h^-1(y) lies on the c-th arc of the
cycle; the centroids are a least-squares fit that scores the own arc and one neighbour arc high, so
the right cluster is always among the top 2 of 8, with a clear gap to the 3rd.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from ...checkpoints.agreeing import SPECIALS, _orthogonal, _rng, _stable, agreement, frequencies
from ...checkpoints.core import GEMMA4_TEXT, GEMMA_NORMS, _merge, draw, kind

ASSISTANT_TEXT = {
    **GEMMA4_TEXT,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "final_logit_softcapping": None,
    "vocab_size_per_layer_input": 0,
    "num_kv_shared_layers": 4,
}

ASSISTANT = {
    "model_type": "gemma4_assistant",
    "backbone_hidden_size": 64,
    "use_ordered_embeddings": True,
    "num_centroids": 8,
    "centroid_intermediate_top_k": 2,
    "tie_word_embeddings": True,
    "text_config": ASSISTANT_TEXT,
}
DRAFT_RMS = 4.0              # rms of the drafter's residual after pre_projection
DRAFT_WRITE_SCALE = 0.03     # the drafter's post-attention / post-feedforward norm weights x this
DRAFT_ROW = 2.0              # |E_d[y]| of the drafter's head rows
HIDDEN_GAIN = 0.05           # gain of pre_projection's hidden half
CENTROID_SCORE = 2.0         # top centroid score / sqrt(D) for a final hidden of rms 1


@kind("gemma4-assistant")
def gemma4_assistant(seed: int, overrides: dict):
    """Gemma-4 "-assistant" drafter (E2B/E4B: centroid head; 26B/31B: tied head; 12B: the
    `gemma4_unified_assistant` type), Q-only layers that read the target's donor K/V. Scaled down
    to the tiny Gemma-4 target: same head dims, KV heads and window. Override `text_config` keys
    through `text_config`, e.g. {"text_config": {"attention_k_eq_v": True}}; {"tie_word_embeddings":
    False} gives an untied head (its own lm_head.weight), with the centroid head too (whose
    candidates transformers scores on lm_head and optiq on the embedding)."""
    ov = dict(overrides)
    text_ov = ov.pop("text_config", {})
    c = _merge(ASSISTANT, ov)
    c["text_config"] = _merge(ASSISTANT_TEXT, text_ov)
    c["text_config"]["tie_word_embeddings"] = c["tie_word_embeddings"]
    unified = c["model_type"] == "gemma4_unified_assistant"
    if unified:
        c["text_config"]["model_type"] = "gemma4_unified_text"
        for k in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            c["text_config"].pop(k)
    c["architectures"] = ["Gemma4UnifiedAssistantForCausalLM" if unified else "Gemma4AssistantForCausalLM"]
    c["torch_dtype"] = "float32"
    d = draw(seed)
    draw_assistant(c, d, seed)
    return c, d.tensors


def draw_assistant(c: dict, d, seed: int) -> None:
    """An assistant's tensors for config `c` (the kind's and the published configs' writer)."""
    t = c["text_config"]
    B, D, V = c["backbone_hidden_size"], t["hidden_size"], t["vocab_size"]
    d.normal("model.embed_tokens.weight", (V, D), 1.0)
    d.scale("model.norm.weight", (D,))
    d.linear("pre_projection.weight", D, 2 * B)
    d.linear("post_projection.weight", B, D)
    for i, layer_type in enumerate(t["layer_types"]):
        p = f"model.layers.{i}."
        hd = t["global_head_dim"] if layer_type == "full_attention" else t["head_dim"]
        d.scale(p + "layer_scalar", (1,))
        d.linear(p + "self_attn.q_proj.weight", t["num_attention_heads"] * hd, D)
        d.scale(p + "self_attn.q_norm.weight", (hd,))
        d.linear(p + "self_attn.o_proj.weight", D, t["num_attention_heads"] * hd)
        d.mlp(p, D, t["intermediate_size"])
        d.norms(p, GEMMA_NORMS, D)
    if c["use_ordered_embeddings"]:
        if V % c["num_centroids"]:
            raise ValueError(f"vocab {V} is not divisible by num_centroids {c['num_centroids']}")
        d.linear("masked_embedding.centroids.weight", c["num_centroids"], D)
        order = np.random.default_rng([seed, zlib.crc32(b"token_ordering")]).permutation(V)
        d.tensors["masked_embedding.token_ordering"] = order.astype(np.int64)
    if not c["tie_word_embeddings"]:
        d.normal("lm_head.weight", (V, D), 1.0)


@kind("gemma4-assistant-agreeing")
def gemma4_assistant_agreeing(seed: int, overrides: dict):
    """Gemma-4 assistant drafter for "gemma4-target-agreeing" built with seed `target_seed`
    (default: this seed): proposes f(t) on a share `agree_frac` (default 0.6) of the cycle and a
    wrong token elsewhere. Takes the "gemma4-assistant" overrides (head, unified type, ...)."""
    ov = dict(overrides)
    agree_frac = float(ov.pop("agree_frac", 0.6))
    target_seed = int(ov.pop("target_seed", seed))
    c, t = gemma4_assistant(seed, ov)
    tc = c["text_config"]
    B, D, V = c["backbone_hidden_size"], tc["hidden_size"], tc["vocab_size"]
    ag = agreement(target_seed, agree_frac, V, B)
    fr = ag.frame
    N = len(fr.order)
    P = len(fr.freqs)
    if D % 2 or D // 2 > P:
        raise ValueError(f"drafter hidden {D} must be even and at most 2 x {P} "
                         "(the target's planes)")
    f32, f64 = np.float32, lambda a: np.asarray(a, np.float64)
    sub = frequencies(N, D // 2, fr.freqs)
    planes = [fr.freqs.index(m) for m in sub]
    cols = np.array([SPECIALS + 1 + 2 * j + e for j in planes for e in (0, 1)])
    R_d = _orthogonal(_rng(seed, "drafter-basis"), D)
    select = np.zeros((D, B))
    select[np.arange(D), cols] = 1.0
    proj = R_d @ select                          # phi(t) = proj @ E0[t]
    phi = fr.E0 @ proj.T                         # [V, D], zero rows for the specials
    phi_norm = float(np.linalg.norm(phi[fr.order[0]]))
    # pre_projection: [sqrt(B) E[t] | h_in] -> D_n^-1 phi(t), scaled to rms DRAFT_RMS.
    w_n = f64(t["model.norm.weight"])
    scale = DRAFT_RMS * math.sqrt(D) / phi_norm
    emb_half = (scale / math.sqrt(B)) * (proj @ fr.R.T) / w_n[:, None]
    hid_half = _rng(seed, "hidden-half").standard_normal((D, B)) * HIDDEN_GAIN / math.sqrt(B)
    t["pre_projection.weight"] = np.concatenate([emb_half, hid_half], axis=1).astype(f32)
    # The head: E_d[h(t)] = DRAFT_ROW phi(t) / |phi|; specials (never fed, never right) get small
    # random rows.
    rows = _rng(seed, "special-rows").standard_normal((V, D)) * (0.1 * DRAFT_ROW / math.sqrt(D))
    rows[ag.h[fr.order]] = DRAFT_ROW * phi[fr.order] / phi_norm
    t["model.embed_tokens.weight"] = rows.astype(f32)
    for i in range(tc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("post_attention_layernorm", "post_feedforward_layernorm"):
            t[p + n + ".weight"] = (t[p + n + ".weight"] * f32(DRAFT_WRITE_SCALE)).astype(f32)
    if c["use_ordered_embeddings"]:
        K = c["num_centroids"]
        per = V // K
        # Cluster by the preimage's position on the cycle: arcs of `per` tokens (specials last).
        pre_index = np.full(V, N + np.arange(V))      # specials sort after the cycle
        pre_index[ag.h[fr.order]] = np.arange(N)       # y = h(order[k]) has preimage index k
        by_arc = np.argsort(pre_index, kind="stable")
        clusters = by_arc.reshape(K, per)
        shuffle = _rng(seed, "cluster-order")
        order = np.concatenate([shuffle.permutation(cl) for cl in clusters])
        t["masked_embedding.token_ordering"] = order.astype(np.int64)
        # Centroids, fitted by least squares on the (unit) drafter hiddens phi(t): a token's own
        # arc scores 1 and so does one neighbour arc (the previous one in the first half of the
        # arc, the next one in the second half), the rest 0. So the top 2 of K is {own,
        # neighbour} with a clear gap to the 3rd everywhere (a plain circular layout ties the
        # 2nd and 3rd at every arc centre, and transformers' topk and optiq's argpartition may
        # then pick different candidate sets).
        k = np.arange(N)
        arc = np.minimum(k // per, K - 1)
        length = np.where(arc == K - 1, N - per * (K - 1), per)
        partner = np.where(k - arc * per < length / 2, (arc - 1) % K, (arc + 1) % K)
        table = np.zeros((N, K))
        table[k, arc] = table[k, partner] = 1.0
        unit = phi[fr.order] / phi_norm
        cent = np.linalg.lstsq(unit, table, rcond=None)[0].T            # [K, D]
        cent *= CENTROID_SCORE / np.abs(unit @ cent.T).max()
        t["masked_embedding.centroids.weight"] = cent.astype(f32)
    return c, _stable(t)

"""Tiny target kinds: Gemma-4 text and Qwen3, each random and agreeing, and the Gemma-4 target
variants every pair runs on.

Agreeing target ("gemma4-target-agreeing"). Greedy decoding walks a permutation f of the
vocabulary: the special ids 0, 1, 2 are fixed points and the other V-3 ids form one cycle, so EOS
(1) never follows a normal token. The embedding rows are, in a random orthonormal basis R,

    E[x] = R (alpha u + beta c_x)

with u a constant direction, c_x = e_x for the specials and, for the token at index k of the
cycle, a harmonic frame c_x = (cos 2pi m_j k/N, sin 2pi m_j k/N)_j / sqrt(P) over P frequencies
chosen for low coherence. f is then one linear map on the embeddings, S = R Q R^T (Q rotates
plane j by 2pi m_j/N), and the last layer's MLP computes it exactly: its gate reads only u, so
gelu(gate) is the same constant for every token and down(gelu(gate) * up(x)) is linear; down is
solved so that the MLP writes D_F^-1 S E[x] (D_F the final norm weight, which it undoes), with a
large post-feedforward norm weight so this write dominates the residual. Through the tied head
the logits are then <E[y], E[f(x)]>: the successor wins by beta^2 (1 - coherence). Every other
residual write (post-attention and post-feedforward norms, per-layer-input norm) is scaled x0.1;
all other tensors stay as the random "gemma4-target" kind draws them (norms, q/k norms, layer
scalars, attention), so the checkpoint is an ordinary Gemma-4 text model.

Caveat: the next token ignores the context, so a stream test on this target cannot see cache or
context bugs; compare logits / hidden states along the path too.

Qwen3 ("qwen3-target-agreeing"): the same token geometry as the Gemma-4 one (`target_frame`, so
`agreement(seed, ...)` gives its f too), embeddings scaled to |E| = QWEN_EMBED_NORM, every
residual write shrunk (o_proj and down_proj x WRITE_SCALE), so the last hidden is E[x] plus a
small context-dependent residue. The head is untied: lm_head row f(x) = g E[x] / w_F (w_F the
final norm weight, undone), so logit_y = g <E[f^-1(y)], E[x] + noise> sqrt(H)/|.|: the successor
scores ~TARGET_LOGIT, every other token at most ALPHA2 + (1 - ALPHA2) x coherence of that.
Everything else stays as "qwen3-target" draws it.
"""

from __future__ import annotations

import math

import numpy as np

from ...checkpoints.agreeing import (
    ALPHA2,
    EMBED_NORM,
    TARGET_LOGIT,
    _orthogonal,
    _rng,
    _stable,
    target_frame,
)
from ...checkpoints.core import GEMMA4_TEXT, GEMMA_NORMS, QWEN_NORMS, _merge, draw, kind

GEMMA4_TARGET = {
    **GEMMA4_TEXT,
    "architectures": ["Gemma4ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                    "sliding_attention", "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0,
    "vocab_size_per_layer_input": 128,
    "num_kv_shared_layers": 0,
    "torch_dtype": "float32",
}
# The Gemma-4 target variants (overrides of "gemma4-target") the pairs run on: the plain one,
# attention_k_eq_v on the full layers, per-layer inputs with kv-shared and double-wide layers.
GEMMA4_VARIANTS = {
    "gemma4": {},
    "gemma4-keqv": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "gemma4-ple-kvshared": {"hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2,
                            "use_double_wide_mlp": True},
}
WRITE_SCALE = 0.1            # agreeing: post-attention / post-feedforward norm weights x this
LAST_WRITE = (20.0, 60.0)    # agreeing: the last layer's post-feedforward norm weight, uniform
GATE = (2.0, 3.0)            # agreeing: the last MLP's (constant) gate pre-activations, uniform
QWEN_EMBED_NORM = 8.0        # |E[x]| of the Qwen3 agreeing target (rms 1 per coordinate)


@kind("gemma4-target")
def gemma4_target(seed: int, overrides: dict):
    """Gemma-4 text target: sliding + full layers, proportional RoPE, softcap, optional
    attention_k_eq_v and per-layer inputs with kv-shared layers (real E2B/26B structure, scaled down)."""
    c = _merge(GEMMA4_TARGET, overrides)
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    first_shared = L - c["num_kv_shared_layers"]
    ple = c["hidden_size_per_layer_input"]
    d = draw(seed)
    # Small embeddings and a large final norm: with a tied head, a large √H-scaled embedding makes
    # every token predict itself (constant greedy streams that test nothing); this mix gives
    # streams of 10-25 distinct tokens with top-1 margins well above the fp32 noise.
    d.normal("model.embed_tokens.weight", (V, H), 0.1)
    d.scale("model.norm.weight", (H,), 2.0, 6.0)
    if ple:
        d.normal("model.embed_tokens_per_layer.weight", (c["vocab_size_per_layer_input"], L * ple), 1.0)
        d.linear("model.per_layer_model_projection.weight", L * ple, H)
        d.scale("model.per_layer_projection_norm.weight", (ple,))
    for i, layer_type in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        full = layer_type == "full_attention"
        hd = c["global_head_dim"] if full else c["head_dim"]
        k_eq_v = c["attention_k_eq_v"] and full
        kv_heads = c["num_global_key_value_heads"] if k_eq_v and c["num_global_key_value_heads"] else c["num_key_value_heads"]
        inter = c["intermediate_size"] * (2 if c["use_double_wide_mlp"] and i >= first_shared > 0 else 1)
        d.scale(p + "layer_scalar", (1,))
        d.linear(p + "self_attn.q_proj.weight", c["num_attention_heads"] * hd, H)
        d.scale(p + "self_attn.q_norm.weight", (hd,))
        if i < first_shared:
            d.linear(p + "self_attn.k_proj.weight", kv_heads * hd, H)
            d.scale(p + "self_attn.k_norm.weight", (hd,))
            if not k_eq_v:
                d.linear(p + "self_attn.v_proj.weight", kv_heads * hd, H)
        d.linear(p + "self_attn.o_proj.weight", H, c["num_attention_heads"] * hd)
        d.mlp(p, H, inter)
        d.norms(p, GEMMA_NORMS, H)
        if ple:
            d.linear(p + "per_layer_input_gate.weight", ple, H)
            d.linear(p + "per_layer_projection.weight", H, ple)
            d.scale(p + "post_per_layer_input_norm.weight", (H,))
    if not c["tie_word_embeddings"]:
        d.linear("lm_head.weight", V, H)
    return c, d.tensors


@kind("gemma4-target-agreeing")
def gemma4_target_agreeing(seed: int, overrides: dict):
    """Gemma-4 target whose greedy stream walks a known permutation (see the module docstring).
    Takes the "gemma4-target" overrides (e.g. attention_k_eq_v, per-layer inputs)."""
    c, t = gemma4_target(seed, overrides)
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    fr = target_frame(seed, V, H)
    f32, f64 = np.float32, lambda a: np.asarray(a, np.float64)
    E = fr.E
    t["model.embed_tokens.weight"] = E.astype(f32)
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = E.astype(f32)
    # Final norm weight sets the logit scale: successor logit ~ 8 |E| mean(w_F) ~ TARGET_LOGIT.
    w_mean = TARGET_LOGIT / (math.sqrt(H) * EMBED_NORM)
    w_fin = _rng(seed, "final-norm").uniform(0.5 * w_mean, 1.5 * w_mean, H).astype(f32)
    t["model.norm.weight"] = w_fin
    last = L - 1
    for i in range(L):
        p = f"model.layers.{i}."
        names = ["post_attention_layernorm", "post_per_layer_input_norm"] + (
            ["post_feedforward_layernorm"] if i != last else [])
        for n in names:
            if p + n + ".weight" in t:
                t[p + n + ".weight"] = (t[p + n + ".weight"] * f32(WRITE_SCALE)).astype(f32)
    p = f"model.layers.{last}."
    inter = t[p + "mlp.up_proj.weight"].shape[0]
    w_pre = f64(t[p + "pre_feedforward_layernorm.weight"])
    w_out = _rng(seed, "last-write").uniform(*LAST_WRITE, H).astype(f32)
    t[p + "post_feedforward_layernorm.weight"] = w_out
    w_fin = f64(w_fin)
    # Input to the last MLP: w_pre * n, n = rms-normed residual ~ sqrt(H) E[x] / |E|.
    # gate_j = gamma_j <u, n> |E| / (sqrt(H) alpha) = gamma_j: the same for every token.
    gamma = _rng(seed, "gate").uniform(*GATE, inter)
    alpha = EMBED_NORM * math.sqrt(ALPHA2)
    gate = np.outer(gamma, fr.u / w_pre) * EMBED_NORM / (math.sqrt(H) * alpha)
    act = 0.5 * gamma * (1 + np.tanh(math.sqrt(2 / math.pi) * (gamma + 0.044715 * gamma ** 3)))
    up = _orthogonal(_rng(seed, "up"), inter, H) * math.sqrt(inter / H)     # up.T @ up = inter/H
    # down @ diag(act) @ up = D_out^-1 D_fin^-1 S D_pre^-1,
    # so MLP(w_pre * n) = D_out^-1 D_fin^-1 S n
    # and the post-feedforward norm writes ~ D_fin^-1 E[f(x)] (its own weight undone).
    target_map = (fr.S / w_pre[None, :]) / (f64(w_out) * w_fin)[:, None]
    down = target_map @ up.T / (inter / H) / act[None, :]
    t[p + "mlp.gate_proj.weight"] = gate.astype(f32)
    t[p + "mlp.up_proj.weight"] = up.astype(f32)
    t[p + "mlp.down_proj.weight"] = down.astype(f32)
    return c, _stable(t)


QWEN3_TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "torch_dtype": "float32",
}


@kind("qwen3-target")
def qwen3_target(seed: int, overrides: dict):
    """Qwen3 target (8B/14B structure, untied head, q/k norms), scaled down."""
    c = _merge(QWEN3_TARGET, overrides)
    H, V, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = draw(seed)
    d.normal("model.embed_tokens.weight", (V, H), 1.0)
    d.scale("model.norm.weight", (H,))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        d.attention(p, H, nh, nkv, hd)
        d.mlp(p, H, c["intermediate_size"])
        d.norms(p, QWEN_NORMS, H)
    if not c["tie_word_embeddings"]:
        d.linear("lm_head.weight", V, H, gain=4.0)
    return c, d.tensors


@kind("qwen3-target-agreeing")
def qwen3_target_agreeing(seed: int, overrides: dict):
    """Qwen3 target whose greedy stream walks `agreement(seed, ...).f` (untied head). Takes the
    "qwen3-target" overrides."""
    c, t = qwen3_target(seed, overrides)
    if c["tie_word_embeddings"]:
        raise ValueError("qwen3-target-agreeing needs an untied lm_head (tie_word_embeddings False)")
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    fr = target_frame(seed, V, H)
    f32 = np.float32
    E = fr.E * (QWEN_EMBED_NORM / EMBED_NORM)
    t["model.embed_tokens.weight"] = E.astype(f32)
    for i in range(L):
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{n}.weight"
            t[name] = (t[name] * f32(WRITE_SCALE)).astype(f32)
    # Normed last hidden ~ w_F * sqrt(H) E[x] / |E|; row f(x) = g E[x] / w_F gives the successor
    # g |E| sqrt(H) = TARGET_LOGIT.
    w_fin = np.asarray(t["model.norm.weight"], np.float64)
    g = TARGET_LOGIT / (QWEN_EMBED_NORM * math.sqrt(H))
    pre = np.argsort(fr.f)                               # pre[y] = f^-1(y)
    t["lm_head.weight"] = (g * E[pre] / w_fin[None, :]).astype(f32)
    return c, _stable(t)

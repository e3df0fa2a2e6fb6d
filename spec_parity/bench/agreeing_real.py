"""The `agreeing-real` condition of `spec-parity bench --serve`: a drafter and its target at their
real widths, in the run's dtype (bf16 at `--shapes real`), with tau set by the weights and the
same for every loop that runs them. One family per source (FAMILIES): DFlash (block 16) on a
Qwen3-8B shaped target, the Gemma-4 assistant (12B, tied head) on its Gemma-4 target, DSpark
(block 7: 7 drafts) on the Qwen3-4B shaped target of the bench's real DSpark case (REAL_DSPARK:
tied head, 5 draft layers, Markov rank 256, a confidence head).

The factory's agreeing kinds need hidden >= vocab: one vector must carry any token's identity.
At real widths the stream is instead confined to K cycle tokens (ids 3 .. K + 2), each embedded
on a coordinate of its own. What the families share (`_stream_target`, `plan`):
  * target: E[c] = e_code(c) + e_U (its own coordinate plus one shared one), every other row 0
    but the family's extras; every layer's o_proj and down_proj 0 (the layers run, at full cost,
    and write nothing; a per-layer input's projection too), so the residual stream carries the
    embedding alone up to the head, which maps the cycle f: greedy decoding walks f whatever the
    context, with the successor's logit TARGET_LOGIT.
  * the drafter proposes h(t) for t, h^k(anchor) at its k-th draft; h = f except on the "out"
    tokens at every tau-th cycle position, where h jumps to the successor of the next out token.
    From a run start a round accepts tau - 1 drafts and commits tau tokens, landing on the next
    run start: tau per round exactly, after at most one shorter first round. tau 1: every token
    is out (h = f o f, no draft ever accepted); tau = the most a round commits (`max`, each
    family's own: DFlash the block, 16; DSpark its 7 drafts + 1, 8; the assistant gamma + 1): no
    token is out (every draft accepted). K is the largest multiple of tau the family's widths carry.
DFlash and DSpark share the drafter's layer 0 (`_slot_heads`): one head per drafted block row
reads the anchor, as the factory's agreeing DFlash does (content-free q / k on e_U, RoPE pairs from
`slot_weights`, score +SLOT_GAP at the row's offset from the anchor, <= -SLOT_GAP elsewhere);
v_proj maps the K code coordinates onto the K head dims of every KV head, and the head of the j-th
draft writes the code whose head row scores h^j(anchor). fc is 0 (context keys and values exactly
0: the sink); every other write is 0. The mask token's embedding row is e_U + e_M; K <= head_dim.
DFlash (`_lift_dflash`):
  * target (untied head): final norm weight 1, head row f(c) = g e_code(c).
  * drafter: rows 1..15 of [anchor, MASK x 15]; the j-th draft writes the code of f^-1(h^j(anchor))
    and scores through the target's head.
Gemma-4 assistant (`_lift_assistant`):
  * target (tied head: logits = E x, so a layer must move c to f(c)): the last layer's MLP is the
    map (`_map_mlp`), its gate reading e_U alone (one constant activation), up_proj row j reading
    e_code(j), down_proj column j writing e_code(f(j)); its post-feedforward norm (weight MAP_WRITE) makes the
    write MAP_WRITE sqrt(H) e_code(f(c)) against sqrt(H) (e_code(c) + e_U) of the embedding, and
    the final norm weight sets the successor's logit to TARGET_LOGIT (before the softcap, 30:
    it keeps the argmax). Layer scalars 1, so no layer rescales the embedding against the write.
  * drafter: pre_projection's embedding half maps the target's sqrt(H)-scaled e_code(j) onto the
    drafter's coordinate j, its hidden half is 0 (the target's hidden and the drafter's own next
    hidden are read, at full cost, and weigh nothing); every layer's o_proj and down_proj 0 (its
    Q-only attention over the target's donor K/V runs and writes nothing); final norm weight 1;
    the head (the drafter's own embedding, tied; an untied lm_head the same) has row h(j) =
    (TARGET_LOGIT / sqrt(D)) e_j: the step fed token j drafts h(j), logit TARGET_LOGIT against 0.
    K <= the drafter's hidden D.
DSpark (`_lift_dspark`):
  * target (tied head, Qwen3): layer 0's MLP is the map, as the assistant's (`_map_mlp`: gate
    pre-activation TIED_GATE on e_U), its down column j writing TIED_WRITE e_code(f(j)) (no
    post-feedforward norm: the down weight carries the scale); the final norm weight sets the
    successor's logit to TARGET_LOGIT (c's own 2 / (TIED_WRITE + 1) of it, the other cycle
    tokens and the mask token half that, 0 elsewhere).
  * drafter: rows 0..6 of [anchor, MASK x 6] (row 0 reads itself, at offset 0); the j-th draft
    writes the code of h^j(anchor) and scores through the drafter's own embedding and head, both
    set to the target's E; markov_w2 0 (the Markov head runs at full cost and adds 0); the
    confidence head stays random, every loop running it at threshold 0 (the full block).
Prompts are drawn from the cycle tokens (`prompt_vocab`), so every request stays on the cycle.
Every other weight is random (mx.random), so every matmul costs what the real model's does; the
constructed matrices are built on the device (`_sparse`), never as dense host arrays.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..case import Case
from ..checkpoints.agreeing import SPECIALS, TARGET_LOGIT
from ..drafters.dflash.checkpoints import SLOT_GAP, SLOT_WRITE
from . import shapes

BLOCK = 16                      # DFlash's block: its tau max
MAP_WRITE = 8.0                 # assistant target: the map layer's post-feedforward norm weight
MAP_GATE = 2.5                  # assistant target: the map MLP's (constant) gate pre-activation
REAL_ASSISTANT = "assistant-12b-tied"   # the bench's real assistant case (loops.RANDOM_CASES)
REAL_DSPARK = "dspark-qwen3-4b"         # the bench's real DSpark case (shapes.real_cases)
TIED_WRITE = 8.0                # DSpark's tied target: layer 0's MLP write of e_code(f(c)), in E's units
TIED_GATE = 12.0                # DSpark's tied target: the map MLP's (constant) gate pre-activation


# ---- what the families share ---------------------------------------------------------------------

def parse_taus(text: str, block: int = BLOCK, what: str = "") -> list[int]:
    """`--tau 2,4,max`: integers 1..block, `max` = block (every draft accepted)."""
    out = []
    for x in (s.strip() for s in text.split(",") if s.strip()):
        v = block if x == "max" else int(x) if x.isdigit() else 0
        if not 1 <= v <= block:
            raise ValueError(f"--tau {text!r}: {x!r} is not an integer in 1..{block} or 'max'{what}")
        out.append(v)
    if not out:
        raise ValueError(f"--tau {text!r}: empty; give e.g. 2,4,max")
    return out


def cycle_size(tau: int, capacity: int) -> int:
    """K: the largest multiple of tau <= capacity, the coordinates the widths give the cycle
    (tau 1: an even K, h = f o f)."""
    return capacity // 2 * 2 if tau == 1 else capacity // tau * tau


def plan(tau: int, block: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(f, h) on cycle indices 0..k-1: f one random cycle; h = f on the tokens in runs, and at the
    out tokens (every tau-th along the cycle; all for tau 1, none for tau = block) the successor
    of the next out token."""
    order = np.random.default_rng([seed, 46]).permutation(k)
    f = np.empty(k, int)
    f[order] = np.roll(order, -1)
    out_pos = (np.arange(k) if tau == 1 else np.array([], int) if tau >= block
               else np.arange(0, k, tau))
    h = f.copy()
    outs = order[out_pos]
    h[outs] = f[np.roll(outs, -1)]
    return f, h


def _zero(t: dict, name: str) -> None:
    t[name] = mx.zeros(t[name].shape, dtype=t[name].dtype)


def _sparse(shape: tuple, dtype, rows, cols, values) -> mx.array:
    """A zero matrix with `values` at (rows, cols), built on the device (only the entries cross)."""
    rows, cols = np.broadcast_arrays(np.asarray(rows), np.asarray(cols))
    values = np.broadcast_to(np.asarray(values, np.float32), rows.shape)
    out = mx.zeros(shape, dtype=dtype)
    out[mx.array(rows.ravel().astype(np.int32)), mx.array(cols.ravel().astype(np.int32))] = (
        mx.array(np.ascontiguousarray(values.ravel())).astype(dtype))
    return out


def _silence(t: dict, prefix: str, layers: int) -> None:
    """Every layer under `prefix` writes nothing: o_proj, down_proj (and a per-layer input's
    projection) 0. Its attention and MLP still run."""
    for i in range(layers):
        for n in ("self_attn.o_proj", "mlp.down_proj", "per_layer_projection"):
            if f"{prefix}layers.{i}.{n}.weight" in t:
                _zero(t, f"{prefix}layers.{i}.{n}.weight")


def _stream_target(t: dict, tc: dict, k: int, extra: tuple = ((), (), ())) -> None:
    """The target's embedding rows e_code(c) + e_U for the cycle tokens (U = k), `extra` (rows,
    cols, values) beside them, every other row 0; its layers silenced."""
    ids = SPECIALS + np.arange(k)
    rows = np.r_[ids, ids, extra[0]]
    cols = np.r_[np.arange(k), np.full(k, k), extra[1]]
    vals = np.r_[np.ones(2 * k), extra[2]]
    name = "model.embed_tokens.weight"
    t[name] = _sparse(t[name].shape, t[name].dtype, rows, cols, vals)
    _silence(t, "model.", tc["num_hidden_layers"])


def _map_mlp(t: dict, p: str, k: int, f: np.ndarray, n_in: float, gate: float, down: float) -> None:
    """The tied target's map: the MLP under `p` moves e_code(c) to e_code(f(c)). Units 0..k-1
    carry it, their gate reading e_U alone (pre-activation `gate`, one constant activation), unit
    j's up row reading e_code(j), its down column writing `down` e_code(f(j)); every other unit's
    gate and up rows 0. `n_in`: e_code, e_U's coordinate after the MLP's input norm (weight 1)."""
    dt = t[p + "mlp.down_proj.weight"].dtype
    H, inter = t[p + "mlp.down_proj.weight"].shape
    codes = np.arange(k)
    t[p + "mlp.gate_proj.weight"] = _sparse((inter, H), dt, codes, k, gate / n_in)
    t[p + "mlp.up_proj.weight"] = _sparse((inter, H), dt, codes, codes, 1.0 / n_in)
    t[p + "mlp.down_proj.weight"] = _sparse((H, inter), dt, f, codes, down)


def _slot_heads(d: dict, dc: dict, H: int, first: int, h: np.ndarray, code: np.ndarray, dt) -> None:
    """The drafter's layer 0 (DFlash, DSpark): head j reads the anchor from block row first + j,
    as the factory's agreeing DFlash does (content-free q / k on e_U, RoPE pairs from
    `slot_weights`, score +SLOT_GAP at the row's offset from the anchor, <= -SLOT_GAP elsewhere);
    v_proj maps the K code coordinates onto the K head dims of every KV head, head j's o_proj
    writes code[h^(j+1)(anchor)], the code whose target-head row scores h^(j+1)(anchor); the spare
    heads read row `first` and write nothing. fc 0 (context keys and values exactly 0: the sink),
    every other write 0."""
    k = len(h)
    U = k
    hd, nh, nkv = dc["head_dim"], dc["num_attention_heads"], dc["num_key_value_heads"]
    bs = dc["block_size"]
    theta = dc.get("rope_theta") or (dc.get("rope_parameters") or {}).get("rope_theta", 1e6)
    ux = math.sqrt(H / 2)                                   # x_U after input_layernorm (weight 1)
    half = hd // 2
    thetas = float(theta) ** (-2 * np.arange(half) / hd)
    w, cmax, b = slot_weights(thetas[: half - 1], 2 * (bs - 1))
    amp = SLOT_GAP / ((1 - cmax) / 2)
    s_qk = math.sqrt(amp / math.sqrt(hd))
    norm_kq = math.sqrt(1 + b)
    key = np.r_[np.sqrt(w), math.sqrt(b), np.zeros(half)] / (ux * norm_kq)
    q_vals = []
    for j in range(nh):
        offset = first + j if first + j < bs else first     # spare heads: row `first`, no write
        z = np.sqrt(w) * np.exp(-1j * offset * thetas[: half - 1])
        q_vals.append(np.r_[z.real, -math.sqrt(b), z.imag, 0.0] / (ux * norm_kq))
    q = _sparse((nh * hd, H), dt, np.arange(nh * hd), U, np.concatenate(q_vals))
    kk = _sparse((nkv * hd, H), dt, np.arange(nkv * hd), U, np.tile(key, nkv))
    v = _sparse((nkv * hd, H), dt, (np.arange(nkv)[:, None] * hd + np.arange(k)).ravel(), np.tile(np.arange(k), nkv),
                1.0 / ux)                                   # v = e_code in the head dims
    o_rows, o_cols = [], []
    hk = np.arange(k)
    for j in range(bs - first):
        hk = h[hk]
        o_rows.append(code[hk])                             # the code scoring h^(j+1) (anchor)
        o_cols.append(j * hd + np.arange(k))
    o = _sparse((H, nh * hd), dt, np.concatenate(o_rows), np.concatenate(o_cols), SLOT_WRITE * math.sqrt(2))
    _silence(d, "", dc["num_hidden_layers"])                # layer 0's o_proj is written next
    p0 = "layers.0.self_attn."
    for name, a in (("q_proj", q), ("k_proj", kk), ("v_proj", v), ("o_proj", o)):
        d[p0 + name + ".weight"] = a
    d[p0 + "q_norm.weight"] = mx.full((hd,), s_qk, dtype=dt)
    d[p0 + "k_norm.weight"] = mx.full((hd,), s_qk, dtype=dt)
    d["layers.0.input_layernorm.weight"] = mx.ones((H,), dtype=dt)
    d["norm.weight"] = mx.ones((H,), dtype=dt)
    _zero(d, "fc.weight")


def _slot_checks(dc: dict, H: int, k: int, mask: int, first: int) -> None:
    drafts = dc["block_size"] - first
    if dc["num_attention_heads"] < drafts or k + 2 > H or SPECIALS <= mask < SPECIALS + k or dc["head_dim"] % 2:
        raise ValueError(f"agreeing-real needs heads >= drafts ({drafts}), hidden > head_dim + 1 and a mask token "
                         f"outside ids {SPECIALS}..{SPECIALS + k - 1}")


@dataclass(frozen=True)
class Family:
    tau_max: Callable[[int], int]                      # gamma -> the most a round commits
    cases: Callable[..., list[Case]]                   # (taus, size, ctx, dtype, gamma, target_layers)
    lift: Callable[[shapes.Checkpoints, int, int], int]   # (ckpt, tau, seed) -> K, in place


def tau_max(source: str, gamma: int) -> int:
    return FAMILIES[source].tau_max(gamma)


def cases(source: str, taus: list[int], size: str, ctx: int, dtype: str, gamma: int = 4,
          target_layers: int | None = None) -> list[Case]:
    """One case of `source` per requested tau at `size` ("real" or "tiny")."""
    return FAMILIES[source].cases(taus, size, ctx, dtype, gamma, target_layers)


def build(case: Case, root: Path) -> shapes.Checkpoints:
    """The case's random checkpoints at its shapes (bench/shapes.py `build`), then the weights
    that set tau replaced in memory."""
    kind, seed, ov = case.params.drafter
    ov = dict(ov)
    tau = ov.pop("agree_tau")
    plain = replace(case, params=replace(case.params, drafter=(kind, seed, ov)))
    ckpt = shapes.build(plain, root)
    k = FAMILIES[case.module].lift(ckpt, tau, case.seed)
    mx.eval(list(ckpt.weights("target").values()), list(ckpt.weights("drafter").values()))
    ckpt.case = case
    ckpt.prompt_vocab = SPECIALS + k
    return ckpt


def _note(tau: int, k: int, extra: str) -> str:
    return f"tau {tau} by construction: stream on {k} cycle tokens, docs/bench.md; {extra}"


# ---- DFlash on a Qwen3 target ----------------------------------------------------------------------

SHAPES = {
    # Qwen3-8B: hidden 4096, 36 layers, 32 / 8 heads x 128, intermediate 12288, vocab 151936, untied.
    "real": ({"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
              "max_position_embeddings": 40960},
             {"num_draft_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 12288, "mask_token_id": 151669},
             "Qwen3-8B DFlash (4096, 36 target / 5 draft layers, 32/8x128, inter 12288, vocab 151936, block 16)"),
    # The same construction at widths a CPU runs (CPU tests, a dry run of the device command).
    "tiny": ({"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": False,
              "max_position_embeddings": 40960},
             {"num_draft_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 32,
              "intermediate_size": 256, "mask_token_id": 511},
             "small DFlash (128, 8 target / 2 draft layers, 16/2x32, vocab 512, block 16)"),
}


def _dflash_cases(taus: list[int], size: str, ctx: int, dtype: str, gamma: int = 4,
                  target_layers: int | None = None) -> list[Case]:
    """One DFlash case per requested tau (block 16 whatever gamma; the Qwen3-8B depth)."""
    tq, dv, label = SHAPES[size]
    taps = shapes.spread_taps(tq["num_hidden_layers"], 5)
    drafter = {"target_kind": "qwen3-target", "target_overrides": tq, "target_layer_ids": taps, "block_size": BLOCK,
               **dv}
    out = []
    for tau in taus:
        note = _note(tau, cycle_size(tau, dv["head_dim"]), f"taps {taps}")
        ov = {**copy.deepcopy(drafter), "agree_tau": tau}
        out.append(shapes.bench_case("real", f"dflash-agreeing-real-tau{tau}", "dflash", f"{label}, tau {tau}",
                                     ("dflash-drafter", ov), ("qwen3-target", tq), ctx, BLOCK - 1, dtype, (note,)))
    return out


def slot_weights(thetas: np.ndarray, span: int, steps: int = 4000) -> tuple[np.ndarray, float, float]:
    """The factory's slot weights (checkpoints/dflash.py `_slot_weights`: w >= 0, sum 1, keeping
    max_{1<=|d|<=span} sum_i w_i cos(d theta_i) low) with numpy alone, the device having no scipy:
    the min-max game solved by multiplicative weights, averaged. Returns (w, that max c, bias)."""
    d = np.concatenate([np.arange(1, span + 1), -np.arange(1, span + 1)])
    cos = np.cos(np.outer(d, thetas))                      # [2 span, n]
    w, p = np.full(len(thetas), 1 / len(thetas)), np.full(len(d), 1 / len(d))
    mean = np.zeros_like(w)
    eta = math.sqrt(8 * math.log(len(thetas)) / steps)
    for _ in range(steps):
        w = w * np.exp(-eta * (p @ cos))
        w /= w.sum()
        p = p * np.exp(eta * (cos @ w))
        p /= p.sum()
        mean += w
    w = np.round(mean / steps, 6)
    w /= w.sum()
    c = float((cos @ w).max())
    return w, c, (1 + c) / 2


def _lift_dflash(ckpt: shapes.Checkpoints, tau: int, seed: int) -> int:
    """Replace the Qwen3 target's and the DFlash drafter's weights that carry the stream (module
    docstring); K."""
    tc, dc = ckpt.target_config, ckpt.drafter_config
    t, d = ckpt.weights("target"), ckpt.weights("drafter")
    dt = t["model.embed_tokens.weight"].dtype
    H, V = tc["hidden_size"], tc["vocab_size"]
    bs, mask = dc["block_size"], dc["dflash_config"]["mask_token_id"]
    k = cycle_size(tau, dc["head_dim"])
    U, M = k, k + 1
    _slot_checks(dc, H, k, mask, 1)
    f, h = plan(tau, bs, k, seed)
    # Target: the stream (the mask token's row e_U + e_M), the head rows.
    _stream_target(t, tc, k, ([mask, mask], [U, M], [1.0, 1.0]))
    g = TARGET_LOGIT / math.sqrt(H / 2)
    t["lm_head.weight"] = _sparse((V, H), dt, SPECIALS + f, np.arange(k), g)    # row f(c) = g e_code(c)
    t["model.norm.weight"] = mx.ones((H,), dtype=dt)
    # Drafter layer 0: slot k (block row k) drafts h^k(anchor) through the head row of code f^-1.
    _slot_heads(d, dc, H, 1, h, np.argsort(f), dt)
    return k


# ---- the Gemma-4 assistant on a Gemma-4 target -----------------------------------------------------

def _assistant_tiny(target_layers: int | None) -> tuple[dict, dict, str]:
    """The 12B case's structure (unified tied assistant, k_eq_v full layer with one global KV
    head, sliding window crossed by the prompts) at widths a CPU runs."""
    layers = target_layers or 6
    t = {**shapes._gemma_target(1, layers, 128, 256, 4, 2, 1, True, 16, 512), "head_dim": 32, "global_head_dim": 64}
    a = {"model_type": "gemma4_unified_assistant", "backbone_hidden_size": t["hidden_size"],
         "use_ordered_embeddings": False, "tie_word_embeddings": True,
         "text_config": {**shapes._assistant_text(t, 64, 128, 4, 1), "head_dim": 32, "global_head_dim": 64}}
    return a, t, f"small tied assistant (128->64, 4 layers, 4 heads, 32/64, window 16, vocab 512; {layers} target layers)"


def _assistant_cases(taus: list[int], size: str, ctx: int, dtype: str, gamma: int = 4,
                     target_layers: int | None = None) -> list[Case]:
    """One assistant case per requested tau: the bench's real assistant case (REAL_ASSISTANT, its
    shapes and stand-in depth), or its structure at tiny widths; gamma drafts per round."""
    if size == "real":
        base = next(c for c in shapes.real_cases(ctx, 1, target_layers, gamma, dtype) if c.name == REAL_ASSISTANT)
        a, t, label, notes = base.params.drafter[2], base.overrides, base.shapes.label, base.shapes.notes
    else:
        (a, t, label), notes = _assistant_tiny(target_layers), ()
    cap = _assistant_capacity(t, a)
    out = []
    for tau in taus:
        note = _note(tau, cycle_size(tau, cap), f"target layer {t['num_hidden_layers'] - 1}'s MLP maps the cycle")
        ov = {**copy.deepcopy(a), "agree_tau": tau}
        out.append(shapes.bench_case("real", f"assistant-agreeing-real-tau{tau}", "assistant", f"{label}, tau {tau}",
                                     ("gemma4-assistant", ov), ("gemma4-target", copy.deepcopy(t)), ctx, gamma, dtype,
                                     (*notes, note)))
    return out


def _assistant_capacity(tc: dict, dc: dict) -> int:
    """The cycle's room: a drafter coordinate per token (D), a target coordinate per token beside
    e_U (H - 1), a map unit per token (the target's intermediate)."""
    return min(dc["text_config"]["hidden_size"], tc["hidden_size"] - 1, tc["intermediate_size"])


def _lift_assistant(ckpt: shapes.Checkpoints, tau: int, seed: int) -> int:
    """Replace the Gemma-4 target's and the assistant's weights that carry the stream (module
    docstring); K."""
    tc, dc = ckpt.target_config, ckpt.drafter_config
    t, d = ckpt.weights("target"), ckpt.weights("drafter")
    if dc.get("use_ordered_embeddings"):
        raise ValueError("agreeing-real builds the assistant's tied or untied head, not a centroid head")
    dt = t["model.embed_tokens.weight"].dtype
    H, V, L = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    D = dc["text_config"]["hidden_size"]
    k = cycle_size(tau, _assistant_capacity(tc, dc))
    f, h = plan(tau, ckpt.case.shapes.gamma + 1, k, seed)
    codes = np.arange(k)
    # Target: the stream; the last layer's MLP moves e_code(c) to e_code(f(c)); the head is E.
    _stream_target(t, tc, k)
    if "lm_head.weight" in t:
        t["lm_head.weight"] = t["model.embed_tokens.weight"]
    for i in range(L):
        t[f"model.layers.{i}.layer_scalar"] = mx.ones((1,), dtype=dt)
    p = f"model.layers.{L - 1}."
    n_in = math.sqrt(H / 2)                                  # e_code, e_U after the pre-feedforward norm
    _map_mlp(t, p, k, f, n_in, MAP_GATE, 1.0)             # its post-feedforward norm sets the write
    t[p + "pre_feedforward_layernorm.weight"] = mx.ones((H,), dtype=dt)
    t[p + "post_feedforward_layernorm.weight"] = mx.full((H,), MAP_WRITE, dtype=dt)
    # x = sqrt(H) (e_c + e_U + MAP_WRITE e_f(c)); logit of f(c) = w (n_f(c) + n_U) = TARGET_LOGIT.
    rms = math.sqrt(2 + MAP_WRITE ** 2)
    t["model.norm.weight"] = mx.full((H,), TARGET_LOGIT * rms / (math.sqrt(H) * (MAP_WRITE + 1)), dtype=dt)
    # Drafter: embedding half of pre_projection e_code(j) -> e_j, head row h(j) on e_j.
    d["pre_projection.weight"] = _sparse(d["pre_projection.weight"].shape, dt, codes, codes, 1.0 / math.sqrt(H))
    _silence(d, "model.", dc["text_config"]["num_hidden_layers"])
    d["model.norm.weight"] = mx.ones((D,), dtype=dt)
    head = _sparse((V, D), dt, SPECIALS + h, codes, TARGET_LOGIT / math.sqrt(D))
    d["model.embed_tokens.weight"] = head
    if "lm_head.weight" in d:
        d["lm_head.weight"] = head
    return k


# ---- DSpark on a Qwen3 target (tied head) --------------------------------------------------------

def _dspark_tiny() -> tuple[dict, dict, str]:
    """The real case's structure (tied Qwen3 target, block 7, Markov and confidence heads; the
    draft layers take the target's heads, >= 7) at widths a CPU runs."""
    tq = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": True,
          "max_position_embeddings": 40960}
    dv = {"target_kind": "qwen3-target", "target_overrides": tq, "target_layer_ids": shapes.spread_taps(8, 5),
          "num_draft_layers": 2, "block_size": 7, "mask_token_id": 511, "markov_rank": 16,
          "confidence_head_alpha": 1.0, "confidence_head_with_markov": True}
    return dv, tq, "small DSpark (128, 8 target / 2 draft layers, 8/2x32, vocab 512, tied, block 7, Markov 16)"


def _dspark_real(ctx: int = 2048, dtype: str = "bfloat16", target_layers: int | None = None) -> Case:
    return next(c for c in shapes.real_cases(ctx, 1, target_layers, 4, dtype) if c.name == REAL_DSPARK)


def _dspark_tau_max(gamma: int) -> int:
    """The drafts of a round + 1: the real case's block (7; the tiny twin's the same) + 1."""
    return _dspark_real().params.drafter[2]["block_size"] + 1


def _dspark_cases(taus: list[int], size: str, ctx: int, dtype: str, gamma: int = 4,
                  target_layers: int | None = None) -> list[Case]:
    """One DSpark case per requested tau: the bench's real DSpark case (REAL_DSPARK: Qwen3-4B,
    tied, 5 draft layers, block 7, Markov 256, its taps and stand-in depth), or its structure at
    tiny widths; block 7 whatever gamma."""
    if size == "real":
        base = _dspark_real(ctx, dtype, target_layers)
        dv, tq, label, notes = base.params.drafter[2], base.overrides, base.shapes.label, base.shapes.notes
    else:
        (dv, tq, label), notes = _dspark_tiny(), ()
    out = []
    for tau in taus:
        note = _note(tau, cycle_size(tau, tq["head_dim"]), f"target layer 0's MLP maps the cycle, taps "
                     f"{dv['target_layer_ids']}")
        ov = {**copy.deepcopy(dv), "agree_tau": tau}
        out.append(shapes.bench_case("real", f"dspark-agreeing-real-tau{tau}", "dspark", f"{label}, tau {tau}",
                                     ("dspark-drafter", ov), ("qwen3-target", copy.deepcopy(tq)), ctx,
                                     dv["block_size"], dtype, (*notes, note)))
    return out


def _lift_dspark(ckpt: shapes.Checkpoints, tau: int, seed: int) -> int:
    """Replace the tied Qwen3 target's and the DSpark drafter's weights that carry the stream
    (module docstring); K."""
    tc, dc = ckpt.target_config, ckpt.drafter_config
    t, d = ckpt.weights("target"), ckpt.weights("drafter")
    if not tc.get("tie_word_embeddings"):
        raise ValueError("agreeing-real builds DSpark on a tied target (the bench's Qwen3-4B)")
    dt = t["model.embed_tokens.weight"].dtype
    H, mask = tc["hidden_size"], dc["mask_token_id"]
    k = cycle_size(tau, dc["head_dim"])
    U, M = k, k + 1
    _slot_checks(dc, H, k, mask, 0)
    if tc["intermediate_size"] < k:
        raise ValueError("agreeing-real needs the tied target's intermediate >= head_dim")
    f, h = plan(tau, dc["block_size"] + 1, k, seed)
    # Target: the stream (the mask token's row e_U + e_M); layer 0's MLP adds TIED_WRITE e_code(f(c))
    # to E[c]; the head is E.
    _stream_target(t, tc, k, ([mask, mask], [U, M], [1.0, 1.0]))
    if "lm_head.weight" in t:
        t["lm_head.weight"] = t["model.embed_tokens.weight"]
    p = "model.layers.0."
    t[p + "post_attention_layernorm.weight"] = mx.ones((H,), dtype=dt)
    _map_mlp(t, p, k, f, math.sqrt(H / 2), TIED_GATE, TIED_WRITE / (TIED_GATE / (1 + math.exp(-TIED_GATE))))
    # x = e_c + e_U + TIED_WRITE e_f(c); logit of f(c) (row E[f(c)]) = w (TIED_WRITE + 1) / rms = TARGET_LOGIT.
    t["model.norm.weight"] = mx.full((H,), TARGET_LOGIT * math.sqrt((2 + TIED_WRITE ** 2) / H) / (TIED_WRITE + 1),
                                     dtype=dt)
    # Drafter: block row s drafts h^(s+1)(anchor) through the head row E[x] (code x); its own
    # embedding and head the target's; the Markov head adds 0, the confidence head stays random.
    _slot_heads(d, dc, H, 0, h, np.arange(k), dt)
    d["embed_tokens.weight"] = t["model.embed_tokens.weight"]
    d["lm_head.weight"] = t["model.embed_tokens.weight"]
    _zero(d, "markov_head.markov_w2.weight")
    return k


FAMILIES = {
    "dflash": Family(lambda gamma: BLOCK, _dflash_cases, _lift_dflash),
    "assistant": Family(lambda gamma: gamma + 1, _assistant_cases, _lift_assistant),
    "dspark": Family(_dspark_tau_max, _dspark_cases, _lift_dspark),
}

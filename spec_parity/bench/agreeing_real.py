"""The `agreeing-real` condition of `spec-parity bench --serve`: DFlash (block 16) on a Qwen3-8B
shaped target at its real widths, in bf16, with tau set by the weights and the same for every
loop that runs them.

The factory's agreeing DFlash (spec_parity/checkpoints/dflash.py) needs head_dim = hidden >=
vocab: one head must carry any token's identity. At real widths (head_dim 128, vocab 151936) the
stream is instead confined to K <= head_dim cycle tokens (ids 3 .. K + 2), each embedded on a
coordinate of its own:
  * target: E[c] = e_code(c) + e_U, the mask token's row e_U + e_M, every other row 0; every
    layer's o_proj and down_proj 0 (the layers run, at full cost, and write nothing), final norm
    weight 1, untied head row f(c) = g e_code(c): greedy decoding walks the cycle f whatever the
    context, with a logit TARGET_LOGIT against 0 for every other token.
  * drafter: layer 0 reads the anchor with one head per block slot, as the factory's agreeing
    DFlash does (content-free q / k on e_U, RoPE pairs from `_slot_weights`, score +SLOT_GAP at the
    slot's offset, <= -SLOT_GAP elsewhere); v_proj maps the K code coordinates onto the K head
    dims of every KV head, head k-1's o_proj writes the code of f^-1(h^k(anchor)), so slot k
    drafts h^k(anchor) through the target's head. fc is 0 (context keys and values exactly 0:
    the sink); every other write is 0.
  * h = f except on the "out" tokens at every tau-th cycle position, where h jumps to the
    successor of the next out token. From a run start a round accepts tau - 1 drafts and commits
    tau tokens, landing on the next run start: tau per round exactly, after at most one shorter
    first round. tau 1: every token is out (h = f o f, no draft ever accepted); tau = block: no
    token is out (every draft accepted). K is the largest multiple of tau <= head_dim.
Prompts are drawn from the cycle tokens (`prompt_vocab`), so every request stays on the cycle.
Every other weight is random (mx.random), so every matmul costs what the real model's does.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..case import Case
from ..checkpoints.agreeing import SPECIALS, TARGET_LOGIT
from ..drafters.dflash.checkpoints import SLOT_GAP, SLOT_WRITE
from . import shapes

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
BLOCK = 16
# Where the condition has no construction (yet): the sides of other sources are declined with this.
DECLINED = {"assistant": "no real-width agreeing construction for the Gemma-4 assistant (optiq) yet",
            "dspark": "no real-width agreeing construction for DSpark (dspark-mlx, DeepSpec) yet"}


def parse_taus(text: str, block: int = BLOCK) -> list[int]:
    """`--tau 2,4,max`: integers 1..block, `max` = block (every draft accepted)."""
    out = []
    for x in (s.strip() for s in text.split(",") if s.strip()):
        v = block if x == "max" else int(x) if x.isdigit() else 0
        if not 1 <= v <= block:
            raise ValueError(f"--tau {text!r}: {x!r} is not an integer in 1..{block} or 'max'")
        out.append(v)
    if not out:
        raise ValueError(f"--tau {text!r}: empty; give e.g. 2,4,max")
    return out


def cases(taus: list[int], size: str, ctx: int, dtype: str) -> list[Case]:
    """One DFlash case per requested tau."""
    tq, dv, label = SHAPES[size]
    taps = shapes.spread_taps(tq["num_hidden_layers"], 5)
    drafter = {"target_kind": "qwen3-target", "target_overrides": tq, "target_layer_ids": taps, "block_size": BLOCK,
               **dv}
    out = []
    for tau in taus:
        note = (f"tau {tau} by construction: stream on {cycle_size(tau, dv['head_dim'])} cycle tokens, "
                f"docs/bench.md; taps {taps}")
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


def cycle_size(tau: int, head_dim: int) -> int:
    """K: the largest multiple of tau the head dims carry (tau 1: an even K, h = f o f)."""
    return head_dim // 2 * 2 if tau == 1 else head_dim // tau * tau


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


def build(case: Case, root: Path) -> shapes.Checkpoints:
    """The case's random checkpoints at its shapes (bench/shapes.py `build`), then the weights
    that set tau replaced in memory."""
    kind, seed, ov = case.params.drafter
    ov = dict(ov)
    tau = ov.pop("agree_tau")
    plain = replace(case, params=replace(case.params, drafter=(kind, seed, ov)))
    ckpt = shapes.build(plain, root)
    k = _lift(ckpt, tau, case.seed)
    ckpt.case = case
    ckpt.prompt_vocab = SPECIALS + k
    return ckpt


def _zero(t: dict, name: str) -> None:
    t[name] = mx.zeros(t[name].shape, dtype=t[name].dtype)


def _rows(shape: tuple, dtype, rows: np.ndarray, values: np.ndarray) -> mx.array:
    """A zero matrix with `values` at the given rows (built on the device, not on the host)."""
    out = mx.zeros(shape, dtype=dtype)
    out[mx.array(rows)] = mx.array(values.astype(np.float32)).astype(dtype)
    return out


def _lift(ckpt: shapes.Checkpoints, tau: int, seed: int) -> int:
    """Replace the target's and drafter's weights that carry the stream (module docstring); K."""
    tc, dc = ckpt.target_config, ckpt.drafter_config
    t, d = ckpt.weights("target"), ckpt.weights("drafter")
    dt = t["model.embed_tokens.weight"].dtype
    H, V = tc["hidden_size"], tc["vocab_size"]
    hd, nh, nkv = dc["head_dim"], dc["num_attention_heads"], dc["num_key_value_heads"]
    bs, mask = dc["block_size"], dc["dflash_config"]["mask_token_id"]
    k = cycle_size(tau, hd)
    U, M = k, k + 1
    if nh < bs - 1 or M >= H or SPECIALS <= mask < SPECIALS + k or hd % 2:
        raise ValueError(f"agreeing-real needs heads >= block - 1, hidden > head_dim + 1 and a mask token "
                         f"outside ids {SPECIALS}..{SPECIALS + k - 1}")
    f, h = plan(tau, bs, k, seed)
    finv = np.argsort(f)
    ids = SPECIALS + np.arange(k)
    # Target: embedding rows, head rows, the layers' writes.
    emb = np.zeros((k + 1, H))
    emb[np.arange(k), np.arange(k)] = 1.0
    emb[:, U] = 1.0
    emb[k, M] = 1.0
    t["model.embed_tokens.weight"] = _rows((V, H), dt, np.r_[ids, mask], emb)
    g = TARGET_LOGIT / math.sqrt(H / 2)
    head = np.zeros((k, H))
    head[np.arange(k), np.arange(k)] = g
    t["lm_head.weight"] = _rows((V, H), dt, SPECIALS + f, head)    # row f(c) = g e_code(c)
    t["model.norm.weight"] = mx.ones((H,), dtype=dt)
    for i in range(tc["num_hidden_layers"]):
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            _zero(t, f"model.layers.{i}.{n}.weight")
    # Drafter layer 0: the slot heads (q / k on e_U as the factory's agreeing DFlash), v, o.
    ux = math.sqrt(H / 2)                                   # x_U after input_layernorm (weight 1)
    half = hd // 2
    thetas = float(dc["rope_theta"]) ** (-2 * np.arange(half) / hd)
    w, cmax, b = slot_weights(thetas[: half - 1], 2 * (bs - 1))
    amp = SLOT_GAP / ((1 - cmax) / 2)
    s_qk = math.sqrt(amp / math.sqrt(hd))
    norm_kq = math.sqrt(1 + b)
    key = np.r_[np.sqrt(w), math.sqrt(b), np.zeros(half)]
    q_rows = np.zeros((nh * hd, H), np.float32)
    for slot in range(1, nh + 1):
        offset = slot if slot < bs else 1                   # spare heads: offset 1, no write
        z = np.sqrt(w) * np.exp(-1j * offset * thetas[: half - 1])
        q_rows[(slot - 1) * hd:slot * hd, U] = np.r_[z.real, -math.sqrt(b), z.imag, 0.0] / (ux * norm_kq)
    k_rows = np.zeros((nkv * hd, H), np.float32)
    v_rows = np.zeros((nkv * hd, H), np.float32)
    for j in range(nkv):
        k_rows[j * hd:(j + 1) * hd, U] = key / (ux * norm_kq)
        v_rows[j * hd + np.arange(k), np.arange(k)] = 1.0 / ux     # v = e_code in the head dims
    o = np.zeros((H, nh * hd), np.float32)
    hk = np.arange(k)
    write = SLOT_WRITE * math.sqrt(2)                           # x |E|
    for slot in range(1, bs):
        hk = h[hk]
        o[finv[hk], (slot - 1) * hd + np.arange(k)] = write     # code of f^-1 h^slot (anchor)
    p0 = "layers.0.self_attn."
    for name, a in (("q_proj", q_rows), ("k_proj", k_rows), ("v_proj", v_rows), ("o_proj", o)):
        d[p0 + name + ".weight"] = mx.array(a).astype(dt)
    d[p0 + "q_norm.weight"] = mx.full((hd,), s_qk, dtype=dt)
    d[p0 + "k_norm.weight"] = mx.full((hd,), s_qk, dtype=dt)
    d["layers.0.input_layernorm.weight"] = mx.ones((H,), dtype=dt)
    d["norm.weight"] = mx.ones((H,), dtype=dt)
    _zero(d, "fc.weight")
    _zero(d, "layers.0.mlp.down_proj.weight")
    for i in range(1, dc["num_hidden_layers"]):
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            _zero(d, f"layers.{i}.{n}.weight")
    mx.eval(list(t.values()), list(d.values()))
    return k

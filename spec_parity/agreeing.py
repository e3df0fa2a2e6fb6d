"""Agreeing checkpoints: a Gemma-4 target whose greedy stream is known in advance and a Gemma-4
assistant drafter that agrees with it on a chosen part of the vocabulary. The Qwen3 target and
the DeepSpec DSpark drafter built the same way are described further down
("qwen3-target-agreeing", "dspark-drafter-agreeing").

Random drafters accept ~0% of their drafts, so only the correction path of a speculative loop
runs. These two kinds make every accepted length 0..γ happen, in the real on-disk format, with
numpy only (no training; building both takes well under a second).

Target ("gemma4-target-agreeing"). Greedy decoding walks a permutation f of the vocabulary: the
special ids 0, 1, 2 are fixed points and the other V-3 ids form one cycle, so EOS (1) never follows
a normal token. The embedding rows are, in a random orthonormal basis R,

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

Assistant ("gemma4-assistant-agreeing"). It proposes h(t) for the token t it is fed, with h = f
on a subset A of the cycle and h = f(rho(t)) off A (rho a cyclic shift of the non-A tokens, so h
is a permutation and h(t) != f(t) there). A draft is accepted exactly while the chain stays in A.
A is laid out along the cycle as runs of lengths 0, 3, 1, 4, 2 (interleaved with filler runs
near the mean) so every accepted length 0..4 and full accepts occur within any ~40 tokens.
The drafter is built from the same target embedding (recomputed from `target_seed`):
pre_projection's embedding half maps sqrt(H) E[t] to D_n^-1 phi(t), where phi(t) = R_d P_sel E0[t]
keeps 16 of the target's frequency planes (including m = 1) in a random drafter basis R_d, and
D_n is the drafter's final norm weight (undone); the hidden half is small. Its four layers write
x0.03 (post norms), so the final hidden is ~phi(t) whatever the donor K/V hold. The drafter's own
embedding (its head) has row E_d[h(t)] = sigma phi(t), so the head's argmax is h(t). Centroid
head: cluster c holds the 16 tokens y whose preimage h^-1(y) lies on the c-th arc of the cycle;
the centroids are a least-squares fit that scores the own arc and one neighbour arc high, so the
right cluster is always among the top 2 of 8, with a clear gap to the 3rd.

`agreement(seed, agree_frac, vocab_size)` gives f, h and A for tests that want the expected
acceptance.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import cache

import numpy as np

from .checkpoints import (
    DSPARK,
    KINDS,
    _merge,
    dspark_drafter,
    gemma4_assistant,
    gemma4_target,
    kind,
    qwen3_target,
)

SPECIALS = 3                 # ids 0 (pad), 1 (eos), 2 (bos): fixed points of f and h
ALPHA2 = 0.1                 # share of |E[x]|^2 on the constant direction u
EMBED_NORM = 4.0             # |E[x]|: the residual stream starts at rms EMBED_NORM
WRITE_SCALE = 0.1            # post-attention / post-feedforward norm weights x this
TARGET_LOGIT = 16.0          # ~ the successor's raw logit (before the softcap)
LAST_WRITE = (20.0, 60.0)    # the last layer's post-feedforward norm weight, uniform
GATE = (2.0, 3.0)            # the last MLP's (constant) gate pre-activations, uniform
DRAFT_RMS = 4.0              # rms of the drafter's residual after pre_projection
DRAFT_WRITE_SCALE = 0.03     # the drafter's post-attention / post-feedforward norm weights x this
DRAFT_ROW = 2.0              # |E_d[y]| of the drafter's head rows
HIDDEN_GAIN = 0.05           # gain of pre_projection's hidden half
CENTROID_SCORE = 2.0         # top centroid score / sqrt(D) for a final hidden of rms 1
LADDER = (0, 3, 1, 4, 2)     # run lengths of A laid along the cycle, repeated
LADDER_EVERY = 25            # about one ladder per this many cycle positions


def _stable(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Round float tensors to 1e-6 before the float32 cast. QR, lstsq and matmul may differ in the
    last float64 bit between BLAS builds; the grid makes the written bytes the same everywhere
    (a flip now needs that bit to straddle a 1e-6 boundary, ~1e-10 per value)."""
    return {k: np.round(v.astype(np.float64), 6).astype(np.float32) if v.dtype.kind == "f" else v
            for k, v in tensors.items()}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(("agreeing/" + name).encode())])


def _orthogonal(rng: np.random.Generator, n: int, m: int | None = None) -> np.ndarray:
    """n x m (default n x n) with orthonormal columns, sign-fixed so it is a function of rng."""
    q, r = np.linalg.qr(rng.standard_normal((n, m or n)))
    return q * np.sign(np.diag(r))


def _coherence(cos_table: np.ndarray, freqs) -> float:
    return float(cos_table[list(freqs)].mean(axis=0)[1:].max())


@cache
def frequencies(n: int, planes: int, pool: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """`planes` frequencies (always including 1) from `pool` (default 1..(n-1)//2) whose harmonic
    frame on n points has low max coherence max_{d!=0} mean_j cos(2pi m_j d/n). Deterministic
    (fixed search seed), independent of the checkpoint seed."""
    pool = tuple(pool or range(1, (n - 1) // 2 + 1))
    if planes > len(pool) or 1 not in pool:
        raise ValueError(f"cannot pick {planes} frequencies (with 1) from {len(pool)} "
                         f"on a cycle of {n}")
    if planes == len(pool):                  # the whole pool: nothing to choose
        return tuple(int(m) for m in sorted(pool))
    d = np.arange(n)
    table = {m: np.cos(2 * np.pi * m * d / n) for m in pool}
    cos = np.zeros((max(pool) + 1, n))
    for m, row in table.items():
        cos[m] = row
    rng = np.random.default_rng(20240601)
    others = [m for m in pool if m != 1]
    best, best_c = None, np.inf
    for _ in range(8):
        cur = [1] + list(rng.choice(others, planes - 1, replace=False))
        c = _coherence(cos, cur)
        improved = True
        while improved:                      # best single swap until none helps
            improved = False
            total = cos[cur].sum(axis=0)
            outside = [m for m in pool if m not in cur]
            for i in range(1, planes):
                trial = (total - cos[cur[i]])[None, :] + cos[outside]
                scores = trial[:, 1:].max(axis=1) / planes
                j = int(np.argmin(scores))
                if scores[j] < c - 1e-12:
                    cur[i], c, improved = outside[j], float(scores[j]), True
                    total = cos[cur].sum(axis=0)
                    outside = [m for m in pool if m not in cur]
        if c < best_c:
            best, best_c = sorted(cur), c
    return tuple(int(m) for m in best)


@dataclass
class Frame:
    """The agreeing target's token geometry (float64)."""
    f: np.ndarray          # [V] successor permutation
    order: np.ndarray      # [N] the cycle: f(order[k]) = order[k+1]
    index: np.ndarray      # [V] cycle index of each token (-1 for specials)
    freqs: tuple           # frequencies of the planes
    E0: np.ndarray         # [V, H] embedding rows in the frame basis
    R: np.ndarray          # [H, H] E = E0 @ R.T
    Q: np.ndarray          # [H, H] successor map in the frame basis: E0[f(x)] = Q E0[x]

    @property
    def E(self) -> np.ndarray:
        return self.E0 @ self.R.T

    @property
    def S(self) -> np.ndarray:
        return self.R @ self.Q @ self.R.T

    @property
    def u(self) -> np.ndarray:
        return self.R[:, SPECIALS]


def target_frame(seed: int, vocab_size: int, hidden_size: int) -> Frame:
    """Everything about the agreeing target that its drafter needs too: depends on (seed, V, H)."""
    V, H = vocab_size, hidden_size
    N, P = V - SPECIALS, (hidden_size - SPECIALS - 1) // 2
    if N < 3 or P < 2:
        raise ValueError(f"vocab {V} / hidden {H} too small for an agreeing target")
    freqs = frequencies(N, P)
    order = SPECIALS + _rng(seed, "cycle").permutation(N)
    f = np.arange(V)
    f[order] = np.roll(order, -1)
    index = np.full(V, -1)
    index[order] = np.arange(N)
    alpha, beta = EMBED_NORM * math.sqrt(ALPHA2), EMBED_NORM * math.sqrt(1 - ALPHA2)
    E0 = np.zeros((V, H))
    E0[:SPECIALS, :SPECIALS] = beta * np.eye(SPECIALS)
    E0[:, SPECIALS] = alpha
    Q = np.eye(H)
    angle = 2 * np.pi * np.outer(np.arange(N), freqs) / N            # [N, P]
    cols = SPECIALS + 1 + 2 * np.arange(P)
    E0[np.ix_(order, cols)] = beta * np.cos(angle) / math.sqrt(P)
    E0[np.ix_(order, cols + 1)] = beta * np.sin(angle) / math.sqrt(P)
    for j, m in enumerate(freqs):
        c, s = math.cos(2 * math.pi * m / N), math.sin(2 * math.pi * m / N)
        a, b = cols[j], cols[j] + 1
        Q[a, a], Q[a, b], Q[b, a], Q[b, b] = c, -s, s, c
    R = _orthogonal(_rng(seed, "basis"), H)
    return Frame(f, order, index, freqs, E0, R, Q)


def _runs(n: int, n_in: int, ladder: tuple[int, ...] = LADDER) -> list[int]:
    """Lengths of the runs of A between the n - n_in tokens outside it: ladders of `ladder`
    interleaved evenly with filler runs near the mean."""
    n_out = n - n_in
    if n_out == 0:
        return []
    L, ls = len(ladder), sum(ladder)
    fit = min(n_in // ls, n_out // L)
    if fit and n_in - fit * ls > 0 and n_out - fit * L == 0:
        fit -= 1                                    # leave a filler run for the remainder
    ladders = min(fit, max(1, math.ceil(n / LADDER_EVERY)))
    rest, tot = n_out - L * ladders, n_in - ls * ladders
    fill = [tot // rest + ((i + 1) * (tot % rest) // rest - i * (tot % rest) // rest)
            for i in range(rest)] if rest else []
    lad = list(ladder) * ladders
    runs, i, j = [], 0, 0
    while i < len(lad) or j < len(fill):
        if j >= len(fill) or (i < len(lad) and i * len(fill) <= j * len(lad)):
            runs.append(lad[i])
            i += 1
        else:
            runs.append(fill[j])
            j += 1
    assert sum(runs) == n_in and len(runs) == n_out
    return runs


@dataclass
class Agreement:
    f: np.ndarray          # [V] the target's successor
    h: np.ndarray          # [V] the drafter's proposal
    agree: np.ndarray      # [V] bool: h == f here (specials included)
    frame: Frame


def agreement(seed: int, agree_frac: float, vocab_size: int = 128,
              hidden_size: int = 64, ladder: tuple[int, ...] = LADDER) -> Agreement:
    """f, h and the agreeing set for the agreeing pair built with this (target) seed. `ladder`:
    the run lengths of A laid along the cycle (LADDER for the assistant; the DSpark drafter uses
    `dspark_ladder(block_size)`)."""
    fr = target_frame(seed, vocab_size, hidden_size)
    N = len(fr.order)
    if not 0.0 <= agree_frac <= 1.0:
        raise ValueError(f"agree_frac {agree_frac} is not in [0, 1]")
    n_in = round(agree_frac * N)
    if N - n_in == 1:
        raise ValueError(f"agree_frac {agree_frac} leaves one token outside the agreeing set; a "
                         "permutation cannot disagree on exactly one token")
    inside = np.ones(N, bool)
    pos = 0
    for r in _runs(N, n_in, tuple(ladder)):
        inside[pos] = False
        pos += 1 + r
    inside = np.roll(inside, int(_rng(seed, "agree-offset").integers(N)))
    agree = np.ones(vocab_size, bool)
    agree[fr.order] = inside
    h = fr.f.copy()
    out = fr.order[~inside]                          # cycle order
    h[out] = fr.f[np.roll(out, -1)]
    return Agreement(fr.f, h, agree, fr)


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


# ---------------------------------------------------------------------------------------------
# Qwen3 agreeing target and the DSpark drafter that agrees with either agreeing target.
#
# Qwen3 ("qwen3-target-agreeing"): the same token geometry as the Gemma-4 one (`target_frame`,
# so `agreement(seed, ...)` gives its f too), embeddings scaled to |E| = QWEN_EMBED_NORM, every
# residual write shrunk (o_proj and down_proj x WRITE_SCALE), so the last hidden is E[x] plus a
# small context-dependent residue. The head is untied: lm_head row f(x) = g E[x] / w_F (w_F the
# final norm weight, undone), so logit_y = g <E[f^-1(y)], E[x] + noise> sqrt(H)/|.|: the
# successor scores ~TARGET_LOGIT, every other token at most ALPHA2 + (1 - ALPHA2) x coherence of
# that. Everything else stays as "qwen3-target" draws it.
#
# DSpark ("dspark-drafter-agreeing"): the random "dspark-drafter" backbone (taps, fc, layers) on
# the agreeing target, with three heads set:
#  * base logits bounded: the final norm weight is scaled so |base logit| <= BASE_BOUND for any
#    hidden (|rmsnorm(x) * w| <= max|w| sqrt(H)); the lm head / embedding stay the target's.
#  * Markov head W1[t] = R_m [sqrt(beta) code_t ; MEMBER s_t ; 0], W2[j] = R_m [sqrt(beta)
#    code_{h^-1(j)} ; 0 ; 0], code_t a harmonic frame over the cycle index of t in the first
#    2P = 2 floor((r - 1) / 2) dims (low coherence mu), s_t = +1 on the agreeing set else -1,
#    R_m a random rotation. So the Markov bias of prev = t is beta <code_t, code_{h^-1(j)}>: h(t)
#    wins by beta (1 - mu) > 2 BASE_BOUND whatever the backbone does, and the draft chain at
#    T=0 is anchor -> h(anchor) -> h(h(anchor)) ... Gated head: gate ~ 1 (bias GATE_BIAS);
#    RNN head: output chunk a R_m P_code R_m^T W1 / sqrt(beta) through tanh (near-linear, a set
#    so |input| <= RNN_TANH), W2 scaled by 1/a; the state never reaches the bias.
#  * confidence sigmoid(w . [h_k ; W1[prev_k]]) with w reading the membership coordinate:
#    logit +-CONF_LOGIT (sigma ~0.95 / ~0.05) plus a random part bounded by 2 CONF_NOISE. So at a
#    threshold in (0.1, 0.9) the proposal stops at the first slot whose previous token leaves
#    the agreeing set: every proposed draft is accepted and empty proposals happen.
# The agreeing set is laid out as `dspark_ladder(block_size)` runs (0, bs, 1, bs - 1, ...) plus
# fillers, so every accepted length 0..bs occurs somewhere on the cycle. At threshold 0 every
# round ends one step after a token outside the set, so over a full cycle the acceptance is at
# most agree_frac / ((1 - agree_frac) bs) (0.21 for 0.6 and bs 7); agree_frac 1.0 gives h = f
# and tau = bs + 1.
# DeepSpec's DFlash variant (markov_rank 0) has no Markov head to carry h: not offered.

QWEN_EMBED_NORM = 8.0        # |E[x]| of the Qwen3 agreeing target (rms 1 per coordinate)
AGREE_MARKOV_RANK = 32       # the DSpark drafter's default markov_rank (DSPARK's 8 is too coherent)
MARKOV_BETA = 40.0           # Markov bias of the proposed token
MEMBER = 1.0                 # |membership coordinate| of W1
CONF_LOGIT = math.log(0.95 / 0.05)   # confidence logit on / off the agreeing set
CONF_NOISE = 0.25            # bound on each random part (hidden, code dims) of a confidence logit
BASE_BOUND = 3.0             # bound on |base logit| of the DSpark drafter
MARKOV_MARGIN = 4.0          # required Markov margin beyond 2 BASE_BOUND
GATE_BIAS = 12.0             # gated Markov head: gate pre-activation ~ this (gate ~ 1)
RNN_TANH = 0.35              # RNN Markov head: bound on |tanh input| of the output chunk
AGREEING_TARGETS = ("gemma4-target-agreeing", "qwen3-target-agreeing")


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


def dspark_ladder(block_size: int) -> tuple[int, ...]:
    """Run lengths 0..block_size, low and high alternating: (0, bs, 1, bs - 1, ...)."""
    lo, hi, out = 0, block_size, []
    while lo <= hi:
        out.append(lo)
        if hi != lo:
            out.append(hi)
        lo, hi = lo + 1, hi - 1
    return tuple(out)


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
    ov.setdefault("target_kind", AGREEING_TARGETS[0])
    ov.setdefault("markov_rank", AGREE_MARKOV_RANK)
    a = _merge(DSPARK, ov)
    if a["target_kind"] not in AGREEING_TARGETS:
        raise ValueError(f"dspark-drafter-agreeing needs an agreeing target_kind {AGREEING_TARGETS}, "
                         f"got {a['target_kind']!r}")
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


# ---------------------------------------------------------------------------------------------
# z-lab DFlash drafter that agrees with either agreeing target ("dflash-drafter-agreeing").
#
# The block is [anchor, MASK x (bs - 1)] and slot k (1..bs-1) must draft h^k(anchor). Layer 0
# does it with one attention head per slot offset (head k-1 reads the block row k back):
#  * content-free q / k: q_proj and k_proj read only the constant direction u of the target's
#    embedding, so after q_norm / k_norm every block row has the same key and head k-1 the same
#    query; their RoPE pairs are set so the score depends only on the offset d between query and
#    key, A (sum_i w_i cos((d - k) theta_i) - b): +SLOT_GAP at d = k, <= -SLOT_GAP elsewhere.
#  * the context (fc projected off u, hidden_norm uniform and small) has keys ~0 and values ~0:
#    a sink for the heads whose offset points before the block.
#  * v_proj keeps only the target's cycle subspace (the mask token is a special id: value 0);
#    head k-1's o_proj maps the anchor's cycle code c_a to SLOT_WRITE x the code of the token
#    whose target-head logit is h^k(a) (f^-1 h^k(a) for the untied Qwen3 head, h^k(a) for the
#    tied Gemma-4 one): a least-squares linear map on the cycle codes, exact when the codes'
#    only linear relation is sum_a c_a = 0 (hidden_size >= vocab_size), checked by its margin.
#  * every other write (layer 0's MLP, later layers) is scaled x DFLASH_WRITE_SCALE; the final
#    norm weight undoes the target's (Qwen3) or sets the logit scale (Gemma-4).
# h, f and the agreeing set come from `agreement(target_seed, agree_frac, V, H,
# dspark_ladder(block_size - 1))`: every accepted length 0..bs-1 occurs along the cycle.

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
    from .dflash_checkpoints import DFLASH, dflash_drafter

    a = _merge({**DFLASH, **DFLASH_AGREE}, overrides)
    agree_frac, target_seed = float(a.pop("agree_frac")), a.pop("target_seed")
    target_seed = seed if target_seed is None else int(target_seed)
    if a["target_kind"] not in AGREEING_TARGETS:
        raise ValueError(f"dflash-drafter-agreeing needs an agreeing target_kind {AGREEING_TARGETS}, "
                         f"got {a['target_kind']!r}")
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

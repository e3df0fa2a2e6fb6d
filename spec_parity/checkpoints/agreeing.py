"""What the agreeing kinds share: a target whose greedy stream is known in advance, and the set of
tokens on which a drafter agrees with it.

Random drafters accept ~0% of their drafts, so only the correction path of a speculative loop
runs. The agreeing kinds (each beside its random kind: "gemma4-target-agreeing" and
"qwen3-target-agreeing" in targets.py, "gemma4-assistant-agreeing" in assistant.py,
"dspark-drafter-agreeing" in dspark.py, "dflash-drafter-agreeing" in dflash.py) make every
accepted length happen, in the real on-disk format, with numpy only (no training; each builds in
well under a second).

The target's greedy decoding walks a permutation f of the vocabulary (`target_frame`: the specials
0, 1, 2 are fixed points, the other V-3 ids one cycle, embedded as a harmonic frame); a drafter
proposes h(t), with h = f on a subset A of the cycle laid out as runs of chosen lengths and a wrong
token off A (`agreement`). A draft is accepted exactly while the chain stays in A.

`agreement(seed, agree_frac, vocab_size)` gives f, h and A for tests that want the expected
acceptance.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from functools import cache

import numpy as np

SPECIALS = 3                 # ids 0 (pad), 1 (eos), 2 (bos): fixed points of f and h
ALPHA2 = 0.1                 # share of |E[x]|^2 on the constant direction u
EMBED_NORM = 4.0             # |E[x]|: the residual stream starts at rms EMBED_NORM
TARGET_LOGIT = 16.0          # ~ the successor's raw logit (before the softcap)
LADDER = (0, 3, 1, 4, 2)     # run lengths of A laid along the cycle, repeated
LADDER_EVERY = 25            # about one ladder per this many cycle positions
AGREEING_TARGETS = ("gemma4-target-agreeing", "qwen3-target-agreeing")


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


def target_kind(kind_name: str, drafter: str) -> str:
    """The target kind an agreeing drafter is built on: one of the agreeing targets."""
    if kind_name not in AGREEING_TARGETS:
        raise ValueError(f"{drafter} needs an agreeing target_kind {AGREEING_TARGETS}, got {kind_name!r}")
    return kind_name


def dspark_ladder(block_size: int) -> tuple[int, ...]:
    """Run lengths 0..block_size, low and high alternating: (0, bs, 1, bs - 1, ...)."""
    lo, hi, out = 0, block_size, []
    while lo <= hi:
        out.append(lo)
        if hi != lo:
            out.append(hi)
        lo, hi = lo + 1, hi - 1
    return tuple(out)

"""Confidence calibration and verification-length scheduling for confidence-head drafters (DSpark).

Pure math on plain numbers (no MLX, no model): a draft source or the serve loop calls these with
the confidences its head produced. No reference implementation exists (DeepSpec ships no
calibrator; STS and the scheduler are paper-only), so the proofs are property tests
(tests/test_calibration.py), each with a planted-bug control.

Three pieces:

* `fit_sts_thresholds`: per-position confidence thresholds fitted from verify outcomes, with the
  exact semantics of mlx-bun 0.0.11 `dspark/calibration.ts` (the reference-shaped consumer:
  DeepSpec truncates a block at the first position whose own sigmoid confidence is below a
  per-position threshold). `write_calibration` / `read_calibration` store it next to a
  checkpoint's config.json as `calibration.json`, whose `thresholds`/`target`/`samples` fields are
  the `StsCalibration` object the DFlash source reads as `cfg.sts`.
* `fit_sts_temperatures` / `apply_sts`: the paper's Sequential Temperature Scaling (DSpark §3.2.1):
  per-position temperatures on the head's logit, fitted left to right, each by a 1-D grid search
  minimizing the ECE of the cumulative survival product with the earlier positions' calibrated
  scores held fixed.
* `schedule_prefix`: the paper's Algorithm 1, the hardware-aware prefix scheduler: per-request
  verification lengths that maximize expected throughput tau * SPS(B) along the greedy admission
  path, with the early stop that keeps it non-anticipating (Appendix A).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

CALIBRATION_FILE = "calibration.json"
FORMAT = "spec-parity.sts-calibration/1"


# ------------------------------------------------------------------------------------------------
# Thresholds (seed semantics)


class ConfSample(NamedTuple):
    """One verify outcome: the head's confidence at draft position `pos` (0-based) and whether the
    target accepted that position (pos < the round's accepted count)."""

    pos: int
    conf: float
    accepted: bool


@dataclass(frozen=True)
class StsCalibration:
    """A threshold fit. `thresholds`, `target`, `samples` are the seed's StsCalibration (`samples`
    counts every sample given, dropped ones included, as the seed does); `samples_by_position`
    counts those kept at intake, so a head that emits NaN shows up there."""

    thresholds: list[float]
    target: float
    samples: int
    gamma: int
    min_samples: int
    samples_by_position: list[int]

    def to_json(self) -> dict:
        return {"thresholds": list(self.thresholds), "target": self.target, "samples": self.samples,
                "gamma": self.gamma, "min_samples": self.min_samples,
                "samples_by_position": list(self.samples_by_position)}


def _fields(s) -> tuple:
    if isinstance(s, Mapping):
        return s["pos"], s["conf"], s["accepted"]
    return s[0], s[1], s[2]


def _position(pos, gamma: int) -> int | None:
    """The slot of a sample's position, or None when it is out of range. An integral float counts
    as that integer (as in the seed, where a position is a JS number); any other non-integer is
    out of range."""
    if isinstance(pos, bool) or not isinstance(pos, numbers.Real):
        return None
    if isinstance(pos, numbers.Integral):
        p = int(pos)
    else:
        f = float(pos)
        if not math.isfinite(f) or f != math.floor(f):
            return None
        p = int(f)
    return p if 0 <= p < gamma else None


def laplace_precision(accepted: int, kept: int) -> float:
    """P(accepted | kept) with +1 accept / +2 total smoothing, so a candidate that keeps one or two
    samples cannot claim 100%."""
    return (accepted + 1) / (kept + 2)


def _smallest_clearing(confs: np.ndarray, accepted: np.ndarray, target: float) -> float | None:
    """The smallest observed confidence tau whose kept set {conf >= tau} has Laplace precision >=
    target, or None. Same result as the seed's scan over the ascending candidate list (a
    candidate's kept set is everything from its first occurrence on), in O(n log n)."""
    order = np.argsort(confs, kind="stable")
    c = confs[order]
    acc_suffix = np.cumsum(accepted[order][::-1])[::-1]
    n = len(c)
    for i in range(n):
        if i > 0 and c[i] == c[i - 1]:
            continue  # same candidate value, same kept set: already scored
        if laplace_precision(int(acc_suffix[i]), n - i) >= target:
            return float(c[i])
    return None


def fit_sts_thresholds(samples, gamma: int, target: float = 0.5, min_samples: int = 50) -> StsCalibration:
    """Per-position thresholds tau_k: at serve time position k is pruned when conf_k < tau_k.

    For each position the candidates are the observed confidences there, smallest first; a
    candidate's precision is the Laplace-smoothed acceptance (accepted+1)/(kept+2) over the samples
    it keeps (conf >= tau). Rules, in order:

    1. position 0 -> 0 (the scheduler never prunes the first draft);
    2. fewer than `min_samples` samples at the position -> 0 (no evidence, no pruning);
    3. no candidate reaches `target` -> 1.0 (prune the position always);
    4. else the smallest candidate that reaches it.

    `samples`: ConfSample / (pos, conf, accepted) tuples / {"pos","conf","accepted"} mappings. At
    intake a sample whose confidence is not a finite number, or a position outside 0..gamma-1, is dropped.
    -0.0 is read as 0.0. The result depends only on the multiset of kept samples per position:
    deterministic and independent of sample order.
    """
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral) or gamma < 1:
        raise ValueError(f"gamma must be a positive integer, got {gamma!r}")
    samples = list(samples)
    by_pos: list[list[tuple[float, bool]]] = [[] for _ in range(gamma)]
    for s in samples:
        pos, conf, accepted = _fields(s)
        k = _position(pos, gamma)
        if k is None or isinstance(conf, bool) or not isinstance(conf, numbers.Real):
            continue  # like the seed's Number.isFinite: no coercion of non-numbers
        c = float(conf)
        if not math.isfinite(c):
            continue
        by_pos[k].append((c + 0.0, bool(accepted)))  # + 0.0 turns -0.0 into 0.0

    thresholds = [0.0] * gamma
    for k in range(1, gamma):
        pos_samples = by_pos[k]
        if len(pos_samples) < min_samples:
            continue  # rule 2
        confs = np.array([c for c, _ in pos_samples], dtype=np.float64)
        acc = np.array([a for _, a in pos_samples], dtype=np.int64)
        chosen = _smallest_clearing(confs, acc, target)
        thresholds[k] = 1.0 if chosen is None else chosen  # rule 3 / rule 4
    thresholds[0] = 0.0  # rule 1
    return StsCalibration(thresholds, float(target), len(samples), int(gamma), int(min_samples),
                          [len(p) for p in by_pos])


def write_calibration(checkpoint: str | Path, calibration: StsCalibration,
                      temperatures: Sequence[float] | None = None) -> Path:
    """Write `calibration.json` next to the checkpoint's config.json, atomically (temp file in the
    same folder, fsync, os.replace): a reader sees the old file or the new one, never half.

    Fields: format, gamma, target, min_samples, samples (all given), samples_by_position (kept),
    thresholds (per position), and `temperatures` (STS, per position) when given."""
    folder = Path(checkpoint)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; not a checkpoint directory")
    if temperatures is not None and len(temperatures) != calibration.gamma:
        raise ValueError(f"{len(temperatures)} temperatures for gamma {calibration.gamma}")
    doc = {"format": FORMAT, **calibration.to_json()}
    if temperatures is not None:
        doc["temperatures"] = [float(t) for t in temperatures]
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / CALIBRATION_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder / CALIBRATION_FILE


def load_calibration(checkpoint: str | Path) -> dict | None:
    """The whole calibration.json of a checkpoint (validated), or None if it has none."""
    path = Path(checkpoint) / CALIBRATION_FILE
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
    th = doc.get("thresholds")
    if (not isinstance(th, list) or len(th) != doc.get("gamma")
            or not all(isinstance(t, (int, float)) and math.isfinite(t) for t in th)):
        raise ValueError(f"{path}: thresholds must be {doc.get('gamma')} finite numbers, got {th!r}")
    return doc


def read_calibration(checkpoint: str | Path) -> list[float] | None:
    """The per-position thresholds stored with a checkpoint, or None (uncalibrated: draft the
    fixed length)."""
    doc = load_calibration(checkpoint)
    return None if doc is None else [float(t) for t in doc["thresholds"]]


# ------------------------------------------------------------------------------------------------
# Sequential Temperature Scaling (paper §3.2.1)

# 2**(i/20) for i in -80..80: 1/16 .. 16, geometric, with 1.0 exactly at the centre.
# The extension's thresholds: where the DFlash source finds them

THRESHOLDS_ENV = "SPEC_PARITY_STS_THRESHOLDS"


class ThresholdError(ValueError):
    pass


def parse_thresholds(text: str, what: str = THRESHOLDS_ENV) -> list[float]:
    try:
        th = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ThresholdError(f"{what}={text!r}: expected comma-separated floats ({e})") from None
    if not th or not all(math.isfinite(t) for t in th):
        raise ThresholdError(f"{what}={text!r}: expected one or more finite comma-separated floats")
    return th


def resolve_thresholds(path: str | Path, thresholds=None) -> tuple[list[float] | None, str | None]:
    """The extension's thresholds and where they came from: the argument, else the env var, else
    the checkpoint's calibration.json, else (None, None): no pruning. An explicit [] means none."""
    if thresholds is not None:
        th = [float(t) for t in thresholds]
        if not all(math.isfinite(t) for t in th):
            raise ThresholdError(f"thresholds {thresholds!r}: expected finite numbers")
        return (th or None), "argument"
    env = os.environ.get(THRESHOLDS_ENV)
    if env is not None and env.strip():
        return parse_thresholds(env), "env"
    th = read_calibration(path)
    return (th, "calibration") if th is not None else (None, None)


DEFAULT_GRID = tuple(float(2.0 ** (i / 20)) for i in range(-80, 81))
ECE_TIE = 1e-12  # ECE differences below this are ties in the grid search


def _logit(c: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(c) - np.log1p(-c)  # 0 -> -inf, 1 -> +inf


def _sigmoid(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


def _check_confidences(c: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(c)) or np.any(c < 0) or np.any(c > 1):
        raise ValueError(f"{what}: confidences must be finite and in [0, 1]")


def apply_sts(confidences, temperatures: Sequence[float]) -> np.ndarray:
    """Calibrated confidences: sigma(logit(c_k) / T_k) for position k (the last axis). With T_k > 0
    this is order-preserving within each position (the head's ranking is kept); 0 and 1 stay put.
    Positions beyond len(temperatures) are an error."""
    c = np.asarray(confidences, dtype=np.float64)
    t = np.asarray(temperatures, dtype=np.float64)
    _check_confidences(c, "apply_sts")
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("apply_sts: temperatures must be finite and > 0")
    n = c.shape[-1] if c.ndim else 0
    if n > len(t):
        raise ValueError(f"apply_sts: {n} positions but only {len(t)} temperatures")
    return _sigmoid(_logit(c) / t[:n])


def survival(confidences) -> np.ndarray:
    """Prefix survival probabilities a_j = prod_{i<=j} c_i along the last axis."""
    return np.cumprod(np.asarray(confidences, dtype=np.float64), axis=-1)


def ece(pred, labels, n_bins: int = 10) -> float:
    """Expected calibration error: equal-width bins over [0, 1] (1.0 in the last bin),
    sum_b (n_b / N) |mean(label)_b - mean(pred)_b|. 0 for no samples."""
    return float(_ece_rows(np.asarray(pred, dtype=np.float64)[None, :], np.asarray(labels), n_bins)[0])


def _ece_rows(pred: np.ndarray, labels: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each row of pred [G, N] against the same labels [N], in one pass."""
    g, n = pred.shape
    if n == 0:
        return np.zeros(g)
    bins = np.minimum((pred * n_bins).astype(np.int64), n_bins - 1)
    idx = (np.arange(g)[:, None] * n_bins + bins).ravel()
    sum_p = np.bincount(idx, weights=pred.ravel(), minlength=g * n_bins)
    sum_y = np.bincount(idx, weights=np.broadcast_to(labels.astype(np.float64), pred.shape).ravel(),
                        minlength=g * n_bins)
    return np.abs(sum_y - sum_p).reshape(g, n_bins).sum(axis=1) / n


def _blocks(blocks) -> list[tuple[np.ndarray, int]]:
    out = []
    for confs, accepted in blocks:
        c = np.asarray(confs, dtype=np.float64).reshape(-1)
        _check_confidences(c, "STS block")
        a = int(accepted)
        if not 0 <= a <= len(c):
            raise ValueError(f"STS block: accepted {a} outside 0..{len(c)}")
        out.append((c, a))
    return out


def _position_rows(blocks: list, k: int):
    """Rows for position k (0-based): the blocks that drafted it, their confidences up to k, and
    the survival label (the prefix up to k was accepted)."""
    rows = [(c[: k + 1], a) for c, a in blocks if len(c) > k]
    conf = np.array([c for c, _ in rows]).reshape(len(rows), k + 1)
    labels = np.array([a > k for _, a in rows], dtype=np.float64)
    return conf, labels


def sts_ece_by_position(blocks, temperatures: Sequence[float], n_bins: int = 10) -> list[float]:
    """ECE of the cumulative survival product at each position, with `temperatures` applied."""
    blocks = _blocks(blocks)
    out = []
    for k in range(len(temperatures)):
        conf, labels = _position_rows(blocks, k)
        pred = survival(apply_sts(conf, temperatures[: k + 1]))[:, k] if len(conf) else np.zeros(0)
        out.append(ece(pred, labels, n_bins))
    return out


def fit_sts_temperatures(blocks, gamma: int | None = None, grid: Sequence[float] = DEFAULT_GRID,
                         n_bins: int = 10) -> list[float]:
    """Sequential Temperature Scaling: one temperature per draft position, fitted left to right.

    `blocks`: held-out verify rounds, each (confidences c_1..c_n of the drafted positions,
    accepted count a). Position k's label is "the prefix 1..k survived" (a >= k); its prediction
    is the cumulative product of calibrated confidences prod_{i<=k} sigma(logit(c_i)/T_i). For
    k = 1..gamma, T_k is the grid value minimizing that product's ECE with T_1..T_{k-1} already
    fixed. 1.0 is always a candidate, and ECEs within ECE_TIE of the minimum are ties, won by the
    temperature nearest 1 (then the smaller): a position is only rescaled when that lowers its
    ECE by more than float noise. So at every position the fitted ECE is <= the ECE with T_k = 1
    under the fitted predecessors (+ ECE_TIE); at position 1 that is the raw ECE. (Not at later
    positions: once T_1 moved, no T_k need reach the raw product's ECE; tests show a case.)
    A position no block reached keeps T = 1.
    """
    blocks = _blocks(blocks)
    gamma = max((len(c) for c, _ in blocks), default=0) if gamma is None else int(gamma)
    temps = np.array(sorted(set(float(t) for t in grid) | {1.0}))
    if np.any(~np.isfinite(temps)) or np.any(temps <= 0):
        raise ValueError("fit_sts_temperatures: grid temperatures must be finite and > 0")
    # candidates in tie-break order: nearest to 1 in log space, then smaller
    order = sorted(range(len(temps)), key=lambda i: (abs(math.log(temps[i])), temps[i]))
    temps = temps[order]
    fitted: list[float] = []
    for k in range(gamma):
        conf, labels = _position_rows(blocks, k)
        if len(conf) == 0:
            fitted.append(1.0)
            continue
        prefix = survival(apply_sts(conf[:, :k], fitted))[:, -1] if k else np.ones(len(conf))
        z = _logit(conf[:, k])
        pred = prefix[None, :] * _sigmoid(z[None, :] / temps[:, None])  # [G, N]
        errs = _ece_rows(pred, labels, n_bins)
        # the first grid value (tie-break order) within ECE_TIE of the minimum: a rescale must buy
        # more than float noise (e.g. a symmetric pair moving toward 0.5 "improves" by 1e-17)
        best = int(np.flatnonzero(errs <= errs.min() + ECE_TIE)[0])
        fitted.append(float(temps[best]))
    return fitted


# ------------------------------------------------------------------------------------------------
# Algorithm 1: hardware-aware prefix scheduler (paper §3.2.2)

SPS = Mapping[int, float] | Callable[[int], float]


def _sps(table: SPS, batch: int) -> float:
    try:
        v = table(batch) if callable(table) else table[batch]
    except (KeyError, IndexError):
        raise ValueError(f"SPS table has no entry for batch size {batch}") from None
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"SPS({batch}) = {v}: must be finite and >= 0")
    return v


def _survivals(confidences) -> list[list[float]]:
    out = []
    for r, conf in enumerate(confidences):
        c = [float(x) for x in conf]
        if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in c):
            raise ValueError(f"request {r}: confidences must be finite and in [0, 1]")
        a, acc = [], 1.0
        for x in c:
            acc *= x
            a.append(acc)
        out.append(a)
    return out


@dataclass(frozen=True)
class Schedule:
    """Algorithm 1's answer. `lengths[r]` = l*_r (verify the first l*_r drafts of request r);
    `throughput` = Theta_best = expected_tokens * SPS(batch); `evaluated` = how many candidates
    of the sorted pool were looked at (the one that triggered the early stop included)."""

    lengths: tuple[int, ...]
    throughput: float
    batch: int
    expected_tokens: float
    evaluated: int


def schedule_prefix(confidences: Sequence[Sequence[float]], sps: SPS) -> Schedule:
    """Algorithm 1 (Hardware-Aware Prefix Scheduler).

    `confidences[r]` = c_{r,1..gamma_r}, request r's per-position (calibrated) confidences, each in
    [0, 1] (requests may draft different lengths); `sps` = the profiled step curve, SPS(B) in steps
    per second for a verify batch of B tokens, as a mapping or a callable.

    a_{r,j} = prod_{i<=j} c_{r,i}. The candidates (r, j) with a_{r,j} > 0 are sorted by a_{r,j}
    descending (ties: request, then position, so a request's positions stay in order). Starting
    from no drafts (B = R, tau = R, Theta_best = R * SPS(R)) each candidate in turn sets l_r = j,
    B += 1, tau += a_{r,j}; Theta = tau * SPS(B). A strict improvement is recorded; the first
    Theta <= Theta_best stops the scan (early stop: the admission of a token never depends on
    candidates after the stop, which is what keeps the schedule non-anticipating, Appendix A).
    Because a_{r,j} is non-increasing in j, every admitted set is a per-request prefix.
    """
    surv = _survivals(confidences)
    R = len(surv)
    if R == 0:
        return Schedule((), 0.0, 0, 0.0, 0)
    pool = sorted((-a, r, j) for r, seq in enumerate(surv) for j, a in enumerate(seq, start=1) if a > 0)
    lengths = [0] * R
    batch, tau = R, float(R)
    best = (tau * _sps(sps, batch), tuple(lengths), batch, tau)
    evaluated = 0
    for neg_a, r, j in pool:
        evaluated += 1
        lengths[r] = j
        batch += 1
        tau += -neg_a
        theta = tau * _sps(sps, batch)
        if theta > best[0]:
            best = (theta, tuple(lengths), batch, tau)
        else:
            break
    theta, chosen, b, t = best
    return Schedule(chosen, theta, b, t, evaluated)


def throughput(confidences: Sequence[Sequence[float]], lengths: Sequence[int], sps: SPS) -> float:
    """Expected throughput Theta = tau * SPS(B) of verifying the first lengths[r] drafts of each
    request: B = sum_r (1 + l_r), tau = sum_r (1 + sum_{j<=l_r} a_{r,j})."""
    surv = _survivals(confidences)
    if len(lengths) != len(surv):
        raise ValueError(f"{len(lengths)} lengths for {len(surv)} requests")
    tau, batch = 0.0, 0
    for a, n in zip(surv, lengths):
        if not 0 <= n <= len(a):
            raise ValueError(f"length {n} outside 0..{len(a)}")
        tau += 1.0 + math.fsum(a[:n])
        batch += 1 + n
    return tau * _sps(sps, batch) if surv else 0.0

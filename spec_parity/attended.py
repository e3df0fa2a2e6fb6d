"""Rows compared as the next query attends them, not as a side stores them.

A sliding layer keeps its context K/V as its implementation likes: mlx-lm's ring buffer (z-lab
MLX; out of position order after a one-row update on a full ring), the newest W-1 rows in time
order (z-lab torch's DynamicSlidingWindowLayer), or every row, masked by position (dflash-mlx).
What its next query sees is one thing: the rows at the newest W-1 positions, in position order.
So each side's rows are put in position order (by the side's own positions array, or by the
layout a pair knows for a reference that has none) and cut to the newest `keep`; then the
positions must be equal, and the rows are held to the case's tier. A window one row off (the
newest row missing, an older one kept) fails on its positions before its values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compare import check_tensor


@dataclass(frozen=True)
class Rows:
    """One side's rows, on axis -2 of `src` ([S, T] taps, [heads, S, d] K/V). Each row's absolute
    position: the side's array `pos` where it has one, else `known` (a reference's layout, from
    its pair), else the rows are in position order, the newest at the other side's newest."""

    src: object                      # checks.Src
    pos: str | None = None
    known: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Window:
    """Rows as attended (see the module docstring): `keep` the newest (a sliding layer's W-1),
    None for every row (a full layer, in position order)."""

    name: str
    port: Rows
    ref: Rows
    quantity: str
    keep: int | None = None
    finding: str = "module"


def _positions(rows: Rows, sides: dict) -> np.ndarray | None:
    arrays = sides[rows.src.side]
    if rows.pos is not None and rows.pos in arrays:
        return np.ravel(arrays[rows.pos]).astype(np.int64)
    return np.asarray(rows.known, np.int64) if rows.known is not None else None


def view(a: np.ndarray, pos: np.ndarray | None, keep: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(rows in position order, the newest `keep`; their positions or None)."""
    order = np.argsort(pos, kind="stable") if pos is not None else np.arange(a.shape[-2])
    order = order[-keep:] if keep else order
    return np.take(a, order, axis=-2), None if pos is None else pos[order]


def judge(c: Window, sides, module, dtype, result) -> None:
    got = [(r.src.get(sides), _positions(r, sides), r.src.label) for r in (c.port, c.ref)]
    if any(a is None for a, _, _ in got):
        return result.missing(c, "missing")
    bad = [label for a, pos, label in got if pos is not None and len(pos) != a.shape[-2]]
    if bad:
        return result.missing(c, f"{bad[0]}'s positions do not number its rows")
    (p, pp), (r, rp) = (view(a, pos, c.keep) for a, pos, _ in got)
    if pp is None and rp is not None and len(rp):
        pp = rp[-1] - p.shape[-2] + 1 + np.arange(p.shape[-2])
    elif rp is None and pp is not None and len(pp):
        rp = pp[-1] - r.shape[-2] + 1 + np.arange(r.shape[-2])
    if pp is not None and not np.array_equal(pp, rp):
        result.metrics[c.name] = {"ok": False, "port_positions": pp.tolist(), "ref_positions": rp.tolist()}
        return result.fail(f"{c.name}: attends positions {pp.tolist()} vs the reference's {rp.tolist()}", c.finding)
    if p.shape != r.shape:
        return result.missing(c, f"shape {list(p.shape)} vs {list(r.shape)} as attended")
    check_tensor(result, c.name, p, r, module, c.quantity, dtype, c.finding)

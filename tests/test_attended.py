"""Context K/V compared as attended (spec_parity.attended): one window in three layouts (mlx-lm's
ring out of time order, the newest W-1 rows in time order, every row kept) compares equal; a
window one row off, or a NaN in it, fails. Planted in the port: tests/test_dflash.py."""

import numpy as np
import pytest

from spec_parity import checks
from spec_parity.attended import Rows, Window
from spec_parity.compare import Result

N, W = 30, 10                                     # 30 context rows, window 10: 9 rows attended
ROWS = np.random.default_rng(0).standard_normal((2, N, 4)).astype(np.float32)   # [heads, position, d]


def _judge(port: dict, ref: dict, known=None, keep=W - 1) -> Result:
    result = Result("dflash", "t", "ref", "L1")
    check = Window("ctx_k.0", Rows(checks.P("ctx_k.0"), "ctx_pos.0"), Rows(checks.R("ctx_k.0"), "ctx_pos.0", known),
                   "context_kv", keep)
    checks.judge(checks.Plan([check]), {"port": port, "ref": ref, "greedy": {}}, "dflash", "float32", result)
    return result


def _side(positions, key="ctx_k.0", pos=True) -> dict:
    out = {key: ROWS[:, positions]}
    if pos:
        out["ctx_pos.0"] = np.array(positions, np.int32)
    return out


RING = [29] + list(range(21, 29))                 # after a one-row update on a full ring


@pytest.mark.parametrize("port", [_side(RING), _side(list(range(N))), _side(list(range(21, 30)), pos=False),
                                  _side(list(range(N))[::-1])], ids=["ring", "every-row", "in-order", "reversed"])
def test_one_window_in_any_layout_is_equal(port):
    assert _judge(port, _side(RING)).ok
    assert _judge(port, _side(RING, pos=False), known=tuple(RING)).ok   # a golden: positions from its pair


@pytest.mark.parametrize("positions,what", [(list(range(20, 29)), "attends positions"),
                                            (list(range(22, 30)), "attends positions"),
                                            (RING[1:] + [29, 29], "attends positions")],
                         ids=["one-row-late", "one-row-short", "duplicate-row"])
def test_a_window_one_row_off_fails_on_its_positions(positions, what):
    r = _judge(_side(positions), _side(RING))
    assert not r.ok and what in r.reason, r.reason


def test_the_stored_layout_alone_is_not_the_window():
    """The ring's rows read in stored order against the same rows in time order: the old
    storage-layout comparison would fail it; as attended it passes, and a wrong position fails."""
    ring = _side(RING, pos=False)
    assert not np.array_equal(ring["ctx_k.0"], ROWS[:, 21:30])
    assert _judge(_side(list(range(21, 30))), ring, known=tuple(RING)).ok
    assert not _judge(_side(list(range(21, 30))), ring, known=tuple(range(21, 30))).ok


def test_a_nan_in_the_window_fails_and_one_outside_it_does_not():
    bad = _side(list(range(N)))
    bad["ctx_k.0"] = bad["ctx_k.0"].copy()
    bad["ctx_k.0"][0, 0] = np.nan                 # position 0: never attended
    assert _judge(bad, _side(RING)).ok
    bad["ctx_k.0"][0, 25] = np.nan
    assert not _judge(bad, _side(RING)).ok


def test_positions_that_do_not_number_the_rows_fail():
    port = _side(RING)
    port["ctx_pos.0"] = port["ctx_pos.0"][:-1]
    assert "do not number its rows" in _judge(port, _side(RING)).reason

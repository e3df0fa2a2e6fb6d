"""tools/serve_kernels.py's round: two request lengths' kernel profiles, their difference over their
rounds' (the prefill and what every request pays once cancel). Its profiles need CUDA; the
arithmetic is held here on summaries made up to a known round."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("serve_kernels_tool", ROOT / "tools" / "serve_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def summary(rounds: int, once: float = 5000.0) -> dict:
    """A request of `rounds` rounds of 100 launches / 700 us busy each (attention 20 of them, 300 us),
    after a prefill of 40 launches and `once` us."""
    return {"status": "ok", "launches_per_call": 40 + 100 * rounds, "kernel_us_per_call": once + 900 * rounds,
            "busy_us_per_call": once + 700 * rounds, "window_us_per_call": 2 * once + 2000 * rounds,
            "classes": [{"class": "attention", "launches_per_call": 20 * rounds, "us_per_call": 300 * rounds},
                        {"class": "matmul", "launches_per_call": 40 + 80 * rounds, "us_per_call": once + 600 * rounds}]}


def test_a_round_is_the_difference_over_the_rounds():
    line = load().per_round((summary(15), 15.0), (summary(31), 31.0))
    assert "100 launches, kernels 900 us, busy 700 us, window 2000 us" in line
    assert "attention 20x 300us, matmul 80x 600us" in line


def test_a_per_request_division_would_be_caught():
    """Control: the long request alone over its rounds (the prefill counted in) is not the round."""
    s = summary(31)
    assert f"{s['launches_per_call'] / 31:.0f} launches" not in load().per_round((summary(15), 15.0), (s, 31.0))

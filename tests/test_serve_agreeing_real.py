"""The agreeing-real condition of `bench --serve` sets tau by construction: at small widths, the
tau each loop measures is the one asked for, within TOLERANCE, and a drafter broken from outside
(its slot writes zeroed) falls to tau 1, so the check can fail."""

import importlib.util
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from spec_parity.bench import agreeing_real, loop_sides, loops

TOLERANCE = 0.1   # measured tau in [(1 - TOLERANCE) tau, tau]: one shorter first round, one cut last
ENV = SimpleNamespace(torch_device=None, torch_reason="not used")


def _tau_of_plan(f: np.ndarray, h: np.ndarray, block: int, start: int, n: int) -> float:
    """Tokens per round of greedy speculative decoding on (f, h) from `start`, n tokens."""
    tok, made, rounds = start, 0, 0
    while made < n:
        drafts, x = [], tok
        for _ in range(block - 1):
            x = h[x]
            drafts.append(x)
        acc, x = 0, tok
        while acc < len(drafts) and drafts[acc] == f[x]:
            x, acc = f[x], acc + 1
        step = min(acc + 1, n - made)
        for _ in range(step):
            tok = f[tok]
        made, rounds = made + step, rounds + 1
    return made / rounds


@pytest.mark.parametrize("tau", [1, 2, 3, 4, 7, 16])
def test_plan_gives_tau(tau):
    """From every start on the cycle, the rounds commit tau tokens (after a first shorter one)."""
    k = agreeing_real.cycle_size(tau, 32)
    f, h = agreeing_real.plan(tau, 16, k, 0)
    assert sorted(f) == list(range(k)) and sorted(h) == list(range(k))
    for start in range(k):
        got = _tau_of_plan(f, h, 16, start, 10 * tau * 16)
        assert (1 - TOLERANCE) * tau <= got <= tau, (start, got)
    if tau == 1:
        assert not np.any(h == f)


def test_parse_taus_refuses():
    assert agreeing_real.parse_taus("2,4,max") == [2, 4, 16]
    for bad in ("0", "17", "two", ""):
        with pytest.raises(ValueError, match="--tau"):
            agreeing_real.parse_taus(bad)


def _measure(case, tmp_path, side: str, corrupt: bool = False) -> tuple[float, list[int], list[int]]:
    ckpt = agreeing_real.build(case, tmp_path)
    if corrupt:   # from outside the construction: the slot heads write nothing
        d = ckpt.weights("drafter")
        d["layers.0.self_attn.o_proj.weight"] = mx.zeros_like(d["layers.0.self_attn.o_proj.weight"])
    opts = loops.Options(prompt_len=64, new_tokens=48, runs=2)
    check, _, _ = loops.prompt_plan(opts, 1, ckpt.prompt_vocab, 0)
    plain = loop_sides.SIDES["plain"].build(ckpt, ENV).generate(check, opts.new_tokens)
    run = loop_sides.SIDES[side].build(ckpt, ENV).generate(check, opts.new_tokens)
    return run.decode_tokens / run.rounds, run.tokens, plain.tokens


SIDES = ["port"] + (["zlab-mlx"] if importlib.util.find_spec("dflash") else [])


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("tau", [1, 4, 16])
def test_loop_measures_tau(tmp_path, side, tau):
    case = agreeing_real.cases("dflash", [tau], "tiny", 64, "float32")[0]
    got, tokens, plain = _measure(case, tmp_path, side)
    assert tokens == plain
    assert (1 - TOLERANCE) * tau <= got <= tau + 1e-9, got


def test_broken_drafter_falls_to_tau_1(tmp_path):
    """The negative control: the tau-16 weights with layer 0's slot writes zeroed."""
    case = agreeing_real.cases("dflash", [16], "tiny", 64, "float32")[0]
    got, tokens, plain = _measure(case, tmp_path, "port", corrupt=True)
    assert tokens == plain
    assert got < 1.2, got


def test_bf16_keeps_tau(tmp_path):
    """The device runs bf16: the construction's margins hold there too."""
    case = agreeing_real.cases("dflash", [4], "tiny", 64, "bfloat16")[0]
    got, tokens, plain = _measure(case, tmp_path, "port")
    assert tokens == plain
    assert (1 - TOLERANCE) * 4 <= got <= 4, got


def test_slot_weights_reach_the_lp():
    """The numpy solver comes within 0.02 of the factory's LP optimum (scipy), at both widths."""
    pytest.importorskip("scipy")
    from spec_parity.drafters.dflash.checkpoints import _slot_weights

    for hd in (128, 32):
        thetas = 1e6 ** (-2 * np.arange(hd // 2) / hd)[: hd // 2 - 1]
        w, c, _ = agreeing_real.slot_weights(thetas, 30)
        assert abs(w.sum() - 1) < 1e-9 and (w >= 0).all()
        assert c <= _slot_weights(thetas, 30)[1] + 0.02

"""The agreeing-real condition of `bench --serve` sets tau by construction, for DFlash, the Gemma-4
assistant and DSpark: at small widths, the tau each loop measures (ours and the peer's own) is the one
asked for, within TOLERANCE, its stream is plain decode's, and a drafter broken from outside (the
weights that carry its proposals zeroed) falls to tau 1, so the check can fail."""

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


@pytest.mark.parametrize("block,tau", [(16, t) for t in (1, 2, 3, 4, 7, 16)] + [(5, t) for t in (1, 2, 3, 4, 5)]
                         + [(8, t) for t in (1, 2, 3, 4, 7, 8)])
def test_plan_gives_tau(block, tau):
    """From every start on the cycle, the rounds commit tau tokens (after a first shorter one):
    DFlash's block 16, the assistant's gamma 4 (a round commits at most 5), DSpark's 7 drafts (8)."""
    k = agreeing_real.cycle_size(tau, 32)
    f, h = agreeing_real.plan(tau, block, k, 0)
    assert sorted(f) == list(range(k)) and sorted(h) == list(range(k))
    for start in range(k):
        got = _tau_of_plan(f, h, block, start, 10 * tau * block)
        assert (1 - TOLERANCE) * tau <= got <= tau, (start, got)
    if tau == 1:
        assert not np.any(h == f)


def test_parse_taus_refuses():
    assert agreeing_real.parse_taus("2,4,max") == [2, 4, 16]
    assert agreeing_real.parse_taus("2,4,max", agreeing_real.tau_max("assistant", 4)) == [2, 4, 5]
    assert agreeing_real.parse_taus("2,4,max", agreeing_real.tau_max("dspark", 4)) == [2, 4, 8]
    for bad in ("0", "17", "two", ""):
        with pytest.raises(ValueError, match="--tau"):
            agreeing_real.parse_taus(bad)
    with pytest.raises(ValueError, match="1..5"):
        agreeing_real.parse_taus("2,8", agreeing_real.tau_max("assistant", 4))


# The drafter's weights that carry its proposals: DFlash's slot writes, the assistant's reading of
# the token it is fed (zeroed, it drafts token 0, which the target never emits).
CARRIERS = {"dflash": "layers.0.self_attn.o_proj.weight", "assistant": "pre_projection.weight",
            "dspark": "layers.0.self_attn.o_proj.weight"}
MAX = {"dflash": 16, "assistant": 5, "dspark": 8}   # the assistant at gamma 4


def _case(source: str, tau: int, dtype: str = "float32"):
    return agreeing_real.cases(source, [tau], "tiny", 64, dtype, gamma=4)[0]


# DeepSpec's loop runs until it has committed one token past the request's last and drops it: its
# last round may add no kept token (tau 1: 47 tokens in 48 rounds). Its tau here is what its rounds
# commit, kept or not: accepted drafts per round + 1.
PER_ROUND = {"deepspec-torch": lambda run: run.accepted / run.rounds + 1}
TORCH_CPU = SimpleNamespace(torch_device="cpu", torch_reason="")


def _measure(case, tmp_path, side: str, corrupt: bool = False) -> tuple[float, list[int], list[int]]:
    ckpt = agreeing_real.build(case, tmp_path)
    if corrupt:   # from outside the construction: the drafter's stream carrier zeroed
        d = ckpt.weights("drafter")
        name = CARRIERS[case.module]
        d[name] = mx.zeros_like(d[name])
    opts = loops.Options(prompt_len=64, new_tokens=48, runs=2)
    check, _, _ = loops.prompt_plan(opts, 1, ckpt.prompt_vocab, 0)
    plain = loop_sides.SIDES["plain"].build(ckpt, ENV).generate(check, opts.new_tokens)
    run = loop_sides.SIDES[side].build(ckpt, TORCH_CPU if side == "deepspec-torch" else ENV).generate(
        check, opts.new_tokens)
    tau = PER_ROUND[side](run) if side in PER_ROUND else run.decode_tokens / run.rounds
    return tau, run.tokens, plain.tokens


def _deepspec_cpu() -> bool:
    from spec_parity.oracles import dspark

    return importlib.util.find_spec("torch") is not None and not dspark.status()


PEERS = {"dflash": ["zlab-mlx"] if importlib.util.find_spec("dflash") else [],
         "assistant": ["optiq"] if importlib.util.find_spec("optiq") else [],
         "dspark": (["dspark-mlx"] if importlib.util.find_spec("dspark_mlx") else [])
         + (["deepspec-torch"] if _deepspec_cpu() else [])}
LOOPS = [(src, side, tau) for src, taus in (("dflash", (1, 4, 16)), ("assistant", (1, 2, 4, 5)))
         for side in ["port"] + PEERS[src] for tau in taus]


@pytest.mark.parametrize("source,side,tau", LOOPS)
def test_loop_measures_tau(tmp_path, source, side, tau):
    got, tokens, plain = _measure(_case(source, tau), tmp_path, side)
    assert tokens == plain
    assert (1 - TOLERANCE) * tau <= got <= tau + 1e-9, got


@pytest.mark.parametrize("source,side", [(src, side) for src in MAX for side in ["port"] + PEERS[src][:1]
                                         if src == "assistant" or side == "port"])
def test_broken_drafter_falls_to_tau_1(tmp_path, source, side):
    """The negative control: the tau-max weights with the drafter's stream carrier zeroed."""
    got, tokens, plain = _measure(_case(source, MAX[source]), tmp_path, side, corrupt=True)
    assert tokens == plain
    assert got < 1.2, got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("side", ["port"] + PEERS["dspark"])
@pytest.mark.parametrize("tau", [2, 4, 8])
def test_dspark_loop_measures_tau(tmp_path, side, tau, dtype):
    """DSpark (7 drafts a round, its Markov head adding 0, confidence threshold 0): each loop
    measures tau (8: max), and its stream is plain decode's."""
    got, tokens, plain = _measure(_case("dspark", tau, dtype), tmp_path, side)
    assert tokens == plain
    assert (1 - TOLERANCE) * tau <= got <= tau + 1e-9, got


@pytest.mark.parametrize("source,side,tau", [("dflash", "port", 4)] + [("assistant", s, t) for s in ["port"]
                                                                      + PEERS["assistant"] for t in (2, 4, 5)])
def test_bf16_keeps_tau(tmp_path, source, side, tau):
    """The device runs bf16: the construction's margins hold there too."""
    got, tokens, plain = _measure(_case(source, tau, "bfloat16"), tmp_path, side)
    assert tokens == plain
    assert (1 - TOLERANCE) * tau <= got <= tau + 1e-9, got


# source: (its bench case, the taus of 2,4,max, the drafts a round, K's capacity: the assistant's hidden, head_dim)
REAL = {"assistant": (agreeing_real.REAL_ASSISTANT, (2, 4, 5), 4, 1024),
        "dspark": (agreeing_real.REAL_DSPARK, (2, 4, 8), 7, 128)}


@pytest.mark.parametrize("source", REAL)
def test_real_cases_are_the_bench_case(source):
    """The real cases take the bench's real case as it is (shapes, head, dtype; DSpark: Qwen3-4B,
    tied, block 7, Markov 256, its taps), with K = the capacity rounded to a multiple of tau."""
    name, taus, gamma, capacity = REAL[source]

    def cases(condition):
        return [c for _, c in loops.cases(loops.Options(shapes="real", sources=(source,), conditions=(condition,),
                                                        dtype="bfloat16", prompt_len=1024))]

    real = next(c for c in cases("random") if c.name == name)
    if source == "assistant":
        assert name == loops.RANDOM_CASES["real"]["assistant"]
    got = cases("agreeing-real")
    assert [c.name for c in got] == [f"{source}-agreeing-real-tau{t}" for t in taus]
    for c in got:
        ov = dict(c.params.drafter[2])
        tau = ov.pop("agree_tau")
        assert (c.kind, c.overrides, c.dtype, c.shapes.gamma) == (real.kind, real.overrides, "bfloat16", gamma)
        assert (c.params.drafter[0], ov) == (real.params.drafter[0], real.params.drafter[2])
        assert f"stream on {capacity // tau * tau} cycle tokens" in c.shapes.notes[-1]
        if source == "dspark":
            assert c.overrides["tie_word_embeddings"] and ov["block_size"] == 7 and ov["markov_rank"] == 256


MLX_PEERS = {"zlab-mlx": "dflash", "dflash-mlx": "dflash_mlx"}     # side: the package it imports


@pytest.mark.parametrize("side", [s for s, package in MLX_PEERS.items() if importlib.util.find_spec(package)])
def test_every_mlx_peer_runs_at_the_runs_dtype(tmp_path, side):
    """A peer left in float32 beside bf16 sides would be timed on twice the bytes."""
    from mlx.utils import tree_flatten

    ckpt = agreeing_real.build(agreeing_real.cases("dflash", [4], "tiny", 64, "bfloat16")[0], tmp_path)
    loop = loop_sides.SIDES[side].build(ckpt, ENV)
    dtypes = {str(v.dtype) for m in loop.keep for _, v in tree_flatten(m.parameters())}
    assert dtypes == {"mlx.core.bfloat16"}, dtypes


def test_slot_weights_reach_the_lp():
    """The numpy solver comes within 0.02 of the factory's LP optimum (scipy), at both widths."""
    pytest.importorskip("scipy")
    from spec_parity.drafters.dflash.checkpoints import _slot_weights

    for hd in (128, 32):
        thetas = 1e6 ** (-2 * np.arange(hd // 2) / hd)[: hd // 2 - 1]
        w, c, _ = agreeing_real.slot_weights(thetas, 30)
        assert abs(w.sum() - 1) < 1e-9 and (w >= 0).all()
        assert c <= _slot_weights(thetas, 30)[1] + 0.02


@pytest.mark.parametrize("argv, message", [
    (["--sources", "assistant", "--tau", "2,8"], "'8' is not an integer in 1..5 or 'max' (the assistant's tau max is"),
    (["--sources", "assistant", "--gamma", "7", "--tau", "9"], "1..8"),
    (["--sources", "dflash", "--tau", "17"], "'17' is not an integer in 1..16"),
    (["--sources", "dspark,dflash", "--tau", "2,9"], "'9' is not an integer in 1..8 or 'max' (dspark)"),
])
def test_a_tau_above_the_family_max_is_refused(argv, message, tmp_path, capsys):
    from spec_parity import cli

    assert cli.main(["bench", "--serve", "--conditions", "agreeing-real", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("spec-parity bench: error: ") and len(err.splitlines()) == 1

"""The pipelined loop (port/serve.py `_pipelined`, `pipeline="on"`): round r + 1 is queued before
round r's verdict is read, everything a round needs kept on the device. It must be the sequential
loop's request to the bit: the same tokens, the same trace (drafts, accepts, emitted per round),
the same drafts, the same stop; every verify forward and draft block bit for bit on the CPU (within
TIER of tests/test_bucketed.py elsewhere), over max_tokens that end a request inside a round or after it and EOS anywhere, with
buckets of 8 rows (the 12-token prompt and 40 tokens cross several). The drafter's rows one late or
the verify written one row early (the controls) must fail it.
"""

import functools

import mlx.core as mx
import pytest
from test_bucketed import BUCKET, _outside_tier
from test_bucketed_verify import IDS, PROMPT, _setup, kernel_walk  # noqa: F401 (a fixture)
from test_speed import _bits_equal

from spec_parity import controls, harness
from spec_parity.port import sampling, serve

# the sources that pipeline: DFlash's and DSpark's bucketed blocks (Qwen3 and Gemma-4 targets), none
LOOPS = ["dflash", "dspark", "dspark-dflash-variant", None]


def _run(name, max_tokens, eos, pipeline, verify="auto"):
    """(tokens, stats, per round the target forward's logits and final hidden and the draft block's
    hidden and logits) of one request; the drafter observed through serve.Observed."""
    target, make, gamma = _setup(name)
    forwards, blocks, forward = [], [], serve.target_forward

    def recorded(*args, **kwargs):
        t = forward(*args, **kwargs)
        forwards.append([t.logits, t.final])
        return t

    def around(name, src, args, call):
        out = call()
        if name.startswith("draft"):
            blocks.append([src.last_block.hidden, src.last_block.logits])
        return out

    provider = make and serve.Observed(make(), around)
    serve.target_forward = recorded
    try:
        tokens, stats = serve.generate(target, PROMPT, max_tokens, provider,
                                       serve.ServeOptions(gamma=gamma, eos=eos, kv_bucket=BUCKET,
                                                          pipeline=pipeline, verify=verify))
    finally:
        serve.target_forward = forward
    return tokens, stats, [f + b for f, b in zip(forwards[1:], blocks)] if blocks else forwards


@functools.cache
def _greedy(name):
    return _run(name, 40, frozenset(), "off")[0]


def _ends(name):
    """(max_tokens, eos) pairs: a request ended by length at 1, 2, 7 (inside a round) and 40
    tokens, and by EOS at its first, 10th and 30th token."""
    g = _greedy(name)
    return [(1, set()), (2, set()), (7, set()), (40, set()), (40, {g[0]}), (40, {g[9]}), (40, {g[29]})]


def _same_request(a, b):
    (tokens, stats, forwards), (p_tokens, p_stats, p_forwards) = a, b
    assert (stats.pipeline, p_stats.pipeline) == ("off", "on")
    assert p_tokens == tokens and p_stats.stop == stats.stop
    assert p_stats.trace == stats.trace and p_stats.proposals == stats.proposals
    assert len(p_forwards) >= len(forwards)   # a round queued after the one that ends a request is dropped
    got = p_forwards[: len(forwards)]
    assert not _outside_tier(got, forwards)
    if mx.default_device().type == mx.DeviceType.cpu:
        assert all(_bits_equal(x, y) for f, p in zip(got, forwards) for x, y in zip(f, p))


@pytest.mark.parametrize("name", harness.slow_except(LOOPS, "dflash"), ids=IDS)
def test_pipelined_loop_is_the_sequential_loop(name):
    """Every end of a request: the sequential loop's tokens, trace, drafts and forwards."""
    for max_tokens, eos in _ends(name):
        _same_request(_run(name, max_tokens, eos, "off"), _run(name, max_tokens, eos, "on"))


def test_pipelined_kernel_verify_is_the_sequential_loop(kernel_walk):  # noqa: F811
    """The kernel verify (its walk; mlx-lm's attention in the kernels' place off MLX CUDA) at an
    offset on the device, as the pipelined loop runs it: the sequential loop's request. Control:
    the verify writing one row before the committed length, caught."""
    for max_tokens, eos in _ends("dflash")[2:5]:
        off, on = (_run("dflash", max_tokens, eos, p, verify="kernel") for p in ("off", "on"))
        assert on[1].verify == "kernel"
        _same_request(off, on)
    off = _run("dflash", 40, set(), "off", verify="kernel")
    with controls.planted("serve", "pipelined_offset_behind"):
        planted = _run("dflash", 40, set(), "on", verify="kernel")
    with pytest.raises(AssertionError):
        _same_request(off, planted)


def test_auto_pipelines_where_it_fits():
    """"auto" pipelines a greedy request with a compiled verify and a source that can (DFlash's
    bucketed block, or none); the sequential loop otherwise."""
    target, make, gamma = _setup("dflash")
    assert serve.generate(target, PROMPT, 8, make(), serve.ServeOptions(gamma=gamma))[1].pipeline == "on"
    assert serve.generate(target, PROMPT, 8, make(), serve.ServeOptions(gamma=gamma, verify="plain"))[1].pipeline == "off"
    assert serve.generate(target, PROMPT, 8, None, serve.ServeOptions(kv_bucket=BUCKET))[1].pipeline == "on"
    assert serve.generate(target, PROMPT, 8, None)[1].pipeline == "off"   # plain decode: mlx-lm's caches


def test_pipeline_refused_where_it_cannot_run():
    """pipeline="on" where `_pipelined` cannot run is refused with the reason and the fix."""
    refused = [("dflash", {"sampler": sampling.Sampler(temperature=1.0)}, "the greedy verify only"),
               ("dflash", {"verify": "plain"}, "the compiled verify"),
               ("dflash", {"record": True}, "record=True"),
               ("dflash-extras", {}, "extension"),
               ("dspark-threshold", {}, "confidence threshold"),
               ("assistant-tied", {"kv_bucket": 8}, "AssistantSource has no draft_pipelined"),
               ("dflash", {"gamma": 0}, "gamma=0"),
               (None, {"kv_bucket": None}, "the compiled verify")]
    for name, kwargs, why in refused:
        target, make, gamma = _setup(name)
        with pytest.raises(ValueError, match=f"pipeline='on' cannot run here: .*{why}.*; use pipeline='off'"):
            serve.generate(target, PROMPT, 8, make and make(),
                           serve.ServeOptions(**{"gamma": gamma, "pipeline": "on", **kwargs}))
    with pytest.raises(ValueError, match="pipeline='yes': expected one of"):
        serve.generate(target, PROMPT, 8, None, serve.ServeOptions(pipeline="yes"))


@pytest.mark.parametrize("name,bug", [("dflash", "pipelined_rows_shifted"), ("dspark", "pipelined_rows_shifted"),
                                      (None, "pipelined_offset_behind")], ids=lambda v: IDS(v) if v is None else v)
def test_planted_pipeline_bugs_fail_the_comparison(name, bug):
    """Negative controls: the drafter's context rows one late (its draft blocks move), the verify
    writing one row before the committed length (its forwards move)."""
    sequential = _run(name, 40, set(), "off")
    with controls.planted("serve", bug):
        planted = _run(name, 40, set(), "on")
    with pytest.raises(AssertionError):
        _same_request(sequential, planted)

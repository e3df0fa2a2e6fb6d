"""The bucketed path (`kv_bucket`, opt-in) of the DSpark and DFlash ports: the context K/V presented
at its buffer's length (a whole number of buckets) with the tail masked, the whole block one
compiled call.

It need not be bit-exact with the default path (its attention runs over a padded key range: the
two-segment softmax sums in another order; mx.fast's attention over the joined keys is another
kernel on the GPU), so every block tensor is held to the default path within torch.testing's fp32
tolerance (rtol 1.3e-6, atol 1e-5: same framework, same math, the ops regrouped; measured max
|diff| here: two-segment 7e-6 on logits of |~10|, sdpa 0 on the CPU), with identical greedy tokens, over
rounds whose context crosses two bucket boundaries (bucket 8, context 5 -> 20 rows). A planted
off-by-one in the context mask (one padded row let through) must fail that comparison.
"""

import functools

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_speed import (
    DFLASH_VARIANTS,
    DSPARK_VARIANTS,
    LONG_PROMPT,
    PROMPT,
    RNN_FUSION_ON_GPU,
    SOURCES,
    _bits_equal,
    _host_argmax,
    extended,
    most_per_round,
    round_syncs,
)

from spec_parity import budgets, checkpoints, compare, controls, harness
from spec_parity.port import compiled, dflash, dspark, serve, targets
from spec_parity.port.fast import assistant as fast_assistant
from spec_parity.port.fast import dflash as fast_dflash
from spec_parity.port.fast import dspark as fast_dspark
from spec_parity.port.fast import kernels
from spec_parity.port.sources.assistant import AssistantSource
from spec_parity.port.sources.dspark import DeepspecProvider, DeepspecSource

BUCKET = 8
KERNELS = pytest.mark.skipif(not kernels.available(), reason="the kernels run on MLX CUDA only")
FP32 = budgets.DTYPE_DEFAULTS["float32"]
# The tier a fast path is held to against the op-by-op one: the fp32 budget (and bit for bit, asserted
# beside it) on the CPU; on MLX CUDA, where fusion and reduction order move fp32, the measured budget.
TIER = FP32 if mx.default_device().type == mx.DeviceType.cpu else budgets.budget_for("serve", "mlx_cuda")
# context rows fed per round: 5 (the prompt's), then 3 per round: 5, 8, ..., 20 (buffers 8, 16, 24)
FEEDS = [(0, 5)] + [(5 + 3 * r, 8 + 3 * r) for r in range(5)]
BUFFERS = sorted({-(-hi // BUCKET) * BUCKET for _, hi in FEEDS})


@functools.cache
def _target(kind: str):
    return targets.load(checkpoints.build(kind, 0, {}))


@functools.cache
def _taps(kind: str, path):
    m = dspark.load(path) if "dspark" in str(path) else dflash.load(path)
    return m.taps(targets.forward(_target(kind), mx.array([LONG_PROMPT])).hidden)


def _dspark_rounds(variant: str, kv_bucket, compiled=True, attention="sdpa", model=None):
    """Per round (context grown by FEEDS): the block's hidden, base and Markov rows, confidence,
    and its tokens; and the model (`model`: that one, already loaded)."""
    ov = DSPARK_VARIANTS[variant]
    kind = ov.get("target_kind", "gemma4-target")
    path = checkpoints.build("dspark-drafter", 0, ov)
    m = model or fast_dspark.load(path, compiled, kv_bucket, attention)
    rows = _taps(kind, path)
    src = DeepspecSource(m, serve.TargetView(_target(kind), make_prompt_cache(_target(kind).model)))
    out = []
    for r, (lo, hi) in enumerate(FEEDS):
        src.pending = rows[:, lo:hi]
        b = src._block([7 + r], None)
        out.append(([b.hidden, b.base_logits, b.logits] + ([b.confidence] if b.confidence is not None else []),
                    b.tokens))
    return out, m


def _dflash_rounds(variant: str, kv_bucket, compiled=True, attention="sdpa", model=None):
    ov = DFLASH_VARIANTS[variant]
    kind = ov.get("target_kind", "qwen3-target")
    path = checkpoints.build("dflash-drafter", 0, ov)
    m = model or fast_dflash.load(path, compiled=compiled, kv_bucket=kv_bucket, bucket_attention=attention)
    ext = dflash.load_extension(path) if "dspark_extras" in ov else None
    rows, caches, out = _taps(kind, path), m.make_caches(), []
    for r, (lo, hi) in enumerate(FEEDS):
        b = extended(ext, m.block(_target(kind), 7 + r, m.args.block_size - 1, rows[:, lo:hi], caches), 7 + r)
        out.append(([b.hidden, b.logits] + [x for x in (b.base_logits, b.confidence) if x is not None], b.tokens))
    return out, m


def _outside_tier(fast, plain) -> list:
    """(round, index, max_abs, error) of every tensor outside TIER; a round is a list of
    tensors (test_bucketed_verify: one target forward's)."""
    bad = []
    for r, (ft, pt) in enumerate(zip(fast, plain, strict=True)):
        for i, (a, b) in enumerate(zip(ft, pt, strict=True)):
            m = compare.tensor_metrics(a, b, TIER)
            if not m["ok"]:
                bad.append((r, i, m.get("max_abs"), m.get("error")))
    return bad


def _within_tier(fast, plain) -> tuple[bool, list]:
    """Every tensor of every round (tensors, tokens) within TIER and every token equal."""
    bad = _outside_tier([t for t, _ in fast], [t for t, _ in plain])
    bad += [(r, "tokens", ft, pt) for r, ((_, ft), (_, pt)) in enumerate(zip(fast, plain)) if ft != pt]
    return not bad, bad


def _bits_same(fast, plain) -> bool:
    """Every tensor of every round bit for bit, and every token."""
    return all(_bits_equal(a, b) for (fa, _), (pa, _) in zip(fast, plain, strict=True)
               for a, b in zip(fa, pa, strict=True)) and [t for _, t in fast] == [t for _, t in plain]


ROUNDS = {"dspark": _dspark_rounds, "dflash": _dflash_rounds}
CASES = [("dspark", v) for v in ("gemma4", "qwen3", "gemma4-keqv", "gemma4-rnn")] + \
        [("dflash", v) for v in DFLASH_VARIANTS]


@pytest.mark.parametrize("attention", [pytest.param(a, marks=KERNELS) if a == "kernel" else a
                                       for a in compiled.BUCKET_ATTENTIONS])
@pytest.mark.parametrize("source,variant", CASES, ids=[f"{s}-{v}" for s, v in CASES])
def test_bucketed_block_within_fp32_of_default(source, variant, attention):
    """Six rounds, the context 5 -> 20 rows over buffers of 8, 16, 24: every block tensor within
    TIER of the default path, the same greedy tokens; the compiled block traced once
    per buffer length, not once per round. Both attention designs."""
    plain, _ = ROUNDS[source](variant, None)
    fast, m = ROUNDS[source](variant, BUCKET, attention=attention)
    ok, bad = _within_tier(fast, plain)
    assert ok, bad
    assert m._bucketed.traces == len(BUFFERS) < len(FEEDS)


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu, reason="a CPU-backend fact")
@pytest.mark.parametrize("source,variant", [("dspark", "qwen3"), ("dspark", "gemma4-rnn"), ("dflash", "qwen3-swa"),
                                            ("dflash", "qwen3-causal")])
def test_sdpa_design_is_bit_exact_on_cpu(source, variant):
    """Measured, and held: on the CPU backend (mx.fast's attention there is its unfused fallback,
    where the masked padded keys add exact zeros) the "sdpa" design equals the default path bit for
    bit; the two-segment one does not (its products sum in another order)."""
    plain, _ = ROUNDS[source](variant, None)

    assert _bits_same(ROUNDS[source](variant, BUCKET, attention="sdpa")[0], plain)
    assert not _bits_same(ROUNDS[source](variant, BUCKET, attention="two-segment")[0], plain)


def _block_peak(attention: str) -> tuple[int, int]:
    """Bytes the second round's DFlash block adds at its peak (context 5 -> 8 rows, buffers of
    16 384 rows of head_dim 128: its scores and mask are small beside them), and the bytes of the
    buffers."""
    path = checkpoints.build("dflash-drafter", 0, {"head_dim": 128})
    m = fast_dflash.load(path, kv_bucket=1 << 14, bucket_attention=attention)
    target, rows, caches = _target("qwen3-target"), _taps("qwen3-target", path), m.make_caches()
    for r, (lo, hi) in enumerate(FEEDS[:2]):
        mx.eval(caches[0].keys if r else [])
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        b = m.block(target, 7 + r, m.args.block_size - 1, rows[:, lo:hi], caches)
        mx.eval(b.logits, [(c.keys, c.values) for c in caches])
    return mx.get_peak_memory() - base, sum(c.keys.nbytes + c.values.nbytes for c in caches)


@pytest.mark.slow
@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                    reason="MLX CUDA's allocator reuses cached blocks: the peak shows no copy, the control's neither")
def test_exact_block_writes_into_the_buffers_copying_nothing():
    """The exact block's writes (context rows, the block's K/V) reuse the buffers (the caches hand
    them over): the peak adds less than one layer's K buffer (an eighth of them all: 2 layers, K
    and V); the joined "sdpa" design (a copy of a layer's K and V per attention) is the control."""
    exact, size = _block_peak("exact")
    joined, _ = _block_peak("sdpa")
    assert exact < size / 8 < size / 2 <= joined, (exact, joined, size)


def test_exact_block_within_fp32_of_default_across_buckets():
    """Six rounds, the context 5 -> 20 rows over buffers of 16, 24, 32 (block rows reserved): the
    exact block's tensors bit for bit the default path's on the CPU (elsewhere within fp32), the
    same tokens; the off-by-one of the buffers' valid rows does not reach it (it has no mask)."""
    plain, _ = _dflash_rounds("qwen3", None)
    exact, _ = _dflash_rounds("qwen3", BUCKET, attention="exact")
    ok, bad = _within_tier(exact, plain)
    assert ok, bad
    if mx.default_device() == mx.cpu:
        assert _bits_same(exact, plain)


@pytest.mark.parametrize("source,variant", [("dspark", "gemma4"), ("dflash", "qwen3-swa")])
def test_trace_counter_counts_every_call_uncompiled(source, variant):
    """The counter's control: with the block function uncompiled it runs (and counts) every round."""
    _, m = ROUNDS[source](variant, BUCKET, compiled=False)
    assert m._bucketed.traces == len(FEEDS)


# The planted controls of the bucketed blocks and the assistant's bucketed step, and where each runs
# (tools/fast_path_tiers.py --controls reads them: how far each reaches).
MASK_CONTROLS = [("dspark", "gemma4", "two-segment"), ("dspark", "qwen3", "two-segment"), ("dflash", "qwen3", "two-segment"),
                 ("dflash", "qwen3-swa", "two-segment"), ("dspark", "qwen3", "sdpa"), ("dflash", "qwen3-causal", "sdpa")]
ASSISTANT_CONTROLS = {"sliding_attention": "bucketed_window_off_by_one", "full_attention": "bucketed_full_past_offset"}


@pytest.mark.parametrize("source,variant,attention", MASK_CONTROLS)
def test_planted_mask_off_by_one_fails_the_comparison(source, variant, attention):
    """Negative control: the context mask letting the first padded row through is caught."""
    plain, _ = ROUNDS[source](variant, None)
    with controls.planted(source, "bucket_mask_off_by_one"):
        planted, _ = ROUNDS[source](variant, BUCKET, attention=attention)
    ok, bad = _within_tier(planted, plain)
    assert not ok and any(r == 0 for r, *_ in bad)   # round 0: 5 rows in a buffer of 8


def _bucketed_provider(make):
    """A SOURCES provider with its drafter on the bucketed path."""
    prov = make()
    if isinstance(prov, DeepspecProvider):
        prov.drafter = fast_dspark.load(prov.path, kv_bucket=BUCKET)
    else:
        prov.drafter = fast_dflash.load(prov.path, kv_bucket=BUCKET)
    return prov


# SOURCES name -> whether its drafter agrees with its target (the random extras one accepts nothing)
LOOPS = {"dspark": True, "dspark-threshold": True, "dflash": True, "dflash-extras-thresholds": False}


@pytest.mark.parametrize("name", harness.slow_except(LOOPS, "dflash"))
def test_serve_loop_with_bucketed_source_is_lossless(name, monkeypatch):
    """spec_parity.port.serve.generate with the bucketed source emits the target's own greedy stream (plain
    decoding through the same loop), an agreeing drafter's drafts are accepted, the block is
    traced less often than once per round, and a round still syncs within its bound."""
    _, kind, overrides, make, gamma, bound = next(s for s in SOURCES if s[0] == name)
    target = targets.load(checkpoints.build(kind, 0, overrides))
    plain, _ = serve.generate(target, PROMPT, 40, None, serve.ServeOptions(gamma=gamma, eos=set()))
    prov = _bucketed_provider(make)
    tokens, stats = serve.generate(target, PROMPT, 40, prov, serve.ServeOptions(gamma=gamma, eos=set()))
    assert tokens == plain and stats.drafted > 0 and (stats.accepted > 0) == LOOPS[name]
    assert prov.drafter._bucketed.traces < len(stats.trace)
    per_round, stats = round_syncs(target, _bucketed_provider(make), 30, gamma, monkeypatch)[:2]
    assert max(per_round) <= most_per_round(bound, stats), per_round


def test_bad_bucket_and_window_are_refused():
    path = checkpoints.build("dspark-drafter", 0, {})
    for bad in (0, -8, 8.0, True):
        with pytest.raises(dspark.DSparkError, match="kv_bucket"):
            fast_dspark.load(path, kv_bucket=bad)
    swa = checkpoints.build("dflash-drafter", 0, DFLASH_VARIANTS["qwen3-swa"])
    with pytest.raises(dflash.DFlashError, match="window='positional'"):
        fast_dflash.load(swa, window="zlab-mlx", kv_bucket=BUCKET)
    with pytest.raises(dflash.DFlashError, match="bucket_attention"):
        fast_dflash.load(swa, kv_bucket=BUCKET, bucket_attention="flash")
    m = fast_dspark.load(path, kv_bucket=BUCKET)
    with pytest.raises(dspark.DSparkError, match="BucketCache"):
        m.draft_block(3, [dspark.KVCache() for _ in m.layers], 4)


@pytest.mark.parametrize("source,variant", harness.slow_except(
    [pytest.param("dspark", "gemma4-rnn", marks=RNN_FUSION_ON_GPU), ("dspark", "qwen3"), ("dflash", "qwen3-swa"),
     ("dflash", "qwen3-extras")], ("dspark", "qwen3")))
def test_compiled_bucketed_block_equals_uncompiled_after_a_weight_change(source, variant):
    """The one compiled block equals the same function uncompiled, bit for bit, also after a weight
    is replaced (the parameters are compile inputs, not constants traced in)."""
    def both(mutate=None):
        (fast, m), (plain, p) = ROUNDS[source](variant, BUCKET), ROUNDS[source](variant, BUCKET, compiled=False)
        if mutate is not None:
            for model in (m, p):
                mutate(model)
            (fast, _), (plain, _) = (ROUNDS[source](variant, BUCKET, model=x) for x in (m, p))
        return fast, plain

    assert _bits_same(*both())
    grown = both(lambda model: setattr(model.layers[0].mlp.up_proj, "weight", model.layers[0].mlp.up_proj.weight * 1.5))
    assert _bits_same(*grown)
    assert not _bits_same(grown[0], both()[1])   # the weight change shows (the comparison is not blind)


def test_dspark_bucketed_host_pick_equals_device_chain():
    """The sampled path (a host `pick` chains the Markov tail after the compiled body) with an
    argmax pick drafts the greedy block's tokens, its rows within fp32 of the greedy ones; a pick
    one token off (the control) drafts others."""
    ov = DSPARK_VARIANTS["gemma4-rnn"]
    path = checkpoints.build("dspark-drafter", 0, ov)
    m, rows = fast_dspark.load(path, kv_bucket=BUCKET), _taps("gemma4-target", path)

    def block(pick):
        src = DeepspecSource(m, serve.TargetView(_target("gemma4-target"), make_prompt_cache(
            _target("gemma4-target").model)))
        src.pending = rows[:, :11]
        return src._block([7], pick)

    greedy, host = block(None), block(_host_argmax)
    assert greedy.tokens == host.tokens
    assert compare.tensor_metrics(host.logits, greedy.logits, FP32)["ok"]
    assert block(lambda row: (_host_argmax(row) + 1) % row.shape[-1]).tokens != greedy.tokens


# ---- the assistant: its donors are the target's own cache buffers ----------------------------------

class _BothChains:
    """Provider: drafts with the default source; each draft chain is also run on the bucketed
    source over the same target caches, and both chains are recorded."""

    def __init__(self, make):
        self.plain, self.bucketed = make(), make()
        self.bucketed.drafter = fast_assistant.load(self.bucketed.path, bucketed=True)
        p = self.plain
        self.id, self.weights_bytes, self.trained_gamma, self.chains = p.id, p.weights_bytes, p.trained_gamma, []

    def open(self, view):
        src, other = self.plain.open(view), self.bucketed.open(view)
        chain = src._chain

        def both(feed, n, hidden, pick):
            steps = chain(feed, n, hidden, pick)
            self.chains.append((steps, other._chain(feed, n, hidden, pick)))
            return steps

        src._chain = both
        return src

    def dispose(self):
        pass


def _assistant_loop(name: str, kv_bucket=None):
    """A 40-token serve loop (past the tiny target's sliding window of 8: the ring wraps, verify
    chunks and trims reorder it) with every chain drafted both ways: (target, provider, gamma,
    bucketed rounds, default rounds), a round = (logits and next hidden of each step, tokens).
    `kv_bucket`: the loop's bucketed verify (the donors are then its VerifyCache buffers)."""
    _, kind, overrides, make, gamma, _ = next(s for s in SOURCES if s[0] == name)
    target = targets.load(checkpoints.build(kind, 0, overrides))
    prov = _BothChains(make)
    serve.generate(target, PROMPT, 40, prov,
                   serve.ServeOptions(gamma=gamma, eos=set(), kv_bucket=kv_bucket))

    def rounds(which):
        return [([x for s in c[which] for x in (s.logits, s.next_hidden)], [s.token for s in c[which]])
                for c in prov.chains]

    return target, prov, gamma, rounds(1), rounds(0)


@pytest.mark.slow
@pytest.mark.parametrize("name", harness.slow_except(["assistant-centroid", "assistant-tied"], "assistant-tied"))
def test_assistant_bucketed_chains_within_fp32_and_lossless(name):
    """Every draft chain of a serve loop drafted on the bucketed path from the same target caches:
    logits and next hidden within fp32 of the default's, the same tokens; the loop with the
    bucketed source emits the target's greedy stream; the one compiled step traced far less often
    than once per step."""
    target, prov, gamma, fast, plain = _assistant_loop(name)
    ok, bad = _within_tier(fast, plain)
    assert ok and len(fast) > 10, bad
    reference, _ = serve.generate(target, PROMPT, 40, None, serve.ServeOptions(gamma=gamma, eos=set()))
    tokens, stats = serve.generate(target, PROMPT, 40, prov.bucketed,
                                   serve.ServeOptions(gamma=gamma, eos=set()))
    assert tokens == reference and stats.accepted > 0
    assert prov.bucketed.drafter._bucketed.traces < stats.drafted / 4


@pytest.mark.parametrize("layer", harness.slow_except(list(ASSISTANT_CONTROLS), "sliding_attention"))
def test_assistant_planted_window_off_by_one_fails_the_comparison(layer):
    """Negative control: one donor entry more than the window (sliding) or past the offset (full)
    let through on the bucketed path is caught."""
    with controls.planted("assistant", ASSISTANT_CONTROLS[layer]):
        _, _, _, fast, plain = _assistant_loop("assistant-tied")
    ok, _ = _within_tier(fast, plain)
    assert not ok


def _wrapped_ring_rounds(window: str):
    """Donors from one-token decoding (mlx-lm's in-place ring: after it wraps, the buffer is not in
    time order, which the serve loop's multi-token verifies never leave): at each ring position a
    chain drafted both ways. Returns (the ring write indices seen, bucketed rounds, default rounds)."""
    _, kind, overrides, make, gamma, _ = next(s for s in SOURCES if s[0] == "assistant-tied")
    target = targets.load(checkpoints.build(kind, 0, overrides))
    plain, fast = make(), make()
    fast.drafter = fast_assistant.load(fast.path, bucketed=True)   # sources opened here with the window given
    caches = make_prompt_cache(target.model)
    ring = caches[targets.donor_layers(target)["sliding"]]
    trace = targets.forward(target, mx.array([LONG_PROMPT[:6]]), caches=caches)
    writes, out = set(), {False: [], True: []}
    for t in LONG_PROMPT[6:]:
        view = serve.TargetView(target, caches)
        for prov in (plain, fast):
            src = AssistantSource(prov.drafter, view, window=window)
            steps = src._chain([t], gamma, trace.final[:, -1:, :], None)
            out[prov is fast].append(([x for s in steps for x in (s.logits, s.next_hidden)], [s.token for s in steps]))
        writes.add(ring._idx)
        trace = targets.forward(target, mx.array([[t]]), caches=caches)
    return writes, out[True], out[False]


@pytest.mark.parametrize("window", harness.slow_except(["optiq", "hf"], "optiq"))
def test_assistant_bucketed_over_a_wrapped_ring(window):
    """At every ring position, both window conventions: each chain on the bucketed path within fp32
    of the default's, the same tokens."""
    writes, fast, plain = _wrapped_ring_rounds(window)
    assert len(writes) > 3   # the ring's write index moved round
    ok, bad = _within_tier(fast, plain)
    assert ok, bad


def test_assistant_ring_order_ignored_fails_the_comparison():
    """Negative control: the ring's rotation dropped (slot j taken as rank j) is caught."""
    with controls.planted("assistant", "ring_order_ignored"):
        _, fast, plain = _wrapped_ring_rounds("optiq")
    assert not _within_tier(fast, plain)[0]

"""L3: the DSpark-on-DFlash extension (port/dflash.py, `DflashProvider(path, extras=True)`).

Its harness cases (dflash/ext-qwen3, ext-gemma4: lossless at T=0, the pruning rule, the
distribution shift KL(base || extended) per row against budgets.L3_GATES, and its heads held to
DeepSpec's teacher-forced) run with every other case; this file holds what is not a case, and what
the heads' controls' verdicts say. No reference implements the extension as a whole (mlx-bun
0.0.11's `dflash-source.ts` is a seam, not an oracle); its Markov and confidence heads are
DeepSpec's, and only they are parity: extras off must be the L2 source exactly; extras on must stay lossless at
T=0; the distribution shift KL(base draft || extended draft) is reported per position; the
acceptance change is judged by the paired A/B verdict and reported, never claimed as parity.
The extension's own definition (Markov bias after the softcap, per-position thresholds from the
argument / env / calibration.json) is held by its negative controls.

Random pairs accept almost nothing, so the calibration is fitted at a low precision target
(CAL_TARGET) for its thresholds to fall between the observed confidences instead of at 1.0.
"""

import contextlib
import dataclasses
import functools
import shutil

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import checkpoints, controls, harness, shared
from spec_parity.drafters.dflash import pair
from spec_parity.port import ab, calibration, dflash, serve, targets
from spec_parity.port.sources.dflash import DflashProvider

EXTRAS = {"markov_rank": 8, "markov_head_type": "vanilla", "confidence": True}
MAX_TOKENS = 40
CAL_PROMPTS = 4
CAL_TARGET = 0.05
AB_PROMPTS = 4


def _dirs(variant: str):
    ov = pair.VARIANTS[variant]
    target = checkpoints.build(ov.get("target_kind", "qwen3-target"), 0, ov.get("target_overrides", {}))
    return target, checkpoints.build("dflash-drafter", 0, ov), checkpoints.build(
        "dflash-drafter", 0, {**ov, "dspark_extras": EXTRAS})


def _prompts(n: int, seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 120, 12).tolist() for _ in range(n)]


def _rounds(provider, rounds: list):
    """`provider`, observed: per round, the proposal and the source's block."""
    def around(name, src, args, call):
        tokens = call()
        if name.startswith("draft"):
            rounds.append((tokens.tolist() if isinstance(tokens, mx.array) else list(tokens), src.last_block))
        return tokens
    return serve.Observed(provider, around)


def _run(target, prompt, provider):
    rounds: list = []
    tokens, stats = serve.generate(target, prompt, MAX_TOKENS, _rounds(provider, rounds),
                                   serve.ServeOptions(gamma=provider.trained_gamma, eos=set()))
    return tokens, stats, rounds


@functools.cache
def _unpruned(t_dir, ck, control=None):
    """One request with extras on and pruning off (read by the KL report and the softcap controls:
    `control`, a key of spec_parity/drafters/dflash/controls.py)."""
    with controls.planted("dflash", control) if control else contextlib.nullcontext():
        return _run(targets.load(t_dir), _prompts(1)[0], DflashProvider(ck, extras=True, thresholds=[]))


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(calibration.THRESHOLDS_ENV, raising=False)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A copy of the qwen3 extras drafter with a calibration.json fitted on samples from actual
    serve-loop rounds (pruning off: every position verified)."""
    t_dir, _, ext_dir = _dirs("qwen3")
    target = targets.load(t_dir)
    prov = DflashProvider(ext_dir, extras=True, thresholds=[], collect_samples=True)
    assert prov.thresholds is None and prov.threshold_source == "argument"
    for p in _prompts(CAL_PROMPTS, seed=3):
        serve.generate(target, p, MAX_TOKENS, prov, serve.ServeOptions(gamma=prov.trained_gamma, eos=set()))
    cal = calibration.fit_sts_thresholds(prov.samples, gamma=prov.trained_gamma, target=CAL_TARGET)
    out = tmp_path_factory.mktemp("calibrated") / "dflash-extras"
    shutil.copytree(ext_dir, out)
    calibration.write_calibration(out, cal)
    return t_dir, out, cal, prov.samples


# ------------------------------------------------------------------------------------------------
# extras off == the L2 source


@pytest.mark.parametrize("variant", harness.slow_except(["qwen3", "gemma4"], "qwen3"))
def test_extras_off_is_the_l2_source(variant):
    """On the extras checkpoint with extras off (the default) the source ignores the extras: same
    tokens, trace and proposals as the plain checkpoint, bit-identical draft logits."""
    t_dir, base_dir, ext_dir = _dirs(variant)
    target = targets.load(t_dir)
    p = _prompts(1)[0]
    base = _run(target, p, DflashProvider(base_dir, max_tokens=MAX_TOKENS))
    off = _run(target, p, DflashProvider(ext_dir, max_tokens=MAX_TOKENS))
    assert off[0] == base[0] and off[1].trace == base[1].trace and off[1].proposals == base[1].proposals
    assert len(off[2]) == len(base[2])
    for (tb, bb), (to, bo) in zip(base[2], off[2]):
        assert tb == to
        assert bo.base_logits is None and bo.confidence is None
        assert np.array_equal(np.array(bb.logits), np.array(bo.logits))
        assert np.array_equal(np.array(bb.hidden), np.array(bo.hidden))


def test_extras_off_ignores_thresholds_and_env(monkeypatch):
    _, _, ext_dir = _dirs("qwen3")
    monkeypatch.setenv(calibration.THRESHOLDS_ENV, "0.9")
    prov = DflashProvider(ext_dir)
    assert prov.thresholds is None and prov.samples is None and prov.extension is None


def test_factory_extras_default_off_and_named():
    _, base_dir, ext_dir = _dirs("qwen3")
    import json

    from safetensors.numpy import load_file

    base_cfg = json.loads((base_dir / "config.json").read_text())
    ext_cfg = json.loads((ext_dir / "config.json").read_text())
    assert not any(k in base_cfg for k in ("markov_rank", "enable_confidence_head"))
    assert {k: ext_cfg[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                    "confidence_head_with_markov")} == {
        "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True}
    bt, et = load_file(str(base_dir / "model.safetensors")), load_file(str(ext_dir / "model.safetensors"))
    assert set(et) - set(bt) == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                                 "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert all(np.array_equal(bt[k], et[k]) for k in bt)
    with pytest.raises(KeyError, match="not in this kind's config"):
        checkpoints.build("dflash-drafter", 0, {"dspark_extras": {"rank": 4}})


def test_extras_on_a_plain_checkpoint_is_refused():
    _, base_dir, _ = _dirs("qwen3")
    with pytest.raises(dflash.DFlashError, match="needs a checkpoint with DSpark extras"):
        DflashProvider(base_dir, extras=True)


# ------------------------------------------------------------------------------------------------
# extras on


@pytest.mark.slow
@pytest.mark.parametrize("variant", harness.slow_except(["qwen3", "gemma4"], "qwen3"))
@pytest.mark.parametrize("markov", harness.slow_except(["vanilla", "gated", "rnn"], "rnn"))
def test_extras_on_is_lossless(variant, markov):
    """T=0 with the Markov head and pruning on (one threshold for every position) emits the
    target's own greedy stream; some proposals are pruned below the block."""
    ov = pair.VARIANTS[variant]
    t_dir, _, _ = _dirs(variant)
    ext = checkpoints.build("dflash-drafter", 0, {**ov, "dspark_extras": {**EXTRAS, "markov_head_type": markov}})
    target = targets.load(t_dir)
    for p in _prompts(2):
        plain, _ = shared.greedy(t_dir, [p], MAX_TOKENS, set())
        prov = DflashProvider(ext, extras=True, thresholds=[0.6])
        tokens, stats, rounds = _run(target, p, prov)
        assert tokens == plain
        assert any(len(t) < prov.trained_gamma for t, _ in rounds)


@pytest.mark.slow
def test_calibration_from_serve_rounds(calibrated):
    """Samples are one per verified draft position; the fit's thresholds come back through
    calibration.json, and the provider reads them (source "calibration")."""
    t_dir, ck, cal, samples = calibrated
    assert cal.samples == len(samples) and min(cal.samples_by_position) >= cal.min_samples
    assert calibration.read_calibration(ck) == cal.thresholds
    assert cal.thresholds[0] == 0.0 and any(0.0 < t < 1.0 for t in cal.thresholds[1:])
    prov = DflashProvider(ck, extras=True)
    assert prov.threshold_source == "calibration" and prov.thresholds == cal.thresholds
    print(f"\ncalibration (target {CAL_TARGET}): thresholds {np.round(cal.thresholds, 3).tolist()}, "
          f"samples/position {cal.samples_by_position}")


def test_threshold_source_order(calibrated, monkeypatch):
    """argument > env SPEC_PARITY_STS_THRESHOLDS > calibration.json > none."""
    _, ck, cal, _ = calibrated
    monkeypatch.setenv(calibration.THRESHOLDS_ENV, "0.0, 0.2,0.3")
    prov = DflashProvider(ck, extras=True)
    assert (prov.thresholds, prov.threshold_source) == ([0.0, 0.2, 0.3], "env")
    prov = DflashProvider(ck, extras=True, thresholds=[0.5])
    assert (prov.thresholds, prov.threshold_source) == ([0.5], "argument")
    monkeypatch.setenv(calibration.THRESHOLDS_ENV, "0.1,nope")
    with pytest.raises(calibration.ThresholdError, match="comma-separated floats"):
        DflashProvider(ck, extras=True)
    monkeypatch.delenv(calibration.THRESHOLDS_ENV)
    _, _, ext_dir = _dirs("qwen3")  # no calibration.json
    assert DflashProvider(ext_dir, extras=True).threshold_source is None


def _first_below(block, thresholds) -> int:
    conf = mx.sigmoid(block.confidence).tolist()
    th = thresholds * len(conf) if len(thresholds) == 1 else thresholds
    return next((k for k, (c, t) in enumerate(zip(conf, th)) if c < t), len(conf))


@pytest.mark.slow
def test_calibrated_pruning_is_applied_and_lossless(calibrated):
    """With the calibration.json thresholds every proposal stops exactly at the first
    below-threshold position, and the stream is still the target's greedy one."""
    t_dir, ck, cal, _ = calibrated
    target = targets.load(t_dir)
    pruned = 0
    for p in _prompts(2):
        plain, _ = shared.greedy(t_dir, [p], MAX_TOKENS, set())
        tokens, _, rounds = _run(target, p, DflashProvider(ck, extras=True))
        assert tokens == plain
        for t, b in rounds:
            assert len(t) == min(_first_below(b, cal.thresholds), len(b.tokens)) and t == b.tokens[:len(t)]
            pruned += len(t) < len(b.tokens)
    assert pruned > 0


@pytest.mark.slow
def test_ab_verdict_base_vs_extension(calibrated, record_property):
    """Paired A/B at T=0 over a few prompts: A = the plain DFlash source, B = the extension with
    the calibration's thresholds. Reported (acceptance delta, speed ratio, verdict), not asserted:
    this is not parity. run_ab itself raises if the arms' streams differ."""
    t_dir, ck, _, _ = calibrated
    _, base_dir, _ = _dirs("qwen3")

    def factory(path):
        return DflashProvider(path, extras=str(path) == str(ck))

    a, b = ab.run_ab(t_dir, base_dir, ck, _prompts(AB_PROMPTS, seed=29), gamma=7, max_tokens=32,
                     provider_factory=factory)
    v = ab.paired_verdict(a, b)
    record_property("ab", v.to_json())
    print(f"\nA/B base vs extension: acceptance A {v.a.acceptance:.4f} B {v.b.acceptance:.4f} "
          f"(delta {v.acceptance_delta_pts:+.2f} pts), tau A {v.a.tau:.3f} B {v.b.tau:.3f}, drafted A "
          f"{sum(r.drafted for r in a)} B {sum(r.drafted for r in b)}, speed x{v.speed_ratio:.2f}: {v.verdict}")
    assert v.verdict.startswith(("PASS", "FAIL")) and v.a.n_prompts == v.b.n_prompts == AB_PROMPTS
    assert sum(r.drafted for r in b) < sum(r.drafted for r in a)  # the pruning shortened proposals


# ------------------------------------------------------------------------------------------------
# negative controls


def test_control_thresholds_ignored_is_caught(calibrated):
    """Pruning skipped: some proposal runs past its first below-threshold position."""
    t_dir, ck, cal, _ = calibrated
    target = targets.load(t_dir)
    with controls.planted("dflash", "thresholds_ignored"):
        _, _, rounds = _run(target, _prompts(1)[0], DflashProvider(ck, extras=True))
    assert any(len(t) > _first_below(b, cal.thresholds) for t, b in rounds)


@pytest.mark.slow
def test_control_markov_before_softcap_is_caught():
    """Gemma-4 (softcap 30): the bias inside the softcap changes the extended logits vs the
    extension's definition (bias after the softcap). The tiny drafter's logits (|x| <~ 2) sit in
    tanh's linear range at cap 30, so its drafts barely move; with the drafter's softcap at 2.0
    (its logits near the cap) the drafts change too. On a target without a softcap (Qwen3 here)
    the two coincide, which is why the control runs with one."""
    ov = pair.VARIANTS["gemma4"]
    t_dir, _, ext_dir = _dirs("gemma4")
    strong = checkpoints.build("dflash-drafter", 0, {**ov, "final_logit_softcapping": 2.0, "dspark_extras": EXTRAS})
    for ck, drafts_differ in ((ext_dir, False), (strong, True)):
        _, good_stats, good = _unpruned(t_dir, ck)
        _, bad_stats, bad = _unpruned(t_dir, ck, "markov_before_softcap")
        gap = float(mx.abs(good[0][1].logits - bad[0][1].logits).max().item())
        assert gap > 1e-2, gap
        if drafts_differ:
            assert good_stats.proposals != bad_stats.proposals
        # the base rows (before the Markov head) are the same in both: only where the bias enters moved
        assert np.array_equal(np.array(good[0][1].base_logits), np.array(bad[0][1].base_logits))


@pytest.mark.slow
def test_markov_before_softcap_coincides_without_a_softcap():
    """Why the control needs a softcap: on Qwen3 (no softcap) the control's drafts are the
    extension's."""
    t_dir, _, ext_dir = _dirs("qwen3")
    _, good, _ = _unpruned(t_dir, ext_dir)
    _, bad, _ = _unpruned(t_dir, ext_dir, "markov_before_softcap")
    assert good.proposals == bad.proposals


# ------------------------------------------------------------------------------------------------
# the heads held to DeepSpec's (the L2 component of the L3 cases)


def _ext_case(name: str):
    return next(c for c in pair.PAIR.cases() if c.name == name)


def test_ext_plan_holds_the_heads_only_where_deepspec_answered():
    """With DeepSpec's arrays (live or golden) the plan holds the port's heads to them; without
    (a real checkpoint where DeepSpec is not installed) it holds the gates alone, and the reference's
    label says the heads were not run."""
    case = _ext_case("ext-qwen3")
    names = [c.name for c in pair.PAIR.plan(case, {"heads.logits": 0, "heads.confidence": 0}).checks]
    assert names[-2:] == ["markov_rows_vs_deepspec", "confidence_vs_deepspec"]
    assert not {"markov_rows_vs_deepspec", "confidence_vs_deepspec"} & {c.name for c in pair.PAIR.plan(case, {}).checks}


def test_ext_reference_without_deepspec(monkeypatch):
    """Not installed: the built-in case reads its golden; on a real checkpoint, or asked live, no
    arrays and a label naming why (the gates still run)."""
    monkeypatch.setattr(pair.PAIR, "oracle_status", lambda oracle: "DEEPSPEC_SRC is not set: fetch it")
    case = _ext_case("ext-qwen3")
    ref, label, _ = harness.reference(case, "auto")
    assert label == f"{pair.HEADS} (golden)" and set(pair.HEAD_INPUTS) <= set(ref)
    assert set(pair.PAIR.feeds(case, ref)) == set(pair.HEAD_INPUTS)
    ref, label, _ = harness.reference(case, "live")
    assert ref == {} and label == f"{pair.HEADS}: not run (DEEPSPEC_SRC is not set)"
    real = case.on_path(str(_dirs("qwen3")[0]))
    assert harness.reference(real, "auto")[0] == {}


@pytest.mark.parametrize("control", ["markov_first_token", "confidence_wrong_row"])
def test_heads_controls_pass_the_gates_and_fail_the_heads(control):
    """What each control's verdict says (against the golden): the L3 gates (lossless, pruning,
    shift) all hold, so without DeepSpec's heads the case would read PASS; the heads check fails.
    The first-token control moves exactly the first slot of every fed block."""
    case = _ext_case(f"ext-qwen3-control-{control}")
    result = harness.evaluate(case, "golden")
    assert result.verdict == "FAIL", result.message()
    assert all(result.metrics[k]["ok"] for k in ("lossless_vs_greedy", "pruning", "shift"))
    markov, confidence = result.metrics["markov_rows_vs_deepspec"], result.metrics["confidence_vs_deepspec"]
    if control == "markov_first_token":
        blocks, n, V = markov["shape"]
        assert not markov["ok"] and confidence["ok"] and markov["mismatch"] <= blocks * V
        assert all(slot == 0 for _, slot, _ in markov["first_mismatch"])
        assert result.reason.startswith("markov_rows_vs_deepspec:")
    else:
        assert markov["ok"] and not confidence["ok"]
        assert result.reason.startswith("confidence_vs_deepspec:")


@pytest.mark.oracle
@pytest.mark.parametrize("markov", harness.slow_except(["vanilla", "gated", "rnn"], "rnn"))
def test_heads_match_deepspec_teacher_forced(markov, live_oracle):
    """Every Markov head type (the cases run vanilla): the extension's heads as the source calls
    them, fed the same rows, anchors and chain as DeepSpec's own head functions, within the heads'
    budgets; DeepSpec's chain is the port's own greedy one."""
    from spec_parity import compare
    from spec_parity.drafters.dflash.adapter import fed_heads
    from spec_parity.oracles import dspark as oracle

    live_oracle("dspark")
    ov = pair.VARIANTS["qwen3"]
    case = _ext_case("ext-qwen3")
    drafter = ("dflash-drafter", 0, {**ov, "dspark_extras": {**EXTRAS, "markov_head_type": markov}})
    case = dataclasses.replace(case, params=dataclasses.replace(case.params, drafter=drafter))
    x = pair._head_inputs(case)
    ref = oracle.extension_heads(case.drafter_dir(), x["heads.hidden"], x["heads.base_logits"], x["heads.anchor"])
    ext = dflash.load_extension(case.drafter_dir())
    port = fed_heads(ext, {**x, "heads.tokens": ref["heads.tokens"]})
    result = compare.Result("dflash", case.name, pair.HEADS, "L3")
    for name, key, quantity in pair.HEAD_CHECKS:
        compare.check_tensor(result, name, port[key], ref[key], "dflash", quantity)
    assert result.ok, result.message()
    for b in range(len(x["heads.anchor"])):
        _, tokens, _ = ext(mx.array(x["heads.hidden"][b]), mx.array(x["heads.base_logits"][b]),
                           mx.array([int(x["heads.anchor"][b])], mx.uint32))
        assert tokens.tolist() == ref["heads.tokens"][b].tolist()

"""The comparison core on constructed inputs: each rule must be able to fail."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec_parity.budgets import BUDGETS, DTYPE_DEFAULTS, Budget, budget_for, knife_edge_bound
from spec_parity.compare import (
    Result,
    bit_exact,
    check_tensor,
    kl,
    stream_metrics,
    teacher_forced,
    tensor_metrics,
    trace_metrics,
    ulp,
)

FP32 = DTYPE_DEFAULTS["float32"]
rng = np.random.default_rng(0)


def test_every_budget_has_a_measurement_and_is_no_looser_than_needed():
    for key, b in BUDGETS.items():
        assert b.measured and "measure" in b.measured, key
        assert b.rtol == DTYPE_DEFAULTS[key[2]].rtol, key
    assert budget_for("no-such-module", "logits") == FP32


def test_within_budget_passes_and_one_planted_error_fails():
    ref = rng.standard_normal((4, 8)).astype(np.float32)
    assert tensor_metrics(ref.copy(), ref, FP32)["ok"]
    bad = ref.copy()
    bad[2, 3] += 1e-3
    m = tensor_metrics(bad, ref, FP32)
    assert not m["ok"] and m["mismatch"] == 1 and m["first_mismatch"] == [[2, 3]]
    assert m["max_abs"] == pytest.approx(1e-3, rel=1e-3) and m["mismatch_pct"] == pytest.approx(100 / 32)


def test_metrics_reported():
    ref = rng.standard_normal(1000)
    m = tensor_metrics(ref * (1 + 1e-7), ref, FP32)
    assert set(m) >= {"max_abs", "max_rel", "mismatch", "mismatch_pct", "first_mismatch", "nmse", "cosine", "max_ulp"}
    assert m["cosine"] == pytest.approx(1.0) and m["nmse"] < 1e-12


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_never_equal_to_finite(bad):
    ref = np.ones(5, np.float32)
    port = ref.copy()
    port[1] = bad
    assert not tensor_metrics(port, ref, Budget(1.0, 1.0))["ok"]
    assert not tensor_metrics(ref, port, Budget(1.0, 1.0))["ok"]


def test_nan_vs_nan_and_same_inf_are_identical_but_opposite_inf_is_not():
    a = np.array([1.0, np.nan, np.inf])
    assert tensor_metrics(a.copy(), a, FP32)["ok"]
    b = a.copy()
    b[2] = -np.inf
    assert not tensor_metrics(b, a, FP32)["ok"]


def test_shape_mismatch_fails():
    assert not tensor_metrics(np.zeros(3), np.zeros(4), FP32)["ok"]


def test_bit_exact_catches_one_ulp_and_dtype():
    a = rng.standard_normal(16).astype(np.float32)
    assert bit_exact(a.copy(), a)["ok"]
    b = a.copy()
    b[5] = np.nextafter(b[5], np.float32(np.inf))
    assert not bit_exact(b, a)["ok"]
    assert not bit_exact(a.astype(np.float64), a)["ok"]


@given(st.floats(min_value=1e-3, max_value=1e4))
def test_ulp_matches_numpy_spacing_fp32(x):
    assert ulp(np.array([x]), "float32")[0] == np.spacing(np.float32(x))


def test_bf16_ulp():
    assert ulp(np.array([1.0]), "bfloat16")[0] == 2**-7
    assert ulp(np.array([20.0]), "bfloat16")[0] == 2**-3


def _logits(n=6, v=10, margin=5.0):
    lg = rng.standard_normal((n, v))
    toks = lg.argmax(-1)
    lg[np.arange(n), toks] += margin
    return lg, toks


def test_equal_streams_pass_and_a_divergence_fails_with_its_index():
    lg, toks = _logits()
    assert stream_metrics(toks, toks, lg)["ok"]
    port = toks.copy()
    port[3] = (port[3] + 1) % 10
    m = stream_metrics(port, toks, lg)
    assert not m["ok"] and m["first_divergence"] == 3 and not m["knife_edge"]
    assert m["ref_margin"] >= 5.0


def test_knife_edge_excused_only_below_the_ulp_bound():
    lg, toks = _logits()
    alt = (toks[2] + 1) % 10
    bound = knife_edge_bound("float32", abs(lg[2, toks[2]]))
    lg[2, alt] = lg[2, toks[2]] - bound / 4
    port = toks.copy()
    port[2] = alt
    m = stream_metrics(port, toks, lg)
    assert m["ok"] and m["knife_edge"] and m["port_in_ref_topk"]
    lg[2, alt] = lg[2, toks[2]] - 4 * bound
    assert not stream_metrics(port, toks, lg)["ok"]


def test_shorter_stream_is_a_divergence():
    lg, toks = _logits()
    assert not stream_metrics(toks[:4], toks, lg)["ok"]


def test_teacher_forced_scores_every_position():
    lg, toks = _logits()
    m = teacher_forced(lg, lg, toks)
    assert m["agree"] == 6 and m["kl_max"] == pytest.approx(0.0, abs=1e-12)
    worse = lg.copy()
    worse[4] = -worse[4]
    m = teacher_forced(worse, lg, toks)
    assert m["agree"] == 5 and m["first_disagreement"] == 4 and m["kl_per_position"][4] > 1


def test_kl_is_zero_on_equal_and_positive_otherwise():
    lg, _ = _logits()
    assert np.allclose(kl(lg, lg), 0)
    assert (kl(lg, lg[::-1]) > 0).all()


def test_trace_compare():
    t = [(4, 2, 3), (4, 4, 5), (4, 0, 1)]
    assert trace_metrics(t, t)["ok"]
    m = trace_metrics(t[:1] + [(4, 3, 4)] + t[2:], t)
    assert not m["ok"] and m["first_differing_round"] == 1 and m["port_round"] == [4, 3, 4]
    assert not trace_metrics(t[:2], t)["ok"]


def test_l3_shift_and_pruning_checks():
    """The L3 checks judge what they are given: KL gates both ways, and the pruning rule
    recomputed from the confidences (a proposal past its first below-threshold position fails)."""
    from spec_parity.checks import P, Plan, Pruning, Shift, judge

    lg = np.random.default_rng(0).normal(size=(6, 10))
    gates = {"kl_mean_min": 1e-3, "kl_mean_max": 1.0, "top1_min": 0.0}
    conf = np.array([2.0, 2.0, -2.0, 2.0, -3.0, 2.0], np.float32)          # sigmoid: .88 .88 .12 .88 .05 .88
    for moved, proposed, ok in ((lg + 0.5 * lg[::-1], [2, 1], True), (lg, [2, 1], False),
                                (lg + 0.5 * lg[::-1], [3, 1], False)):
        sides = {"port": {"b": lg, "e": moved, "c": conf, "n": np.array([3, 3]), "p": np.array(proposed)}}
        plan = Plan([Shift("shift", P("b"), P("e"), gates), Pruning("pruning", P("c"), P("n"), P("p"), (0.5,))])
        r = Result("m", "c", "o", "L3")
        judge(plan, sides, "m", "float32", r)
        assert r.ok == ok, r.message()

def test_result_renders_as_message_json_and_markdown():
    r = Result("targets", "c", "transformers (live)", "L2")
    ref = rng.standard_normal(8)
    check_tensor(r, "logits", ref + 1.0, ref, "targets", "logits")
    assert not r.ok and "logits" in r.reason
    assert "[FAIL] targets/c" in r.message() and "max_abs" in r.message()
    assert json.loads(json.dumps(r.to_json()))["verdict"] == "FAIL"
    assert r.markdown_row().startswith("| targets | c |")


def test_l1_tier_uses_bit_exactness():
    r = Result("m", "c", "o", "L1")
    a = np.float32([1.0, 2.0])
    check_tensor(r, "x", a + np.spacing(a), a, "m", "x")
    assert not r.ok


def test_longer_port_stream_is_a_divergence_without_a_margin():
    lg, toks = _logits()
    m = stream_metrics(np.concatenate([toks, [1]]), toks, lg)
    assert not m["ok"] and m["first_divergence"] == len(toks) and "ref_margin" not in m

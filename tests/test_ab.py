"""spec_parity.port.ab: paired drafter A/B statistics (seed semantics), the report, and `spec-parity ab`.

Same scheme as tests/test_calibration.py: each property is a plain `prop_*(verdict_fn, example)`;
the `@given` test runs it on the port, its control on the port with one planted bug
(spec_parity/controls/ab.py, applied from outside), found by hypothesis `find` within the default
example count; the port equals a transcription of the seed's ab-stats.ts (the reference).
"""

from __future__ import annotations

import json

import pytest
from deepdiff import DeepDiff
from hypothesis import given
from hypothesis import strategies as st

from spec_parity import checkpoints, controls, harness
from spec_parity.port import ab

from controls import must_fail

# --- strategies ----------------------------------------------------------------------------------


@st.composite
def prompt_results(draw, gamma):
    drafted_by_pos = [draw(st.integers(0, 12)) for _ in range(gamma)]
    accepted_by_pos = [draw(st.integers(0, d)) for d in drafted_by_pos]
    return ab.AbPromptResult(
        prompt="1 2 3", generated_tokens=draw(st.integers(0, 64)), drafted=sum(drafted_by_pos),
        accepted=sum(accepted_by_pos), target_calls=draw(st.integers(0, 40)),
        wall_ms=draw(st.one_of(st.just(0.0), st.sampled_from([10.0, 20.0, 50.0]), st.floats(0.001, 1e4))),
        drafted_by_pos=drafted_by_pos, accepted_by_pos=accepted_by_pos)


@st.composite
def paired_arms(draw):
    """(A's results, B's results, max_drop_pts): B is a copy of A (a tie on every count), A with
    only the wall clock redrawn, or independent; per-prompt gammas may differ."""
    n = draw(st.integers(0, 6))
    a = [draw(prompt_results(draw(st.integers(0, 4)))) for _ in range(n)]
    how = draw(st.sampled_from(["copy", "retimed", "independent"]))
    if how == "copy":
        b = [ab.AbPromptResult(**r.to_json()) for r in a]
    elif how == "retimed":
        b = [ab.AbPromptResult(**{**r.to_json(), "wall_ms": draw(st.sampled_from([10.0, 20.0, 50.0]))}) for r in a]
    else:
        b = [draw(prompt_results(draw(st.integers(0, 4)))) for _ in range(n)]
    max_drop = draw(st.one_of(st.just(3), st.sampled_from([0, 0.5, 2.5]), st.floats(0, 20)))
    return a, b, max_drop


# --- the seed, transcribed (mlx-bun 0.0.11 ab-stats.ts, in its own shape): the reference ---------


def seed_summarize(results):
    def total(f):
        return sum(f(r) for r in results)

    generated, drafted, accepted = total(lambda r: r.generated_tokens), total(lambda r: r.drafted), total(lambda r: r.accepted)
    calls, wall = total(lambda r: r.target_calls), total(lambda r: r.wall_ms)
    gamma = max([0, *[len(r.drafted_by_pos) for r in results]])
    by_pos = []
    for i in range(gamma):
        d = total(lambda r, i=i: r.drafted_by_pos[i] if i < len(r.drafted_by_pos) else 0)
        a = total(lambda r, i=i: r.accepted_by_pos[i] if i < len(r.accepted_by_pos) else 0)
        by_pos.append(a / d if d > 0 else 0.0)
    return ab.AbArmSummary(len(results), generated, accepted / drafted if drafted > 0 else 0.0,
                           generated / calls if calls > 0 else 0.0,
                           generated / wall * 1000 if wall > 0 else 0.0, by_pos)


def seed_verdict(a_results, b_results, max_drop_pts=3):
    if len(a_results) != len(b_results):
        raise ValueError(f"paired_verdict: arm sizes differ ({len(a_results)} vs {len(b_results)})")
    a, b = seed_summarize(a_results), seed_summarize(b_results)
    delta = (b.acceptance - a.acceptance) * 100
    ratio = b.tok_per_sec / a.tok_per_sec if a.tok_per_sec > 0 else 0.0
    rates = [(ra.accepted / ra.drafted if ra.drafted > 0 else 0.0, rb.accepted / rb.drafted if rb.drafted > 0 else 0.0)
             for ra, rb in zip(a_results, b_results)]
    holds = sum(1 for acc_a, acc_b in rates if acc_b >= acc_a - max_drop_pts / 100)
    ok = delta >= -max_drop_pts
    passed = ok and ratio > 1
    verdict = ab.verdict_text(delta, ratio, max_drop_pts, ok, passed)   # the wording, not the rule
    return ab.AbVerdict(a, b, delta, ratio, holds, max_drop_pts, passed, verdict)


def planted_verdict(a, b, m=3):
    """The port's verdict looked up at call time, so a control planted around it (controls/ab.py) shows."""
    return ab.paired_verdict(a, b, m)


# --- the properties ------------------------------------------------------------------------------


def prop_sign_symmetry(verdict, ex):
    """Swapping the arms negates the acceptance delta exactly and inverts the speed ratio."""
    a, b, m = ex
    ab_, ba = verdict(a, b, m), verdict(b, a, m)
    assert ab_.acceptance_delta_pts == -ba.acceptance_delta_pts
    if ab_.speed_ratio > 0 and ba.speed_ratio > 0:
        assert abs(ab_.speed_ratio * ba.speed_ratio - 1) < 1e-9


def prop_counts_bounded(verdict, ex):
    """Prompt counts, paired holds and every acceptance stay in range for valid inputs."""
    a, b, m = ex
    v = verdict(a, b, m)
    assert v.a.n_prompts == v.b.n_prompts == len(a)
    assert 0 <= v.paired_acceptance_holds <= len(a)
    for s, results in ((v.a, a), (v.b, b)):
        assert 0 <= s.acceptance <= 1
        assert all(0 <= x <= 1 for x in s.acceptance_by_pos), s.acceptance_by_pos
        assert len(s.acceptance_by_pos) == max([0] + [len(r.drafted_by_pos) for r in results])
        assert s.generated_tokens == sum(r.generated_tokens for r in results)
        assert s.tau >= 0 and s.tok_per_sec >= 0


def prop_pass_iff_both(verdict, ex):
    """PASS iff (B - A acceptance, in points) >= -max_drop AND B's tok/s strictly above A's; the
    wording names which condition failed."""
    a, b, m = ex
    v = verdict(a, b, m)

    def acc(rs):
        d = sum(r.drafted for r in rs)
        return sum(r.accepted for r in rs) / d if d else 0.0

    def tps(rs):
        w = sum(r.wall_ms for r in rs)
        return sum(r.generated_tokens for r in rs) / w * 1000 if w else 0.0

    held = (acc(b) - acc(a)) * 100 >= -m
    faster = tps(a) > 0 and tps(b) / tps(a) > 1
    assert v.passed == (held and faster), (v.verdict, held, faster)
    assert v.verdict.startswith("PASS — ") == v.passed
    if not v.passed:
        assert ("wall-clock did not improve" in v.verdict) == held, v.verdict


def check_size_mismatch(verdict):
    one = ab.AbPromptResult("1", 4, 4, 2, 3, 10.0, [2, 2], [1, 1])
    for a, b in (([one], []), ([], [one]), ([one, one], [one])):
        try:
            verdict(a, b)
        except ValueError as e:
            assert str(e) == f"paired_verdict: arm sizes differ ({len(a)} vs {len(b)})"
        else:
            raise AssertionError(f"no error for arms of {len(a)} and {len(b)} prompts")


AB_PROPS = {
    # property: (body, planted bug that must fail it)
    "sign_symmetry": (prop_sign_symmetry, "relative_delta"),
    "counts_bounded": (prop_counts_bounded, "by_pos_over_prompts"),
    "pass_iff_both": (prop_pass_iff_both, "speed_not_strict"),
}


@pytest.mark.property
@given(paired_arms())
def test_ab_sign_symmetry(ex):
    prop_sign_symmetry(ab.paired_verdict, ex)


@pytest.mark.property
@given(paired_arms())
def test_ab_counts_bounded(ex):
    prop_counts_bounded(ab.paired_verdict, ex)


@pytest.mark.property
@given(paired_arms())
def test_ab_pass_iff_both(ex):
    prop_pass_iff_both(ab.paired_verdict, ex)


@pytest.mark.property
@pytest.mark.parametrize("name", sorted(AB_PROPS))
def test_ab_control(name):
    prop, bug = AB_PROPS[name]
    with controls.planted("ab", bug):
        must_fail(lambda ex: prop(planted_verdict, ex), paired_arms())


@pytest.mark.property
@given(paired_arms())
def test_ab_equals_seed_transcription(ex):
    a, b, m = ex
    assert DeepDiff(ab.paired_verdict(a, b, m).to_json(), seed_verdict(a, b, m).to_json()) == {}


def test_ab_arm_size_mismatch():
    check_size_mismatch(ab.paired_verdict)


@pytest.mark.property
def test_ab_arm_size_mismatch_control():
    with controls.planted("ab", "no_size_check"):
        must_fail(lambda _: check_size_mismatch(planted_verdict), fixed=[None])


# --- wording and the report ----------------------------------------------------------------------


def _arm(accepted: int, wall_ms: float, drafted: int = 100):
    return [ab.AbPromptResult("5 6 7", 100, drafted, accepted, 40, wall_ms, [drafted // 2, drafted // 2],
                              [accepted - accepted // 2, accepted // 2])]


def test_verdict_wording_says_rose_or_dropped():
    base = _arm(50, 1000.0)
    cases = [
        (_arm(49, 500.0), True, "PASS — acceptance dropped 1.0 pts (within 3), wall-clock ×2.00"),
        (_arm(40, 500.0), False, "FAIL — acceptance dropped 10.0 pts (limit 3); B does not preserve A's acceptance"),
        (_arm(50, 1000.0), False, "FAIL — acceptance unchanged at 0.0 pts (within 3) but wall-clock did not improve (×1.00)"),
        (_arm(60, 2000.0), False, "FAIL — acceptance rose 10.0 pts (within 3) but wall-clock did not improve (×0.50)"),
    ]
    for b, passed, text in cases:
        v = ab.paired_verdict(base, b)
        assert (v.passed, v.verdict) == (passed, text)
    assert ab.paired_verdict(base, _arm(47, 500.0), max_drop_pts=2.5).verdict.startswith("FAIL — acceptance dropped 3.0 pts (limit 2.5)")
    # JS toFixed: exact binary value, half away from zero; -0 prints 0
    assert [ab.to_fixed(x, d) for x, d in [(0.25, 1), (-2.25, 1), (2.5, 0), (1.005, 2), (-0.04, 1), (-0.0, 1)]] == \
        ["0.3", "-2.3", "3", "1.00", "-0.0", "0.0"]


def test_render_report():
    a = _arm(50, 1000.0) + _arm(30, 1000.0, drafted=60)
    b = _arm(49, 500.0) + _arm(20, 400.0, drafted=60)
    text, doc = ab.render_report("q4", "q3", ab.paired_verdict(a, b))
    assert text == "\n".join([
        "  A: q4                        acceptance  50.0%  τ 2.50  100.0 tok/s  (200 tok over 2 prompts)",
        "  B: q3                        acceptance  43.1%  τ 2.50  222.2 tok/s  (200 tok over 2 prompts)",
        "  A: q4                        by-pos [50.0% 50.0%]",
        "  B: q3                        by-pos [43.8% 42.5%]",
        "  paired: B holds A's acceptance on 1/2 prompts",
        "  FAIL — acceptance dropped 6.9 pts (limit 3); B does not preserve A's acceptance",
    ])
    expected = {
        "labels": {"a": "q4", "b": "q3"},
        "a": {"n_prompts": 2, "generated_tokens": 200, "acceptance": 0.5, "tau": 2.5, "tok_per_sec": 100.0,
              "acceptance_by_pos": [0.5, 0.5]},
        "b": {"n_prompts": 2, "generated_tokens": 200, "acceptance": 69 / 160, "tau": 2.5,
              "tok_per_sec": 200 / 900 * 1000, "acceptance_by_pos": [35 / 80, 34 / 80]},
        "acceptance_delta_pts": (69 / 160 - 0.5) * 100, "speed_ratio": (200 / 900 * 1000) / 100.0,
        "paired_acceptance_holds": 1, "max_drop_pts": 3, "pass": False,
        "verdict": "FAIL — acceptance dropped 6.9 pts (limit 3); B does not preserve A's acceptance",
    }
    assert DeepDiff(doc, expected, math_epsilon=1e-12) == {}
    assert DeepDiff(json.loads(json.dumps(doc)), doc) == {}  # JSON-able as is


def test_read_prompts(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("# a comment\n2 17 33\n\n  5\t6 7  \n")
    assert ab.read_prompts(f, vocab_size=128) == [[2, 17, 33], [5, 6, 7]]
    for bad in ("2 x 3\n", "2 128\n", "-1 2\n", "# only a comment\n"):
        f.write_text(bad)
        with pytest.raises(ValueError):
            ab.read_prompts(f, vocab_size=128)


# --- the command, on two tiny drafters -------------------------------------------------------------


class _Recording:
    """Wraps a provider and logs which arm opened a request, in order."""

    def __init__(self, inner, log, name):
        self.inner, self.log, self.name = inner, log, name
        self.id, self.weights_bytes, self.trained_gamma = inner.id, inner.weights_bytes, inner.trained_gamma

    def open(self, view):
        self.log.append(self.name)
        return self.inner.open(view)

    def dispose(self):
        self.inner.dispose()


@pytest.mark.slow
def test_ab_command_on_tiny_drafters(tmp_path, capsys):
    from spec_parity import checkpoints, cli
    from spec_parity.port.sources.assistant import AssistantProvider

    target = checkpoints.build("gemma4-target", 0, {})
    da, db = checkpoints.build("gemma4-assistant", 0, {}), checkpoints.build("gemma4-assistant", 1, {})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# token ids\n2 17 33 5 90 41 7 12\n2 64 3 99 27 8\n")
    out = tmp_path / "ab.json"
    rc = cli.main(["ab", "--target", str(target), "--a", str(da), "--b", str(db), "--prompts", str(prompts),
                   "--gamma", "3", "--max-tokens", "8", "--json", str(out)])
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert rc == (0 if doc["pass"] else 1)
    assert doc["verdict"] in printed and "paired: B holds A's acceptance on" in printed
    results = {arm: [ab.AbPromptResult(**r) for r in doc["prompts"][arm]] for arm in ("a", "b")}
    assert [r.prompt for r in results["a"]] == [r.prompt for r in results["b"]] == ["2 17 33 5 90 41 7 12", "2 64 3 99 27 8"]
    for r in results["a"] + results["b"]:
        assert r.drafted == sum(r.drafted_by_pos) and r.accepted == sum(r.accepted_by_pos)
        assert len(r.drafted_by_pos) == 3 and 0 < r.generated_tokens <= 8 and r.wall_ms > 0
    # the JSON's report is exactly the report of its own per-prompt results
    _, again = ab.render_report(da.name, db.name, ab.paired_verdict(results["a"], results["b"]))
    assert DeepDiff({k: doc[k] for k in again}, again) == {}

    # arm order alternates per prompt, after one untimed warm-up of each arm
    log: list[str] = []
    a_res, b_res = ab.run_ab(target, da, db, [[2, 17, 33], [2, 64, 3], [5, 6, 7]], gamma=2, max_tokens=4,
                             provider_factory=lambda p: _Recording(AssistantProvider(p), log, "a" if p == da else "b"))
    assert log == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert len(a_res) == len(b_res) == 3


@pytest.mark.parametrize("target, drafter, overrides", harness.slow_except([
    ("gemma4-target", "gemma4-assistant", {}),
    ("gemma4-target", "dspark-drafter", {}),
    ("qwen3-target", "dflash-drafter", {}),
    ("qwen3-target", "dflash-drafter", {"dspark_extras": {"markov_rank": 8, "markov_head_type": "vanilla",
                                                          "confidence": True}}),
], ("gemma4-target", "dspark-drafter", {})))
def test_ab_takes_every_draft_source(target, drafter, overrides):
    """Each arm's provider comes from its config (assistant, DSpark, DFlash, DSpark-on-DFlash);
    block drafters draft their trained block by default."""
    t = checkpoints.build(target, 0, {})
    a, b = checkpoints.build(drafter, 0, overrides), checkpoints.build(drafter, 1, overrides)
    ra, rb = ab.run_ab(t, a, b, [[3, 4, 5, 6, 7, 8]], max_tokens=8, warmup=False)
    assert ra[0].drafted > 0 and rb[0].drafted > 0
    assert ab.paired_verdict(ra, rb).verdict.startswith(("PASS — acceptance", "FAIL — acceptance"))


def test_readme_says_which_drafters_ab_takes():
    """README names every draft source `ab` takes (test_ab_takes_every_draft_source runs them)."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    line = text[text.index("spec-parity ab --target"):][:300]
    for name in ("Gemma-4 assistant", "DSpark", "DFlash", "DSpark-on-DFlash"):
        assert name in line, (name, line)

"""`spec-parity bench --serve`: the command runs, every side reports tok/s or a reason, our loop's
stream equals plain greedy decode (T=0 is lossless) and a planted wrong token is caught, the
agreeing kinds set a tau above the random drafters'. Speed figures are reported, never asserted."""

from __future__ import annotations

import json

import pytest

from spec_parity import cli, controls
from spec_parity.bench import combine, loop_sides, loops
from spec_parity.bench.sides import Side
from spec_parity.port.fast import kernels

SMALL = dict(sources=("dspark",), sides=["port"], prompt_len=32, new_tokens=12, runs=2)


def _sides(doc: dict, condition: str) -> dict:
    case = next(c for c in doc["cases"] if c["condition"] == condition)
    return {s["side"]: s for s in case["sides"]}


@pytest.fixture(scope="module")
def small():
    return loops.run(loops.Options(**SMALL))


@pytest.mark.slow
def test_our_stream_is_plain_decode_and_agreeing_tau_is_above_random(small):
    random, agreeing = _sides(small, "random"), _sides(small, "agreeing")
    for sides in (random, agreeing):
        assert sides["plain"]["status"] == "ok" and sides["port"]["status"] == "ok"
        assert sides["port"]["stream"]["lossless"] is True
        assert sides["port"]["check_tokens"] == sides["plain"]["check_tokens"]
        assert len(sides["port"]["check_tokens"]) == SMALL["new_tokens"]
        assert sides["port"]["decode_tokens_per_s"]["median"] > 0 and sides["port"]["round_split_s"]
    assert random["port"]["tau"] < 1.5 < agreeing["port"]["tau"]
    assert random["port"]["acceptance"] < agreeing["port"]["acceptance"]


@pytest.mark.slow
def test_a_loop_that_emits_a_wrong_token_is_caught():
    with controls.planted("bench", "serve_wrong_token"):
        doc = loops.run(loops.Options(**{**SMALL, "conditions": ("random",)}))
    sides = _sides(doc, "random")
    assert sides["port"]["stream"] == {"lossless": False, "first_divergence": SMALL["new_tokens"] - 1,
                                       "compared": SMALL["new_tokens"]}
    assert "no (at 11)" in loops.markdown(doc)


def test_stream_check_names_the_first_divergence():
    assert loops.stream_check([1, 2, 3], [1, 2, 3])["lossless"] is True
    assert loops.stream_check([1, 5, 3], [1, 2, 3])["first_divergence"] == 1
    assert loops.stream_check([1, 2], [1, 2, 3]) == {"lossless": False, "first_divergence": 2, "compared": 3}


def test_every_request_is_at_its_own_lengths_and_walks_the_same_stretch():
    opts = loops.Options(prompt_len=50, new_tokens=10, runs=4)
    check, split, per_side = loops.prompt_plan(opts, 3, 100, 0)
    prompts = [check, split] + [p for side in per_side for p in side]
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] == 50 and all(b - a > opts.new_tokens + 16 for a, b in zip(lengths, lengths[1:]))
    assert {p[-1] for p in prompts} == {check[-1]} and min(min(p) for p in prompts) >= 3
    means = {sum(len(p) for p in side) / len(side) for side in per_side}
    assert len(means) == 1  # runs reversed on odd rounds: every side's mean length is the same


def test_a_side_that_cannot_run_records_why(monkeypatch):
    def broken(case, env):
        raise ImportError("No module named 'nothing'")
    monkeypatch.setitem(loop_sides.SIDES, "port", Side("port", ("dspark",), broken, install="pip install nothing"))
    port = loops.side_result([loops.run_pass(loop_sides.SIDES["port"], None, None, [], [], [], 4)], None)
    assert port["status"] == "not run" and "install: pip install nothing" in port["reason"]


def test_a_side_that_fails_while_it_runs_records_why(monkeypatch):
    def failing(ckpt, env):
        def generate(prompt, n):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return loop_sides.Loop(generate)
    monkeypatch.setitem(loop_sides.SIDES, "port", Side("port", ("dspark",), failing))
    port = loops.side_result([loops.run_pass(loop_sides.SIDES["port"], None, None, [[3]], [3], [3], 4)], None)
    assert port["status"] == "failed" and port["reason"].startswith("RuntimeError: CUDA error")


@pytest.mark.slow
@pytest.mark.parametrize("source", ("assistant", "dspark", "dflash"))   # spread over the workers
def test_the_command_runs_every_side_at_tiny_shapes(tmp_path, source):
    out = tmp_path / "serve"
    assert cli.main(["bench", "--serve", "--sources", source, "--prompt-len", "24", "--new-tokens", "8", "--runs", "2",
                     "--torch-device", "cpu", "--out", str(out)]) == 0
    doc = json.loads((out / "serve.json").read_text())
    assert (out / "serve.md").read_text().startswith("# spec-parity bench --serve")
    assert {(c["condition"], c["source"]) for c in doc["cases"]} == {   # the default --conditions
        (k, source) for k in ("random", "agreeing")}
    for c in doc["cases"]:
        assert c["status"] == "ok"
        assert {s["side"] for s in c["sides"]} == {x.name for x in loop_sides.sides_for(c["source"], None)}
        for s in c["sides"]:
            assert (s["status"] == "ok" and s["decode_tokens_per_s"]["median"] > 0) or s.get("reason"), s
            if s["side"] == "port-kernel" and not kernels.available():
                assert s["status"] == "not run" and "CUDA" in s["reason"], s
            elif s["side"] in loop_sides.OURS:
                assert s["stream"]["lossless"] is True, (c["case"], s["side"])


def test_plain_and_our_default_are_in_every_selection():
    """--peers names the extra sides; plain decode (the baseline) and our default loop run in every
    --serve case, as `port` does in the step bench (a run without them has no figure to compare)."""
    for source in ("assistant", "dspark", "dflash"):
        names = [s.name for s in loop_sides.sides_for(source, ["zlab-mlx"])]
        assert names[:2] == ["plain", "port"] and set(names) <= {"plain", "port", "zlab-mlx"}
        assert [s.name for s in loop_sides.sides_for(source, [])][:2] == ["plain", "port"]


def test_sides_run_in_two_passes_the_second_reversed(monkeypatch, tmp_path):
    """A B C, then C B A: each side built twice with half of its timed requests, its figures over
    both passes; a side whose first pass could not run is not built again (one pass in sequence,
    the design before, builds each side once: the order below fails)."""
    built = []

    def fake(name, fail=False):
        def build(ckpt, env):
            built.append(name)
            if fail:
                raise ImportError("No module named 'nothing'")

            def generate(prompt, n):
                return loop_sides.Run(tokens=list(range(n)), t_first=0.0, t_end=len(prompt) * 1e-3, n_first=1,
                                      rounds=n - 1)
            return loop_sides.Loop(generate)
        return Side(name, ("dspark",), build, install="pip install nothing")

    sides = [fake("plain"), fake("port"), fake("peer"), fake("gone", fail=True)]
    monkeypatch.setattr(loop_sides, "sides_for", lambda source, wanted: sides)
    opts = loops.Options(sources=("dspark",), conditions=("random",), prompt_len=16, new_tokens=4, runs=4)
    case = loops.cases(opts)[0][1]
    out = loops.run_case("random", case, opts, None, tmp_path, lambda msg: None)
    assert built == ["plain", "port", "peer", "gone", "peer", "port", "plain"]
    rows = {r["side"]: r for r in out["sides"]}
    assert rows["gone"]["status"] == "not run"
    _, _, per_side = loops.prompt_plan(opts, len(sides), 1000, 0)
    for i, name in enumerate(["plain", "port", "peer"]):
        assert rows[name]["status"] == "ok" and len(rows[name]["samples_tokens_per_s"]) == opts.runs
        assert rows[name]["prompt_lens"] == [len(p) for p in per_side[i][0::2] + per_side[i][1::2]]
    assert rows["port"]["stream"]["lossless"] is True


def test_a_serve_run_stopped_midway_keeps_its_finished_cases(tmp_path, monkeypatch):
    """serve.json is written after each case: a run that stops in its second case (planted from
    outside: run_case raises there) leaves the first on disk, marked incomplete, and combine
    names where it stopped."""
    calls = []

    def run_case(condition, case, *args):
        calls.append(condition)
        if len(calls) == 2:
            raise RuntimeError("stopped in the second case")
        return {"case": case.name, "condition": condition, "status": "ok", "sides": []}

    monkeypatch.setattr(loops, "run_case", run_case)
    with pytest.raises(RuntimeError, match="second case"):
        cli.main(["bench", "--serve", "--sources", "dspark", "--runs", "2", "--out", str(tmp_path / "a")])
    doc = json.loads((tmp_path / "a" / "serve.json").read_text())
    assert [c["condition"] for c in doc["cases"]] == ["random"] and doc["complete"] is False
    assert doc["cases_planned"] == 2 and not (tmp_path / "a" / "serve.md").exists()
    calls.clear()
    with pytest.raises(RuntimeError):
        cli.main(["bench", "--serve", "--sources", "dspark", "--runs", "2", "--out", str(tmp_path / "b")])
    printed = combine.markdown(combine.combine(*combine.load([tmp_path / "a", tmp_path / "b"])))
    assert "stopped after 1 of its 2 cases" in printed

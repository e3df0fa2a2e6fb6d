"""A verdict says what it checked, and a port's arrays keep the output contract before any
tolerance. The ports here are our own port behind wrappers (applied from outside the product
code) that leave the optional quantities out, break one rule of the contract, or decline; the
unchanged wrapper is each test's control (our port exposes everything and keeps the contract)."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from spec_parity import cli, compare, controls, harness, ports, protocol
from spec_parity.budgets import budget_for

QWEN3 = "targets/qwen3"
PORTS = '''
from spec_parity import ports, protocol

def _wrap(name, change):
    ours = ports.ours().runs["targets"]
    return ports.Port(name, "0", {"targets": lambda req: change(req, ours(req))})

def public():
    def required(req, out):
        p = protocol.get(req.module, req.kind)
        return {k: v for k, v in out.items() if p.quantity(k) is not None and p.quantity(k).required}
    return _wrap("public-only", required)

def full():
    return _wrap("full", lambda req, out: out)

def declining():
    def run(req):
        raise ports.Declined("no such kind here")
    return ports.Port("decliner", "0", {"targets": run})
'''


def _case(case_id):
    return next(c for c in harness.all_cases() if c.id == case_id)


def _port(module, name, change):
    """Our port on `module`, its arrays passed through `change(request, arrays) -> arrays`."""
    ours = ports.ours().runs[module]
    return ports.Port(name, "0", {module: lambda req: change(req, dict(ours(req)))}, (__file__,))


def _evaluate(case_id, port):
    case = _case(case_id)
    return harness.evaluate(case, "golden", ports.Selection({case.module: port}))


def _required_only(req, out):
    p = protocol.get(req.module, req.kind)
    return {k: v for k, v in out.items() if p.quantity(k) is not None and p.quantity(k).required}


def test_a_public_outputs_only_port_is_pass_partial():
    """Passing every check it exposed arrays for is not PASS when most checks could not run: the
    verdict and its coverage say which did not."""
    full = _evaluate(QWEN3, _port("targets", "full", lambda req, out: out))
    assert full.verdict == "PASS" and not full.coverage["not_exposed"], full.message()
    r = _evaluate(QWEN3, _port("targets", "public-only", _required_only))
    assert r.verdict == "PASS-PARTIAL" and r.ok, r.message()
    assert r.coverage["checked"] == ["logits", "stream"], r.coverage
    assert {"final", "hidden.0", "layers", "teacher_forced"} <= set(r.coverage["not_exposed"])
    assert r.coverage["quantities"] == {"required": ["logits", "stream.tokens"], "optional": []}
    n = len(r.coverage["not_exposed"])
    assert f"public outputs only: {n} checks not run: final, hidden.0" in r.reason
    assert "coverage: 2 checks run on 2 required and 0 optional quantities" in r.message()
    assert r.checks_run == f"2/{2 + n}" and f"/{2 + n}" in full.checks_run


def _cli(monkeypatch, tmp_path, factory, *extra):
    (tmp_path / "wrapped_ports.py").write_text(PORTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return cli.main(["run", "--module", "targets", "--case", "qwen3", "--source", "golden", "--out",
                     str(tmp_path / factory), "--port", f"targets=wrapped_ports:{factory}", *extra])


def test_a_pass_partial_is_not_green_unless_required_so(monkeypatch, tmp_path, capsys):
    """PASS-PARTIAL exits 4 by default (counted apart: not green), 0 under --require outputs, 1
    under --require internals; a port that exposes everything exits 0 under each."""
    import json

    assert _cli(monkeypatch, tmp_path, "public") == compare.PARTIAL_EXIT
    out = capsys.readouterr().out
    assert "0/1 as expected (controls must FAIL), 1 passed only what the port exposes (PASS-PARTIAL" in out
    row = json.loads((tmp_path / "public" / "report.json").read_text())["results"][0]
    assert row["verdict"] == "PASS-PARTIAL" and row["coverage"]["checked"] == ["logits", "stream"]
    assert "final" in row["coverage"]["not_exposed"]
    assert "| PASS-PARTIAL | 2/" in (tmp_path / "public" / "report.md").read_text()
    assert _cli(monkeypatch, tmp_path, "public", "--require", "outputs") == 0
    capsys.readouterr()
    assert _cli(monkeypatch, tmp_path, "public", "--require", "internals") == 1
    assert "0/1 as expected" in capsys.readouterr().out
    for require in ((), ("--require", "outputs"), ("--require", "internals")):     # the control
        assert _cli(monkeypatch, tmp_path, "full", *require) == 0
        assert "1/1 as expected" in capsys.readouterr().out


def test_a_port_that_declines_every_case_is_not_green(monkeypatch, tmp_path, capsys):
    assert _cli(monkeypatch, tmp_path, "declining") == 1
    out = capsys.readouterr().out
    assert "1 declined by the port" in out and "port decliner 0" in out and "checked nothing" in out
    assert _cli(monkeypatch, tmp_path, "full") == 0                                 # the control
    assert "checked nothing" not in capsys.readouterr().out


def _renamed(old, new):
    def change(req, out):
        out[new] = out.pop(old)
        return out
    return change


def _extra(req, out):
    out["debug.scores"] = out["logits"]
    return out


def _as(key, dtype):
    def change(req, out):
        out[key] = out[key].astype(dtype)
        return out
    return change


def _batched(req, out):
    out["logits"] = out["logits"][None]
    return out


@pytest.mark.parametrize("change, words, blocked", [
    (_renamed("logits", "logit"), "logits: missing; the port returned 'logit' — name it as the protocol does",
     ["logits"]),
    (_extra, "debug.scores: not an array of the protocol targets/forward", []),
    (_as("logits", np.float64), "logits: dtype float64, protocol says float32", ["logits"]),
    (_as("stream.tokens", np.int64), "stream.tokens: dtype int64, protocol says int32",
     ["stream", "stream.logits[shared]"]),
    (_batched, "logits: shape [1, ", ["logits"]),
], ids=["misspelt", "extra", "float64-logits", "int64-tokens", "shape"])
def test_each_contract_violation_fails_before_any_tolerance(change, words, blocked):
    """float64 logits and int64 tokens are within every L2 budget; the contract fails them, and
    the checks that read them do not run. The control (the unchanged wrapper) passes in the first
    test."""
    r = _evaluate(QWEN3, _port("targets", f"contract-{words[:24]}", change))
    assert r.verdict == "FAIL" and list(r.findings) == ["contract"], r.message()
    assert words in r.reason, r.reason
    assert r.first_failure == "contract" and r.coverage.get("blocked", []) == blocked, r.coverage
    assert not set(blocked) & set(r.metrics) and "final" in r.coverage["checked"]


def _float64(req, out):
    return {k: v.astype(np.float64) if np.asarray(v).dtype.kind == "f" else v for k, v in out.items()}


def test_an_all_float64_answer_is_a_contract_fail_not_a_delta():
    """On a full-attention DFlash case (L1), the window delta changes nothing: float64 arrays that
    equal ours in value are FAIL on the contract, never DELTA `window-ring`."""
    ok = _evaluate("dflash/mod-qwen3", _port("dflash", "as-is", lambda req, out: out))
    assert ok.verdict == "PASS", ok.message()                                       # the control
    r = _evaluate("dflash/mod-qwen3", _port("dflash", "float64", _float64))
    assert r.verdict == "FAIL" and "delta" not in r.metrics, r.message()
    assert "contract" in r.findings and "logits.0: dtype float64, protocol says float32" in r.reason


def _following_nudged(req, out, nudge):
    out = dict(ports.ours().runs["dflash"](replace(req, options={**req.options, "window": "positional"})))
    if nudge:
        out["logits.3"] = np.nextafter(out["logits.3"], np.float32(np.inf)).astype(np.float32)
    return out


@pytest.mark.parametrize("nudge, verdict", [(False, "DELTA"), (True, "FAIL")])
def test_a_delta_is_named_at_the_case_tier(nudge, verdict):
    """An L1 case: a port on the other window convention is DELTA only while it matches our port on
    that convention bit for bit; one ULP off in one array (well within L2) keeps its FAIL."""
    port = _port("dflash", f"positional-nudged-{nudge}", lambda req, out: _following_nudged(req, out, nudge))
    r = _evaluate("dflash/mod-gemma4", port)
    assert r.verdict == verdict, r.message()
    assert ("delta" in r.metrics) == (verdict == "DELTA")


def _layer_off(req, out):
    for k in ("layer.1", "own.1"):
        out[k] = out[k] + np.float32(1e-3)
    return out


def test_a_delta_must_touch_the_first_failing_check():
    """A port off in one recorded drafter layer only fails at `layers`. Our port on the window's
    other convention reproduces every array a delta's trial compares (layers are left out there),
    but on a full-attention case it changes no layer output: no delta is the cause, FAIL stays."""
    r = _evaluate("dflash/mod-qwen3", _port("dflash", "layer-off", _layer_off))
    assert r.verdict == "FAIL" and r.first_failure == "layers" and "delta" not in r.metrics, r.message()


def _planted_public(key, public):
    """Our target port with a control planted (spec_parity.controls), returning only the
    protocol's required arrays when `public`."""
    def change(req, out):
        return _required_only(req, out) if public else out
    ours = ports.ours().runs["targets"]

    def run(req):
        with controls.planted("targets", key):
            return change(req, dict(ours(req)))
    return ports.Port(f"{key}-public-{public}", "0", {"targets": run}, (__file__,))


ROPE = [("qwen3", "rope-L3", "PASS-PARTIAL"), ("qwen3", "rope-L1", "PASS-PARTIAL"), ("gemma4", "rope-L3", "PASS-PARTIAL"),
        ("gemma4", "rope-L1", "PASS-PARTIAL")]


def _doc_row(case: str, key: str) -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "harness.md").read_text()
    section = text.split("## What a public-outputs-only check can and cannot catch", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| {case} | `{key}` |"))
    return [x.strip() for x in row.strip("|").split("|")]


@pytest.mark.parametrize("case, key, public_verdict", harness.slow_except(ROPE, ROPE[0]))
def test_what_a_public_outputs_only_check_cannot_catch(case, key, public_verdict):
    """docs/harness.md's measured example, each row: one layer's RoPE base x1.001 (a control of
    spec_parity.controls). On either target it moves the logits by less than their L2 budget and
    no greedy token: returning only the public outputs the port reads PASS-PARTIAL (never PASS);
    exposing its layers, it fails naming the layer. The doc's max|Δ| is this measurement's (±20 %)."""
    atol = budget_for("targets", "logits", "float32").atol
    layer = int(key.split("-L")[1])
    public = _evaluate(f"targets/{case}", _planted_public(key, True))
    full = _evaluate(f"targets/{case}", _planted_public(key, False))
    worst = public.metrics["logits"]["max_abs"]
    assert public.verdict == public_verdict and public.metrics["stream"]["equal"], public.message()
    assert (worst < atol) == (public_verdict == "PASS-PARTIAL")
    assert full.verdict == "FAIL" and (full.first_failure == "logits") == (worst >= atol), full.message()
    if worst < atol:
        assert full.metrics["layers"]["first_divergent_layer"] == layer, full.message()
    assert full.metrics["teacher_forced"]["agree"] == full.metrics["teacher_forced"]["positions"]
    row = _doc_row(case, key)
    assert abs(float(row[2].split(",")[0]) / worst - 1) < 0.2, (row, worst)
    assert row[4].startswith(public.verdict) and row[5].startswith(full.verdict), row

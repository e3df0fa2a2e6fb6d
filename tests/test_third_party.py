"""The third-party adapters in examples/ stay runnable: per package, module cases through the
harness with its adapter selected, held to the verdicts docs/third-party.md records for them
(read from that file, so the doc and the test cannot drift apart). Each package has one case
that passes and one that does not (dflash-mlx: FAIL at a named array, and a kind it declines;
dspark-mlx: cannot load the drafter, with the error the doc names), so no verdict can be a constant.

The packages are not spec-parity dependencies: install them beside it, e.g.
`pip install --no-deps --target /tmp/peers dflash-mlx==0.1.8 dspark-mlx==0.1.0` and put
/tmp/peers on PYTHONPATH; absent, each test skips with one line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spec_parity import harness, ports

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "third-party.md"

# (module, import name, pip requirement, adapter module, doc section, cases)
PEERS = [
    ("dflash", "dflash_mlx", "dflash-mlx==0.1.8", "dflash_mlx_adapter", "dflash-mlx 0.1.8",
     ["mod-qwen3", "mod-qwen3-causal", "mod-qwen3-swa", "ext-qwen3"]),
    ("dspark", "dspark_mlx", "dspark-mlx==0.1.0", "dspark_mlx_adapter", "dspark-mlx 0.1.0",
     ["mod-qwen3", "mod-gemma4-gated", "loop-qwen3-t0.0", "sampled-agree0.8-gemma4-T2.0"]),
]
FINDINGS = ("lossless", "stream", "drafts", "schedule")     # a loop row's columns after the first failing check


def recorded(section: str, case: str) -> tuple[str, str, list[str]]:
    """(verdict, first failing check or error, the row's further cells) of `case` in `section`'s
    verdict tables of docs/third-party.md."""
    text = DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    m = re.search(rf"^\| {re.escape(case)} \| [^|]+ \| [^|]+ \| (PASS-PARTIAL|PASS|FAIL|ERROR|DECLINED|DELTA) \| ([^|]*) \|(.*)$",
                  text, re.M)
    assert m, f"{DOC}: no row for {case} under '## {section}'"
    return m.group(1), m.group(2).strip().strip("`"), [x.strip() for x in m.group(3).strip().rstrip("|").split("|")]


@pytest.mark.parametrize("module,name,req,adapter,section,case",
                         [(*p[:5], c) for p in PEERS for c in p[5]], ids=[f"{p[0]}-{c}" for p in PEERS for c in p[5]])
def test_adapter_gives_the_recorded_verdict(module, name, req, adapter, section, case, monkeypatch):
    pytest.importorskip(name, reason=f"{name} not importable: pip install --no-deps {req} (see {DOC.name})")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    port = ports.load(f"{adapter}:make_port")
    selection = ports.Selection({module: port})
    c = {c.name: c for c in harness.pair(module).cases()}[case]
    verdict, first, cells = recorded(section, case)
    if verdict == "ERROR":                     # the port cannot run the case: the doc names why
        with pytest.raises(Exception) as e:
            harness.evaluate(c, "golden", selection)
        assert f"{e.type.__name__}: {e.value}" == first
        return
    result = harness.evaluate(c, "golden", selection)
    assert result.metrics["port"]["identity"] == port.identity
    if verdict == "DECLINED":                  # the adapter says it has no counterpart: not a pass
        assert result.verdict == "DECLINED" and first in result.reason, result.message()
        return
    assert result.verdict == verdict, f"{case}: {result.message()}"
    failed = [k for k, v in result.metrics.items() if isinstance(v, dict) and v.get("ok") is False]
    assert (failed[0] if failed else "") == first, f"{case}: first failing check {failed[:3]}, doc says {first!r}"
    if verdict == "DELTA":                     # the row names the delta the harness named
        assert all(d in cells[-1] for d in result.metrics["delta"]["deltas"]), (cells, result.metrics["delta"])
    if c.params.KIND == "loop":                # each finding as recorded: ok / FAIL / not exposed / not compared
        for finding, cell in zip(FINDINGS, cells):
            assert (cell == "FAIL") == (finding in result.findings), f"{case}: {finding} is {cell!r} in the doc"

"""The third-party adapters in examples/ stay runnable: per package, module cases through the
harness with its adapter selected, held to the verdicts docs/third-party.md records for them
(read from that file, so the doc and the test cannot drift apart). Each package has one case
that passes and one that does not (dflash-mlx: FAIL at a named array, and a kind it declines;
dspark-mlx: cannot load the drafter, with the error the doc names; mlx-vlm and mlx-dspark: PASS,
FAIL at a named array, ERROR, DECLINED), so no verdict can be a constant.

The packages are not spec-parity dependencies: install them beside it, e.g.
`pip install --no-deps --target /tmp/peers dflash-mlx==0.1.8 dspark-mlx==0.1.0 mlx-vlm==0.7.10
mlx-dspark==0.20.3 requests urllib3 charset-normalizer` and put /tmp/peers on PYTHONPATH; absent,
each test skips with one line.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from spec_parity import harness, ports

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "third-party.md"

VLM_PIP = "mlx-vlm==0.7.10 requests urllib3 charset-normalizer"
DSPARK_PIP = f"mlx-dspark==0.20.3 {VLM_PIP}"
# (module, import name, pip requirement, adapter module, doc section, cases)
PEERS = [
    ("dflash", "dflash_mlx", "dflash-mlx==0.1.8", "dflash_mlx_adapter", "dflash-mlx 0.1.8",
     ["mod-qwen3", "mod-qwen3-causal", "mod-qwen3-swa", "ext-qwen3"]),
    ("dspark", "dspark_mlx", "dspark-mlx==0.1.0", "dspark_mlx_adapter", "dspark-mlx 0.1.0",
     ["mod-qwen3", "mod-gemma4-gated", "loop-qwen3-t0.0", "sampled-agree0.8-gemma4-T2.0"]),
    ("dflash", "mlx_vlm", VLM_PIP, "mlx_vlm_adapter", "mlx-vlm 0.7.10",
     ["mod-qwen3", "mod-qwen3-swa", "mod-gemma4", "dflash/loop-qwen3", "dflash/loop-gemma4"]),
    ("dspark", "mlx_vlm", VLM_PIP, "mlx_vlm_adapter", "mlx-vlm 0.7.10", ["dspark/mod-qwen3", "dspark/mod-gemma4", "dspark/mod-gemma4-gated"]),
    ("assistant", "mlx_vlm", VLM_PIP, "mlx_vlm_adapter", "mlx-vlm 0.7.10",
     ["step-gemma4-centroid-optiq", "step-gemma4-tied-optiq", "step-gemma4-centroid-transformers-hfpos",
      "step-gemma4-centroid-transformers"]),
    ("dspark", "mlx_dspark", DSPARK_PIP, "mlx_dspark_adapter", "mlx-dspark 0.20.3",
     ["mod-qwen3", "mod-qwen3-embtap", "mod-qwen3-dflash", "mod-gemma4"]),
    ("dflash", "mlx_dspark", DSPARK_PIP, "mlx_dspark_adapter", "mlx-dspark 0.20.3",
     ["dflash/mod-qwen3", "dflash/mod-qwen3-causal", "dflash/mod-qwen3-swa-torch", "dflash/loop-qwen3-eos",
      "dflash/loop-agree-qwen3-bs16", "dflash/loop-gemma4"]),
]
FINDINGS = ("lossless", "stream", "drafts", "schedule")     # a loop row's columns after the first failing check


def recorded(section: str, case: str) -> tuple[str, str, list[str]]:
    """(verdict, first failing check or error, the row's further cells) of `case` in `section`'s
    verdict tables of docs/third-party.md (in a section covering several modules a row may name
    its case MODULE/CASE)."""
    text = DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    m = re.search(rf"^\| {re.escape(case)} \| [^|]+ \| [^|]+ \| (PASS-PARTIAL|PASS|FAIL|ERROR|DECLINED|DELTA) \| ([^|]*) \|(.*)$",
                  text, re.M)
    assert m, f"{DOC}: no row for {case} under '## {section}'"
    return m.group(1), m.group(2).strip().strip("`"), [x.strip() for x in m.group(3).strip().rstrip("|").split("|")]


@pytest.mark.parametrize("module,name,req,adapter,section,case",
                         [(*p[:5], c) for p in PEERS for c in p[5]], ids=[f"{p[1]}-{c}" for p in PEERS for c in p[5]])
def test_adapter_gives_the_recorded_verdict(module, name, req, adapter, section, case, monkeypatch):
    pytest.importorskip(name, reason=f"{name} not importable: pip install --no-deps {req} (see {DOC.name})")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    port = ports.load(f"{adapter}:make_port")
    selection = ports.Selection({module: port})
    c = {c.name: c for c in harness.pair(module).cases()}[case.rsplit("/", 1)[-1]]
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


def test_a_fed_layer_that_returns_a_tuple_keeps_its_tuple():
    """mlx-vlm's Gemma-4 layers return (h, k, v): the own-error run hands on the reference's h in
    the first slot and keeps the rest, where it once returned a bare array and the model's
    unpacking failed."""
    import mlx.core as mx

    from spec_parity.oracles.layers import mlx_recorded

    layers = [lambda h: (h + 1, "k", "v"), lambda h: (h * 2, "k", "v")]
    fed, out = np.full((2, 3), 5.0, np.float32), {}
    with mlx_recorded(layers, out, "own", {"layer.0": fed, "layer.1": fed}):
        h = mx.zeros((1, 2, 3))
        for layer in layers:
            h, k, v = layer(h)
    assert (k, v) == ("k", "v") and np.array_equal(np.array(h[0]), fed)
    assert np.array_equal(np.array(out["own.1"][0]), fed * 2)      # layer 1 ran on the fed h


def test_every_half_type_reaches_numpy_as_float32_exactly():
    """numpy has no bfloat16 and a float16 left as it is would be compared in float16: both half
    types come back float32, holding every value (the protocol's arrays are float32 at any dtype)."""
    import mlx.core as mx
    import torch

    from spec_parity.oracles.layers import to_numpy

    values = [1.0, -2.5, 3.140625, 65504.0, 2.0 ** -14]
    for mdt, tdt in ((mx.bfloat16, torch.bfloat16), (mx.float16, torch.float16)):
        expect = np.array(mx.array(values).astype(mdt).astype(mx.float32))
        for a in (mx.array(values).astype(mdt), torch.tensor(values).to(tdt)):
            got = to_numpy(a)
            assert got.dtype == np.float32 and np.array_equal(got, expect), (a.dtype, got)
    assert to_numpy(mx.array([1, 2])).dtype.kind == "i" and to_numpy(torch.tensor([1, 2])).dtype.kind == "i"


def test_an_adapter_whose_package_is_absent_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """An adapter's factory imports its package: absent, `run --port` names the port and the fix
    in one line and exits 2, before any case runs (it once ended in a traceback)."""
    from spec_parity import cli

    (tmp_path / "absent_adapter.py").write_text("def make_port():\n    import no_such_package_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = cli.main(["run", "--module", "dflash", "--port", "dflash=absent_adapter:make_port", "--source",
                   "golden", "--case", "mod-qwen3", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "no_such_package_here" in err and "install it" in err, err
    assert not (tmp_path / "out" / "report.json").exists()

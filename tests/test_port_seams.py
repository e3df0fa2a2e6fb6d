"""The two plug-in seams: a port in process (`--port MODULE=pkg.module:make_port`) and a port in
any language through the file protocol (`--port-cmd`, `export`). Our own port through either
seam gets exactly the verdicts it gets in process; a port that returns perturbed arrays (a
wrapper outside product code, the controls of these tests) is caught through both. Each test here
spawns Python processes (about 3 s of CPU each on the 2-core machine): they run under --slow
(CI), not in the dev loop."""

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from spec_parity import exchange, harness, ports

OURS_CMD = f"{sys.executable} -m spec_parity.exchange {{case}} {{out}}"
FAST = ["targets/qwen3"]
SLOW = ["dflash/mod-qwen3", "assistant/step-gemma4-centroid-optiq", "assistant/step-gemma4-centroid-transformers",
        "assistant/loop-random-centroid-g2", "dspark/mod-gemma4", "dspark/loop-gemma4-t0.5", "dflash/loop-qwen3-eos"]


def _case(case_id):
    return next(c for c in harness.all_cases() if c.id == case_id)


def _verdict(case, port=None, monkeypatch=None):
    if port is not None:
        monkeypatch.setitem(ports._SELECTED, case.module, port)
    r = harness.evaluate(case, "golden")
    return r.verdict, r.reason, {k: m.get("max_abs") for k, m in r.metrics.items() if isinstance(m, dict)}


@pytest.mark.slow
@pytest.mark.parametrize("case_id", harness.slow_except(FAST + SLOW, *FAST))
def test_file_protocol_gives_our_in_process_verdicts(case_id, monkeypatch):
    case = _case(case_id)
    here = _verdict(case)
    assert here[0] == "PASS"
    assert _verdict(case, exchange.command_port(OURS_CMD), monkeypatch) == here


PERTURB = """
import sys
from pathlib import Path
from spec_parity import exchange, ports
req = exchange.read_case(Path(sys.argv[1]))
out = ports.ours().runs[req.module](req)
out["logits"] = out["logits"] + 1e-3
exchange.write_outputs(Path(sys.argv[2]), out)
"""


@pytest.mark.slow
def test_file_protocol_catches_a_perturbed_port(tmp_path, monkeypatch):
    script = tmp_path / "perturbed.py"
    script.write_text(PERTURB)
    port = exchange.command_port(f"{sys.executable} {script} {{case}} {{out}}")
    verdict, reason, _ = _verdict(_case("targets/qwen3"), port, monkeypatch)
    assert verdict == "FAIL" and "logits" in reason


def test_a_port_that_fails_names_its_error(tmp_path, monkeypatch):
    port = exchange.command_port(f"{sys.executable} -c 'raise SystemExit(\"no such model\")' {{case}} {{out}}")
    monkeypatch.setitem(ports._SELECTED, "targets", port)
    with pytest.raises(exchange.ExchangeError, match="exited 1 on targets/qwen3: no such model"):
        harness.evaluate(_case("targets/qwen3"), "golden")


DECLINE = "import sys; sys.stderr.write('no block kind here\\n'); sys.exit(3)"


def test_a_port_that_declines_reads_declined_not_pass(monkeypatch):
    """Exit 3 through the file protocol, `ports.Declined` in process: DECLINED with the reason;
    exit 1 is an error, never a decline (the control)."""
    case = _case("dflash/mod-qwen3")
    port = exchange.command_port(f'{sys.executable} -c "{DECLINE}" {{case}} {{out}}')
    verdict, reason, _ = _verdict(case, port, monkeypatch)
    assert verdict == "DECLINED" and "no block kind here" in reason
    failing = exchange.command_port(f'{sys.executable} -c "{DECLINE.replace("exit(3)", "exit(1)")}" {{case}} {{out}}')
    monkeypatch.setitem(ports._SELECTED, case.module, failing)
    with pytest.raises(exchange.ExchangeError, match="exited 1"):
        harness.evaluate(case, "golden")

    def declines(req):
        raise ports.Declined("not implemented here")

    verdict, reason, _ = _verdict(case, ports.Port("decliner", "0", {"dflash": declines}), monkeypatch)
    assert verdict == "DECLINED" and "decliner declines this case: not implemented here" in reason


MYPORT = """
from spec_parity import ports

def make_port():
    ours = ports.ours().runs["targets"]
    return ports.Port("mine", "0.1", {"targets": lambda req: ours(req)})

def make_bad_port():
    ours = ports.ours().runs["targets"]
    def run(req):
        out = ours(req)
        out["hidden.2"] = out["hidden.2"] * 1.01
        return out
    return ports.Port("mine-bad", "0.1", {"targets": run})
"""


def _cli(tmp_path, *args):
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "spec_parity.cli", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path)


@pytest.mark.slow
def test_in_process_port_option_through_the_cli(tmp_path):
    (tmp_path / "myport.py").write_text(MYPORT)
    run = ["run", "--module", "targets", "--case", "qwen3", "--source", "golden"]
    good = _cli(tmp_path, *run, "--port", "targets=myport:make_port", "--out", "good")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "targets=mine 0.1" in (tmp_path / "good" / "report.md").read_text()
    bad = _cli(tmp_path, *run, "--port", "targets=myport:make_bad_port", "--out", "bad")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    rows = json.loads((tmp_path / "bad" / "report.json").read_text())
    row = rows[0] if isinstance(rows, list) else rows["results"][0]
    assert row["verdict"] == "FAIL" and "hidden.2" in row["reason"]
    missing = _cli(tmp_path, *run, "--port", "targets=nosuch:make_port", "--out", "x")
    assert missing.returncode != 0 and "cannot be imported" in missing.stderr


@pytest.mark.slow
def test_export_writes_a_case_folder(tmp_path):
    done = _cli(tmp_path, "export", "--module", "dflash", "--case", "mod-qwen3", "--out", "cases")
    assert done.returncode == 0, done.stdout + done.stderr
    folder = tmp_path / "cases" / "dflash" / "mod-qwen3"
    doc = json.loads((folder / "request.json").read_text())
    assert doc["protocol"] == "dflash/modules" and doc["options"]["accepts"] == [3, 0, 0, 7, 0, 1, 0, 2]
    assert doc["expected"]["logits.0"]["dtype"] == "float32" and len(doc["expected"]["logits.0"]["shape"]) == 2
    assert (folder / "target" / "config.json").exists() and (folder / "drafter" / "model.safetensors").exists()
    inputs = load_file(str(folder / "inputs.safetensors"))
    assert np.array_equal(inputs["prompt"], harness.prompt(_case("dflash/mod-qwen3")))


def test_port_specs_are_checked():
    with pytest.raises(ports.PortError, match="expected MODULE="):
        ports.select(["targets"])
    with pytest.raises(ports.PortError, match="no port named"):
        ports.load("nosuch")
    with pytest.raises(ports.PortError, match="must name"):
        exchange.command_port("my-port")
    assert ports.load("spec-parity").ours and ports.for_module("dflash").ours


def test_the_protocol_docs_are_rendered_from_the_code():
    from pathlib import Path

    assert (Path(__file__).parent.parent / "docs" / "protocol.md").read_text() == exchange.markdown() + "\n"

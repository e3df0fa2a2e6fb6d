"""The two plug-in seams: a port in process (`--port MODULE=pkg.module:make_port`) and a port in
any language through the file protocol (`--port-cmd`, `export`). Our own port through either
seam gets exactly the verdicts it gets in process; a port that returns perturbed arrays (a
wrapper outside product code, the controls of these tests) is caught through both. Each test here
spawns Python processes (about 3 s of CPU each on the 2-core machine): they run under --slow
(CI), not in the dev loop."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from spec_parity import exchange, harness, ports

OURS_CMD = f"{sys.executable} -m spec_parity.exchange {{case}} {{out}}"
WRITES = "import sys, pathlib\npathlib.Path(sys.argv[2]).joinpath"
FAST = ["targets/qwen3"]
SLOW = ["dflash/mod-qwen3", "assistant/step-gemma4-centroid-optiq", "assistant/step-gemma4-centroid-transformers",
        "assistant/loop-random-centroid-g2", "dspark/mod-gemma4", "dspark/loop-gemma4-t0.5", "dflash/loop-qwen3-eos"]


def _case(case_id):
    return next(c for c in harness.all_cases() if c.id == case_id)


def _verdict(case, port=None):
    r = harness.evaluate(case, "golden", ports.Selection({case.module: port} if port else {}))
    return r.verdict, r.reason, {k: m.get("max_abs") for k, m in r.metrics.items() if isinstance(m, dict)}


@pytest.mark.slow
@pytest.mark.parametrize("case_id", harness.slow_except(FAST + SLOW, *FAST))
def test_file_protocol_gives_our_in_process_verdicts(case_id):
    case = _case(case_id)
    here = _verdict(case)
    assert here[0] == "PASS"
    assert _verdict(case, exchange.command_port(OURS_CMD)) == here


PERTURB = """
import sys
from pathlib import Path
from spec_parity import exchange, ports
req = exchange.read_case(Path(sys.argv[1]))
out = ports.ours().runs[req.module](req)
out["logits"] = out["logits"] + 1e-2
exchange.write_outputs(Path(sys.argv[2]), out)
"""


@pytest.mark.slow
def test_file_protocol_catches_a_perturbed_port(tmp_path):
    script = tmp_path / "perturbed.py"
    script.write_text(PERTURB)
    port = exchange.command_port(f"{sys.executable} {script} {{case}} {{out}}")
    verdict, reason, _ = _verdict(_case("targets/qwen3"), port)
    assert verdict == "FAIL" and "logits" in reason


def _cmd(tmp_path, script: str, **kw) -> ports.Port:
    (tmp_path / "my_port.py").write_text(script)
    return exchange.command_port(f"{sys.executable} {tmp_path / 'my_port.py'} {{case}} {{out}}", **kw)


def _fails(port, monkeypatch, tmp_path, case_id="targets/qwen3") -> str:
    """The message of the port's error on the case; no case folder is left in tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(exchange.ExchangeError) as e:
        harness.evaluate(_case(case_id), "golden", ports.Selection({"targets": port}))
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "spec-parity-case-" not in str(e.value)
    return str(e.value)


def test_a_port_that_fails_names_its_error(tmp_path, monkeypatch):
    """The last lines of stderr, not only the last one (a Python traceback's last line alone
    rarely says where)."""
    lines = "import sys\nfor i in range(8):\n    print(f'step {i}', file=sys.stderr)\nraise SystemExit('no such model')\n"
    msg = _fails(_cmd(tmp_path, lines), monkeypatch, tmp_path)
    assert "exited 1 on targets/qwen3; its stderr ends: step 4 | step 5 | step 6 | step 7 | no such model" in msg
    assert "step 3" not in msg


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


SPAWNS = """import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen(["sleep", "120"])
Path(sys.argv[0]).with_name("child.pid").write_text(str(child.pid))
print("loading", file=sys.stderr, flush=True)
time.sleep(120)
"""


def test_a_hanging_port_times_out_and_its_process_group_is_killed(tmp_path, monkeypatch):
    t0 = time.monotonic()
    msg = _fails(_cmd(tmp_path, SPAWNS, timeout=2), monkeypatch, tmp_path)
    assert time.monotonic() - t0 < 30
    assert "timed out after 2 s on targets/qwen3" in msg and "its stderr ends: loading" in msg
    assert _gone(int((tmp_path / "child.pid").read_text())), "the command's child outlived the timeout"


def test_ctrl_c_kills_the_port_and_removes_the_case_folder(tmp_path, monkeypatch):
    """KeyboardInterrupt while the command runs: the group is killed, the folder removed, the
    interrupt goes on."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    spawns = ports.Selection({"targets": _cmd(tmp_path, SPAWNS)})
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 3.0)
        with pytest.raises(KeyboardInterrupt):
            harness.evaluate(_case("targets/qwen3"), "golden", spawns)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert _gone(int((tmp_path / "child.pid").read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stopped_run_leaves_no_case_folder_and_no_port_running(tmp_path, sig):
    """`spec-parity run` stopped while its --port-cmd runs (Ctrl-C, or SIGTERM from a cancelled
    job): the command's group is killed and the case folder removed before it exits."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "my_port.py").write_text(SPAWNS)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": ":".join(sys.path)}
    argv = [sys.executable, "-m", "spec_parity.cli", "run", "--module", "targets", "--case", "qwen3", "--source",
            "golden", "--out", str(tmp_path / "r"), "--port-cmd", f"{sys.executable} {tmp_path / 'my_port.py'} {{case}} {{out}}"]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pid, deadline = tmp_path / "child.pid", time.monotonic() + 180
    while not (pid.exists() and pid.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid.exists() and list((tmp_path / "tmp").glob("spec-parity-case-*")), proc.communicate()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err
    assert list((tmp_path / "tmp").glob("spec-parity-case-*")) == [], err
    assert _gone(int(pid.read_text())), "the command's child outlived the run"


@pytest.mark.parametrize("script,needs", [
    ("print('done')\n", "the port wrote nothing for targets/qwen3: write outputs.safetensors and/or outputs.json"),
    (f"{WRITES}('outputs.json').write_text('{{logits')\n", "outputs.json for targets/qwen3: not valid JSON"),
    (f"{WRITES}('outputs.safetensors').write_bytes(b'garbage')\n", "outputs.safetensors for targets/qwen3 cannot be read"),
], ids=["nothing", "json", "safetensors"])
def test_unreadable_outputs_are_named(tmp_path, monkeypatch, script, needs):
    assert needs in _fails(_cmd(tmp_path, script), monkeypatch, tmp_path)


def test_the_identity_hashes_the_commands_files(tmp_path):
    """The script's bytes change the identity; a command with no file says so; --port-id names it."""
    script = tmp_path / "my_port.py"
    script.write_text("print(1)\n")
    cmd = f"{sys.executable} {script} {{case}} {{out}}"
    before = exchange.command_port(cmd).identity
    assert before == exchange.command_port(cmd).identity
    script.write_text("print(2)\n")
    after = exchange.command_port(cmd).identity
    assert before != after and before.startswith("port-cmd ") and "no files hashed" not in after
    assert exchange.command_port("sh -c 'true' {case} {out}").identity.endswith("(no files hashed)")
    assert exchange.command_port(cmd, port_id="node-port").identity.startswith(f"node-port {cmd} (")


def test_port_options_are_checked_before_anything_loads():
    """Each combination that would leave a named port unused; the port specs are not importable,
    so a refusal that loaded them first would name the import instead."""
    spec = "targets=nosuch:make_port"
    assert ports.check([spec], False, ["targets"]) == {"targets": "nosuch:make_port"}
    with pytest.raises(ports.PortError, match="selects no targets case \\(--module dflash\\)"):
        ports.check([spec], False, ["dflash"], "--module dflash")
    with pytest.raises(ports.PortError, match="give a --drafter whose cases are dflash's"):
        ports.check(["dflash=nosuch:make_port"], False, ["targets"], "--target /x")
    with pytest.raises(ports.PortError, match="both answer targets"):
        ports.check([spec], True, ["targets"])
    with pytest.raises(ports.PortError, match="one port per module"):
        ports.check([spec, spec], False, ["targets"])
    with pytest.raises(ports.PortError, match="both answer targets"):   # pytest's --port with --port-cmd
        ports.configure([spec], exchange.command_port(OURS_CMD))


def test_where_names_the_frame_in_the_ports_own_files(tmp_path):
    (tmp_path / "mine.py").write_text("def inner():\n    raise ValueError('x')\n\n\ndef outer():\n    inner()\n")
    spec = importlib.util.spec_from_file_location("mine", tmp_path / "mine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(ValueError) as e:
        mod.outer()
    assert ports.where(ports.Port("m", "0", {}, (str(tmp_path / "mine.py"),)), e.value) == "mine.py:2 in inner"
    assert ports.where(ports.Port("m", "0", {}, (str(tmp_path),)), e.value) == f"{tmp_path.name}/mine.py:2 in inner"
    assert ports.where(ports.Port("m", "0", {}, (str(tmp_path / "other"),)), e.value) == ""


DECLINE = "import sys; sys.stderr.write('no block kind here\\n'); sys.exit(3)"


def test_a_port_that_declines_reads_declined_not_pass():
    """Exit 3 through the file protocol, `ports.Declined` in process: DECLINED with the reason;
    exit 1 is an error, never a decline (the control)."""
    case = _case("dflash/mod-qwen3")
    port = exchange.command_port(f'{sys.executable} -c "{DECLINE}" {{case}} {{out}}')
    verdict, reason, _ = _verdict(case, port)
    assert verdict == "DECLINED" and "no block kind here" in reason
    failing = exchange.command_port(f'{sys.executable} -c "{DECLINE.replace("exit(3)", "exit(1)")}" {{case}} {{out}}')
    with pytest.raises(exchange.ExchangeError, match="exited 1"):
        harness.evaluate(case, "golden", ports.Selection({case.module: failing}))

    def declines(req):
        raise ports.Declined("not implemented here")

    verdict, reason, _ = _verdict(case, ports.Port("decliner", "0", {"dflash": declines}))
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
    assert ports.load("spec-parity").ours and ports.Selection().port("dflash").ours


def test_the_protocol_docs_are_rendered_from_the_code():
    assert (Path(__file__).parent.parent / "docs" / "protocol.md").read_text() == exchange.markdown() + "\n"

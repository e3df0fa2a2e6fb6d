"""Bad input on the command line: one line on stderr naming the file (or option) and the fix, exit
2, no traceback (`--debug` shows it); NaN in a weight never passes.

BAD_INPUTS is also docs/robustness.md's table: `PYTHONPATH=$PWD python tests/test_robustness.py`
runs every input through `spec_parity.cli.main` and prints the table's rows, and
test_docs_table_is_current holds the document to what the runs print.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spec_parity import checkpoints, cli, harness
from spec_parity.drafters.targets.checkpoints import GEMMA4_TARGET

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "robustness.md"


def _copy(kind: str, tmp: Path, name: str) -> Path:
    dst = tmp / name
    if not dst.exists():
        shutil.copytree(checkpoints.build(kind, 0, {}), dst)
    return dst


def _edit_config(d: Path, drop: str) -> Path:
    """Remove one key (dotted: nested) from d/config.json."""
    cfg = json.loads((d / "config.json").read_text())
    parts, node = drop.split("."), cfg
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _truncate(d: Path) -> Path:
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return d


def _prompts(tmp: Path, data: bytes) -> Path:
    f = tmp / "prompts.txt"
    f.write_bytes(data)
    return f


def _ab(tmp: Path, prompts: Path | None = None, a: Path | None = None, b: Path | None = None, *extra) -> list[str]:
    target = _copy("gemma4-target", tmp, "gemma4-target")
    drafter = _copy("gemma4-assistant", tmp, "assistant")
    prompts = prompts or _prompts(tmp, b"2 17 33\n")
    return ["ab", "--target", str(target), "--a", str(a or drafter), "--b", str(b or drafter),
            "--prompts", str(prompts), *extra]


def _target_file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("x")
    return tmp / "a-file"


# (what, argv builder, strings the one line must name). Every builder works in its own tmp folder.
BAD_INPUTS = [
    ("missing --target directory", lambda t: ["run", "--target", str(t / "no-such-dir")],
     ["no-such-dir", "no such directory", "give the checkpoint directory"]),
    ("--target is a file", lambda t: ["run", "--target", str(_target_file(t))], ["a-file", "not a directory"]),
    ("--target without config.json", lambda t: ["run", "--target", str(t)], ["config.json: missing", "point at the checkpoint"]),
    ("config.json not JSON", lambda t: ["run", "--target", str(_broken_json(t))], ["config.json", "not valid JSON"]),
    ("qwen3 config.json lacks rope_theta", lambda t: ["run", "--target", str(
        _edit_config(_copy("qwen3-target", t, "q"), "rope_theta"))], ["q/config.json", "lacks rope_theta (or rope_parameters)", "add it"]),
    ("gemma4 config.json lacks sliding_window", lambda t: ["run", "--target", str(
        _edit_config(_copy("gemma4-target", t, "g"), "sliding_window"))], ["config.json", "sliding_window"]),
    ("assistant config.json lacks text_config.sliding_window", lambda t: _ab(
        t, a=_edit_config(_copy("gemma4-assistant", t, "bad-assistant"), "text_config.sliding_window")),
     ["bad-assistant/config.json", "text_config.sliding_window"]),
    ("DSpark config.json lacks block_size", lambda t: ["run", "--target", str(_copy("gemma4-target", t, "g")),
                                                       "--drafter", str(_edit_config(_copy("dspark-drafter", t, "ds"), "block_size"))],
     ["ds/config.json", "block_size"]),
    ("DFlash config.json lacks dflash_config.mask_token_id", lambda t: _ab(
        t, b=_edit_config(_copy("dflash-drafter", t, "df"), "dflash_config.mask_token_id")),
     ["df/config.json", "dflash_config.mask_token_id"]),
    ("--target that is a drafter", lambda t: ["run", "--target", str(_copy("gemma4-assistant", t, "assistant"))],
     ["a Gemma-4 assistant checkpoint, not a --target one", "gemma4_assistant"]),
    ("truncated target safetensors", lambda t: ["run", "--target", str(_truncate(_copy("qwen3-target", t, "q")))],
     ["q/model.safetensors", "truncated", "re-download"]),
    ("garbage target safetensors", lambda t: ["run", "--target", str(_garbage(_copy("qwen3-target", t, "q")))],
     ["q/model.safetensors", "not a safetensors file"]),
    ("truncated drafter safetensors", lambda t: _ab(t, a=_truncate(_copy("gemma4-assistant", t, "cut"))),
     ["cut/model.safetensors", "truncated"]),
    ("no safetensors beside config.json", lambda t: ["run", "--target", str(_no_weights(_copy("qwen3-target", t, "q")))],
     ["no *.safetensors", "copy the checkpoint's weights"]),
    ("--out is a file", lambda t: ["run", "--module", "targets", "--case", "qwen3", "--out", str(_target_file(t))],
     ["--out", "a-file", "cannot be written"]),
    ("--out below a file", lambda t: ["run", "--module", "targets", "--case", "qwen3", "--out",
                                      str(_target_file(t) / "report")], ["--out", "Not a directory"]),
    ("--case that does not exist", lambda t: ["run", "--case", "no-such-case"], ["no-such-case", "spec-parity list"]),
    ("ab prompts file is binary", lambda t: _ab(t, _prompts(t, bytes(range(256)))), ["prompts.txt", "binary"]),
    ("ab prompts with a NUL byte", lambda t: _ab(t, _prompts(t, b"1 2\x003\n")), ["prompts.txt", "binary", "NUL"]),
    ("ab prompt id out of vocabulary", lambda t: _ab(t, _prompts(t, b"1 2 3\n5 128 9\n")),
     ["prompts.txt:2", "[128]", "0..127"]),
    ("ab prompt id negative", lambda t: _ab(t, _prompts(t, b"1 -4 3\n")), ["prompts.txt:1", "[-4]", "0..127"]),
    ("ab prompt not integers", lambda t: _ab(t, _prompts(t, b"hello world\n")), ["prompts.txt:1", "token ids"]),
    ("ab prompts file empty", lambda t: _ab(t, _prompts(t, b"# only a comment\n\n")), ["prompts.txt", "no prompts"]),
    ("ab prompts file missing", lambda t: _ab(t, t / "none.txt"), ["none.txt", "cannot be read"]),
    ("DSpark config.json with markov_rank > 0 lacks markov_head_type", lambda t: [
        "run", "--target", str(_copy("gemma4-target", t, "g")),
        "--drafter", str(_edit_config(_copy("dspark-drafter", t, "ds"), "markov_head_type"))],
     ["ds/config.json", "markov_rank is 8", "markov_head_type", "add it"]),
    ("target safetensors with an extra tensor", lambda t: ["run", "--target", str(_tensors(
        _copy("qwen3-target", t, "q"), add="model.layers.0.extra.weight"))],
     ["q/model.safetensors", "model.layers.0.extra.weight", "no place", "remove it"]),
    ("target safetensors missing a tensor", lambda t: ["run", "--target", str(_tensors(
        _copy("gemma4-target", t, "g"), drop="model.norm.weight"))],
     ["g/model.safetensors", "model.norm.weight", "missing", "re-download"]),
    ("target safetensors with a misshaped tensor", lambda t: ["run", "--target", str(_tensors(
        _copy("qwen3-target", t, "q"), grow="model.layers.1.mlp.up_proj.weight"))],
     ["q/model.safetensors", "model.layers.1.mlp.up_proj.weight", "[129, 64]", "fix the config.json keys"]),
    ("target weights not named model*.safetensors", lambda t: ["run", "--target", str(_renamed(_copy("qwen3-target", t, "q")))],
     ["q: no model*.safetensors", "rename the weights"]),
    ("drafter safetensors with an extra tensor", lambda t: ["run", "--target", str(_copy("qwen3-target", t, "q")),
                                                            "--drafter", str(_tensors(_copy("dflash-drafter", t, "df"), add="fc.bias"))],
     ["df/model.safetensors", "fc.bias", "no place"]),
    ("assistant sliding_window other than the target's", lambda t: ["run", "--target", str(_copy("gemma4-target", t, "g")),
                                                                    "--drafter", str(_pair("gemma4-assistant", t, "sw", {"text_config": {"sliding_window": 16}}))],
     ["sw/config.json", "text_config.sliding_window 16 != sliding_window 8", "set the drafter's"]),
    ("DSpark drafter built on a deeper target", lambda t: ["run", "--target", str(_copy("gemma4-target", t, "g")),
                                                           "--drafter", str(_pair("dspark-drafter", t, "deep", {"target_overrides": {
                                                               "num_hidden_layers": 8, "layer_types": ["sliding_attention", "full_attention"] * 4}}))],
     ["deep/config.json", "num_target_layers 8 != num_hidden_layers 6", "pair the drafter"]),
    ("DFlash drafter of another hidden size", lambda t: _ab(t, b=_pair("dflash-drafter", t, "wide", {"target_overrides": {"hidden_size": 96}})),
     ["wide/config.json", "hidden_size 96 != hidden_size 64", "pair the drafter"]),
    ("DFlash tap on the target's final layer", lambda t: ["run", "--target", str(_copy("qwen3-target", t, "q")),
                                                          "--drafter", str(_pair("dflash-drafter", t, "tap", {"target_layer_ids": [1, 3, 5]}))],
     ["tap/config.json", "target_layer_ids", "z-lab MLX accepts it"]),
    ("ab --json in a folder that is a file", lambda t: _ab(t, None, None, None, "--json", str(_target_file(t) / "r.json")),
     ["--json", "cannot be written"]),
    ("export --out below a file", lambda t: ["export", "--module", "targets", "--out", str(_target_file(t) / "out")],
     ["--out", "a-file/out", "cannot be written"]),
    ("bench --out below a file", lambda t: ["bench", "--sources", "dspark", "--out", str(_target_file(t) / "out")],
     ["--out", "a-file/out", "cannot be written"]),
    ("bench --serve --out below a file", lambda t: ["bench", "--serve", "--out", str(_target_file(t) / "out")],
     ["--out", "a-file/out", "cannot be written"]),
    ("bench --serve with one timed request", lambda t: ["bench", "--serve", "--runs", "1", "--out", str(t / "o")],
     ["--runs 1", "--runs >= 2"]),
    ("bench --serve with an unknown peer", lambda t: ["bench", "--serve", "--peers", "nobody", "--out", str(t / "o")],
     ["--peers", "nobody", "known"]),
    ("combine --out below a file", lambda t: ["combine", str(_run(t, "a")), str(_run(t, "b", commit="b")),
                                              "--out", str(_target_file(t) / "out")], ["--out", "cannot be written"]),
    ("combine with one run", lambda t: ["combine", str(_run(t, "a"))], ["1 run given", "at least 2 runs"]),
    ("combine runs of two trees", lambda t: ["combine", str(_run(t, "a")), str(_run(t, "b", source_sha256="0" * 64))],
     ["b/serve.json", "one tree"]),
    ("combine a file that is not a run's JSON", lambda t: ["combine", str(_run(t, "a")), str(_target_file(t))],
     ["a-file", "not a bench run's JSON"]),
    ("gemma4 target whose last layer is sliding", lambda t: ["run", "--target", str(_pair("gemma4-target", t, "g", {
        "layer_types": ["sliding_attention", "full_attention"] * 2 + ["full_attention", "sliding_attention"]}))],
     ["g/config.json", "layer_types[-1] is 'sliding_attention'", "transformers' Gemma4TextConfig forces", "set layer_types[-1]"]),
    ("assistant whose last layer is sliding", lambda t: ["run", "--target", str(_copy("gemma4-target", t, "g")), "--drafter", str(
        _pair("gemma4-assistant", t, "a", {"text_config": {"layer_types": ["full_attention"] + ["sliding_attention"] * 3}}))],
     ["a/config.json", "text_config.layer_types[-1] is 'sliding_attention'", "set text_config.layer_types[-1]"]),
    ("gemma4 target with a layer type mlx-lm lacks", lambda t: ["run", "--target", str(_set_config(
        _copy("gemma4-target", t, "g"), "layer_types", ["chunked_attention"] + GEMMA4_TARGET["layer_types"][1:]))],
     ["g/config.json", "layer_types holds ['chunked_attention']", "sliding_attention and full_attention"]),
    ("gemma4 target layer_types of another length", lambda t: ["run", "--target", str(_set_config(
        _copy("gemma4-target", t, "g"), "layer_types", GEMMA4_TARGET["layer_types"][1:]))],
     ["g/config.json", "layer_types has 5 entries for num_hidden_layers 6", "one entry per layer"]),
    ("Qwen3 DSpark drafter with a sliding layer", lambda t: ["run", "--target", str(_copy("qwen3-target", t, "q")), "--drafter", str(
        _set_config(_pair("dspark-drafter", t, "ds", {"target_kind": "qwen3-target"}), "layer_types",
                    ["full_attention", "sliding_attention"]))],
     ["ds/config.json", "layer_types holds ['sliding_attention']", "set every entry to full_attention"]),
    # port misuse: a named port that would not run, or ours running where the user named theirs
    ("--port for a module --module does not select", lambda t: ["run", "--module", "dflash", "--port", _myport("targets")],
     ["--port targets=myport:make_port", "selects no targets case (--module dflash)", "with --module targets"]),
    ("--port for a module --case does not select", lambda t: ["run", "--case", "mod-qwen3", "--port", _myport("targets")],
     ["selects no targets case (--case mod-qwen3)", "drop the --port"]),
    ("--port with --port-cmd (every module)", lambda t: ["run", "--port", _myport("dflash"), "--port-cmd", CMD],
     ["--port dflash=myport:make_port and --port-cmd both answer dflash", "run them apart"]),
    ("--port with --port-cmd on the same --module", lambda t: ["run", "--module", "dflash", "--port", _myport("dflash"),
                                                               "--port-cmd", CMD], ["both answer dflash"]),
    ("the same module twice in --port", lambda t: ["run", "--port", _myport("dflash"), "--port", "dflash=other:make_port"],
     ["--port dflash=myport:make_port and --port dflash=other:make_port", "one port per module"]),
    ("--port for an unknown module", lambda t: ["run", "--port", _myport("dflsh")],
     ["no module 'dflsh'", "targets, assistant, dspark, dflash"]),
    ("--port-cmd without {out}", lambda t: ["run", "--port-cmd", "./my-port {case}"], ["must name {case} and {out}"]),
    ("--port-cmd with an unclosed quote", lambda t: ["run", "--port-cmd", "sh -c './my-port {case} {out}"],
     ["No closing quotation", "close every quote"]),
    ("--port-cmd with another {placeholder}", lambda t: ["run", "--port-cmd", "./my-port {model} {case} {out}"],
     ["KeyError: 'model'", "name only {case} and {out}"]),
    ("--port-cmd whose program does not exist", lambda t: ["run", "--port-cmd", str(t / "my-port") + " {case} {out}"],
     ["my-port' is neither a file nor a command on PATH"]),
    ("--timeout without --port-cmd", lambda t: ["run", "--timeout", "5"], ["--timeout 5: applies to --port-cmd only"]),
    ("--timeout 0", lambda t: ["run", "--port-cmd", CMD_OK, "--timeout", "0"], ["--timeout 0", "(> 0)"]),
    ("--case naming a control with --port-cmd", lambda t: ["run", "--case", "qwen3-control-rope-L1", "--port-cmd", CMD_OK],
     ["'qwen3-control-rope-L1': a negative control", "runs only where our port answers"]),
    ("--port-id without --port-cmd", lambda t: ["run", "--port-id", "mine"], ["--port-id mine: applies to --port-cmd only"]),
    ("bisect --port for a module the case is not", lambda t: [*_bisect(t), "--case", "mod-qwen3", "--port", _myport("targets")],
     ["spec-parity bisect:", "selects no targets case (--case mod-qwen3)"]),
    ("bisect --port with --port-cmd", lambda t: [*_bisect(t), "--case", "mod-qwen3", "--port", _myport("dflash"),
                                                 "--port-cmd", CMD], ["both answer dflash"]),
    ("bisect --port-cmd without {case}", lambda t: [*_bisect(t), "--case", "qwen3", "--port-cmd", "./my-port {out}"],
     ["must name {case} and {out}"]),
    ("a shard the target's index names is missing", lambda t: ["run", "--target", str(_shard_missing(t))],
     ["model.safetensors.index.json", "names shard(s) ['model-00002-of-00002.safetensors']", "download every shard"]),
]


def _shard_missing(t: Path) -> Path:
    """The Qwen3 target in two shards with its index, the second shard lost."""
    from shipped import reshipped

    d = reshipped(checkpoints.build("qwen3-target", 0, {}), t / "sharded", shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    return d


def _set_config(d: Path, key: str, value) -> Path:
    """d/config.json with `key` set to `value`."""
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _myport(module: str) -> str:
    return f"{module}=myport:make_port"


CMD = "./my-port {case} {out}"
CMD_OK = f"{sys.executable} -c pass {{case}} {{out}}"


def _bisect(t: Path) -> list[str]:
    """bisect's argv up to --case, on a throwaway repository of two commits."""
    repo = t / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    repo.mkdir()
    subprocess.run([*git, "init", "-q"], check=True)
    for i in range(2):
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", f"c{i}"], check=True)
    return ["bisect", "--repo", str(repo), "--good", "HEAD~1", "--bad", "HEAD"]


def _run(t: Path, name: str, **project) -> Path:
    """A committed serve run (benchmarks/), copied to t/name/serve.json with `project` keys replaced."""
    doc = json.loads((ROOT / "benchmarks" / "serve-dflash-h200-peers-1.json").read_text())
    doc["project"].update(project)
    (t / name).mkdir()
    (t / name / "serve.json").write_text(json.dumps(doc))
    return t / name / "serve.json"


QWEN3 = ["run", "--module", "targets", "--case", "qwen3", "--source", "golden"]
HANG = "import sys, time\nprint('loading the model', file=sys.stderr, flush=True)\ntime.sleep(60)\n"
FAIL = "import sys\nfor i in range(8):\n    print(f'step {i}', file=sys.stderr)\nraise SystemExit('no such model')\n"
SILENT = "print('done')\n"
KILLED = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"


def _writes(name: str, data: str) -> str:
    return f"import sys, pathlib\npathlib.Path(sys.argv[2], {name!r}).write_text({data!r})\n"


FAILING_PORT = """from spec_parity import ports


def _forward(req):
    raise ValueError("shapes (1, 4) and (2, 4) do not match")


def run(req):
    return _forward(req)


def make_port():
    return ports.Port("failing", "0.1", {"targets": run})
"""


def _port_cmd(t: Path, script: str, *extra: str) -> list[str]:
    """QWEN3 answered by `script` through --port-cmd."""
    (t / "my_port.py").write_text(script)
    return [*QWEN3, "--out", str(t / "r"), "--port-cmd", f"{sys.executable} {t / 'my_port.py'} {{case}} {{out}}", *extra]


def _in_process(t: Path, module: str, source: str) -> list[str]:
    (t / f"{module}.py").write_text(source)
    return [*QWEN3, "--out", str(t / "r"), "--port", f"targets={module}:make_port"]


# A port that fails at run time: the case reads ERROR (exit 1) with what the one line must name.
PORT_ERRORS = [
    ("--port-cmd that hangs (--timeout 2)", lambda t: _port_cmd(t, HANG, "--timeout", "2"),
     ["timed out after 2 s on targets/qwen3", "process group was killed", "--timeout S", "loading the model"]),
    ("--port-cmd that exits 1", lambda t: _port_cmd(t, FAIL),
     ["exited 1 on targets/qwen3", "step 4 / step 5 / step 6 / step 7 / no such model"]),
    ("--port-cmd killed by a signal", lambda t: _port_cmd(t, KILLED), ["was killed by SIGKILL", "printed nothing"]),
    ("--port-cmd that writes nothing", lambda t: _port_cmd(t, SILENT),
     ["wrote nothing for targets/qwen3", "outputs.safetensors and/or outputs.json", "{out}", "stdout ends: done"]),
    ("--port-cmd outputs.json not JSON", lambda t: _port_cmd(t, _writes("outputs.json", "{logits: [1]")),
     ["outputs.json for targets/qwen3: not valid JSON (Expecting property name"]),
    ("--port-cmd outputs.json not an object", lambda t: _port_cmd(t, _writes("outputs.json", "[1, 2]")),
     ["outputs.json for targets/qwen3: a JSON list, not an object"]),
    ("--port-cmd outputs.json with a ragged array", lambda t: _port_cmd(t, _writes("outputs.json", '{"logits": [[1], [1, 2]]}')),
     ["outputs.json for targets/qwen3: 'logits' is not an array"]),
    ("--port-cmd outputs.safetensors corrupt", lambda t: _port_cmd(t, _writes("outputs.safetensors", "not tensors")),
     ["outputs.safetensors for targets/qwen3 cannot be read"]),
    ("in-process --port that raises", lambda t: _in_process(t, "failing_port", FAILING_PORT),
     ["ValueError: shapes (1, 4) and (2, 4) do not match", "[at failing_port.py:5 in _forward]"]),
]


@contextlib.contextmanager
def _isolated(t: Path):
    """One runtime row: temp folders under t/tmp and t on sys.path, both undone afterwards."""
    import tempfile

    (t / "tmp").mkdir()
    tempdir = tempfile.tempdir
    tempfile.tempdir = str(t / "tmp")
    sys.path.insert(0, str(t))
    try:
        yield
    finally:
        sys.path.remove(str(t))
        sys.modules.pop("failing_port", None)
        tempfile.tempdir = tempdir


def port_outcomes(tmp_root: Path) -> dict[str, tuple[int, dict, list[str]]]:
    """Every PORT_ERRORS entry run once: exit code, its report.json row, what it left in t/tmp."""
    done = {}
    for i, (what, build, _) in enumerate(PORT_ERRORS):
        t = tmp_root / f"pe{i:02d}"
        t.mkdir(parents=True)
        with _isolated(t):
            rc, _, _ = run_cli(build(t))
        row = json.loads((t / "r" / "report.json").read_text())["results"][0]
        done[what] = rc, row, sorted(p.name for p in (t / "tmp").iterdir())
    return done


def port_doc_row(what: str, rc: int, row: dict, tmp_root: Path) -> str:
    msg = re.sub(r"\$TMP/pe\d\d", "$TMP", row["reason"].replace(str(tmp_root), "$TMP"))
    return f"| {what} | `{msg.replace('|', '/')}` | {row['verdict']} | {rc} |"


def _tensors(d: Path, add: str = "", drop: str = "", grow: str = "") -> Path:
    """d/model.safetensors with a tensor added, dropped, or grown by one row."""
    from safetensors.numpy import load_file, save_file

    t = load_file(d / "model.safetensors")
    if add:
        t[add] = np.zeros((4, 4), np.float32)
    if drop:
        del t[drop]
    if grow:
        t[grow] = np.concatenate([t[grow], t[grow][:1]])
    save_file(t, d / "model.safetensors")
    return d


def _renamed(d: Path) -> Path:
    (d / "model.safetensors").rename(d / "weights.safetensors")
    return d


def _pair(kind: str, tmp: Path, name: str, overrides: dict) -> Path:
    """A factory drafter built with `overrides` (for another target), copied to tmp/name."""
    dst = tmp / name
    shutil.copytree(checkpoints.build(kind, 0, overrides), dst)
    return dst


def _broken_json(t: Path) -> Path:
    d = t / "broken"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3",')
    return d


def _garbage(d: Path) -> Path:
    (d / "model.safetensors").write_bytes(b"this is not a tensor file " * 8)
    return d


def _no_weights(d: Path) -> Path:
    (d / "model.safetensors").unlink()
    return d


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def outcomes(tmp_root: Path) -> dict[str, tuple[int, str, str]]:
    """Every BAD_INPUTS entry run once, each in its own folder under tmp_root."""
    done = {}
    for i, (what, build, _) in enumerate(BAD_INPUTS):
        t = tmp_root / f"in{i:02d}"
        t.mkdir(parents=True)
        done[what] = run_cli(build(t))
    return done


def doc_row(what: str, rc: int, err: str, tmp_root: Path) -> str:
    """The table row, with this machine's folders written as $TMP and the factory's cache."""
    msg = re.sub(r"\$TMP/in\d\d", "$TMP", err.strip().replace(str(tmp_root), "$TMP"))
    return f"| {what} | `{msg.replace('|', '/')}` | {rc} |"


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    return root, outcomes(root)


@pytest.mark.parametrize("what,needs", [(w, n) for w, _, n in BAD_INPUTS], ids=[w for w, _, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(ran, what, needs):
    _, results = ran
    rc, out, err = results[what]
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spec-parity "), err
    assert "Traceback" not in err + out and out == "", (out, err)
    for s in needs:
        assert s in err, (s, err)


def test_docs_table_is_current(ran):
    root, results = ran
    text = DOC.read_text()
    for what, (rc, _, err) in results.items():
        assert doc_row(what, rc, err, root) in text, f"docs/robustness.md is stale: {doc_row(what, rc, err, root)}"


@pytest.fixture(scope="module")
def port_ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("port-errors")
    return root, port_outcomes(root)


@pytest.mark.parametrize("what,needs", [(w, n) for w, _, n in PORT_ERRORS], ids=[w for w, _, _ in PORT_ERRORS])
def test_port_error_is_an_error_row_exit_1(port_ran, what, needs):
    """The case reads ERROR naming the failure, the run exits 1, no case folder is left behind,
    and the message points at no deleted temp folder."""
    _, results = port_ran
    rc, row, left = results[what]
    assert (rc, row["verdict"]) == (1, "ERROR"), (rc, row)
    assert left == [], left
    assert "spec-parity-case-" not in row["reason"] and "Traceback" in row["trace"], row
    for s in needs:
        assert s.replace(" / ", " | ") in row["reason"], (s, row["reason"])


def test_port_errors_table_is_current(port_ran):
    root, results = port_ran
    text = DOC.read_text()
    for what, (rc, row, _) in results.items():
        assert port_doc_row(what, rc, row, root) in text, f"docs/robustness.md is stale: {port_doc_row(what, rc, row, root)}"


def test_an_error_keeps_its_traceback(tmp_path):
    """report.json holds the traceback down to the port's frame; --debug prints it, and without
    --debug the terminal shows the one-line reason only."""
    for debug in (False, True):
        t = tmp_path / str(debug)
        t.mkdir()
        with _isolated(t):
            rc, _, err = run_cli(["--debug"] * debug + _in_process(t, "failing_port", FAILING_PORT))
        trace = json.loads((t / "r" / "report.json").read_text())["results"][0]["trace"]
        assert rc == 1 and 'failing_port.py", line 5, in _forward' in trace and trace.startswith("Traceback")
        assert ("Traceback" in err and 'failing_port.py", line 5, in _forward' in err) == debug, err


def test_misuse_is_refused_before_any_case(tmp_path, monkeypatch):
    """Negative control for the refusals above: with ports.check passing everything, the same
    --port misuse runs cases (our port where the user named theirs)."""
    from spec_parity import ports

    ran_cases = []
    monkeypatch.setattr(harness, "evaluate", lambda case, source, selection: ran_cases.append(case) or harness.Result(
        case.module, case.name, "-", case.tier, verdict=case.expect))
    argv = ["run", "--module", "dflash", "--case", "mod-qwen3", "--port", "targets=spec-parity", "--out", str(tmp_path)]
    rc, _, err = run_cli(argv)
    assert rc == 2 and "selects no targets case" in err and ran_cases == []
    monkeypatch.setattr(ports, "check", lambda *a, **k: {})
    assert run_cli(argv)[0] == 0 and "dflash/mod-qwen3" in [c.id for c in ran_cases]


def test_out_is_checked_before_the_first_case(tmp_path, monkeypatch):
    ran_cases = []
    monkeypatch.setattr(harness, "evaluate", lambda case, source, selection: ran_cases.append(case))
    rc, _, err = run_cli(["run", "--module", "targets", "--case", "qwen3", "--out", str(_target_file(tmp_path))])
    assert rc == 2 and "--out" in err and ran_cases == []


def test_every_factory_kind_passes_the_preflight():
    """The preflight refuses no checkpoint the project builds."""
    from spec_parity.port import checkpoint

    for kind in checkpoints.KINDS:
        assert checkpoint.check_dir(checkpoints.build(kind, 0, {}), "--x") in checkpoint.REQUIRED


def test_required_table_is_load_bearing(tmp_path, monkeypatch):
    """Negative control: with qwen3's required keys gone the missing rope_theta is not refused."""
    from spec_parity.port import checkpoint

    d = _edit_config(_copy("qwen3-target", tmp_path, "q"), "rope_theta")
    with pytest.raises(checkpoint.CheckpointError, match="rope_theta"):
        checkpoint.check_dir(d, "--target")
    monkeypatch.setitem(checkpoint.REQUIRED, "qwen3", ())
    assert checkpoint.check_dir(d, "--target") == "qwen3"


def test_debug_shows_the_traceback_and_the_process_exits_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "spec_parity.cli", "run", "--target", str(tmp_path / "none")]
    plain = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    debug = subprocess.run(argv[:3] + ["--debug"] + argv[3:], capture_output=True, text=True, env=env, cwd=ROOT)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "CheckpointError" in debug.stderr


def test_read_tensors_names_the_broken_file(tmp_path):
    from spec_parity.port import checkpoint

    d = _truncate(_copy("gemma4-assistant", tmp_path, "a"))
    with pytest.raises(checkpoint.CheckpointError, match=r"a/model\.safetensors: truncated"):
        checkpoint.read_tensors(d)


@pytest.mark.oracle
@pytest.mark.slow
def test_nan_weight_fails_non_finite(tmp_path):
    """A NaN in one target weight makes every later value NaN on both sides: FAIL non-finite,
    exit 1, and report.md says so. (It passed, exit 0, when equal NaNs counted as agreement.)"""
    from safetensors.numpy import load_file, save_file

    pytest.importorskip("transformers")
    d = _copy("qwen3-target", tmp_path, "nan-target")
    tensors = load_file(d / "model.safetensors")
    key = "model.layers.2.mlp.down_proj.weight"
    tensors[key] = tensors[key].copy()
    tensors[key][0, 0] = np.nan
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "report"
    rc, stdout, _ = run_cli(["run", "--module", "targets", "--target", str(d), "--source", "live", "--out", str(out)])
    assert rc == 1, stdout
    assert "FAIL non-finite" in stdout
    md = (out / "report.md").read_text()
    assert "FAIL non-finite" in md and "NaN" in md and "NaN/Inf never pass" in md


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for what, (rc, _, err) in outcomes(Path(tmp)).items():
            print(doc_row(what, rc, err, Path(tmp)))
        print()
        for what, (rc, row, _) in port_outcomes(Path(tmp)).items():
            print(port_doc_row(what, rc, row, Path(tmp)))

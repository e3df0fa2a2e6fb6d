"""The file protocol: a port in any language answers a case through files.

A case folder holds `request.json` (module, case, kind, options, dtype, the protocol's arrays
with their meaning, and the names/shapes/dtypes our port returns for it), `inputs.safetensors`
(`prompt` [1, P] int32 and every fed reference array) and the checkpoints as `target/` and
`drafter/` (the real on-disk format). The port writes into its output folder
`outputs.safetensors` and/or `outputs.json` ({name: nested list}, e.g. a loop's stream and
trace); names as the protocol has them.

`spec-parity export` writes case folders; `spec-parity run --port-cmd "CMD {case} {out}"` writes
one per case into a temporary folder, runs CMD and reads what it wrote back. CMD runs in a process
group of its own, with a per-case timeout (`--timeout S`, default 600 s) after which the whole
group is killed and the case reads ERROR naming the timeout; the temporary folder is removed on
every exit path (done, failed, timed out, Ctrl-C, SIGTERM). A command that exits non-zero reads
ERROR with the last lines of its stderr; exit 3 declines the case (its last stderr line is the
reason). The port's identity in the report is the command with the sha256 of every argument that is
an existing file (the executable given as a path, an interpreter's script); `--port-id NAME` names
it. `python -m spec_parity.exchange CASE OUT` answers a case folder with our own port, through the
same files (the seam's own test).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from . import ports, protocol
from .protocol import Request

TIMEOUT_S = 600.0
TAIL_LINES = 5


class ExchangeError(RuntimeError):
    """A case folder or a port's output that cannot be read; the message names the file."""


def write_case(req: Request, folder: Path, expected: dict | None = None, link: bool = False) -> Path:
    """The case folder of `req` (checkpoints copied, or linked when `link`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, src in (("target", req.target), ("drafter", req.drafter)):
        dst = folder / name
        if src is None or dst.exists():
            continue
        if link:
            dst.symlink_to(Path(src).resolve(), target_is_directory=True)
        else:
            shutil.copytree(src, dst)
    p = protocol.get(req.module, req.kind)
    doc = {"module": req.module, "case": req.case, "kind": req.kind, "protocol": f"{req.module}/{req.kind}",
           "target": "target", "drafter": "drafter" if req.drafter is not None else None,
           "options": req.options, "dtype": req.dtype, "inputs": sorted(req.inputs),
           "returns": [{"name": q.name, "shape": q.shape, "dtype": q.dtype, "required": q.required,
                        "meaning": q.meaning} for q in p.returns]}
    if expected is not None:
        doc["expected"] = {k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)}
                           for k, v in sorted(expected.items())}
    arrays = {"prompt": np.ascontiguousarray(req.prompt, np.int32)}
    arrays.update({k: np.ascontiguousarray(v) for k, v in req.inputs.items()})
    save_file(arrays, str(folder / "inputs.safetensors"))
    (folder / "request.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return folder


def read_case(folder: Path) -> Request:
    folder = Path(folder)
    try:
        doc = json.loads((folder / "request.json").read_text())
        arrays = load_file(str(folder / "inputs.safetensors"))
    except (OSError, ValueError) as e:
        raise ExchangeError(f"{folder}: not a case folder ({e}); write one with `spec-parity export`") from e
    prompt = arrays.pop("prompt")
    return Request(doc["module"], doc["case"], doc["kind"], folder / doc["target"],
                   folder / doc["drafter"] if doc["drafter"] else None, prompt, doc["options"], doc["dtype"], arrays)


def read_outputs(out: Path, req: Request) -> dict:
    """What a port wrote into `out`: safetensors as they are, JSON lists as arrays of the
    protocol's dtype for that name. An error names the file by its name in `out` and the case."""
    tensors, listed = out / "outputs.safetensors", out / "outputs.json"
    what = f"{req.module}/{req.case}"
    if not tensors.exists() and not listed.exists():
        raise ExchangeError(f"the port wrote nothing for {what}: write outputs.safetensors and/or outputs.json "
                            "into the folder given as {out} (docs/protocol.md)")
    arrays: dict = {}
    if tensors.exists():
        try:
            arrays.update(load_file(str(tensors)))
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ExchangeError(f"the port's outputs.safetensors for {what} cannot be read "
                                f"({type(e).__name__}: {e}); write it with a safetensors library") from e
    if listed.exists():
        try:
            doc = json.loads(listed.read_text())
        except (OSError, ValueError) as e:
            raise ExchangeError(f"the port's outputs.json for {what}: not valid JSON ({e}); write one object "
                                "{name: nested list}") from e
        if not isinstance(doc, dict):
            raise ExchangeError(f"the port's outputs.json for {what}: a JSON {type(doc).__name__}, not an object; "
                                "write one object {name: nested list}")
        p = protocol.get(req.module, req.kind)
        for k, v in doc.items():
            q = p.quantity(k)
            try:
                arrays[k] = np.asarray(v, dtype=(q.dtype if q and q.dtype in ("int32", "float32") else None))
            except (TypeError, ValueError) as e:
                raise ExchangeError(f"the port's outputs.json for {what}: {k!r} is not an array ({e}); "
                                    "give it as a nested list of numbers") from e
    return arrays


def write_outputs(out: Path, arrays: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(out / "outputs.safetensors"))


def parse_cmd(cmd: str) -> list[str]:
    """--port-cmd's argv with {case} and {out} still in it, or PortError naming what is wrong."""
    bad = f"--port-cmd {cmd!r}"
    try:
        cmd.format(case="", out="")
        argv = shlex.split(cmd)
    except (KeyError, IndexError, ValueError) as e:
        raise ports.PortError(f"{bad}: cannot be parsed ({type(e).__name__}: {e}); name only {{case}} and "
                              "{out}, write a literal brace as {{ or }}, and close every quote") from e
    if "{case}" not in cmd or "{out}" not in cmd:
        raise ports.PortError(f"{bad}: the command must name {{case}} and {{out}} "
                              "(e.g. \"./my-port {case} {out}\")")
    return argv


def command_port(cmd: str, timeout: float = TIMEOUT_S, port_id: str | None = None) -> ports.Port:
    """A port that answers every module by running `cmd` ({case} and {out} filled in) per case, at
    most `timeout` seconds each. Its identity hashes every argument that is an existing file."""
    argv = parse_cmd(cmd)
    if not (Path(argv[0]).is_file() or shutil.which(argv[0])):
        raise ports.PortError(f"--port-cmd {cmd!r}: {argv[0]!r} is neither a file nor a command on PATH; "
                              "give the port's executable (a path, or a command on PATH)")
    if not timeout > 0:
        raise ports.PortError(f"--timeout {timeout:g}: give the seconds a case may take (> 0)")

    def run(req: Request) -> dict:
        what = f"{req.module}/{req.case}"
        with tempfile.TemporaryDirectory(prefix="spec-parity-case-") as tmp:
            case, out = write_case(req, Path(tmp) / "case", link=True), Path(tmp) / "out"
            out.mkdir()
            code, printed = _run(shlex.split(cmd.format(case=shlex.quote(str(case)), out=shlex.quote(str(out)))),
                                 timeout, what)
            if code == ports.DECLINE_EXIT:
                raise ports.Declined((_lines(printed[0]) or ["(no reason on stderr)"])[-1])
            if code != 0:
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
                raise ExchangeError(f"--port-cmd {how} on {what}{_tail(*printed)}")
            try:
                return read_outputs(out, req)
            except ExchangeError as e:
                raise ExchangeError(f"--port-cmd: {e}{_tail(*printed)}") from e

    files = tuple(str(Path(a).resolve()) for a in argv if Path(a).is_file())
    return ports.Port(port_id or "port-cmd", cmd, {m: run for m in protocol.MODULES}, files)


def _run(argv: list[str], timeout: float, what: str) -> tuple[int, tuple[str, str]]:
    """argv in a process group of its own: its exit code, (stderr, stdout). On a timeout, Ctrl-C
    or any error the whole group is killed before the case folder goes."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a process that left the group still holds the pipes
            out, err = "", ""
        raise ExchangeError(f"--port-cmd timed out after {timeout:g} s on {what} (its process group was "
                            f"killed); give --timeout S if the port needs longer{_tail(err, out)}") from None
    finally:
        _kill(proc)
    return proc.returncode, (err, out)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the command's process group (what it started too), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _lines(text: str) -> list[str]:
    return [x.strip()[:240] for x in (text or "").splitlines() if x.strip()]


def _tail(err: str, out: str = "") -> str:
    """The last lines the port printed on stderr (else stdout), on one line."""
    name, lines = ("stderr", _lines(err)) if _lines(err) else ("stdout", _lines(out))
    return f"; its {name} ends: {' | '.join(lines[-TAIL_LINES:])}" if lines else "; it printed nothing"


def markdown() -> str:
    """docs/protocol.md: the arrays of every protocol, then the file protocol that carries them."""
    return "\n".join([protocol.markdown(), "## The file protocol (a port in any language)", "",
                      __doc__.split("\n\n", 1)[1].strip(), ""])


def main(argv: list[str] | None = None) -> int:
    """`python -m spec_parity.exchange CASE OUT`: our own port on a case folder."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m spec_parity.exchange CASE_DIR OUT_DIR", file=sys.stderr)
        return 2
    req = read_case(Path(args[0]))
    write_outputs(Path(args[1]), ports.ours().runs[req.module](req))
    return 0


if __name__ == "__main__":
    sys.exit(main())

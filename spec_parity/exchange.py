"""The file protocol: a port in any language answers a case through files.

A case folder holds `request.json` (module, case, kind, options, dtype, the protocol's arrays
with their meaning, and the names/shapes/dtypes our port returns for it), `inputs.safetensors`
(`prompt` [1, P] int32 and every fed reference array) and the checkpoints as `target/` and
`drafter/` (the real on-disk format). The port writes into its output folder
`outputs.safetensors` and/or `outputs.json` ({name: nested list}, e.g. a loop's stream and
trace); names as the protocol has them.

`spec-parity export` writes case folders; `spec-parity run --port-cmd "CMD {case} {out}"` writes
one per case, runs CMD and reads what it wrote back. `python -m spec_parity.exchange CASE OUT`
answers a case folder with our own port, through the same files (the seam's own test).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from . import ports, protocol
from .protocol import Request


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
    protocol's dtype for that name."""
    tensors, listed = out / "outputs.safetensors", out / "outputs.json"
    if not tensors.exists() and not listed.exists():
        raise ExchangeError(f"{out}: the port wrote neither outputs.safetensors nor outputs.json")
    arrays: dict = {}
    try:
        if tensors.exists():
            arrays.update(load_file(str(tensors)))
        if listed.exists():
            p = protocol.get(req.module, req.kind)
            for k, v in json.loads(listed.read_text()).items():
                q = p.quantity(k)
                arrays[k] = np.asarray(v, dtype=(q.dtype if q and q.dtype in ("int32", "float32") else None))
    except (OSError, ValueError) as e:
        raise ExchangeError(f"{out}: cannot read the port's outputs ({e})") from e
    return arrays


def write_outputs(out: Path, arrays: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(out / "outputs.safetensors"))


def command_port(cmd: str) -> ports.Port:
    """A port that answers every module by running `cmd` ({case} and {out} filled in) per case."""
    if "{case}" not in cmd or "{out}" not in cmd:
        raise ports.PortError(f"--port-cmd {cmd!r}: the command must name {{case}} and {{out}}")

    def run(req: Request) -> dict:
        with tempfile.TemporaryDirectory(prefix="spec-parity-case-") as tmp:
            case, out = write_case(req, Path(tmp) / "case", link=True), Path(tmp) / "out"
            out.mkdir()
            argv = shlex.split(cmd.format(case=shlex.quote(str(case)), out=shlex.quote(str(out))))
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
                if done.returncode == ports.DECLINE_EXIT:
                    raise ports.Declined(tail[0])
                raise ExchangeError(f"--port-cmd exited {done.returncode} on {req.module}/{req.case}: {tail[0]}")
            return read_outputs(out, req)

    return ports.Port("port-cmd", cmd, {m: run for m in protocol.MODULES}, ())


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

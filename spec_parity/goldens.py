"""Golden outputs of the live references, with provenance, so comparisons run where a reference
cannot be installed.

Layout: `fixtures/<module>/<case>.safetensors` + `<case>.json` (the manifest). Numerics specific to
one machine go under `fixtures/<module>/<machine-key>/`, which overrides the shared folder when
present. Regeneration writes only the local machine's set: the shared folder if it was made on
this machine key (or does not exist yet), the keyed folder otherwise. Writes are atomic (temp file
+ os.replace, tensors before manifest), so an interrupted regen never leaves a half golden.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import load_file, save_file

from .shipped import shipped

if TYPE_CHECKING:
    from .case import Case


class GoldenError(RuntimeError):
    pass


def atomic_write(path: Path, data: bytes) -> None:
    """A temp file in the same folder, then os.replace: a reader sees the old file or the new one,
    never half of one (the bench's files, the greedy memo). `save` keeps its own pair of temps: its
    manifest is written before the tensors are replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make a report unreadable to others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def root() -> Path:
    """Where goldens are read and written: SPEC_PARITY_FIXTURES, else the shipped fixtures/."""
    return Path(os.environ.get("SPEC_PARITY_FIXTURES", shipped()))


def machine_key() -> str:
    return f"{platform.system().lower()}-{platform.machine().lower()}-cpu"


def regen_command(case: Case) -> str:
    return f"spec-parity fixtures regen --module {case.module} --case {case.golden_name}   (or: pytest --regen-goldens)"


def _paths(folder: Path, name: str) -> tuple[Path, Path]:
    return folder / f"{name}.safetensors", folder / f"{name}.json"


def locate(case: Case) -> tuple[Path, Path] | None:
    for folder in (root() / case.module / machine_key(), root() / case.module):
        t, m = _paths(folder, case.golden_name)
        if t.exists() and m.exists():
            return t, m
    return None


def load(case: Case) -> tuple[dict[str, np.ndarray], dict]:
    """The golden arrays and manifest for `case`; a clear error if missing, corrupt or stale."""
    found = locate(case)
    if found is None:
        raise GoldenError(f"no golden for {case.module}/{case.golden_name} under {root()}; "
                          f"create it with a live reference: {regen_command(case)}")
    tpath, mpath = found
    manifest = json.loads(mpath.read_text())
    data = tpath.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest.get("golden_sha256"):
        raise GoldenError(f"golden {tpath} does not match the sha256 in its manifest (edited or truncated); "
                          f"regenerate: {regen_command(case)}")
    expected = case.manifest()
    stored = {k: manifest.get(k) for k in expected}
    if stored != expected:
        from deepdiff import DeepDiff

        diff = DeepDiff(stored, expected, verbose_level=2)
        raise GoldenError(f"stale golden {mpath}: its manifest disagrees with the case "
                          f"(stored -> expected):\n{diff.pretty()}\nregenerate: {regen_command(case)}")
    return load_file(str(tpath)), manifest


def write_target(case: Case) -> Path:
    shared = root() / case.module
    _, m = _paths(shared, case.golden_name)
    if not m.exists() or json.loads(m.read_text()).get("device") == machine_key():
        return shared
    return shared / machine_key()


def save(case: Case, arrays: dict[str, np.ndarray], provenance: dict) -> Path:
    folder = write_target(case)
    folder.mkdir(parents=True, exist_ok=True)
    tpath, mpath = _paths(folder, case.golden_name)
    fd, tmp_t = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in sorted(arrays.items())}, tmp_t,
                  metadata={"spec-parity": f"{case.module}/{case.golden_name}"})  # one key: safetensors orders a map randomly
        digest = hashlib.sha256(Path(tmp_t).read_bytes()).hexdigest()
        manifest = {**case.manifest(), **provenance, "device": machine_key(), "golden_sha256": digest,
                    "seed": case.seed}
        fd, tmp_m = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp_t, 0o644)
        os.chmod(tmp_m, 0o644)
        os.replace(tmp_t, tpath)
        os.replace(tmp_m, mpath)
    finally:
        for t in (tmp_t,):
            if os.path.exists(t):
                os.unlink(t)
    return tpath

"""Results that several cases and tests read, computed once per process.

- The target's plain greedy stream is the losslessness reference of every serve-loop case and
  test: the same (target checkpoint, prompt, length, EOS) recurs across a case, its negative
  controls (whose bugs are the drafter's or the loop's, never the target's), its torch twin and the
  loop tests. Keyed by the checkpoint's files (resolved path, size, mtime) and the exact arguments;
  the target is loaded here from its directory, so a caller's modified model never enters it.
- A live reference run is keyed by the case's manifest, the same fields a golden must agree with:
  a negative control's manifest is its base's (the planted bug is the port's), so they share one
  run as they share one golden.
- A port run is keyed by the whole case and the bytes of the reference it is given, so the golden
  and the live test of one case share it when the two references are the same bytes. A pair may
  key a run more finely by what it reads (pairs/dflash.py: a serve-loop run, shared by the z-lab
  MLX and torch twins of a Qwen3 loop).

Arrays in a stored result are made read-only and dicts are handed out as copies: no reader can
change what the next one gets.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .checkpoints import FILES

_STORE: dict = {}


def once(key, compute: Callable):
    """compute() the first time `key` is asked for in this process; the stored result after."""
    if key not in _STORE:
        _STORE[key] = _freeze(compute())
    return _handout(_STORE[key])


def _freeze(x):
    if isinstance(x, np.ndarray):
        x.setflags(write=False)
    elif isinstance(x, dict):
        for v in x.values():
            _freeze(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _freeze(v)
    return x


def _handout(x):
    if isinstance(x, dict):
        return dict(x)
    if isinstance(x, tuple):
        return tuple(_handout(v) for v in x)
    if isinstance(x, list):
        return list(x)
    return x


def digest(arrays: dict) -> str:
    """sha256 over names, dtypes, shapes and bytes of a dict of arrays."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def case_key(case) -> str:
    return json.dumps(asdict(case), sort_keys=True, default=str)


def manifest_key(case) -> str:
    return json.dumps(case.manifest(), sort_keys=True)


def stamp(path: str | Path) -> tuple:
    """A checkpoint directory's identity: resolved path, and size and mtime of each file."""
    path = Path(path).resolve()
    stats = [(path / f).stat() for f in FILES]
    return (str(path),) + tuple((s.st_size, s.st_mtime_ns) for s in stats)


def greedy(checkpoint: str | Path, prompt, n: int, eos: Iterable[int] | None = None):
    """`port.targets.greedy` of the target in `checkpoint` on `prompt` ([1, T] or a token list):
    the new tokens (a fresh list) and the logits each was chosen from [len, V]."""
    key = stamp(checkpoint)
    ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
    eos = None if eos is None else frozenset(eos)

    def compute():
        import mlx.core as mx

        from port import targets

        tokens, logits = targets.greedy(targets.load(key[0]), mx.array([ids], dtype=mx.int32), n,
                                        None if eos is None else set(eos))
        mx.eval(logits)
        return tokens, logits

    return once(("greedy", key, tuple(ids), int(n), eos), compute)

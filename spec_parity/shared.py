"""Results that several cases and tests read, computed once per process.

- The target's plain greedy stream is the losslessness reference of every serve-loop case and
  test: the same (target checkpoint, prompt, length, EOS) recurs across a case, its negative
  controls (whose bugs are the drafter's or the loop's, never the target's), its torch twin and the
  loop tests. Keyed by the checkpoint's files (resolved path, size, mtime) and the exact arguments;
  the target is loaded here from its directory, so a caller's modified model never enters it.
  It is also kept on disk, under $SPEC_PARITY_CACHE/greedy, keyed by the checkpoint's bytes, the
  arguments and the code that decodes it (`_memo`): the next run of the suite reads it back.
- A live reference run is keyed by the case's manifest, the same fields a golden must agree with:
  a negative control's manifest is its base's (the planted bug is the port's), so they share one
  run as they share one golden.
- A port run is keyed by the whole case and the bytes of the reference it is given, so the golden
  and the live test of one case share it when the two references are the same bytes. A pair may
  key a run more finely by what it reads (drafters/dflash/pair.py: a serve-loop run, shared by the z-lab
  MLX and torch twins of a Qwen3 loop).

Arrays in a stored result are made read-only and dicts are handed out as copies: no reader can
change what the next one gets.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .checkpoints import cache_root
from .goldens import atomic_write

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
    from spec_parity.port import checkpoint

    path = Path(path).resolve()
    stats = [f.stat() for f in checkpoint.files(path)]
    return (str(path),) + tuple((s.st_size, s.st_mtime_ns) for s in stats)


def greedy(checkpoint: str | Path, prompt, n: int, eos: Iterable[int] | None = None, dtype: str = "float32"):
    """`spec_parity.port.targets.greedy` of the target in `checkpoint` on `prompt` ([1, T] or a token list),
    its weights cast to `dtype` (the case's: a bf16 checkpoint in a float32 case runs at float32):
    the new tokens (a fresh list) and the logits each was chosen from [len, V]. Also kept on disk
    (`_memo`): every serve-loop test reads one, and each run of the suite would decode them anew."""
    key = stamp(checkpoint)
    ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
    eos = None if eos is None else frozenset(eos)

    def compute():
        import mlx.core as mx

        from spec_parity.port import targets

        memo = _memo(Path(key[0]), ids, n, eos, dtype)
        kept = _read_memo(memo)
        if kept is not None:
            return kept
        tokens, logits = targets.greedy(targets.load(key[0], getattr(mx, dtype)), mx.array([ids], dtype=mx.int32), n,
                                        None if eos is None else set(eos))
        mx.eval(logits)
        if memo is not None:
            bits = logits.view({2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[logits.dtype.size])
            buf = io.BytesIO()
            np.savez(buf, tokens=np.array(tokens, np.int64), bits=np.array(bits),
                     dtype=np.array(str(logits.dtype).split(".")[-1]))
            atomic_write(memo, buf.getvalue())
        return tokens, logits

    return once(("greedy", key, tuple(ids), int(n), eos, dtype), compute)


MEMO_MAX_BYTES = 64 << 20


def _memo(checkpoint: Path, ids: list[int], n: int, eos, dtype: str = "float32") -> Path | None:
    """Where a greedy stream is kept across processes: keyed by the checkpoint's bytes, the
    arguments, the code that decodes and keeps it (port/targets.py, mlx-lm's models, this file, the
    mlx and mlx-lm versions) and what else moves its logits (the device, MLX_ENABLE_TF32). None for a
    checkpoint over MEMO_MAX_BYTES (a real one: hashing it would cost more than decoding)."""
    import mlx.core as mx

    from spec_parity.port import checkpoint as ckpt

    files = ckpt.files(checkpoint)
    if sum(f.stat().st_size for f in files) > MEMO_MAX_BYTES:
        return None
    h = hashlib.sha256(_code_digest().encode())
    for f in files:
        h.update(hashlib.sha256(f.read_bytes()).digest())
    h.update(json.dumps([ids, int(n), None if eos is None else sorted(eos), dtype, str(mx.default_device()),
                         os.environ.get("MLX_ENABLE_TF32")]).encode())
    return cache_root() / "greedy" / f"{h.hexdigest()[:24]}.npz"


def _read_memo(memo: Path | None):
    """A kept stream, or None when there is none or it cannot be read (then it is decoded and
    written anew)."""
    import mlx.core as mx

    if memo is None or not memo.exists():
        return None
    try:
        with np.load(memo) as z:
            return [int(t) for t in z["tokens"]], mx.array(z["bits"]).view(getattr(mx, str(z["dtype"])))
    except (OSError, KeyError, ValueError, AttributeError, zipfile.BadZipFile):
        return None


@functools.cache
def _code_digest() -> str:
    import mlx.core as mx
    import mlx_lm

    from spec_parity.port import targets

    models = Path(mlx_lm.__file__).parent / "models"
    h = hashlib.sha256(f"{mx.__version__}|{getattr(mlx_lm, '__version__', '')}".encode())
    for f in [Path(__file__), Path(targets.__file__)] + sorted(models.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()

"""Results that several cases and tests read, computed once per process.

The target's plain greedy stream is the losslessness reference of every serve-loop case and test:
the same (target checkpoint, prompt, length, EOS) recurs across a case, its negative controls (whose
bugs are the drafter's or the loop's, never the target's), its torch twin and the loop tests. It is
a function of those arguments alone, so it is computed once and read by all of them. The key is the
checkpoint's files (resolved path, size, mtime) and the exact arguments; the target is loaded here
from its directory, so a caller's modified model (a planted bug in the target) never enters it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .checkpoints import FILES


def _stamp(path: str | Path) -> tuple:
    path = Path(path).resolve()
    stats = [(path / f).stat() for f in FILES]
    return (str(path),) + tuple((s.st_size, s.st_mtime_ns) for s in stats)


def greedy(checkpoint: str | Path, prompt, n: int, eos: Iterable[int] | None = None):
    """`port.targets.greedy` of the target in `checkpoint` on `prompt` ([1, T] or a token list):
    the new tokens (a fresh list) and the logits each was chosen from [len, V]."""
    ids = tuple(int(t) for t in np.asarray(prompt).reshape(-1))
    tokens, logits = _greedy(_stamp(checkpoint), ids, int(n), None if eos is None else frozenset(eos))
    return list(tokens), logits


@functools.cache
def _greedy(stamp: tuple, ids: tuple, n: int, eos: frozenset | None):
    import mlx.core as mx

    from port import targets

    target = targets.load(stamp[0])
    tokens, logits = targets.greedy(target, mx.array([list(ids)], dtype=mx.int32), n,
                                    None if eos is None else set(eos))
    mx.eval(logits)
    return tuple(tokens), logits

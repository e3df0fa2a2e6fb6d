"""Compiled step pieces, shared by the drafter ports.

A draft step or block is split where its shapes change: the attention over the context / donor
K/V (whose length grows every round) runs outside mx.compile, the shape-stable pieces between
two attentions run through it. Positions and token ids enter as arrays, so a new round does not
retrace. The plain pieces are the same functions uncompiled (`model.compiled = False`), and the
tests hold the two bit for bit.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
from mlx.utils import tree_map


class Pieces:
    """A model's pieces, compiled once on first use with the module's parameters as compile inputs
    (a weight replaced later is seen, not a stale constant). A plain object, so it is not part of
    the module's state."""

    def __init__(self):
        self.compiled = None

    def get(self, model, plain):
        """`plain` (a tuple / list tree of functions) as is, or its compiled twin when
        `model.compiled`."""
        if not model.compiled:
            return plain
        if self.compiled is None:
            self.compiled = tree_map(partial(mx.compile, inputs=[model.state]), plain)
        return self.compiled


def position(model, value: int):
    """A position for the pieces: an array when compiled (no retrace per value), else the int."""
    return mx.array(value, mx.int32) if model.compiled else value

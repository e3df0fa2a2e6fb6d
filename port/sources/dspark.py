"""DSpark (port/dspark.py) behind the serve-loop seam: DeepspecSource and DeepspecProvider."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .. import checkpoint, targets
from ..compiled import AUTO
from ..dspark import Block, Model, check_pairing
from ..fast import dspark as fast
from . import PipelinedRows, context_bytes


class DeepspecSource(PipelinedRows):
    """DSpark behind the serve-loop seam. It owns the per-layer context K/V: prefill queues the
    tapped prompt rows, each draft first appends the queued rows (projected, at their absolute
    positions), and commit queues only the anchor + accepted rows of the verify."""

    def __init__(self, drafter: Model, view, threshold: float = 0.0):
        check_pairing(drafter, view.target)
        self.m, self.threshold = drafter, threshold
        self.tap_layers = drafter.tap_layers()
        self.cache: list[KVCache] | None = None  # per draft layer, preallocated (grows in steps)
        self.length = 0
        self.pending = None
        self.last_block: Block | None = None

    def prefill(self, prompt_ids, tapped) -> None:
        self.pending = mx.concatenate(tapped, axis=-1)

    @property
    def nbytes(self) -> int:
        """Bytes of this request's context K/V (all draft layers) and queued tap rows."""
        return context_bytes(self.cache, self.pending)

    def draft(self, feed: list[int], n: int, anchor_hidden) -> list[int]:
        return self.draft_device(feed, n, anchor_hidden).tolist()

    def draft_device(self, feed: list[int], n: int, anchor_hidden) -> mx.array:
        """The greedy proposal as a lazy array; it syncs only for a confidence threshold (the
        proposal's length)."""
        block = self._block(feed, None)
        return block.token_ids[: min(self.m.prefix_length(block.confidence, self.threshold), n)]

    def draft_sampled(self, feed: list[int], n: int, anchor_hidden, pick) -> list[int]:
        """`draft` with each slot's token chosen by `pick(row)` (None: argmax), chained through
        the Markov head and the confidence head as DeepSpec's sampled proposal is."""
        block = self._block(feed, pick)
        return block.tokens[: min(self.m.prefix_length(block.confidence, self.threshold), n)]

    def _block(self, feed: list[int], pick) -> Block:
        rows = self.pending
        kv = self.m.context_kv(self.m.project(rows), self.length)
        if self.cache is None:
            self.cache = [self.m.make_cache() for _ in kv]
        for c, (k, v) in zip(self.cache, kv):
            c.update_and_fetch(k, v)
        self.length += rows.shape[1]
        self.pending = None
        self.last_block = self.m.draft_block(feed[-1], self.cache, self.length, pick)
        return self.last_block

    def commit(self, n_drafted: int, accepted: int, tapped) -> None:
        self.pending = targets.verified_rows(tapped, accepted)

    def pipelines(self) -> str | None:
        """Why this source cannot draft in the pipelined loop (port/serve.py; None: it can)."""
        if not isinstance(self.m, fast.Bucketed):
            return "the DSpark drafter needs its bucketed block (kv_bucket)"
        if self.threshold > 0:
            return "a confidence threshold reads the proposal's length on the host"
        return None

    def draft_pipelined(self, pending: mx.array, n: int, offset: mx.array, room: int) -> mx.array:
        """`draft_device` from the pending token and the committed length `offset` as device
        scalars (`room`: a bound on `offset` the host knows): the last commit's rows all join the
        context at the previous call's offset, and the block attends those before `offset`."""
        if self.pending is not None:
            block = self._block([pending], None)
        else:
            self.last_block = block = self.m.block_at(pending, self.cache, self.rows, self.at, offset, self.room)
        self.at, self.room = offset, room
        return block.token_ids[:n]

    def dispose(self) -> None:
        self.cache = self.rows = None


class DeepspecProvider:
    """The drafter on a fast path (port/fast/dspark.py). `kv_bucket` (default "auto", i.e.
    compiled.BUCKET rows): the bucketed block, and the serve loop's bucketed verify, so that a
    round at a new context length plans no new attention kernel on MLX CUDA; None: the plain
    compiled path and mlx-lm's caches. `dtype`: the drafter's floating weights cast to it (None: as
    stored)."""

    def __init__(self, path: str | Path, threshold: float = 0.0, kv_bucket: int | str | None = AUTO, dtype=None):
        self.path = Path(path)
        self.id = self.path.name
        self.drafter = fast.load(self.path, kv_bucket=kv_bucket, dtype=dtype)
        self.kv_bucket = getattr(self.drafter, "kv_bucket", None)
        self.weights_bytes = checkpoint.weights_bytes(self.path)
        self.trained_gamma = self.drafter.args.block_size
        self.threshold = threshold

    def open(self, view) -> DeepspecSource:
        return DeepspecSource(self.drafter, view, self.threshold)

    def dispose(self) -> None:
        self.drafter = None

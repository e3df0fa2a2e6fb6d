"""DFlash (port/dflash.py) behind the serve-loop seam: DflashSource and DflashProvider, with the
DSpark-on-DFlash extension's heads and pruning when it is on."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import checkpoint, heads, targets
from ..calibration import ConfSample, resolve_thresholds
from ..compiled import AUTO
from ..dflash import Block, Model, check_pairing, load_extension
from ..fast import dflash as fast
from . import PipelinedRows, context_bytes


class DflashSource(PipelinedRows):
    """DFlash behind the serve-loop seam. It owns the per-layer context K/V; prefill queues the
    tapped prompt rows, each draft projects the queued rows into the K/V (at their absolute
    positions) while drafting, and commit queues only the pending + accepted rows of the verify.

    `max_tokens` (optional) reproduces z-lab's last block: with n tokens emitted it drafts at most
    max_tokens - n (z-lab shrinks the block to what is left; the serve loop would draft a full
    block and drop the excess)."""

    def __init__(self, drafter: Model, view, max_tokens: int | None = None, thresholds: list[float] | None = None,
                 samples: list | None = None, extension: heads.Extension | None = None):
        check_pairing(drafter, view.target)
        self.m, self.target, self.max_tokens, self.extension = drafter, view.target, max_tokens, extension
        self.thresholds = list(thresholds) if thresholds else None  # extras only
        self.samples = samples  # extras: a list to append (pos, sigmoid(conf), accepted) per verified draft
        self.tap_layers = list(drafter.args.target_layer_ids)
        self.caches = drafter.make_caches()
        self.pending: mx.array | None = None
        self.emitted = 0
        self.last_block: Block | None = None

    def _queue(self, rows: mx.array) -> None:
        self.pending = rows if self.pending is None else mx.concatenate([self.pending, rows], axis=1)

    def prefill(self, prompt_ids, tapped) -> None:
        x = mx.concatenate(tapped, axis=-1)
        if self.m.all_sliding and x.shape[1] > self.m.args.sliding_window - 1:
            # No layer can see more than the newest W-1 prompt rows: project only those.
            skip = x.shape[1] - (self.m.args.sliding_window - 1)
            x = x[:, skip:]
            for c in self.caches:
                c.offset = skip
        self._queue(x)
        self.emitted = 1

    @property
    def nbytes(self) -> int:
        """Bytes of this request's context K/V (all draft layers) and queued tap rows."""
        return context_bytes(self.caches, self.pending)

    def draft(self, feed: list[int], n: int, anchor_hidden) -> list[int]:
        return self.draft_device(feed, n, anchor_hidden).tolist()

    def draft_device(self, feed: list[int], n: int, anchor_hidden) -> mx.array:
        """The drafts as a lazy array: no host sync (extras with thresholds: one, for the length)."""
        return self._draft(feed, n, None)

    def draft_sampled(self, feed: list[int], n: int, anchor_hidden, pick) -> list[int]:
        """`draft` with each row's token chosen by `pick(row)`. The block's rows come from one
        forward over the mask tokens, so plain DFlash picks every row on its own (row order); with
        the extension the Markov head chains on the picked token and the confidence head reads it
        (as DSpark's sampled proposal does)."""
        return self._draft(feed, n, pick).tolist()

    def _draft(self, feed: list[int], n: int, pick) -> mx.array:
        n = min(n, self.m.args.block_size - 1)
        if self.max_tokens is not None:
            n = min(n, self.max_tokens - self.emitted)
        if n <= 0:
            self.last_block = None
            return mx.array([], mx.uint32)
        block = self.m.block(self.target, feed[-1], n, self.pending, self.caches)
        self.pending = None
        if self.extension is not None:
            block = self.extend(block, feed[-1], pick)
        elif pick is not None:
            block = Block(block.hidden, block.logits, mx.array([int(pick(row)) for row in block.logits], mx.uint32))
        self.last_block = block
        if block.confidence is not None and self.thresholds:
            return block.token_ids[: prune_length(block.confidence, self.thresholds)]
        return block.token_ids

    def pipelines(self) -> str | None:
        """Why this source cannot draft in the pipelined loop (port/serve.py; None: it can)."""
        if not isinstance(self.m, fast.Bucketed):
            return "the DFlash drafter needs its bucketed block (kv_bucket)"
        if self.extension is not None:
            return "the DSpark-on-DFlash extension reads its confidence on the host"
        if self.max_tokens is not None:
            return "max_tokens (z-lab's last block) shrinks the block by the emitted count"
        return None

    def draft_pipelined(self, pending: mx.array, n: int, offset: mx.array, room: int) -> mx.array:
        """`draft_device` from the pending token and the committed length `offset` as device
        scalars (`room`: a bound on `offset` the host knows): the last commit's rows all join the
        context at the previous call's offset, and the block attends those before `offset`."""
        n = min(n, self.m.args.block_size - 1)
        if self.pending is not None:
            block = self.m.block(self.target, pending, n, self.pending, self.caches)
            self.pending = None
        else:
            ids = targets.block_ids(pending, self.m.args.mask_token_id, n).reshape(-1)
            block = self.m.block_at(self.target, ids, self.rows, self.at, offset, self.room, self.caches)
        self.at, self.room, self.last_block = offset, room, block
        return block.token_ids

    def extend(self, block: Block, anchor: int, pick) -> Block:
        """The extension on the block's rows: the Markov bias added to row k after the softcap,
        chained on the row's token (its argmax on the device, or `pick(row)`); then the
        confidence logits of every row."""
        rows, tokens, conf = self.extension(block.hidden, block.logits, mx.array([anchor], mx.uint32), pick)
        return Block(block.hidden, rows, tokens, base_logits=block.logits, confidence=conf)

    def commit(self, n_drafted: int, accepted: int, tapped) -> None:
        self._queue(targets.verified_rows(tapped, accepted))
        self.emitted += accepted + 1
        block = self.last_block
        if self.samples is not None and block is not None and block.confidence is not None and n_drafted:
            conf = mx.sigmoid(block.confidence[:n_drafted]).tolist()
            self.samples += [ConfSample(k, float(c), k < accepted) for k, c in enumerate(conf)]

    def dispose(self) -> None:
        self.caches = self.pending = self.rows = None


def prune_length(confidence: mx.array, thresholds: list[float]) -> int:
    """Draft tokens kept: up to the first position k whose sigmoid(confidence_k) < thresholds[k]
    (one threshold: every position; past the list's end: never pruned). Compared on the device
    against the thresholds rounded up to float32, which for a float32 confidence decides c < t
    exactly as the float64 threshold does; one 4-byte read."""
    n = confidence.shape[0]
    return targets.first_true(mx.sigmoid(confidence) < _cuts(tuple(float(t) for t in thresholds), n), n)


@lru_cache(maxsize=64)
def _cuts(thresholds: tuple[float, ...], n: int) -> mx.array:
    """Per position the smallest float32 >= its threshold (-inf past the list's end), built once
    per (thresholds, n): a host-filled array is managed memory on MLX CUDA."""
    th = thresholds * n if len(thresholds) == 1 else thresholds[:n]
    up = [np.nextafter(np.float32(t), np.float32(np.inf)) if float(np.float32(t)) < t else np.float32(t) for t in th]
    return mx.array(np.array(up + [-np.inf] * (n - len(up)), np.float32))


class DflashProvider:
    """The drafter on a fast path (port/fast/dflash.py). `extras=True` turns on the
    DSpark-on-DFlash extension (port/dflash.py docstring); `thresholds` overrides the env var and
    the checkpoint's calibration (spec_parity.port.calibration.resolve_thresholds); `collect_samples` gathers, over every
    request, the (position, sigmoid(confidence), accepted) samples of each verified draft in
    `self.samples` (what spec_parity.port.calibration.fit_sts_thresholds fits).

    `kv_bucket` (default "auto"): the bucketed block, and the serve loop's bucketed verify, at
    compiled.BUCKET rows, so that a round at a new context length plans no new attention kernel on
    MLX CUDA; "auto" is the plain compiled path only where the bucketed one cannot hold the window
    (window="zlab-mlx" with sliding layers). None: the plain compiled path and mlx-lm's caches.
    `dtype`: the drafter's floating weights cast to it (None: as stored)."""

    def __init__(self, path: str | Path, window: str = "positional", max_tokens: int | None = None,
                 embed: str = "scaled", extras: bool = False, thresholds=None, collect_samples: bool = False,
                 kv_bucket: int | str | None = AUTO, scales: str = "either", dtype=None):
        self.path = Path(path)
        self.id = self.path.name
        self.drafter = fast.load(self.path, window, embed, kv_bucket=kv_bucket, scales=scales, dtype=dtype)
        self.kv_bucket = getattr(self.drafter, "kv_bucket", None)
        self.extension = load_extension(self.path, dtype) if extras else None
        self.weights_bytes = checkpoint.weights_bytes(self.path)
        self.trained_gamma = self.drafter.args.block_size - 1
        self.max_tokens = max_tokens
        self.extras = extras
        self.thresholds, self.threshold_source = (resolve_thresholds(self.path, thresholds) if extras
                                                  else (None, None))
        self.samples: list | None = [] if extras and collect_samples else None

    def open(self, view) -> DflashSource:
        if not self.extras:
            return DflashSource(self.drafter, view, self.max_tokens)
        return DflashSource(self.drafter, view, self.max_tokens, self.thresholds, self.samples, self.extension)

    def dispose(self) -> None:
        self.drafter = None

"""The Gemma-4 assistant (port/assistant.py) behind the serve-loop seam: AssistantSource and
AssistantProvider."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .. import assistant, checkpoint
from ..assistant import Model, Step, check_pairing
from ..fast import assistant as fast


@dataclass(frozen=True)
class Chain:
    """One round's draft steps, read like a block drafter's last block (`logits` [n, V], built only
    when read: the serve loop never reads it)."""

    steps: tuple[Step, ...]
    confidence = None

    @property
    def logits(self) -> mx.array:
        return mx.stack([s.logits for s in self.steps])


class AssistantSource:
    """The assistant drafter behind the serve-loop seam. It owns no cache: every draft reads the
    target's live donor K/V and the anchor hidden, and the loop's cache trim is its rollback."""

    tap_layers = None
    nbytes = 0  # no cache of its own: the request's bytes are the target's caches

    def __init__(self, drafter: Model, view, positions: str = "optiq", window: str | int = "optiq"):
        check_pairing(drafter, view.target)
        self.drafter, self.view = drafter, view
        self.positions, self.window = positions, window
        self.last_block: Chain | None = None

    def prefill(self, prompt_ids, tapped) -> None:
        pass

    def draft(self, feed: list[int], n: int, anchor_hidden) -> list[int]:
        return self.draft_device(feed, n, anchor_hidden).tolist()

    def draft_device(self, feed: list[int], n: int, anchor_hidden) -> mx.array:
        """The greedy drafts as a lazy [n] array: no host sync."""
        steps = self._chain(feed, n, anchor_hidden, None)
        return mx.concatenate([s.token_id.reshape(-1) for s in steps]) if steps else mx.array([], mx.int32)

    def draft_sampled(self, feed: list[int], n: int, anchor_hidden, pick) -> list[int]:
        """`draft` with each token chosen by `pick(logits)` (None: argmax); the chain feeds the
        picked token to the next step. q = what pick drew from (the loop records it)."""
        return [s.token for s in self._chain(feed, n, anchor_hidden, pick)]

    def _chain(self, feed: list[int], n: int, anchor_hidden, pick) -> list[Step]:
        # The pending token feed[-1] is not in the cache yet: it sits at position offset.
        position = self.view.caches[0].offset
        donors = self.drafter.donors(self.view.target, self.view.caches, self.window)
        steps = assistant.draft_chain(self.drafter, self.view.target, donors, feed[-1], anchor_hidden, position, n,
                            self.positions, self.window, pick)
        self.last_block = Chain(tuple(steps))
        return steps

    def commit(self, n_drafted: int, accepted: int, tapped) -> None:
        pass

    def dispose(self) -> None:
        pass


class AssistantProvider:
    """A loaded assistant drafter on its compiled path (port/fast/assistant.py; `bucketed`: the
    bucketed step, which reads the serve loop's bucketed verify caches, at compiled.BUCKET rows);
    `open` binds it to one request's target view. The default stays plain: a one-row step plans
    no attention kernel per key length on MLX CUDA, and the bucketed step is fp32-close, not
    bit-exact (tests/test_bucketed.py). `dtype`: the drafter's weights cast to it (None: as stored)."""

    trained_gamma = None

    def __init__(self, path: str | Path, bucketed: bool = False, dtype=None, **options):
        self.path = Path(path)
        self.id = self.path.name
        self.drafter = fast.load(self.path, dtype, bucketed=bucketed)
        self.kv_bucket = getattr(self.drafter, "kv_bucket", None)
        self.weights_bytes = checkpoint.weights_bytes(self.path)
        self.options = options

    def open(self, view) -> AssistantSource:
        return AssistantSource(self.drafter, view, **self.options)

    def dispose(self) -> None:
        self.drafter = None

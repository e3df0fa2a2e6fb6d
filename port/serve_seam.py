"""The serve loop's seam (port/serve.py): what a draft source and a provider implement, what a
source may read of the target, what a request reports (`Stats`), and `Observed`, which reports
every seam call from outside the source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from . import targets


@dataclass
class TargetView:
    """What a source may read of the target: the model and its live caches (borrowed)."""

    target: targets.Target
    caches: list


class DraftSource(Protocol):
    """Per-request drafting state."""

    tap_layers: list[int] | None

    def prefill(self, prompt_ids: list[int], tapped: list[mx.array] | None) -> None: ...

    def draft(self, feed: list[int], n: int, anchor_hidden: mx.array) -> list[int]:
        """Up to n tokens following feed[-1]; anchor_hidden is the target hidden that predicted it."""

    def commit(self, n_drafted: int, accepted: int, tapped: list[mx.array] | None) -> None:
        """The verify kept pending + `accepted` drafts; `tapped` are the verify's taps of all its
        rows [pending, d1..dn]: only the first accepted + 1 belong to the committed context."""

    def dispose(self) -> None: ...

    # Optional (found with hasattr):
    #   draft_sampled(feed, n, anchor_hidden, pick) -> list[int]: as `draft`, but every draft
    #       token is `pick(logits_row)` of the row the source would take the argmax of, chained
    #       as the source chains its own tokens; the returned tokens are a prefix of the picks.
    #   draft_device(feed, n, anchor_hidden) -> mx.array: as `draft`, the tokens as a lazy integer array
    #       [m] (m known on the host); the T=0 loop uses it unless `draft` was replaced on the
    #       instance (an observer wrapping `draft` still sees every draft).
    #   nbytes: the bytes the source holds for this request (its context K/V), for admission.
    #   draft_pipelined(pending, n, offset, room) -> mx.array, commit_pipelined(tapped) and
    #       pipelines() -> str | None: the pipelined loop's seam (`_pipelined`): `draft_device`
    #       with the pending token and the committed length as device scalars (room: a bound on it
    #       the host knows), `commit` keeping every row of the verify; pipelines() says why this
    #       request's source cannot (None: it can).


class DraftProvider(Protocol):
    """A loaded drafter, shared by requests. `kv_bucket` (optional): the verify's bucket its
    source wants (generate's "auto"); absent, mlx-lm's caches."""

    id: str
    weights_bytes: int
    trained_gamma: int | None

    def open(self, view: TargetView) -> DraftSource: ...

    def dispose(self) -> None: ...


@dataclass
class Stats:
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    emitted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    trace: list[tuple[int, int, int]] = field(default_factory=list)  # per round (drafted, accepted, emitted)
    proposals: list[list[int]] = field(default_factory=list)  # per round, the draft tokens
    elapsed_s: float = 0.0
    stop: str = ""
    logits: list = field(default_factory=list)  # with record=True: the row each committed token came from
    weights_bytes: int = 0       # the provider's weights (shared by requests)
    target_cache_bytes: int = 0  # peak bytes of this request's target K/V caches
    source_bytes: int = 0        # peak bytes the source holds for this request (its context K/V)
    kv_bucket: int | None = None  # the verify's bucket (None: mlx-lm's caches)
    verify: str = "plain"        # the verify's forward: one of VERIFIES
    pipeline: str = "off"        # "on": the pipelined loop (serve._pipelined)

    @property
    def request_bytes(self) -> int:
        """What one more request costs on top of the shared weights: target caches + source state."""
        return self.target_cache_bytes + self.source_bytes

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round (accepted + 1), the papers' τ."""
        return sum(a + 1 for _, a, _ in self.trace) / len(self.trace) if self.trace else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.elapsed_s if self.elapsed_s else 0.0

    def to_json(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "target_calls": self.target_calls,
                "emitted": self.emitted, "acceptance": self.acceptance, "tau": self.tau,
                "accepted_by_position": self.accepted_by_position, "drafted_by_position": self.drafted_by_position,
                "tokens_per_s": self.tokens_per_s, "stop": self.stop, "trace": [list(r) for r in self.trace],
                "weights_bytes": self.weights_bytes, "target_cache_bytes": self.target_cache_bytes,
                "source_bytes": self.source_bytes, "request_bytes": self.request_bytes, "kv_bucket": self.kv_bucket,
                "verify": self.verify, "pipeline": self.pipeline}


def _device_drafter(source):
    """The source's `draft_device`, unless `draft` was replaced on the instance (a wrapper that
    observes drafts must keep seeing them; `Observed` is the one that needs no replacing)."""
    if isinstance(source, _ObservedSource):
        return getattr(source, "draft_device", None)
    own = getattr(type(source), "draft", None)
    if not hasattr(source, "draft_device") or getattr(source.draft, "__func__", None) is not own:
        return None
    return source.draft_device


SEAM = ("prefill", "draft", "draft_device", "draft_sampled", "commit", "draft_pipelined", "commit_pipelined")


class Observed:
    """A provider whose sources report every seam call to `around(name, source, args, call)`,
    which returns `call()`'s value. Tests and the bench read drafts, context updates and times
    through it, instead of replacing a method on the source (which would turn the loop's
    device drafts off); the loop drafts on the device exactly when it would unobserved."""

    def __init__(self, provider, around):
        self.inner, self.around = provider, around
        self.id, self.weights_bytes, self.trained_gamma = provider.id, provider.weights_bytes, provider.trained_gamma
        self.kv_bucket = getattr(provider, "kv_bucket", None)

    def open(self, view):
        return _ObservedSource(self.inner.open(view), self.around)

    def dispose(self) -> None:
        self.inner.dispose()


class _ObservedSource:
    def __init__(self, inner, around):
        self.inner, self._around = inner, around

    def __getattr__(self, name):
        if name not in SEAM:
            return getattr(self.inner, name)
        if name == "draft_device" and _device_drafter(self.inner) is None:
            raise AttributeError(name)
        method = getattr(self.inner, name)
        return lambda *args: self._around(name, self.inner, args, lambda: method(*args))

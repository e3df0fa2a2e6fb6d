"""The one serve loop every draft source plugs into, and the seam it plugs through.

Round: the source drafts up to gamma tokens from the pending token -> ONE batched target forward
over [pending, d1..dn] with one head matmul over the n+1 positions -> the longest prefix where the
drafts equal the target's greedy tokens -> the correction (or, on a full accept, the bonus) token
-> every target cache trimmed back to pending + the accepted drafts -> the source commits.
At T=0 the emitted stream is the target's own greedy stream whatever the drafter proposes; only
the acceptance rate moves. EOS ends generation and is not emitted as content.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

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


class DraftProvider(Protocol):
    """A loaded drafter, shared by requests."""

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
                "tokens_per_s": self.tokens_per_s, "stop": self.stop, "trace": [list(r) for r in self.trace]}


def trim_caches(caches: list, n: int) -> None:
    """Drop the newest n entries of every cache (a verify's rejected drafts).

    mlx-lm refuses to trim a RotatingKVCache past its window. After a multi-token update its buffer
    is in time order with the new tokens last, so the rejected ones are the tail: cut them and put
    the write index at the end. What remains is >= window-1 older tokens plus the kept ones, and
    both of mlx-lm's update paths (concat and in-place ring) continue correctly from that state.
    """
    if n <= 0:
        return
    for c in caches:
        if isinstance(c, RotatingKVCache):
            keep = c._temporal_order(c.keys).shape[2] - n
            c.keys = c._temporal_order(c.keys)[..., :keep, :]
            c.values = c._temporal_order(c.values)[..., :keep, :]
            c.offset -= n
            c._idx = keep
        else:
            c.trim(n)


def _taps(trace: targets.Trace, layers: list[int] | None, rows: slice) -> list[mx.array] | None:
    """hidden_states[l + 1] for each tap layer l (-1 = the embedding), rows of the sequence."""
    if layers is None:
        return None
    return [trace.hidden[layer + 1][:, rows, :] for layer in layers]


def generate(target: targets.Target, prompt: list[int], max_tokens: int, provider: DraftProvider | None = None,
             gamma: int = 4, eos: set[int] | None = None, record: bool = False, trim_bias: int = 0,
             emit_eos: bool = False, bonus: bool = True) -> tuple[list[int], Stats]:
    """Greedy speculative decoding. Returns the content tokens and the stats (with the per-round
    trace). With no source it is plain greedy decoding through the same verify path.

    `trim_bias`, `emit_eos`, `bonus` exist only to plant the negative controls (trim one too few,
    EOS emitted as content, bonus token dropped on a full accept): the tests show the suite
    catches each."""
    eos = targets.eos_ids(target) if eos is None else eos
    caches = make_prompt_cache(target.model)
    source = provider.open(TargetView(target, caches)) if provider is not None else None
    stats = Stats(accepted_by_position=[0] * gamma, drafted_by_position=[0] * gamma)
    taps = source.tap_layers if source is not None else None
    t0 = time.perf_counter()
    trace = targets.forward(target, mx.array([prompt]), caches=caches)
    stats.target_calls += 1
    if source is not None:
        source.prefill(prompt, _taps(trace, taps, slice(None)))
    pending = int(mx.argmax(trace.logits[0, -1]).item())
    anchor = trace.final[:, -1:, :]
    committed = [pending]
    if record:
        stats.logits.append(trace.logits[0, -1])
    while pending not in eos and len(committed) < max_tokens:
        drafts = source.draft([pending], gamma, anchor) if source is not None else []
        drafts = drafts[:gamma]
        stats.proposals.append(list(drafts))
        trace = targets.forward(target, mx.array([[pending] + drafts]), caches=caches)
        stats.target_calls += 1
        greedy = mx.argmax(trace.logits[0], axis=-1).tolist()
        k = 0
        while k < len(drafts) and drafts[k] == greedy[k]:
            k += 1
        stats.drafted += len(drafts)
        stats.accepted += k
        for i in range(len(drafts)):
            stats.drafted_by_position[i] += 1
            stats.accepted_by_position[i] += i < k
        dropped = not bonus and drafts and k == len(drafts)
        new = drafts[:k] if dropped else drafts[:k] + [greedy[k]]
        room = max_tokens - len(committed)
        stop_at = next((i for i, t in enumerate(new) if t in eos), None)
        emitted = new[: min(room, stop_at + 1 if stop_at is not None else len(new))]
        committed += emitted
        if record:
            stats.logits += [trace.logits[0, i] for i in range(len(emitted))]
        stats.trace.append((len(drafts), k, len(emitted)))
        trim_caches(caches, len(drafts) - k - trim_bias + (1 if dropped else 0))
        if source is not None:
            source.commit(len(drafts), k, _taps(trace, taps, slice(None)))
        if len(emitted) < len(new):
            break
        pending = emitted[-1]
        anchor = trace.final[:, k - 1:k, :] if dropped else trace.final[:, k:k + 1, :]
    stats.elapsed_s = time.perf_counter() - t0
    stats.stop = "eos" if committed[-1] in eos else "length"
    content = committed if emit_eos or committed[-1] not in eos else committed[:-1]
    stats.emitted = len(committed)
    if source is not None:
        source.dispose()
    return content, stats

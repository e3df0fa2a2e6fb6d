"""The one serve loop every draft source plugs into, and the seam it plugs through.

Round: the source drafts up to gamma tokens from the pending token -> ONE batched target forward
over [pending, d1..dn] with one head matmul over the n+1 positions -> the longest prefix where the
drafts equal the target's greedy tokens -> the correction (or, on a full accept, the bonus) token
-> every target cache trimmed back to pending + the accepted drafts -> the source commits.
At T=0 the emitted stream is the target's own greedy stream whatever the drafter proposes; only
the acceptance rate moves. EOS ends generation and is not emitted as content.

With a `sampler` (port/sampling.py: temperature, top-k, top-p, seed), logits `processors` and an
acceptance `mode` the same round samples instead: "match" (drafts greedy, the target samples
every position, accept while draft == sample) or "rejection" (drafts drawn from the source's q,
accept with min(1, p/q), resample from norm(max(0, p - q)), bonus from p). The seam's optional
`draft_sampled(feed, n, anchor_hidden, pick)` lets a source draft through the loop's `pick`
(logits row -> token), which applies the processors and the draft sampler and records q; a
source without it drafts deterministically (q = the point mass on its draft). With the default
arguments (no sampler, no processors, mode "match") the loop is the greedy one, unchanged.

Host synchronizations at T=0: a source with the optional `draft_device` keeps its drafts on the
device (argmax chained into the next step's embedding without leaving it), the verify input is
built on the device, the accept runs there, and the round syncs once, for one 8-byte verdict
(accepted count, first EOS, last token); the drafts and the committed tokens reach the host in one
read when the request ends (`read_at_end`). On MLX CUDA a host read of more than 8 bytes would cost
the next round page faults. (DSpark / the DFlash extension with confidence thresholds sync once
more, for the proposal length the verify's shape needs.)

Pipelined (`pipeline`, on by default where it fits: the compiled verify, and DFlash's or
DSpark's bucketed block, or no source): that verdict is read one round late. Round r + 1 is built from device arrays
(the pending token, the committed length) and queued before round r's verdict is read, so the
host's graph building overlaps the device's work (`_pipelined`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from . import sampling, targets
from .compiled import AUTO, VerifyCache
from .fast import verify as fast_verify

VERIFIES = ("kernel", "compiled", "plain")   # fastest first: AUTO takes the first that runs
COMPILED = ("kernel", "compiled")             # the verifies port/fast/verify.py runs as one compiled call
PIPELINES = ("on", "off")


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


class _Greedy:
    """The seed's verify: greedy drafts, accept while draft == the target's argmax. Drafts may be a
    device array (draft_device). The accept runs on the device and the host reads one 8-byte
    verdict per round (`_verdict`); the round's tokens stay there until the request ends."""

    reads_history = False

    def __init__(self, eos: set[int]):
        # built once per request; an array the host filled is CUDA managed memory (faults once)
        self.eos = mx.array(sorted(eos), mx.int32) if eos else None

    def first(self, logits, history: list[int]) -> int:
        return int(mx.argmax(logits).item())

    def draft(self, source, pending: int, gamma: int, anchor, history: list[int]):
        device = _device_drafter(source)
        if device is None:
            return source.draft([pending], gamma, anchor), None
        drafts = device([pending], gamma, anchor)[:gamma].astype(mx.int32)
        mx.async_eval(drafts)  # the drafts run while the host builds the verify graph
        return drafts, None

    def verify(self, drafts, q, logits, history: list[int]) -> tuple[int, int, int, mx.array]:
        greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        if not isinstance(drafts, mx.array):
            drafts = mx.array(drafts, mx.int32)
        return _read(_verdict(drafts, greedy, self.eos)) + (greedy,)


_BITS = 10
_FIELD = (1 << _BITS) - 1


def _verdict(drafts: mx.array, greedy: mx.array, eos: mx.array | None) -> mx.array:
    """A greedy round's outcome as ONE int64 scalar: on MLX CUDA a host read of more than 8 bytes
    puts the buffer in managed memory and the next round's kernels page-fault on it (0.1-0.56 ms
    a block, measured on an H200); an 8-byte scalar costs nothing. Fields: k, the accepted
    drafts (the prefix where drafts == greedy); the index of the first EOS in greedy (n + 1: none);
    the round's last new token, greedy[k]. The round's new tokens are greedy[:k + 1]: the accepted
    drafts equal the target's."""
    n = drafts.shape[0]
    if n:
        k = mx.cumprod((drafts == greedy[:n]).astype(mx.int32)).sum()
    else:
        k = mx.zeros((), mx.int32)
    if eos is None:
        stop = mx.full((), n + 1, mx.int32)
    else:
        stop = targets.first_index((greedy[:, None] == eos[None, :]).any(axis=1), n + 1)
    tok = mx.take(greedy, k)
    return (k.astype(mx.int64) + (stop.astype(mx.int64) << _BITS) + (tok.astype(mx.int64) << (2 * _BITS)))


def _read(verdict: mx.array) -> tuple[int, int, int]:
    """A `_verdict` read on the host (its one 8-byte sync): (accepted, first EOS, last token)."""
    v = verdict.item()
    return v & _FIELD, (v >> _BITS) & _FIELD, v >> (2 * _BITS)


class _Sampled:
    """Verify with the request's sampler and processors, in either acceptance mode."""

    reads_history = True

    def __init__(self, sampler: sampling.Sampler, processors, mode: str, draft_sampler, eos: set[int]):
        self.processors, self.mode, self.eos = list(processors), mode, eos
        self.keys = sampling.Keys(sampler.seed)
        self.sampler = sampler
        self.draft_sampler = sampling.drafting_sampler(sampler, mode, draft_sampler)

    def _rows(self, logits, history: list[int], drafts: list[int]):
        """Processed logits of the rows [m, V]; row i follows history + drafts[:i]."""
        if not self.processors:
            return logits
        toks = history + drafts
        return mx.stack([sampling.process(self.processors, mx.array(toks[: len(history) + i], mx.int32), logits[i, ...])
                         for i in range(logits.shape[0])])

    def first(self, logits, history: list[int]) -> int:
        p = self.sampler.probs(self._rows(logits[None], history, []))
        if float(p.sum().item()) < 0.5:
            raise sampling.SamplingError("the logits processors left no token the target may emit")
        return int(sampling.sample(p, self.keys.uniform((1,)))[0].item())

    def draft(self, source, pending: int, gamma: int, anchor, history: list[int]):
        sampled = hasattr(source, "draft_sampled") and (self.mode == "rejection" or self.processors)
        if not sampled:
            drafts = source.draft([pending], gamma, anchor)[:gamma]
            return drafts, None                      # deterministic: q = the point mass on the draft
        picks, rows = [], []
        base = history

        def pick(logits) -> int:
            row = sampling.process(self.processors, mx.array(base + picks, mx.int32), logits) if self.processors else logits
            q = self.draft_sampler.probs(row.astype(mx.float32))
            u = None if self.draft_sampler.greedy else self.keys.uniform(())
            tok = int((mx.argmax(q) if u is None else sampling.sample(q, u)).item())
            picks.append(tok)
            rows.append(q)
            return tok

        drafts = list(source.draft_sampled([pending], gamma, anchor, pick))[:gamma]
        if drafts != picks[: len(drafts)]:
            raise sampling.SamplingError(f"{type(source).__name__}.draft_sampled returned {drafts}, not a prefix "
                                         f"of its picks {picks}: its drafts would not follow q")
        if not drafts:
            return drafts, None
        q = mx.stack(rows[: len(drafts)])
        mass = q.sum(axis=-1).tolist()
        n = next((i for i, m in enumerate(mass) if m < 0.5), len(drafts))   # a row with no allowed token
        return drafts[:n], q[:n]

    def verify(self, drafts: list[int], q, logits, history: list[int]) -> tuple[int, int, int, list[int]]:
        """As `_Greedy.verify`: (accepted, first EOS in the new tokens, last new token, new tokens)."""
        n = len(drafts)
        p = sampling.verify_probs(self.sampler, self._rows(logits[: n + 1], history, drafts))[None]
        d = mx.array(drafts, mx.int32).reshape(1, n)
        if self.mode == "match":
            k, nxt = sampling.accept_match(d, p, self.keys.uniform((1, n + 1)))
        else:
            if q is None:
                q = (mx.arange(p.shape[-1])[None, :] == d.reshape(n, 1)).astype(mx.float32)
            k, nxt = sampling.accept_rejection(d, q[None], p, self.keys.uniform((1, n)), self.keys.uniform((1,)))
        k = int(k.item())
        new = drafts[:k] + [int(nxt.item())]
        stop = next((i for i, t in enumerate(new) if t in self.eos), n + 1)
        return k, stop, new[_kept(n, k) - 1], new


def _kept(n: int, k: int) -> int:
    """How many new tokens a round of n drafts with k accepted commits: the accepted drafts and the
    correction (on a full accept: bonus) token."""
    return k + 1


def _verify_ids(pending: int, drafts) -> mx.array:
    """[[pending, d1..dn]] for the verify forward; device drafts stay on the device."""
    if isinstance(drafts, mx.array):
        return mx.concatenate([mx.array([pending], mx.int32), drafts])[None]
    return mx.array([[pending] + drafts])


def read_at_end(groups: list[list]) -> list[list[list[int]]]:
    """Each group's pieces (host lists or device int arrays) as host lists, every device piece in
    ONE read: the request's tokens and proposals reach the host once, at its end."""
    device = [p for g in groups for p in g if isinstance(p, mx.array)]
    flat = mx.concatenate([p.astype(mx.int32) for p in device]).tolist() if device else []
    out, at = [], 0
    for g in groups:
        out.append([])
        for p in g:
            if isinstance(p, mx.array):
                out[-1].append(flat[at:at + p.size])
                at += p.size
            else:
                out[-1].append(list(p))
    return out


def _count_bytes(stats: Stats, caches: list, source) -> None:
    """The request's peak bytes so far: its target caches, and what the source holds."""
    own = int(getattr(source, "nbytes", 0) or 0) if source is not None else 0
    stats.target_cache_bytes = max(stats.target_cache_bytes, sum(c.nbytes for c in caches))
    stats.source_bytes = max(stats.source_bytes, own)


def _count_round(stats: Stats, n: int, k: int, stop: int, left: int) -> int:
    """A round of n drafts, k accepted and the first EOS of its new tokens at `stop`, into the
    stats; the tokens it emits (`left`: what max_tokens leaves)."""
    stats.drafted += n
    stats.accepted += k
    for i in range(n):
        stats.drafted_by_position[i] += 1
        stats.accepted_by_position[i] += i < k
    kept = _kept(n, k)
    emitted = min(left, stop + 1 if stop < kept else kept)
    stats.trace.append((n, k, emitted))
    return emitted


def _pipelined(target: targets.Target, caches: list, source, verifier: _Greedy, eos: set[int], pending: int,
               gamma: int, left: int, stats: Stats, pieces: list, proposals: list, verify: str) -> None:
    """The greedy rounds, each queued before the last one's verdict is read, so that the host
    builds round r + 1 while the device runs round r (on MLX CUDA the host's graph building is
    most of a round, docs/benchmarks.md). Nothing a round needs comes from the host: the pending
    token, the committed length (`offset`: where the verify writes, and what the drafter's next
    block attends) and the accept stay on the device; the source keeps every row of the verify and
    counts those before the offset (`draft_pipelined`, `commit_pipelined`). The host reads round
    r's 8-byte verdict after queuing round r + 1, for the stats, EOS and max_tokens. A round queued
    after the one that ends the request runs and is dropped; where max_tokens may end it (what is
    left is within the largest round so far) the host reads the verdict first instead. The
    same tokens, drafts and trace as the sequential loop (tests/test_pipelined.py).

    Each round writes at most n + 1 rows past the committed length the host last read, so the
    target's and the drafter's buffers are reserved to that bound (`room`)."""
    taps = source.tap_layers if source is not None else None
    exact = caches[0].offset
    offset, tok = mx.array(exact, mx.int32), mx.array(pending, mx.int32)
    queued, most = None, 1   # most: the largest round read so far, in tokens

    def settle(drafts, greedy, verdict) -> bool:
        """A round's verdict read into the stats and tokens; whether it ends the request."""
        nonlocal left, exact, most
        k, stop, last = _read(verdict)
        proposals.append(drafts)
        out = _count_round(stats, drafts.shape[0], k, stop, left)
        pieces.append(greedy[:out])
        left, exact, most = left - out, exact + k + 1, max(most, out)
        _count_bytes(stats, caches, source)
        return out < _kept(drafts.shape[0], k) or last in eos or not left

    while True:
        if queued is not None and left <= most:
            if settle(*queued):
                return
            queued = None
        room = exact + (queued[0].shape[0] + 1 if queued is not None else 0)
        drafts = (source.draft_pipelined(tok, gamma, offset, room)[:gamma].astype(mx.int32) if source is not None
                  else mx.zeros((0,), mx.int32))
        for c in caches:
            c.offset = room
        trace = target_forward(target, mx.concatenate([tok.reshape(1), drafts])[None], caches, verify, offset)
        stats.target_calls += 1
        greedy = mx.argmax(trace.logits[0, ...], axis=-1).astype(mx.int32)
        verdict = _verdict(drafts, greedy, verifier.eos)
        accepted = (verdict & _FIELD).astype(mx.int32)
        tok, offset = mx.take(greedy, accepted), offset + accepted + 1
        if source is not None:
            source.commit_pipelined(_taps(trace, taps, slice(None)))
        mx.async_eval(verdict, tok, offset)
        if queued is not None and settle(*queued):
            return
        queued = drafts, greedy, verdict


def generate(target: targets.Target, prompt: list[int], max_tokens: int, provider: DraftProvider | None = None,
             gamma: int = 4, eos: set[int] | None = None, record: bool = False,
             sampler: sampling.Sampler | None = None, processors=(), mode: str = "match",
             draft_sampler: sampling.Sampler | None = None,
             kv_bucket: int | str | None = AUTO, verify: str = AUTO, pipeline: str = AUTO) -> tuple[list[int], Stats]:
    """Speculative decoding. Returns the content tokens and the stats (with the per-round
    trace). With no source it is plain decoding through the same verify path.

    Default: greedy (T=0), token match. `sampler` (port.sampling.Sampler), `processors`
    (callables (tokens, logits [1, V]) -> logits, mlx-lm's convention, applied to every verify
    row before acceptance and to the draft rows of a source with `draft_sampled`), `mode`
    ("match" or "rejection") and `draft_sampler` (rejection: what the drafts are drawn from;
    default the request's sampler) select the sampling verify, see port/sampling.py.

    `kv_bucket` (rows, or None): the bucketed verify (targets.make_caches): the target's caches
    are buffers a whole number of buckets long that every forward attends over whole, masked, so
    on MLX CUDA the attention plans a kernel once per bucket, not once per round's key length.
    Bit-exact with mlx-lm's caches on the CPU (tests/test_bucketed.py), within fp32 tolerance on
    MLX CUDA, the same greedy stream. Default "auto": the provider's own `kv_bucket` (DSpark and
    DFlash: compiled.BUCKET; the assistant and plain decoding: None) where the target's caches
    allow it (targets.make_caches); `stats.kv_bucket` says what the request ran with.

    `verify`: "compiled" (port/fast/verify.py: the bucketed verify as one compiled call, traced
    once per buffer length; needs a kv_bucket), "kernel" (the same with port/fast/kernels.py's
    attention: MLX CUDA from compute capability 8.0, Qwen3 targets with bf16 activations;
    1.03-1.41x the compiled verify's loop in serving: docs/benchmarks.md, "The kernel verify against
    the compiled one"), "plain"
    (targets.forward, op by op), or "auto" (default): the first of "kernel", "compiled", "plain"
    that runs here; `stats.verify` says which ran.

    `pipeline`: "on" (`_pipelined`: round r + 1 is built while the device runs round r; the
    greedy verify, compiled, and a source with `draft_pipelined` (DFlash, DSpark) or none), "off" (the sequential
    loop below), or "auto" (default): on where it fits; `stats.pipeline` says which ran.

    Its negative controls (planted bugs) live in spec_parity/controls/serve.py."""
    if mode not in sampling.MODES:
        raise sampling.SamplingError(f"unknown acceptance mode {mode!r}; known: {sampling.MODES}")
    if not 0 <= gamma < _FIELD:
        raise ValueError(f"gamma={gamma}: expected 0..{_FIELD - 1} draft tokens per round (the round's verdict "
                         f"packs counts up to {_FIELD} in {_BITS} bits)")
    processors = list(processors)
    eos = targets.eos_ids(target) if eos is None else eos
    if sampler is None and not processors and mode == "match":
        verifier = _Greedy(eos)
    else:
        verifier = _Sampled(sampler or sampling.Sampler(), processors, mode, draft_sampler, eos)
    auto = kv_bucket == AUTO
    caches = targets.make_caches(target, getattr(provider, "kv_bucket", None) if auto else kv_bucket, strict=not auto)
    kv_bucket = caches[0].step if caches and isinstance(caches[0], VerifyCache) else None
    verify = resolve_verify(verify, target, kv_bucket)
    source = provider.open(TargetView(target, caches)) if provider is not None else None
    stats = Stats(accepted_by_position=[0] * gamma, drafted_by_position=[0] * gamma, kv_bucket=kv_bucket,
                  weights_bytes=int(getattr(provider, "weights_bytes", 0) or 0) if provider is not None else 0,
                  verify=verify)
    taps = source.tap_layers if source is not None else None
    t0 = time.perf_counter()
    trace = target_forward(target, mx.array([prompt]), caches, verify)
    stats.target_calls += 1
    if source is not None:
        source.prefill(prompt, _taps(trace, taps, slice(None)))
    pending = verifier.first(trace.logits[0, -1], prompt)
    anchor = trace.final[:, -1:, :]
    pieces, count = [[pending]], 1   # the committed tokens: host lists, or device slices (_Greedy)
    proposals = []

    def history() -> list[int]:
        return prompt + [t for p in pieces for t in p] if verifier.reads_history else prompt

    if record:
        stats.logits.append(trace.logits[0, -1])
    stats.pipeline = resolve_pipeline(pipeline, verifier, verify, source, record, gamma)
    if stats.pipeline == "on" and pending not in eos and count < max_tokens:
        _pipelined(target, caches, source, verifier, eos, pending, gamma, max_tokens - count, stats, pieces, proposals,
                   verify)
    while stats.pipeline == "off" and pending not in eos and count < max_tokens:
        drafts, q = verifier.draft(source, pending, gamma, anchor, history()) if source is not None else ([], None)
        drafts = drafts[:gamma]
        n = len(drafts)
        trace = target_forward(target, _verify_ids(pending, drafts), caches, verify)
        stats.target_calls += 1
        # trace.logits[0, ...]: a view, where [0] would be a Gather (see port/dflash.py Model.block)
        k, stop, last, new = verifier.verify(drafts, q, trace.logits[0, ...], history())
        proposals.append(drafts)
        kept = _kept(n, k)
        emitted = _count_round(stats, n, k, stop, max_tokens - count)
        pieces.append(new[:emitted])
        count += emitted
        if record:
            stats.logits += [trace.logits[0, i] for i in range(emitted)]
        trim_caches(caches, n - kept + 1)
        if source is not None:
            source.commit(n, k, _taps(trace, taps, slice(None)))
        _count_bytes(stats, caches, source)
        if emitted < kept:
            break
        pending = last
        anchor = trace.final[:, kept - 1:kept, :]
    pieces, stats.proposals = read_at_end([pieces, proposals])
    committed = [t for p in pieces for t in p]
    stats.elapsed_s = time.perf_counter() - t0
    _count_bytes(stats, caches, source)
    stats.stop = "eos" if committed[-1] in eos else "length"
    stats.emitted = len(committed)
    if source is not None:
        source.dispose()
    return _content(committed, eos), stats


def resolve_verify(verify: str, target: targets.Target, kv_bucket: int | None) -> str:
    """The request's verify forward: AUTO is the first of VERIFIES that port/fast/verify.py takes."""
    return _resolve("verify", verify, VERIFIES, {"kernel": fast_verify.kernel_unsupported(target, kv_bucket),
                                                 "compiled": fast_verify.unsupported(target, kv_bucket)})


def resolve_pipeline(pipeline: str, verifier, verify: str, source, record: bool, gamma: int) -> str:
    """The request's loop: AUTO is "on" wherever `_pipelined` runs."""
    return _resolve("pipeline", pipeline, PIPELINES, {"on": _unpipelined(verifier, verify, source, record, gamma)})


def _resolve(option: str, value: str, choices: tuple[str, ...], why: dict[str, str | None]) -> str:
    """An option whose choices run fastest first, the last everywhere; `why`: why a choice cannot
    run here (None or absent: it can). AUTO is the first that can; one asked for where it cannot is
    refused with the reason and the fix (the next one that can)."""
    if value == AUTO:
        return next(c for c in choices if not why.get(c))
    if value not in choices:
        raise ValueError(f"{option}={value!r}: expected one of {choices} or {AUTO!r}")
    if why.get(value):
        fix = next(c for c in choices[choices.index(value) + 1:] if not why.get(c))
        raise ValueError(f"{option}={value!r} cannot run here: {why[value]}; use {option}={fix!r}")
    return value


def _unpipelined(verifier, verify: str, source, record: bool, gamma: int) -> str | None:
    """Why `_pipelined` cannot run a request (None: it can)."""
    if not isinstance(verifier, _Greedy):
        return "it runs the greedy verify only (no sampler, processors or rejection mode)"
    if verify not in COMPILED:
        return "it needs the compiled verify (verify='compiled' on a kv_bucket)"
    if record:
        return "record=True keeps every round's logits"
    if source is None:
        return None
    if not gamma:
        return "gamma=0: a source that drafts nothing keeps its context in the sequential loop"
    if _device_drafter(source) is None or not hasattr(source, "draft_pipelined"):
        return f"{type(getattr(source, 'inner', source)).__name__} has no draft_pipelined"
    return source.pipelines()


def target_forward(target: targets.Target, ids: mx.array, caches: list, verify: str,
                   offset: mx.array | None = None) -> targets.Trace:
    """The loop's target forward, the prefill and every verify (the seam tests and the bench wrap):
    the compiled verify once the caches hold their buffers (after the prefill), else targets.forward;
    with an `offset` (the pipelined loop's, on the device) fast_verify.forward_at."""
    attention = "kernel" if verify == "kernel" else "sdpa"
    if offset is not None:
        return fast_verify.forward_at(target, ids, caches, offset, attention)
    if verify in COMPILED and fast_verify.ready(caches):
        return fast_verify.forward(target, ids, caches, attention)
    return targets.forward(target, ids, caches=caches)


def _content(committed: list[int], eos: set[int]) -> list[int]:
    """The request's content: the committed tokens less a final EOS (a stop token, not text)."""
    return committed if committed[-1] not in eos else committed[:-1]

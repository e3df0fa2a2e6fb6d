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
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from . import sampling, targets
from .compiled import AUTO, VerifyCache
from .fast import verify as fast_verify
from .serve_options import (
    COMPILED,
    DEFAULT,
    PIPELINES,
    ServeOptions,
    resolve_choice,
    resolve_verify,
)
from .serve_options import VERIFIES as VERIFIES
from .serve_seam import SEAM as SEAM
from .serve_seam import DraftProvider, Stats, TargetView, _device_drafter
from .serve_seam import DraftSource as DraftSource
from .serve_seam import Observed as Observed


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
        p = sampling.emittable(self.sampler.probs(self._rows(logits[None], history, [])))
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
             options: ServeOptions = DEFAULT) -> tuple[list[int], Stats]:
    """Speculative decoding, served as `options` say (ServeOptions). Returns the content tokens
    and the stats (with the per-round trace). With no provider it is plain decoding through the
    same verify path. Its negative controls (planted bugs) live in spec_parity/controls/serve.py."""
    r = _open(target, provider, options)
    t0 = time.perf_counter()
    trace = target_forward(target, mx.array([prompt]), r.caches, r.stats.verify)
    r.stats.target_calls += 1
    if r.source is not None:
        r.source.prefill(prompt, _taps(trace, r.source.tap_layers, slice(None)))
    pending = r.verifier.first(trace.logits[0, -1], prompt)
    pieces, proposals = [[pending]], []   # the committed tokens: host lists, or device slices (_Greedy)
    if options.record:
        r.stats.logits.append(trace.logits[0, -1])
    if pending not in r.eos and max_tokens > 1:
        if r.stats.pipeline == "on":
            _pipelined(target, r.caches, r.source, r.verifier, r.eos, pending, options.gamma, max_tokens - 1,
                       r.stats, pieces, proposals, r.stats.verify)
        else:
            _sequential(r, prompt, pending, trace, max_tokens - 1, pieces, proposals, options)
    pieces, r.stats.proposals = read_at_end([pieces, proposals])
    committed = [t for p in pieces for t in p]
    r.stats.elapsed_s = time.perf_counter() - t0
    _count_bytes(r.stats, r.caches, r.source)
    r.stats.stop = "eos" if committed[-1] in r.eos else "length"
    r.stats.emitted = len(committed)
    if r.source is not None:
        r.source.dispose()
    return _content(committed, r.eos), r.stats


@dataclass
class _Request:
    """A request's resolved state: its caches, its source, how it verifies, its stop tokens and stats."""

    target: targets.Target
    caches: list
    source: DraftSource | None
    verifier: _Greedy | _Sampled
    eos: set[int]
    stats: Stats


def _open(target: targets.Target, provider: DraftProvider | None, o: ServeOptions) -> _Request:
    """Every "auto" of `o` resolved and every option checked, before the prefill: the stop tokens,
    the verifier, the caches (kv_bucket), the verify forward, the source, the pipelined loop."""
    if o.mode not in sampling.MODES:
        raise sampling.SamplingError(f"unknown acceptance mode {o.mode!r}; known: {sampling.MODES}")
    if not 0 <= o.gamma < _FIELD:
        raise ValueError(f"gamma={o.gamma}: expected 0..{_FIELD - 1} draft tokens per round (the round's verdict "
                         f"packs counts up to {_FIELD} in {_BITS} bits)")
    eos = targets.eos_ids(target) if o.eos is None else o.eos
    greedy = o.sampler is None and not o.processors and o.mode == "match"
    verifier = _Greedy(eos) if greedy else _Sampled(o.sampler or sampling.Sampler(), o.processors, o.mode,
                                                     o.draft_sampler, eos)
    auto = o.kv_bucket == AUTO
    caches = targets.make_caches(target, getattr(provider, "kv_bucket", None) if auto else o.kv_bucket,
                                 strict=not auto)
    kv_bucket = caches[0].step if caches and isinstance(caches[0], VerifyCache) else None
    verify = resolve_verify(o.verify, target, kv_bucket)
    source = provider.open(TargetView(target, caches)) if provider is not None else None
    stats = Stats(accepted_by_position=[0] * o.gamma, drafted_by_position=[0] * o.gamma, kv_bucket=kv_bucket,
                  weights_bytes=int(getattr(provider, "weights_bytes", 0) or 0) if provider is not None else 0,
                  verify=verify)
    stats.pipeline = resolve_pipeline(o.pipeline, verifier, verify, source, o.record, o.gamma)
    return _Request(target, caches, source, verifier, eos, stats)


def _sequential(r: _Request, prompt: list[int], pending: int, trace: targets.Trace, left: int, pieces: list,
                proposals: list, o: ServeOptions) -> None:
    """The rounds one after the other: each round's verdict is read before the next is built."""
    anchor, taps = trace.final[:, -1:, :], r.source.tap_layers if r.source is not None else None

    def history() -> list[int]:
        return prompt + [t for p in pieces for t in p] if r.verifier.reads_history else prompt

    while pending not in r.eos and left > 0:
        drafts, q = (r.verifier.draft(r.source, pending, o.gamma, anchor, history()) if r.source is not None
                     else ([], None))
        drafts = drafts[:o.gamma]
        n = len(drafts)
        trace = target_forward(r.target, _verify_ids(pending, drafts), r.caches, r.stats.verify)
        r.stats.target_calls += 1
        # trace.logits[0, ...]: a view, where [0] would be a Gather (see port/dflash.py Model.block)
        k, stop, last, new = r.verifier.verify(drafts, q, trace.logits[0, ...], history())
        proposals.append(drafts)
        kept = _kept(n, k)
        emitted = _count_round(r.stats, n, k, stop, left)
        pieces.append(new[:emitted])
        left -= emitted
        if o.record:
            r.stats.logits += [trace.logits[0, i] for i in range(emitted)]
        trim_caches(r.caches, n - kept + 1)
        if r.source is not None:
            r.source.commit(n, k, _taps(trace, taps, slice(None)))
        _count_bytes(r.stats, r.caches, r.source)
        if emitted < kept:
            return
        pending = last
        anchor = trace.final[:, kept - 1:kept, :]


def resolve_pipeline(pipeline: str, verifier, verify: str, source, record: bool, gamma: int) -> str:
    """The request's loop: AUTO is "on" wherever `_pipelined` runs."""
    return resolve_choice("pipeline", pipeline, PIPELINES, {"on": _unpipelined(verifier, verify, source, record, gamma)})


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

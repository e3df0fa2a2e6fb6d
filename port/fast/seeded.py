"""Many seeded requests of one prompt at T > 0, in lockstep: the sampled parity cases' fast path.

`serve.generate` runs one request at a time, op by op. At the tiny parity checkpoints a round on
the CPU is some 200 small ops, so a thousand seeded requests cost tens of seconds while the
arithmetic is a few milliseconds. Here every live request of a round joins a group of those
with the same committed length, so a group is a plain batch with no ragged rows: its target
caches are its rows' own K/V stacked (every row holds the same number of tokens), the drafter
runs vmapped over its rows, and each set of rows that drafted the same number of tokens verifies
with port/sampling.py's rule as one batch. Each request draws from its own key chain
(`sampling.Keys(seed)`) in `serve.generate`'s order, so a request's tokens and trace are
`serve.generate`'s for its seed (tests/test_seeded.py).

What it runs: no logits processors; "match" with a drafter that drafts greedily (the assistant),
"rejection" with one that draws its drafts (DSpark); anything else is `Unsupported`, and the
caller runs the plain loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .. import assistant, dspark, sampling, targets


class Unsupported(ValueError):
    """What the lockstep path does not run; the plain loop does."""


@dataclass
class Group:
    """Live requests with the same committed length: the target has processed `length` tokens
    of each (the prompt and every committed token but the pending one)."""

    rows: list[int]          # request indices
    length: int
    kv: list[tuple]          # per target cache, the rows' K/V [b, heads, n, d] in time order
    anchor: mx.array         # [b, 1, H]: the target hidden that predicted the pending token
    pending: mx.array        # [b] int32
    context: list[tuple]     # the drafter's own per-row state (its context K/V), batch first


def _joined(pieces: list[Group]) -> Group:
    """Groups of one committed length (the rows of several verifies that go on to it) as one."""
    def stack(pairs_of: list[list[tuple]]) -> list[tuple]:
        return [tuple(mx.concatenate([f[c][i] for f in pairs_of]) for i in (0, 1)) for c in range(len(pairs_of[0]))]

    return Group([r for f in pieces for r in f.rows], pieces[0].length, stack([f.kv for f in pieces]),
                 mx.concatenate([f.anchor for f in pieces]), mx.concatenate([f.pending for f in pieces]),
                 stack([f.context for f in pieces]))


def _live(c) -> tuple[mx.array, mx.array]:
    """A cache's K/V in time order, every row it holds."""
    if isinstance(c, RotatingKVCache):
        return c._temporal_order(c.keys), c._temporal_order(c.values)
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def _kept(template, kv: tuple, length: int) -> tuple:
    """What a cache must hold of a request's first `length` tokens (the last `length` of kv are
    they): all of them, or for a sliding cache the last window's worth. From that state mlx-lm's
    concatenating update (a verify of drafts) keeps the window less one and appends, and its
    in-place update (a verify of the pending token alone) drops the oldest row for the new one,
    each laying out its buffer as serve.generate's trimmed cache leads it to."""
    k, v = kv
    n = length if not isinstance(template, RotatingKVCache) else min(length, template.max_size)
    return k[..., k.shape[2] - n:, :], v[..., v.shape[2] - n:, :]


def _cache(template, kv: tuple, length: int):
    """A fresh cache of the template's kind holding kv as a request's first `length` tokens."""
    if isinstance(template, RotatingKVCache):
        c = RotatingKVCache(template.max_size, template.keep)
        c.keys, c.values = kv
        c.offset, c._idx = length, kv[0].shape[2]
        return c
    c = KVCache()
    c.keys, c.values = kv
    c.offset = length
    return c


class RowKeys:
    """`sampling.Keys` of many requests at once: row i's chain is Keys(seeds[i])'s, split once per
    draw, the split and the draw vmapped over the rows drawing (the same bits, a few ops a draw)."""

    def __init__(self, seeds: list[int]):
        self.keys = mx.stack([mx.random.key(s) for s in seeds])

    def uniform(self, rows: mx.array, shape: tuple) -> mx.array:
        """One draw of `shape` for each of `rows` -> [len(rows), *shape]."""
        pair = mx.vmap(mx.random.split)(self.keys[rows])
        self.keys[rows] = pair[:, 0]
        return mx.vmap(lambda key: mx.random.uniform(shape=shape, key=key))(pair[:, 1])


class AssistantDrafts:
    """The assistant's greedy chain (assistant.draft_chain) vmapped over a group's rows."""

    mode = "match"

    def __init__(self, provider):
        self.drafter, o = provider.drafter, provider.options
        self.positions, self.window = o.get("positions", "optiq"), o.get("window", "optiq")
        if self.window != "optiq":
            raise Unsupported(f"window convention {self.window!r}: the lockstep caches keep the optiq view only")

    def start(self, prefill: targets.Trace) -> list:
        return []

    def draft(self, target, caches, g: Group, keys, sampler, gamma: int):
        """(drafts [b, gamma], None: q is the point mass on each draft)."""
        donors = self.drafter.donors(target, caches, self.window)

        def one(token, hidden, rows):
            steps = assistant.draft_chain(self.drafter, target, {t: (k[None], v[None]) for t, (k, v) in rows.items()},
                                          token, hidden[None], g.length, gamma, self.positions, self.window)
            return mx.concatenate([s.token_id.reshape(-1) for s in steps])

        drafts = mx.vmap(one)(g.pending, g.anchor, donors).astype(mx.int32)
        return drafts, mx.full((drafts.shape[0],), gamma, mx.int32), None

    def commit(self, context: list, trace: targets.Trace, at: mx.array, accepted: int, length: int) -> list:
        return []


class DsparkDrafts:
    """DSpark's block (dspark.Model's plain forward and tail) vmapped over a group's rows, each
    slot drawn from q = the drafting sampler's row with the row's own uniforms, chained through
    the Markov head and the confidence head; its context K/V carried per request."""

    mode = "rejection"

    def __init__(self, provider):
        self.m, self.threshold = provider.drafter, provider.threshold
        self.taps = self.m.tap_layers()

    def _context_kv(self, trace: targets.Trace, batch, rows: slice, offset: int) -> list:
        """The context K/V of the tapped rows `rows` of the requests `batch` of a target forward."""
        tapped = mx.concatenate([trace.hidden[layer + 1][batch, rows] for layer in self.taps], axis=-1)
        return dspark.Model.context_kv(self.m, self.m.project(tapped), offset)

    def start(self, prefill: targets.Trace) -> list:
        return self._context_kv(prefill, slice(None), slice(None), 0)

    def draft(self, target, caches, g: Group, keys, sampler, gamma: int):
        """(drafts [b, bs], each row's count, q [b, bs, V])."""
        m, bs = self.m, self.m.args.block_size
        rows = mx.array(g.rows)
        u = mx.stack([keys.uniform(rows, ()) for _ in range(bs)], axis=1)

        def one(anchor, context, uniforms):
            hidden, base = dspark.Model.__call__(m, targets.block_ids(anchor, m.args.mask_token_id, bs - 1),
                                                 [(k[None], v[None]) for k, v in context], g.length)
            qs = []

            def pick(row):
                qs.append(sampler.probs(row.astype(mx.float32)))
                return sampling.sample(qs[-1], uniforms[len(qs) - 1])

            _, tokens, conf = dspark.Model.tail(m, hidden, base, anchor.reshape(1).astype(mx.uint32), pick)
            return tokens.astype(mx.int32), mx.stack(qs), mx.zeros((bs,)) if conf is None else conf

        tokens, q, conf = mx.vmap(one)(g.pending, g.context, u)
        if m.args.enable_confidence_head and self.threshold > 0:
            below = (mx.sigmoid(conf) < self.threshold).astype(mx.int32)
            n = mx.where(below.any(axis=1), mx.argmax(below, axis=1), bs)
        else:
            n = mx.full((tokens.shape[0],), bs, mx.int32)
        return tokens, mx.minimum(n, gamma), q

    def commit(self, context: list, trace: targets.Trace, at: mx.array, accepted: int, length: int) -> list:
        """The context of the verify's rows `at` (context: theirs so far), their pending token's
        and accepted drafts' tapped rows appended at `length`, as DeepspecSource.commit queues them."""
        new = self._context_kv(trace, at, slice(0, accepted + 1), length)
        return [(mx.concatenate([k, nk], axis=2), mx.concatenate([v, nv], axis=2)) for (k, v), (nk, nv) in zip(context, new)]


def _drafts_for(provider, mode: str):
    from ..sources.assistant import AssistantProvider
    from ..sources.dspark import DeepspecProvider

    kinds = {AssistantProvider: AssistantDrafts, DeepspecProvider: DsparkDrafts}
    kind = kinds.get(type(provider))
    if kind is None:
        raise Unsupported(f"{type(provider).__name__} has no lockstep draft")
    if kind.mode != mode:
        raise Unsupported(f"{type(provider).__name__} runs in lockstep in {kind.mode!r} mode, not {mode!r}")
    return kind(provider)


def generate(target: targets.Target, prompt: list[int], max_tokens: int, provider, gamma: int,
             sampler: sampling.Sampler, seeds: list[int], eos: set[int] = frozenset(), mode: str = "match"):
    """Per seed, `serve.generate(target, prompt, max_tokens, provider, ServeOptions(gamma=gamma,
    eos=eos, mode=mode, sampler=sampler at that seed))`'s content tokens and trace [(drafted,
    accepted, emitted)], every request in lockstep."""
    if sampler.greedy or gamma < 1:
        raise Unsupported("the lockstep path runs a sampler at T > 0 with gamma >= 1")
    run = _Lockstep(target, _drafts_for(provider, mode), sampler, gamma, seeds, eos, max_tokens)
    groups = run.prefill(prompt)
    while groups:
        fragments: dict[int, list[Group]] = {}
        for g in groups:
            run.round(g, fragments)
        groups = [_joined(pieces) for _, pieces in sorted(fragments.items())]
    return [(c[:-1] if c[-1] in eos else c, tr) for c, tr in zip(run.committed, run.traces)]


class _Lockstep:
    """The requests' state (committed tokens, traces, what max_tokens leaves, key chains) and
    what a round does to a group."""

    def __init__(self, target, drafts, sampler, gamma: int, seeds: list[int], eos: set[int], max_tokens: int):
        self.target, self.drafts, self.sampler, self.gamma, self.eos = target, drafts, sampler, gamma, eos
        self.templates = targets.make_caches(target)
        if any(type(c) not in (KVCache, RotatingKVCache) or getattr(c, "keep", 0) for c in self.templates):
            raise Unsupported("the target's caches are not mlx-lm's KVCache / RotatingKVCache")
        self.keys, self.max_tokens = RowKeys(seeds), max_tokens
        self.committed: list[list[int]] = []
        self.traces: list[list[tuple[int, int, int]]] = [[] for _ in seeds]
        self.left = [max_tokens - 1] * len(seeds)

    def prefill(self, prompt: list[int]) -> list[Group]:
        """One prefill for every request and each one's first token: the first group."""
        pre = targets.forward(self.target, mx.array([prompt]), caches=self.templates)
        p0 = sampling.emittable(self.sampler.probs(pre.logits[0, -1:]))   # serve's first draw: not verify_probs
        n = len(self.left)
        first = sampling.sample(mx.broadcast_to(p0, (n, p0.shape[-1])),
                                self.keys.uniform(mx.arange(n), (1,))[:, 0]).tolist()
        self.committed = [[t] for t in first]
        live = [i for i, t in enumerate(first) if t not in self.eos and self.max_tokens > 1]
        if not live:
            return []
        B, P = len(live), len(prompt)

        def rep(kv):
            return tuple(mx.repeat(a, B, axis=0) for a in kv)

        return [Group(live, P, [rep(_kept(c, _live(c), P)) for c in self.templates],
                      mx.repeat(pre.final[:, -1:, :], B, axis=0), mx.array([first[i] for i in live], mx.int32),
                      [rep(kv) for kv in self.drafts.start(pre)])]

    def round(self, g: Group, fragments: dict[int, list[Group]]) -> None:
        """Group g drafts, then each set of its rows with the same number of drafts verifies."""
        caches = [_cache(c, kv, g.length) for c, kv in zip(self.templates, g.kv)]
        drafted, counts, q = self.drafts.draft(self.target, caches, g, self.keys, self.sampler, self.gamma)
        mx.eval(drafted, counts, q)     # once: each proposal length's verify slices them
        counts = counts.tolist()
        for n in sorted(set(counts)):
            js = [j for j, c in enumerate(counts) if c == n]
            idx = mx.array(js)
            self.verify(g, js, idx, n, drafted[idx, :n], None if q is None else q[idx, :n], fragments)

    def verify(self, g: Group, js: list[int], idx: mx.array, n: int, d: mx.array, q, fragments) -> None:
        """The rows js of group g, each with n drafts d: one verify, the rule, the bookkeeping, and the
        fragments of the next round's groups (keyed by committed length)."""
        rows, keys = [g.rows[j] for j in js], self.keys
        caches = [_cache(c, (k[idx], v[idx]), g.length) for c, (k, v) in zip(self.templates, g.kv)]
        trace = targets.forward(self.target, mx.concatenate([g.pending[idx][:, None], d], axis=1), caches=caches)
        p = sampling.verify_probs(self.sampler, trace.logits)
        drawing = mx.array(rows)
        if self.drafts.mode == "match":
            k, nxt = sampling.accept_match(d, p, keys.uniform(drawing, (1, n + 1))[:, 0])
        else:
            ua = keys.uniform(drawing, (1, n))[:, 0]
            k, nxt = sampling.accept_rejection(d, q, p, ua, keys.uniform(drawing, (1,))[:, 0])
        after = [_live(c) for c in caches]
        by_k: dict[int, list[int]] = {}
        for j, (r, a, last, drafts) in enumerate(zip(rows, k.tolist(), nxt.tolist(), d.tolist())):
            if self.settle(r, n, a, drafts[:a] + [last]):
                by_k.setdefault(a, []).append(j)
        for a, sub in by_k.items():
            at, length = mx.array(sub), g.length + 1 + a
            kv = [_kept(c, (kk[at, :, : kk.shape[2] - n + a], vv[at, :, : vv.shape[2] - n + a]), length)
                  for c, (kk, vv) in zip(self.templates, after)]
            rows_of_g = idx[at]
            context = self.drafts.commit([(ck[rows_of_g], cv[rows_of_g]) for ck, cv in g.context], trace, at, a,
                                         g.length)
            piece = Group([rows[j] for j in sub], length, kv, trace.final[at, a: a + 1, :], nxt[at], context)
            mx.eval(piece.kv, piece.anchor, piece.pending, piece.context)   # once: several next groups read them
            fragments.setdefault(length, []).append(piece)

    def settle(self, r: int, n: int, accepted: int, new: list[int]) -> bool:
        """Request r's round of n drafts, `accepted` of them, its new tokens `new` (the accepted
        drafts and the correction or bonus), as serve.generate counts it; whether it goes on."""
        stop = next((i for i, t in enumerate(new) if t in self.eos), n + 1)
        kept = accepted + 1
        emitted = min(self.left[r], stop + 1 if stop < kept else kept)
        self.traces[r].append((n, accepted, emitted))
        self.committed[r] += new[:emitted]
        self.left[r] -= emitted
        return emitted == kept and new[-1] not in self.eos and self.left[r] > 0

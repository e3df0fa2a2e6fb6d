"""Sampling at verify: the request's sampler, logits processors and the two acceptance rules.

The serve loop (`spec_parity.port.serve.generate`) calls these with a batch of one; the functions take a
leading batch axis so the statistical tests can run the very same arithmetic over many
independent streams at once.

Sampler. `Sampler(temperature, top_k, top_p, seed)`: logits -> probabilities by temperature,
then top-k (ties with the k-th value kept), then top-p (the smallest most-probable prefix whose
mass reaches top_p), renormalized; temperature < 1e-5 (DeepSpec's cut) is greedy: the one-hot
of the argmax. Every random number comes from an explicit MLX PRNG key (`Keys`) split once per
draw, so a run is a function of the seed. A token is drawn from a probability row by inverse
CDF against one uniform (`sample`): the row must be normalized; the leftover mass of a row that
sums to less than 1 goes to its last token with nonzero mass (this is what makes an
unnormalized residual visible: spec_parity/controls/serve.py plants one).

Logits processors follow mlx-lm's convention: `processor(tokens, logits) -> logits` with
`tokens` the 1-D int32 array of the prompt and every token before the position, `logits`
[1, V]. They must be pure functions of their arguments: the loop calls them on speculative
positions that may be rejected.

Acceptance, per verify of drafts d1..dn with target rows p_0..p_n (p_i predicts the token after
d_i; p_0 the one after the pending token):

- "match" (token match, the seed's v1): the target samples every row with the request's
  sampler, x_i ~ p_i; drafts are accepted while d_{i+1} == x_i; the first mismatch's x_k (or
  x_n on a full accept) is the next token. Every emitted token is a sample from the target's
  conditional at its position, whatever the drafter proposed (drafts must not depend on the
  target's draws, which they cannot: they are made before the verify).
- "rejection" (speculative sampling, DeepSpec's `verify_draft_tokens`, the DSpark paper):
  the drafts were drawn d_{i+1} ~ q_i; accept d_{i+1} with probability min(1, p_i/q_i); at the
  first rejection k resample from normalize(max(0, p_k - q_k)) (p_k itself if that mass is
  <= 1e-8, DeepSpec's fallback); on a full accept the bonus token is drawn from p_n (the
  residual against a zero q row). A source that drafts deterministically has q = the point
  mass on its draft, for which the rule is lossless too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
MODES = ("match", "rejection")
GREEDY_BELOW = 1e-5
RESIDUAL_FLOOR = 1e-8


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class Sampler:
    """The request's sampler. temperature 0 (the default) is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise SamplingError(f"temperature {self.temperature} < 0")
        if self.top_k < 0:
            raise SamplingError(f"top_k {self.top_k} < 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p {self.top_p} is not in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def probs(self, logits: mx.array) -> mx.array:
        """Probabilities [..., V] (float32) of logits [..., V]. A row with no finite logit (every
        token banned by a processor) gives a zero row."""
        x = logits.astype(mx.float32)
        V = x.shape[-1]
        valid = mx.max(x, axis=-1, keepdims=True) > -mx.inf
        if self.greedy:
            p = (mx.arange(V) == mx.argmax(x, axis=-1, keepdims=True)).astype(mx.float32)
            return mx.where(valid, p, 0.0)
        x = x / self.temperature
        if 0 < self.top_k < V:
            kth = mx.sort(x, axis=-1)[..., V - self.top_k: V - self.top_k + 1]
            x = mx.where(x >= kth, x, -mx.inf)
        p = mx.softmax(x, axis=-1)
        if self.top_p < 1.0:
            order = mx.argsort(-p, axis=-1)
            sp = mx.take_along_axis(p, order, axis=-1)
            keep_sorted = (mx.cumsum(sp, axis=-1) - sp) < self.top_p
            keep = mx.put_along_axis(mx.zeros(p.shape, mx.bool_), order, keep_sorted, axis=-1)
            p = mx.where(keep, p, 0.0)
            p = p / p.sum(axis=-1, keepdims=True)
        return mx.where(valid, p, 0.0)

    def with_temperature(self, temperature: float) -> Sampler:
        return Sampler(temperature, self.top_k, self.top_p, self.seed)


class Keys:
    """An explicit MLX PRNG key, split once per draw."""

    def __init__(self, seed: int):
        self.key = mx.random.key(seed)

    def uniform(self, shape: Sequence[int]) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return mx.random.uniform(shape=tuple(shape), key=sub)


def sample(probs: mx.array, u: mx.array) -> mx.array:
    """Inverse-CDF draw: probs [..., V] (normalized), u [...] uniform in [0, 1) -> int32 [...].
    Rounding (or an unnormalized row) that leaves u beyond the row's mass gives the last token
    with nonzero mass."""
    V = probs.shape[-1]
    idx = (mx.cumsum(probs, axis=-1) <= u[..., None]).sum(axis=-1)
    last = V - 1 - mx.argmax((probs > 0)[..., ::-1], axis=-1)
    return mx.minimum(idx, last).astype(mx.int32)


def _prefix(ok: mx.array) -> mx.array:
    """Length of the all-true prefix of each row of ok [B, n] (bool)."""
    if ok.shape[1] == 0:
        return mx.zeros((ok.shape[0],), mx.int32)
    return mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)


def _row(x: mx.array, k: mx.array) -> mx.array:
    """x [B, n, V], k [B] -> x[b, k_b] as [B, V]."""
    return mx.take_along_axis(x, k[:, None, None].astype(mx.int32), axis=1)[:, 0]


def accept_match(drafts: mx.array, p: mx.array, u: mx.array) -> tuple[mx.array, mx.array]:
    """Token match. drafts [B, n] int, p [B, n+1, V] target probabilities, u [B, n+1] uniforms
    -> (accepted [B], next token [B])."""
    n = drafts.shape[1]
    x = sample(p, u)
    k = _prefix(drafts == x[:, :n])
    return k, mx.take_along_axis(x, k[:, None], axis=1)[:, 0]


def accept_rejection(drafts: mx.array, q: mx.array, p: mx.array, u_accept: mx.array,
                     u_resample: mx.array) -> tuple[mx.array, mx.array]:
    """Rejection sampling. drafts [B, n] drawn from q [B, n, V]; p [B, n+1, V]; u_accept [B, n],
    u_resample [B] uniforms -> (accepted [B], next token [B])."""
    B, n = drafts.shape
    V = p.shape[-1]
    k = accepted_prefix(drafts, q, p, u_accept) if n else mx.zeros((B,), mx.int32)
    qz = mx.concatenate([q.astype(mx.float32), mx.zeros((B, 1, V), mx.float32)], axis=1)
    return k, sample(residual(_row(p, k), _row(qz, k)), u_resample)


def accepted_prefix(drafts: mx.array, q: mx.array, p: mx.array, u: mx.array) -> mx.array:
    """The acceptance test of the rejection rule: how many drafts [B, n] pass u_i < min(1, p_i/q_i)
    at their token (p's first n rows; q > 0 where d was drawn) before the first that fails."""
    n = drafts.shape[1]
    idx = drafts[..., None].astype(mx.int32)
    pd = mx.take_along_axis(p[:, :n], idx, axis=-1)[..., 0]
    qd = mx.take_along_axis(q, idx, axis=-1)[..., 0]
    return _prefix(u * qd < pd)


def residual(p: mx.array, q: mx.array) -> mx.array:
    """What a rejection resamples from: normalize(max(0, p - q)) per row, p itself where that has
    no mass (<= RESIDUAL_FLOOR, DeepSpec's fallback)."""
    r = mx.maximum(p - q, 0.0)
    mass = r.sum(axis=-1, keepdims=True)
    return mx.where(mass <= RESIDUAL_FLOOR, p, r / mx.maximum(mass, RESIDUAL_FLOOR))


def emittable(p: mx.array) -> mx.array:
    """The target's probabilities p [..., V], refused where the processors left a row no token the
    target may emit (Sampler.probs gives such a row zero mass)."""
    if float(p.sum(axis=-1).min().item()) < 0.5:
        raise SamplingError("the logits processors left no token the target may emit")
    return p


def verify_probs(sampler: Sampler, rows: mx.array) -> mx.array:
    """The target's p at verify: its (processed) logits rows through the request's sampler,
    `emittable`."""
    return emittable(sampler.probs(rows))


def drafting_sampler(sampler: Sampler, mode: str, draft_sampler: Sampler | None = None) -> Sampler:
    """What drafts are drawn with: "match" drafts greedily; "rejection" draws from q with
    `draft_sampler`, by default the request's sampler (DeepSpec: the same temperature)."""
    if draft_sampler is not None:
        return draft_sampler
    return sampler if mode == "rejection" else Sampler()


def process(processors: Sequence[LogitsProcessor], tokens: mx.array, logits: mx.array) -> mx.array:
    """Apply the processors in order to one row: tokens [T] int32, logits [V] -> [V]."""
    row = logits[None]
    for proc in processors:
        row = proc(tokens, row)
    return row.reshape(logits.shape)


def ban(token_ids) -> LogitsProcessor:
    """A grammar-style processor: the given tokens can never be chosen (logit -inf)."""
    ids = sorted({int(t) for t in token_ids})
    if any(t < 0 for t in ids):
        raise SamplingError(f"negative token id in {ids}")

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        V = logits.shape[-1]
        banned = mx.array([t for t in ids if t < V], mx.int32)
        return mx.where((mx.arange(V)[:, None] == banned[None, :]).any(axis=-1), -mx.inf, logits)

    return processor

"""DeepSpec's DSpark heads, shared by the DSpark port and the DSpark-on-DFlash extension.

Markov head: a bias on each draft slot's row from the previous token (and, gated / rnn, the
slot's hidden), added after the softcap, chained slot by slot. Confidence head: one logit per
slot from [h_k ; W1[prev_k]] (with_markov) or h_k; the proposal stops at the first slot whose
sigmoid falls under the threshold.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MARKOV_TYPES = ("vanilla", "gated", "rnn")


class HeadError(ValueError):
    pass


class MarkovHead(nn.Module):
    """Vanilla: bias = W2(W1[prev]); gated: W2(sigmoid(G[h; W1[prev]]) * W1[prev]);
    rnn: a GRU-like state over the block, bias = W2(tanh(output))."""

    def __init__(self, kind: str, rank: int, hidden_size: int, vocab_size: int):
        super().__init__()
        if kind not in MARKOV_TYPES:
            raise HeadError(f"unsupported markov_head_type {kind!r} (vanilla, gated, rnn)")
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def __call__(self, prev, h, state):
        """Bias for one slot given the previous token [1] and hidden [1, H]; returns (bias, state)."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            return self.markov_w2(mx.sigmoid(self.gate_proj(mx.concatenate([h, e], axis=-1))) * e), state
        state = mx.zeros_like(e) if state is None else state
        g, cand, out = mx.split(self.joint_proj(mx.concatenate([state, e, h], axis=-1)), 3, axis=-1)
        g = mx.sigmoid(g)
        return self.markov_w2(mx.tanh(out)), g * state + (1.0 - g) * mx.tanh(cand)


class ConfidenceHead(nn.Module):
    def __init__(self, dims: int):
        super().__init__()
        self.proj = nn.Linear(dims, 1)


def markov_chain(head: MarkovHead | None, hidden, base, anchor: mx.array, pick=None):
    """Rows and tokens of a block through a Markov head: row_k = base_k + bias(prev_k, h_k) (after
    the softcap), prev_0 = the anchor ([1] uint32), prev_k = token k-1. Greedy (pick None) the
    tokens stay on the device, chained into the next slot's bias; `pick(row)` chooses each instead
    (a host int, or a scalar array). Returns (rows [n, V], tokens [n] uint32, on the device)."""
    if head is None and pick is None:
        return base, mx.argmax(base, axis=-1)
    # Rows stay [1, V] slices (base[k:k + 1], one Slice node; base[k] would be a Gather, base[k, ...] a
    # Slice and a Squeeze), joined by one concatenate: fewer graph nodes, each host time on MLX CUDA.
    rows, tokens, prev, state = [], [], anchor, None
    for k in range(hidden.shape[0]):
        row = base[k:k + 1]
        if head is not None:
            bias, state = head(prev, hidden[k:k + 1], state)
            row = row + bias
        rows.append(row)
        prev = mx.argmax(row, axis=-1) if pick is None else _picked(pick(row[0, ...]))
        tokens.append(prev.astype(mx.uint32))
    return mx.concatenate(rows), mx.concatenate(tokens)


def _picked(token) -> mx.array:
    """A pick as the [1] token array the next slot reads: a host int, or a scalar array (a pick
    that stays on the device, as port/fast/seeded.py's vmapped one does)."""
    return token.reshape(1) if isinstance(token, mx.array) else mx.array([int(token)])


def previous_tokens(anchor: mx.array, tokens: mx.array) -> mx.array:
    """prev_k of each slot: [anchor, token_0 .. token_{n-2}] (the Markov head's inputs)."""
    return mx.concatenate([anchor, tokens[:-1]])


def build(markov_rank: int, markov_head_type: str, confidence: bool, with_markov: bool, hidden_size: int,
          vocab_size: int) -> dict:
    """{name: head} for a drafter's config: markov_head (rank > 0), confidence_head (enabled)."""
    heads = {}
    if markov_rank > 0:
        heads["markov_head"] = MarkovHead(markov_head_type, markov_rank, hidden_size, vocab_size)
    if confidence:
        heads["confidence_head"] = ConfidenceHead(hidden_size + (markov_rank if with_markov else 0))
    return heads


def extend(markov: MarkovHead | None, confidence: ConfidenceHead | None, with_markov: bool, hidden, base,
           anchor: mx.array, pick=None):
    """The heads on one block: hidden [n, H], base [n, V] after the softcap; the confidence head
    reads [h_k ; W1[prev_k]] `with_markov`. Returns (rows, tokens, confidence logits [n] or None)."""
    rows, tokens = markov_chain(markov, hidden, base, anchor, pick)
    if confidence is None:
        return rows, tokens, None
    return rows, tokens, confidence_logits(confidence, markov if with_markov else None, hidden,
                                           previous_tokens(anchor, tokens))


def confidence_logits(confidence: ConfidenceHead, markov: MarkovHead | None, hidden, prev: mx.array):
    """Each slot's confidence logit [n]: proj([h_k ; W1[prev_k]]), or proj(h_k) without `markov`."""
    feats = hidden if markov is None else mx.concatenate([hidden, markov.markov_w1(prev)], axis=-1)
    return confidence.proj(feats)[:, 0]


class Extension(nn.Module):
    """The heads on a drafter that has none of its own (DSpark-on-DFlash): under DeepSpec's names
    markov_head.* and confidence_head.*, as the checkpoint stores them."""

    def __init__(self, markov_rank: int, markov_head_type: str, confidence: bool, with_markov: bool,
                 hidden_size: int, vocab_size: int):
        super().__init__()
        self.with_markov = with_markov
        for name, head in build(markov_rank, markov_head_type, confidence, with_markov, hidden_size,
                                vocab_size).items():
            setattr(self, name, head)

    def __call__(self, hidden, base, anchor: mx.array, pick=None):
        return extend(self.get("markov_head"), self.get("confidence_head"), self.with_markov, hidden, base, anchor,
                      pick)

"""Negative controls of z-lab's DFlash drafter (port/dflash.py) and its DSpark extension (the
source's, port/sources/dflash.py)."""

from __future__ import annotations

import functools

from ...controls import LAYER_SCALE, control, one_layer_scaled
from ..dspark.controls import bucket_mask_off_by_one, chain_before_softcap, rejected_rows

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.compiled:valid_rows", "spec_parity.port.dflash:Attention.__init__", "spec_parity.port.dflash:Attention.block_heads",
    "spec_parity.port.dflash:Attention.mask",
    "spec_parity.port.dflash:DecoderLayer.__call__", "spec_parity.port.dflash:Model.head", "spec_parity.port.dflash:load",
    "spec_parity.port.fast.dflash:rows_as_heads", "spec_parity.port.heads:confidence_logits", "spec_parity.port.heads:markov_chain",
    "spec_parity.port.sources.dflash:DflashSource.extend", "spec_parity.port.sources.dflash:prune_length",
    "spec_parity.port.targets:verified_rows",
)


@functools.cache
def _random_head(vocab: int, hidden: int):
    """A fixed random head (what a port that forgot to borrow the target's would score with)."""
    import mlx.core as mx
    import mlx.nn as nn

    head = nn.Linear(hidden, vocab, bias=False)
    head.weight = mx.random.normal((vocab, hidden), key=mx.random.key(7)) * hidden ** -0.5
    return head


@control("dflash", "own_head", "the drafter scores with its own (random) lm head instead of the target's")
def _own_head(case):
    from spec_parity.port import dflash

    def own(self, target, h):
        return _random_head(self.args.vocab_size, self.args.hidden_size)(h) * self.args.output_multiplier

    return {(dflash.Model, "head"): own}


@control("dflash", "ctx_input_layernorm", "the context rows pass through each layer's input_layernorm before K/V")
def _ctx_norm(case):
    """On the plain model (the pairs' module cases), where each layer takes the context rows."""
    from spec_parity.port import dflash

    def normed(self, x, ctx, cache, block_at):
        return self.finish(x, self.self_attn(self.input_layernorm(x), self.input_layernorm(ctx), cache, block_at))

    return {(dflash.DecoderLayer, "__call__"): normed}


@control("dflash", "block_position_shift", "the block's positions shifted by one (start+1..start+bs)")
def _position(case):
    from spec_parity.port import dflash

    heads = dflash.Attention.block_heads
    return {(dflash.Attention, "block_heads"): lambda self, q, k, v, at: heads(self, q, k, v, at + 1)}


@control("dflash", "window_one_short", "a sliding layer's window one row short (the config's W read as W-1)")
def _window_short(case):
    """Its newest W-2 context rows attended where W-1 are due: the stored window ends where the
    reference's does, one row shorter at the old end."""
    from spec_parity.port import dflash

    load = dflash.load

    def short(*args, **kwargs):
        model = load(*args, **kwargs)
        if model.args.sliding_window:
            model.args.sliding_window -= 1
        return model

    return {(dflash, "load"): short}


@control("dflash", "rows_as_heads_transposed", "rows-as-heads: the block rows folded into the heads row-major")
def _rows_as_heads(case):
    from spec_parity.port.fast import dflash as fast

    def transposed(q):
        B, H, L, D = q.shape
        return q.transpose(0, 2, 1, 3).reshape(B, L * H, 1, D)

    return {(fast, "rows_as_heads"): transposed}


control("dflash", "rejected_rows", "rejected verify rows kept in the context")(rejected_rows)
control("dflash", "bucket_mask_off_by_one", "kv_bucket: the context mask lets the first padded row through")(
    bucket_mask_off_by_one)


@control("dflash", "markov_before_softcap", "extension: Markov bias added before the softcap")
def _markov(case):
    from spec_parity.port.sources.dflash import DflashSource

    extend = DflashSource.extend

    def biased(self, block, anchor, pick):
        with chain_before_softcap(lambda h: self.m.head(self.target, h), self.m.args.final_logit_softcapping):
            return extend(self, block, anchor, pick)

    return {(DflashSource, "extend"): biased}


@control("dflash", "thresholds_ignored", "extension: the confidence thresholds are not applied (no pruning)")
def _thresholds(case):
    from spec_parity.port.sources import dflash

    return {(dflash, "prune_length"): lambda confidence, thresholds: confidence.shape[0]}


@control("dflash", "markov_first_token", "extension: the Markov head's first slot reads token 0, not the anchor, "
         "as its previous token")
def _markov_first_token(case):
    """The bug the L3 gates let through (the stream stays lossless, pruning and the shift in their
    gates): only the first slot's bias moves; the extension's heads held to DeepSpec's catch it."""
    import mlx.core as mx

    from spec_parity.port import heads

    chain = heads.markov_chain

    def zero_first(head, hidden, base, anchor, pick=None):
        return chain(head, hidden, base, mx.zeros_like(anchor), pick)

    return {(heads, "markov_chain"): zero_first}


@control("dflash", "confidence_wrong_row", "extension: the confidence head reads the previous slot's hidden row "
         "(slot 0 the last one's)")
def _confidence_wrong_row(case):
    import mlx.core as mx

    from spec_parity.port import heads

    logits = heads.confidence_logits

    def shifted(confidence, markov, hidden, prev):
        return logits(confidence, markov, mx.roll(hidden, 1, axis=0), prev)

    return {(heads, "confidence_logits"): shifted}


@control("dflash", "layer_scale", f"one drafter layer's output x{LAYER_SCALE} (the layer the case names)")
def _layer_scale(case):
    from spec_parity.port import dflash

    return one_layer_scaled(dflash, "load", lambda m: m.layers, case)


# Bugs only a configuration off the built-in cases shows (every built-in DFlash drafter has
# rope_theta 1e6, and its sliding window wider than its block): the fuzzer's to find
# (tests/test_fuzz.py holds both halves: the matrix passes with each planted, a fuzz run fails).
@control("dflash", "rope_theta_fixed", "RoPE at base 1e6 whatever rope_theta the config gives")
def _rope_fixed(case):
    from mlx_lm.models.rope_utils import initialize_rope

    from spec_parity.port import dflash

    init = dflash.Attention.__init__

    def fixed(self, a, layer, window):
        init(self, a, layer, window)
        self.rope = initialize_rope(a.head_dim, base=1e6, traditional=False, scaling_config=a.rope_scaling,
                                    max_position_embeddings=a.max_position_embeddings)

    return {(dflash.Attention, "__init__"): fixed}


@control("dflash", "window_within_block", "a sliding layer no wider than the block sees its whole stored context")
def _window_within_block(case):
    import mlx.core as mx

    from spec_parity.port import dflash

    mask = dflash.Attention.mask

    def wide(self, n_ctx, L):
        m = mask(self, n_ctx, L)
        if self.sliding and self.a.sliding_window <= L:
            m = m | (mx.arange(n_ctx + L)[None] < n_ctx)
        return m

    return {(dflash.Attention, "mask"): wide}

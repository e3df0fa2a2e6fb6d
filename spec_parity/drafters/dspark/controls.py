"""Negative controls of DeepSpec's DSpark drafter (port/dspark.py). The context, mask and Markov
controls are shared with DFlash (spec_parity/drafters/dflash/controls.py), whose source and extension do
the same there."""

from __future__ import annotations

from ...controls import LAYER_SCALE, control, one_layer_scaled, swapped

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.compiled:valid_rows", "spec_parity.port.dspark:Attention.kv", "spec_parity.port.dspark:Model.embed",
    "spec_parity.port.dspark:Model.final", "spec_parity.port.dspark:Model.prefix_length", "spec_parity.port.dspark:Model.tail",
    "spec_parity.port.dspark:Model.tap_layers", "spec_parity.port.dspark:load", "spec_parity.port.heads:markov_chain",
    "spec_parity.port.targets:verified_rows",
)


def rejected_rows(case):
    """Every verify row joins the drafter's context, the rejected drafts' too."""
    import mlx.core as mx

    from spec_parity.port import targets

    return {(targets, "verified_rows"): lambda tapped, accepted: mx.concatenate(tapped, axis=-1)}


def bucket_mask_off_by_one(case):
    """kv_bucket: the context mask of the compiled block lets the first padded row through."""
    from spec_parity.port import compiled

    rows = compiled.valid_rows
    return {(compiled, "valid_rows"): lambda valid, S: rows(valid + 1, S)}


def chain_before_softcap(logits_before_cap, cap):
    """spec_parity.port.heads.markov_chain with the bias added before the softcap: row_k =
    softcap(logits_before_cap(h_k) + bias_k)."""
    import mlx.core as mx

    from spec_parity.port import heads

    chain = heads.markov_chain

    def before(head, hidden, base, anchor, pick=None):
        if head is None:
            return chain(head, hidden, base, anchor, pick)
        rows, tokens, prev, state = [], [], anchor, None
        for k in range(hidden.shape[0]):
            bias, state = head(prev, hidden[k:k + 1], state)
            out = logits_before_cap(hidden[k:k + 1]) + bias
            rows.append((mx.tanh(out / cap) * cap if cap else out)[0, ...])
            prev = mx.argmax(rows[-1], keepdims=True) if pick is None else mx.array([int(pick(rows[-1]))])
            tokens.append(prev.astype(mx.uint32))
        return mx.stack(rows), mx.concatenate(tokens)

    return swapped({(heads, "markov_chain"): before})


@control("dspark", "markov_before_softcap", "Markov bias added before the softcap")
def _markov(case):
    from spec_parity.port import dspark

    tail = dspark.Model.tail

    def biased(self, hidden, base, anchor, pick=None):
        with chain_before_softcap(self.lm_head, self.args.final_logit_softcapping):
            return tail(self, hidden, base, anchor, pick)

    return {(dspark.Model, "tail"): biased}


@control("dspark", "cumulative_truncation", "truncation on the cumulative product of confidences")
def _cumulative(case):
    import mlx.core as mx

    from spec_parity.port import dspark, targets

    def prefix_length(self, confidence, threshold):
        if confidence is None or threshold <= 0.0:
            return self.args.block_size
        return targets.first_true(mx.cumprod(mx.sigmoid(confidence)) < threshold, self.args.block_size)

    return {(dspark.Model, "prefix_length"): prefix_length}


control("dspark", "rejected_rows", "rejected rows appended to the context")(rejected_rows)


@control("dspark", "rope_on_v", "RoPE applied to V")
def _rope_on_v(case):
    from spec_parity.port import dspark

    kv = dspark.Attention.kv

    def rotated(self, x, offset):
        k, v = kv(self, x, offset)
        return k, self.rope(v, offset=offset)

    return {(dspark.Attention, "kv"): rotated}


@control("dspark", "no_embed_scale", "the sqrt(H) embedding scale missing")
def _no_embed_scale(case):
    from spec_parity.port import dspark

    return {(dspark.Model, "embed"): lambda self, ids: self.embed_tokens(ids)}


@control("dspark", "anchor_not_predicting", "the anchor slot does not predict (slots 1..bs used)")
def _anchor(case):
    import mlx.core as mx

    from spec_parity.port import dspark

    def shifted(self, h):
        full = self.norm(h)[0, ...]
        hidden = mx.concatenate([full[1:], full[-1:]], axis=0)
        return hidden, self.logits(hidden)

    return {(dspark.Model, "final"): shifted}


@control("dspark", "tap_index", "taps read hidden_states[l] instead of [l + 1]")
def _tap_index(case):
    from spec_parity.port import dspark

    return {(dspark.Model, "tap_layers"): lambda self: [i - 1 if i >= 0 else i for i in self.args.target_layer_ids]}


control("dspark", "bucket_mask_off_by_one", "kv_bucket: the context mask lets the first padded row through")(
    bucket_mask_off_by_one)


@control("dspark", "layer_scale", f"one drafter layer's output x{LAYER_SCALE} (the layer the case names)")
def _layer_scale(case):
    from spec_parity.port import dspark

    return one_layer_scaled(dspark, "load", lambda m: m.layers, case)

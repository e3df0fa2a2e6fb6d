"""Negative controls of the Gemma-4 assistant drafter (port/assistant.py), caught by the step
comparisons against both oracles' goldens."""

from __future__ import annotations

from ...controls import LAYER_SCALE, control, one_layer_scaled

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.assistant:Attention.__init__", "spec_parity.port.assistant:Model.candidate_rows",
    "spec_parity.port.assistant:RMSNorm.__call__", "spec_parity.port.assistant:draft_chain", "spec_parity.port.assistant:load",
    "spec_parity.port.assistant:sliding_view",
    "spec_parity.port.fast.assistant:donor_buffers",
)


@control("assistant", "scale", "attention scale 1/sqrt(d) instead of 1.0")
def _scale(case):
    from spec_parity.port import assistant

    init = assistant.Attention.__init__

    def built(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.scale = self.head_dim ** -0.5

    return {(assistant.Attention, "__init__"): built}


@control("assistant", "position", "draft position off by one")
def _position(case):
    from spec_parity.port import assistant

    chain = assistant.draft_chain

    def shifted(drafter, target, donors, token, hidden, position, *args, **kwargs):
        return chain(drafter, target, donors, token, hidden, position + 1, *args, **kwargs)

    return {(assistant, "draft_chain"): shifted}


@control("assistant", "window", "sliding window off by one (newest W entries instead of W-1)")
def _window(case):
    from spec_parity.port import assistant

    chain, view = assistant.draft_chain, assistant.sliding_view

    def wide_chain(drafter, *args, **kwargs):
        return chain(drafter, *args, **{**kwargs, "window": drafter.args.sliding_window})

    return {(assistant, "draft_chain"): wide_chain,
            (assistant, "sliding_view"): lambda k, v, window, convention="optiq": view(k, v, window, window)}


@control("assistant", "donor", "wrong donor layer (the second-to-last sliding layer)")
def _donor(case):
    """The drafter handed the second-to-last sliding layer's K/V of the case's prompt (in the
    caller's donor dict, as a port that picked the wrong layer would hold them)."""
    from spec_parity.port import assistant

    chain = assistant.draft_chain

    def wrong(drafter, target, donors, *args, **kwargs):
        donors["sliding_attention"] = _second_to_last_sliding(case, target)
        return chain(drafter, target, donors, *args, **kwargs)

    return {(assistant, "draft_chain"): wrong}


def _second_to_last_sliding(case, target):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ...harness import prompt

    caches = make_prompt_cache(target.model)
    target.model(mx.array(prompt(case)), cache=caches)
    owners = [i for i, t in enumerate(target.config["layer_types"][: len(caches)]) if t == "sliding_attention"]
    c = caches[owners[-2]]
    return c._temporal_order(c.keys), c._temporal_order(c.values)


@control("assistant", "ordering", "centroid token ordering ignored")
def _ordering(case):
    import mlx.core as mx

    from spec_parity.port import assistant

    load = assistant.load

    def unordered(*args, **kwargs):
        drafter = load(*args, **kwargs)
        drafter.masked_embedding.token_ordering = mx.arange(drafter.args.vocab_size, dtype=mx.int64)
        return drafter

    return {(assistant, "load"): unordered}


@control("assistant", "head_rows", "the untied centroid head's candidates scored on the embedding, not lm_head")
def _head_rows(case):
    from spec_parity.port import assistant

    return {(assistant.Model, "candidate_rows"): lambda self: self.model.embed_tokens.weight}


def _donor_where(layer: str, shift):
    """The bucketed path's donor window (spec_parity.port.fast.assistant.donor_buffers' `where`) moved by
    `shift`, a function of the old `where`."""
    def swaps(case):
        from spec_parity.port.fast import assistant

        buffers = assistant.donor_buffers

        def moved(*args):
            out = buffers(*args)
            k, v, where = out[layer]["kv"]
            out[layer]["kv"] = (k, v, shift(where))
            return out

        return {(assistant, "donor_buffers"): moved}
    return swaps


control("assistant", "bucketed_window_off_by_one",
        "bucketed donors: one sliding entry more than the window let through")(
    _donor_where("sliding_attention", lambda where: (where[0], where[1] - 1, where[2])))
control("assistant", "bucketed_full_past_offset", "bucketed donors: one full-attention entry past the offset let through")(
    _donor_where("full_attention", lambda where: (where[0] + 1,)))
control("assistant", "ring_order_ignored", "bucketed donors: the ring's rotation dropped (slot j taken as rank j)")(
    _donor_where("sliding_attention", lambda where: (where[0] * 0, *where[1:])))


@control("assistant", "layer_scale", f"one drafter layer's output x{LAYER_SCALE} (the layer the case names)")
def _layer_scale(case):
    from spec_parity.port import assistant

    return one_layer_scaled(assistant, "load", lambda m: m.model.layers, case)


@control("assistant", "fp16_norms", "in float16 the norms compute in float16, not float32 (bfloat16 and float32 "
         "as they should)")
def _fp16_norms(case):
    """A dtype no built-in case runs: the fuzzer's to find (tests/test_fuzz.py)."""
    import mlx.core as mx

    from spec_parity.port import assistant

    plain = assistant.RMSNorm.__call__

    def half(self, x):
        if x.dtype != mx.float16:
            return plain(self, x)
        return mx.fast.rms_norm(x, self.weight.astype(x.dtype), self.eps)

    return {(assistant.RMSNorm, "__call__"): half}

"""Our DSpark port (port/dspark.py) behind protocols dspark/modules, dspark/loop and dspark/sampled."""

from __future__ import annotations

import numpy as np

from spec_parity.oracles.layers import as_numpy, mlx_recorded

from ...adapters import loop
from ...checks import layer_feeds
from ...protocol import Request
from ...sampled import first_and_rounds, first_round_end


def run(req: Request) -> dict:
    import mlx.core as mx

    from spec_parity.port import dspark, targets
    from spec_parity.port.sources.dspark import DeepspecProvider

    dt = getattr(mx, req.dtype)
    target = targets.load(req.target, dt)
    p = req.prompt
    if req.kind == "sampled":
        return sampled(target, req)
    if req.kind == "loop":
        provider = DeepspecProvider(req.drafter, req.options["threshold"], dtype=dt)
        n = req.options["max_new_tokens"]
        # DeepSpec runs a round while fewer than n + 1 tokens are committed, then trims to n. The
        # blocks' extras (`ext.*`) are the DSpark-on-DFlash protocol's, not this one's: left out.
        out = loop.run(target, p, n + 1, provider, provider.trained_gamma, set(), keep=n)
        return {k: v for k, v in out.items() if not k.startswith("ext.")}
    m = dspark.load(req.drafter, dtype=dt)
    dspark.check_pairing(m, target)
    trace = targets.forward(target, mx.array(p))
    taps = m.taps(trace.hidden)
    c = m.project(taps)
    kv = m.context_kv(c, 0)
    anchor = int(mx.argmax(trace.logits[0, -1]).item())
    recorded = {}
    with mlx_recorded(m.layers, recorded):
        block = m.draft_block(anchor, kv, p.shape[1])
    feed = layer_feeds(req.inputs)
    if feed:                    # the own-error run: each layer on the reference's input and context
        ctx = [(mx.array(req.inputs[f"context_k.{i}"])[None], mx.array(req.inputs[f"context_v.{i}"])[None])
               if f"context_k.{i}" in req.inputs else layer_kv for i, layer_kv in enumerate(kv)]
        with mlx_recorded(m.layers, recorded, "own", feed):
            m.draft_block(anchor, ctx, p.shape[1])
    out = {"anchor": np.array([anchor], np.int32), "taps": taps[0], "context": c[0], "block_hidden": block.hidden,
           "base_logits": block.base_logits, "logits": block.logits, "tokens": np.array(block.tokens, np.int32)}
    for i, (k, v) in enumerate(kv):
        out[f"context_k.{i}"], out[f"context_v.{i}"] = k[0], v[0]
    if block.confidence is not None:
        out["confidence"] = block.confidence
    for t in req.options["thresholds"]:
        n = m.prefix_length(block.confidence, t)
        out[f"prefix@{t}"] = np.array([n], np.int32)
        out[f"proposal@{t}"] = np.array(block.tokens[:n], np.int32)
    return {**{k: np.array(v) for k, v in out.items()}, **as_numpy(recorded)}


def sampled(target, req: Request) -> dict:
    """Our loop in rejection mode at the temperature, once per seed: per request the first round's
    accepted length, its rounds and the first round's end token (spec_parity.sampled)."""
    import mlx.core as mx

    from spec_parity.port.sources.dspark import DeepspecProvider

    o = req.options
    provider = DeepspecProvider(req.drafter, o["threshold"], dtype=getattr(mx, req.dtype))
    # DeepSpec runs a round while fewer than n + 1 tokens are committed, then trims to n.
    requests = loop.seeded_requests(target, req.prompt, o["max_new_tokens"] + 1, provider, provider.trained_gamma, o,
                                    mode="rejection")
    return {**first_and_rounds([[a for _, a, _ in t] for _, t in requests]),
            **first_round_end([loop.first_round(*r) for r in requests], target.config["vocab_size"])}

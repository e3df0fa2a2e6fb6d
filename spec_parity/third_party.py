"""The third-party MLX ports (dflash-mlx 0.1.8, dspark-mlx 0.1.0; the DFlash rounds of mlx-vlm 0.7.10
and mlx-dspark 0.20.3) driven in one place: their
parity adapters (examples/*_adapter.py), the bench's peer sides (spec_parity/bench/peers.py) and
its --serve loops (spec_parity/bench/loop_sides.py) call these, so each of their calls is written once. Only their public objects (and, for
dspark-mlx, the drafter's own methods) are called; nothing of theirs is re-implemented. Both are
imported when a function runs: neither is a spec-parity dependency.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

# ---- dflash-mlx ---------------------------------------------------------------------------------


def dflash_mlx_draft(drafter_dir: str | Path):
    """dflash-mlx's DFlashDraftModel from a checkpoint directory (`load_draft_bundle`, eager)."""
    from dflash_mlx.runtime.loading import load_draft_bundle

    draft, _ = load_draft_bundle(str(drafter_dir), lazy=False)
    return draft


def dflash_mlx_target_ops(target):
    """dflash-mlx's TargetOps for an mlx-lm target (`resolve_target_ops`)."""
    from dflash_mlx.engine.target_ops import resolve_target_ops

    return resolve_target_ops(target)


def dflash_mlx_bind(draft, target, ops):
    """The drafter bound to the target (`bind_draft_to_target`): the TargetOps it drafts with."""
    from dflash_mlx.engine.target_ops import bind_draft_to_target

    return bind_draft_to_target(draft, target, target_ops=ops)


def dflash_mlx_backend():
    """dflash-mlx's eager draft backend (`EagerDraftBackend`): what its loop drafts with."""
    from dflash_mlx.draft_backend import EagerDraftBackend

    return EagerDraftBackend()


def dflash_mlx_cache(backend, draft, sink: int, window: int, allow_full: bool):
    """The drafter's context caches of an `EagerDraftBackend` (`make_cache`)."""
    return backend.make_cache(draft_model=draft, sink_size=sink, window_size=window,
                              allow_full_context_layers=allow_full)


def dflash_mlx_tail(draft):
    """The block's mask-token tail, as dflash-mlx's loop stages it: [bs - 1] uint32."""
    import mlx.core as mx

    return mx.full((int(draft.block_size) - 1,), int(draft.mask_token_id), dtype=mx.uint32)


def dflash_mlx_block(backend, target, ops, draft, cache, first, tail, taps):
    """One greedy draft block after the new context rows `taps` (`project_target_hidden` +
    `draft_greedy`, synchronous): the block's tokens. `first`: the anchor, [1] uint32."""
    return backend.draft_greedy(target_model=target, target_ops=ops, draft_model=draft, draft_cache=cache,
                                staged_first=first, draft_context=draft.project_target_hidden(taps),
                                block_len=int(draft.block_size), mask_token_tail=tail, suppress_token_mask=None,
                                async_launch=False)


@contextlib.contextmanager
def dflash_mlx_hooks(target, ops):
    """dflash-mlx's speculative hooks on the target for the duration (`install_speculative_hooks`,
    what its own loop runs with), then undone: they replace `__call__` of mlx-lm's attention
    classes for the whole process, so every later target of that class (another side's, ours)
    would run through them."""
    text = ops.text_model(target)
    classes = {type(m) for layer in text.layers
               for m in (getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None)) if m is not None}
    saved = {cls: dict(vars(cls)) for cls in classes}
    ops.install_speculative_hooks(target)
    try:
        yield
    finally:
        for cls, before in saved.items():
            for name in set(vars(cls)) - set(before):
                delattr(cls, name)
            for name, value in before.items():
                if vars(cls).get(name) is not value:
                    setattr(cls, name, value)
        if hasattr(text, _DFLASH_MLX_INSTALLED):
            delattr(text, _DFLASH_MLX_INSTALLED)


_DFLASH_MLX_INSTALLED = "_dflash_speculative_hooks_installed"  # install_speculative_hooks' once-flag on the model


def dflash_mlx_generate(target, ops, draft, prompt: list[int], max_new_tokens: int):
    """dflash-mlx's own loop, `stream_dflash_generate`, with `EagerDraftBackend`, verify_mode
    "dflash" (fixed blocks), cycle events on and no stop token: its events, as it yields them."""
    from dflash_mlx.diagnostics import DiagnosticsConfig, TraceConfig
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.context import build_offline_runtime_config, build_runtime_context

    context = build_runtime_context(build_offline_runtime_config(verify_mode="dflash"),
                                    DiagnosticsConfig(trace=TraceConfig(cycle_events=True)))
    return stream_dflash_generate(target_model=target, target_ops=ops, draft_model=draft,
                                  draft_backend=dflash_mlx_backend(), prompt_tokens_override=list(prompt),
                                  max_new_tokens=max_new_tokens, stop_token_ids=[], runtime_context=context)


def dflash_mlx_event_types():
    """(token event, cycle event) classes of dflash-mlx's loop."""
    from dflash_mlx.engine.events import CycleCompleteEvent, TokenEvent

    return TokenEvent, CycleCompleteEvent


# ---- dspark-mlx ---------------------------------------------------------------------------------

def dspark_mlx_draft(drafter_dir: str | Path):
    """dspark-mlx's drafter and its config from a checkpoint directory (`load_draft`)."""
    import dspark_mlx

    return dspark_mlx.load_draft(str(drafter_dir))


def dspark_mlx_first(drafter, taps, anchor):
    """A fresh context of `taps` (`reset` + `extend_context`), then `draft(anchor)`: (ids, logits,
    confidence), as dspark-mlx's loop drafts after its prefill."""
    drafter.reset()
    return dspark_mlx_next(drafter, taps, anchor)


def dspark_mlx_next(drafter, rows, anchor):
    """The committed `rows` into the context (`extend_context`), then `draft(anchor)`."""
    drafter.extend_context(rows)
    return drafter.draft(anchor)


def dspark_mlx_generate(target, drafter, layer_ids: list[int], prompt: list[int], max_new_tokens: int):
    """dspark-mlx's own loop, `generate_eager` (T=0, threshold 0), on its mlx-lm host
    (`hosts.MlxLmHostAdapter`): its events, as it yields them."""
    from dspark_mlx import generate_eager
    from dspark_mlx.hosts import MlxLmHostAdapter

    return generate_eager(MlxLmHostAdapter(target, layer_ids), drafter, list(prompt), max_new_tokens)


def dspark_mlx_event_types():
    """(token event, summary event) classes of dspark-mlx's loop."""
    from dspark_mlx import SummaryEvent, TokenEvent

    return TokenEvent, SummaryEvent


# ---- DFlash forced-commit rounds (mlx-vlm, mlx-dspark) ------------------------------------------

def dflash_rounds(req, target, ids: list[int], layers: list, draft, make_cache) -> dict:
    """dflash/modules' forced-commit rounds for a drafter that drafts a block from new context
    rows: `draft(anchor, taps, cache)` -> (tokens [1, B-1], final-normed hidden of rows 1..B-1,
    their logits), `make_cache()` its fresh context caches (mlx-lm caches: a full layer's
    `KVCache` state is returned as ctx_*). The target is spec-parity's mlx-lm one (spec_parity.port.targets),
    prefilled as the case's `prefill` says; `layers` are recorded in round 0 (`layer.*`) and, fed
    the reference's, once more on fresh caches (`own.*`)."""
    import mlx.core as mx
    import numpy as np

    from spec_parity.checks import layer_feeds
    from spec_parity.oracles.layers import as_numpy, mlx_recorded
    from spec_parity.port import serve, targets

    def prefilled():
        p, caches, feats = req.prompt, targets.make_caches(target), []
        for part in [p[:, :-1], p[:, -1:]] if req.options["prefill"] == "split" else [p]:
            t = targets.forward(target, mx.array(part.astype(np.int32)), caches=caches)
            feats.append(mx.concatenate([t.hidden[i + 1] for i in ids], axis=-1))
        return caches, make_cache(), mx.concatenate(feats, axis=1), int(mx.argmax(t.logits[0, -1]).item())

    recorded = {}
    caches, draft_cache, taps, anchor = prefilled()
    out, anchors = {"taps.0": taps[0]}, [anchor]
    for r, a in enumerate(req.options["accepts"]):
        with mlx_recorded(layers, recorded) if r == 0 else contextlib.nullcontext():
            tokens, hidden, logits = draft(anchor, taps, draft_cache)
        tokens = tokens.astype(mx.int32)
        out[f"hidden.{r}"], out[f"tokens.{r}"], out[f"logits.{r}"] = hidden[0], tokens[0], logits[0]
        t = targets.forward(target, mx.concatenate([mx.array([[anchor]], dtype=mx.int32), tokens], axis=1),
                            caches=caches)
        a = min(a, tokens.shape[1])
        anchor = int(mx.argmax(t.logits[0, a]).item())
        anchors.append(anchor)
        serve.trim_caches(caches, tokens.shape[1] - a)
        taps = mx.concatenate([t.hidden[i + 1] for i in ids], axis=-1)[:, : a + 1]
        out[f"taps.{r + 1}"] = taps[0]
    for i, c in enumerate(draft_cache):
        if type(c).__name__ == "KVCache" and c.keys is not None:
            out[f"ctx_k.{i}"], out[f"ctx_v.{i}"] = c.keys[0, :, : c.offset], c.values[0, :, : c.offset]
    out["anchors"] = mx.array(anchors, dtype=mx.int32)
    feed = layer_feeds(req.inputs)
    if feed:        # fresh caches, round 0 again, each layer fed the reference's previous layer
        _, own_cache, own_taps, first = prefilled()
        with mlx_recorded(layers, recorded, "own", feed):
            draft(first, own_taps, own_cache)
    return {**{k: np.array(v) for k, v in out.items()}, **as_numpy(recorded)}

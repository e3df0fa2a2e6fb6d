"""The third-party MLX ports, dflash-mlx 0.1.8 and dspark-mlx 0.1.0, driven in one place: their
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

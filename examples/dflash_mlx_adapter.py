"""dflash-mlx 0.1.8 (PyPI, bstnxbt) behind spec-parity's protocols dflash/modules and dflash/loop.

An example of checking a third-party port through the plug-in seam, never part of spec-parity:

    pip install --no-deps --target /tmp/peers dflash-mlx==0.1.8
    PYTHONPATH=$PWD:$PWD/examples:/tmp/peers python -m spec_parity.cli run --module dflash \\
        --port dflash=dflash_mlx_adapter:make_port --source golden

Everything goes through dflash-mlx's public objects: `DFlashDraftModel` (loaded by its
`runtime.loading.load_draft_bundle`), its `TargetOps` for the target (`resolve_target_ops`,
`forward_with_hidden_capture`, `verify_block`, `restore_after_acceptance`,
`extract_context_feature`, `logits_from_hidden`), `EagerDraftBackend` (`make_cache`,
`draft_greedy`) and its caches' `fetch()`. The target is loaded with mlx-lm's `load_model`
(spec-parity's checkpoints carry no tokenizer, which dflash-mlx's `load_target_bundle` wants).
The calls the bench makes too are written once, in spec_parity/third_party.py.

Module cases drive dflash-mlx's own calls in the forced accept schedule (`accepts`), one round
as its decode loop does one: draft_greedy on the committed context, verify [anchor + drafts],
roll the target back to the forced length, commit that many verify rows as the next context.
The prompt goes through the target as the case's `prefill` says (z-lab MLX splits off the last
token, torch runs it whole): that is the harness's schedule of target calls, not a convention
of the drafter. One small wrap: `draft_greedy` returns only the tokens, so the draft model's
`forward_projected_context` is wrapped on the instance to record the block hidden it returns;
the logits are that hidden through `target_ops.logits_from_hidden`, as draft_greedy computes them.

What the case asks and dflash-mlx does not do is left as dflash-mlx does it, for the verdict
to show: the drafter config's `is_causal`, `input_embedding_scale` and `output_multiplier` are
never read, top level or nested (DFlashDraftModelArgs has no such fields; option `scales`),
the block embedding is always the target's scaled one (option `embed`), and the sliding window
is dflash-mlx's own (option `window`): every context row is kept and masked by position. Stored
context K/V (`ctx_*`) are its caches' rows, with their positions (`position_indices()`,
`ctx_pos.*`), so the harness compares them as attended. Each draft layer's output in round 0 is
recorded from outside (`draft.layers` wrapped, spec_parity.oracles.layers.mlx_recorded, as for the
references: `layer.*`), and, fed the reference's, once more from fresh caches (`own.*`): the
first divergent layer.

Loop cases run `runtime.stream_dflash_generate` (its own loop) on the prompt ids at T=0 with
verify_mode "dflash" (fixed blocks; the default "adaptive" shortens blocks on wall-clock
timing, so its schedule is not reproducible) and cycle events on (`DiagnosticsConfig.trace`),
which give per round the block length, acceptance and commit count. dflash-mlx also drafts by
prompt lookup ("copyspec", always on) where the context repeats; such rounds are counted as
dflash-mlx reports them. Its stop token arrives as a TokenEvent; the protocol's stream is content,
so a trailing EOS is dropped (the schedule keeps it, as dflash-mlx counts it). Proposals and draft
logits are not exposed by its loop. The L3 extension cases (DSpark heads on the DFlash drafter)
have no counterpart in dflash-mlx: the adapter declines them (`ports.Declined`), and they read
DECLINED.
"""

from __future__ import annotations

import contextlib

import numpy as np

from spec_parity import ports, third_party


def make_port() -> ports.Port:
    import dflash_mlx

    return ports.Port("dflash-mlx", dflash_mlx.__version__, {"dflash": run},
                      (__file__, ports.package_dir("dflash_mlx")))


def run(req) -> dict:
    if req.kind == "extension":
        raise ports.Declined("dflash-mlx 0.1.8 has no DSpark-on-DFlash extension (Markov and confidence "
                             "heads on the DFlash drafter)")
    return _loop(req) if req.kind == "loop" else _modules(req)


def _load(req):
    """Target (mlx-lm model + dflash-mlx TargetOps, hooks installed as load_target_bundle does)
    and the drafter bound to it, both at the request's dtype (a checkpoint stored in bf16 or fp16
    runs at the case's float32, as the reference does)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    target, _ = load_model(req.target, lazy=False)
    target.set_dtype(getattr(mx, req.dtype))
    ops = third_party.dflash_mlx_target_ops(target)
    ops.install_speculative_hooks(target)
    draft = third_party.dflash_mlx_draft(req.drafter)
    draft.set_dtype(getattr(mx, req.dtype))
    third_party.dflash_mlx_bind(draft, target, ops)
    return target, ops, draft


def _modules(req) -> dict:
    import mlx.core as mx

    from spec_parity.checks import layer_feeds
    from spec_parity.oracles.layers import as_numpy, mlx_recorded

    target, ops, draft = _load(req)
    o = req.options
    bs, ids, capture = int(draft.block_size), list(draft.target_layer_ids), {i + 1 for i in draft.target_layer_ids}

    hidden = []
    forward = draft.forward_projected_context

    def recording(**kw):
        h = forward(**kw)
        hidden.append(h)
        return h
    draft.forward_projected_context = recording

    backend, tail, recorded = third_party.dflash_mlx_backend(), third_party.dflash_mlx_tail(draft), {}
    cache, draft_cache, taps, anchor = _prefilled(req, target, ops, draft, backend)
    out, anchors, start = {"taps.0": taps[0]}, [anchor], req.prompt.shape[1]
    for r, a in enumerate(o["accepts"]):
        with mlx_recorded(draft.layers, recorded) if r == 0 else contextlib.nullcontext():
            tokens = third_party.dflash_mlx_block(backend, target, ops, draft, draft_cache,
                                                  mx.array([anchor], dtype=mx.uint32), tail, taps)
        h = hidden[-1]
        out[f"hidden.{r}"], out[f"tokens.{r}"] = h[0, 1:], tokens.astype(mx.int32)
        out[f"logits.{r}"] = ops.logits_from_hidden(target, h[:, 1:, :])[0]
        ops.arm_rollback(cache, prefix_len=start)
        verify, captured = ops.verify_block(target_model=target, verify_ids=mx.concatenate(
            [mx.array([anchor], dtype=mx.uint32), tokens])[None], target_cache=cache, capture_layer_ids=capture)
        a = min(a, bs - 1)
        anchor = int(mx.argmax(verify[0, a]).item())
        anchors.append(anchor)
        start += a + 1
        ops.restore_after_acceptance(cache, target_len=start, acceptance_length=a, drafted_tokens=bs - 1)
        taps = ops.extract_context_feature(captured, ids)[:, : a + 1, :]
        out[f"taps.{r + 1}"] = taps[0]
    # The last commit enters the caches at the next draft, as in the reference: not in ctx_*.
    for i, c in enumerate(draft_cache):
        k, v = c.fetch()
        out[f"ctx_k.{i}"], out[f"ctx_v.{i}"], out[f"ctx_pos.{i}"] = k[0], v[0], c.position_indices()
    out["anchors"] = mx.array(anchors, dtype=mx.int32)
    feed = layer_feeds(req.inputs)
    if feed:        # fresh caches, round 0 again, each layer fed the reference's previous layer
        _, own_cache, own_taps, first = _prefilled(req, target, ops, draft, backend)
        with mlx_recorded(draft.layers, recorded, "own", feed):
            third_party.dflash_mlx_block(backend, target, ops, draft, own_cache, mx.array([first], dtype=mx.uint32),
                                         tail, own_taps)
    return {**{k: np.array(v) for k, v in out.items()}, **as_numpy(recorded)}


def _prefilled(req, target, ops, draft, backend):
    """Fresh target and draft caches, the prompt through the target as the case's `prefill` says:
    (target cache, draft cache, the prompt's taps [1, P, T], the first anchor)."""
    import mlx.core as mx
    from dflash_mlx.engine.config import resolve_draft_window
    from dflash_mlx.runtime.config import runtime_config_from_defaults

    p, o, ids = req.prompt, req.options, list(draft.target_layer_ids)
    allow_full = bool(ops.capabilities_for(target).supports_full_context_draft_layers)
    n_ctx = p.shape[1] + len(o["accepts"]) * int(draft.block_size)
    sink, window = resolve_draft_window(runtime_config_from_defaults(), draft, context_len=n_ctx,
                                        allow_full_attention_context=allow_full)
    draft_cache = third_party.dflash_mlx_cache(backend, draft, sink, window, allow_full)
    cache = ops.make_cache(target, enable_speculative_linear_cache=True)
    feats = []
    for part in [p[:, :-1], p[:, -1:]] if o["prefill"] == "split" else [p]:
        logits, captured = ops.forward_with_hidden_capture(target, input_ids=mx.array(part), cache=cache,
                                                           capture_layer_ids={i + 1 for i in ids})
        feats.append(ops.extract_context_feature(captured, ids))
    return cache, draft_cache, mx.concatenate(feats, axis=1), int(mx.argmax(logits[0, -1]).item())


def _loop(req) -> dict:
    from dflash_mlx.diagnostics import DiagnosticsConfig, TraceConfig
    from dflash_mlx.engine.events import CycleCompleteEvent, TokenEvent
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.context import build_offline_runtime_config, build_runtime_context

    target, ops, draft = _load(req)
    o = req.options
    context = build_runtime_context(build_offline_runtime_config(verify_mode="dflash"),
                                    DiagnosticsConfig(trace=TraceConfig(cycle_events=True)))
    tokens, rounds = [], []
    for e in stream_dflash_generate(target_model=target, target_ops=ops, draft_model=draft,
                                    draft_backend=third_party.dflash_mlx_backend(), prompt_tokens_override=req.prompt[0].tolist(),
                                    max_new_tokens=o["max_tokens"], stop_token_ids=list(o["eos"]),
                                    runtime_context=context):
        if isinstance(e, TokenEvent):
            tokens.append(e.token_id)
        elif isinstance(e, CycleCompleteEvent):
            rounds.append((e.block_len - 1, e.acceptance_len, e.commit_count))
    if tokens and tokens[-1] in o["eos"]:       # dflash-mlx emits its stop token; EOS is not content
        tokens.pop()
    r = np.array(rounds, np.int32).reshape(-1, 3)
    return {"stream.tokens": np.array(tokens, np.int32), "stream.drafted": r[:, 0], "stream.accepted": r[:, 1],
            "stream.emitted": r[:, 2], "tau": np.array([r[:, 2].mean() if len(r) else 0.0])}

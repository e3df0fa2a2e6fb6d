"""mlx-dspark 0.20.3 (PyPI, ARahim3) behind spec-parity's protocols dspark/modules and dflash/modules.

An example of checking a third-party port through the plug-in seam, never part of spec-parity:

    pip install --no-deps --target /tmp/vlm-peers mlx-dspark==0.20.3 mlx-vlm==0.7.10 \\
        requests urllib3 charset-normalizer
    PYTHONPATH=$PWD:$PWD/examples:/tmp/vlm-peers python -m spec_parity.cli run --module dspark \\
        --port dspark=mlx_dspark_adapter:make_port --source golden

mlx-dspark imports mlx-vlm at load (mlx_dspark/load.py -> mlx_vlm.utils), hence both.

The drafter is mlx-dspark's own (`load.load_drafter`, DeepSpec's checkpoint layout, loaded with
`quantize=False`: its default quantizes the drafter to 4 bits). The target is mlx-lm's model
behind mlx-dspark's `target.Target`, whose `run(ids, cache, tap)` gives the logits and the
tapped hiddens (the outputs of layers `target_layer_ids`, DeepSpec's `hidden_states[l + 1]`).

Module cases run the round its `speculative_generate` runs after its prefill, with its own calls:
`update_context(taps, 0, caches)`, then `embed([anchor, mask...])`, `backbone(noise, P, caches)`,
`head_slice`, `compute_logits` (base logits), `sample_block` (greedy tokens through the Markov
head) and `confidence_logits`. Internals, and how they are read:
- Markov-corrected logits: `sample_block` does not return them; each row is recomputed as its
  loop computes it, the base row plus `markov_head.step_bias(previous token)`;
- per-layer context K/V: its `CtxCache` objects (`k`, `v`, in position order);
- each drafter layer's output: `drafter.layers` wrapped from outside (spec_parity.oracles.layers).
- the proposal length at a threshold: mlx-dspark has no function for it; its loop
  (generate.py, "optional confidence-based truncation") keeps a draft while the cumulative
  product of sigmoid(confidence) stays at or above t, and proposes at least one token. The
  adapter states that rule once (`_kept`) so the verdict shows what it does.

dflash/modules runs the forced-commit rounds (spec_parity/third_party.py `dflash_rounds`, shared
with the mlx-vlm adapter) with its DFlash drafter (`load.load_dflash`, z-lab's checkpoint layout,
unquantized), bound to the case's mlx-lm target as `dflash_generate` binds it; the block hidden
is recorded by wrapping the instance's `forward_hidden`.

Gemma-4 targets (DSpark): mlx-dspark taps them through mlx-vlm's multimodal Gemma-4 (target.py `run`:
`language_model(..., capture_layer_ids=tap)`); the cases' targets are mlx-lm `gemma4_text`
checkpoints, which mlx-vlm loads as its `gemma4_text` model, whose output then carries no
`hidden_states` (Target.run fails in `mx.concatenate(None)`), and its mlx-lm path replicates the
layer loop without Gemma-4's embedding scale. The adapter declines those cases, DFlash's too.

dflash/loop runs its `generate.dflash_generate` at T=0 on the prompt ids, its `Target` over the
case's mlx-lm checkpoint; given `prompt_ids`, what the loop reads of a tokenizer is the stop ids
and the decoded text (`_StopIds` gives the case's eos, and no text). The rounds come from its
`on_round` callback; the drafts are not exposed. dspark loop and sampled kinds are declined (the
same stand-in would serve `speculative_generate`; not written).
"""

from __future__ import annotations

import json

import numpy as np

from spec_parity import ports, third_party


def make_port() -> ports.Port:
    import mlx_dspark

    return ports.Port("mlx-dspark", mlx_dspark.__version__, {"dspark": run, "dflash": run_dflash},
                      (__file__, ports.package_dir("mlx_dspark")))


def run(req) -> dict:
    if req.kind != "modules":
        raise ports.Declined(f"dspark/{req.kind} is not driven by this adapter (mlx-dspark's "
                             "generate.speculative_generate would run behind _StopIds, as dflash/loop does)")
    _no_gemma(req)
    return _modules(req)


def _no_gemma(req) -> None:
    """Decline a Gemma-4 target: mlx-dspark's Target cannot run the case's mlx-lm checkpoint."""
    family = json.loads((req.target / "config.json").read_text()).get("model_type", "")
    if family.startswith("gemma"):
        raise ports.Declined("mlx-dspark taps a Gemma-4 target only through mlx-vlm's multimodal "
                             "gemma4 model (target.Target.run: `capture_layer_ids`); the case's target is an "
                             f"mlx-lm {family} checkpoint, whose mlx-vlm model returns no hidden states for it "
                             "and whose mlx-lm layers its Target does not run (target.py:162)")


def run_dflash(req) -> dict:
    if req.kind == "loop":
        _no_gemma(req)
        return _dflash_loop(req)
    if req.kind != "modules":
        raise ports.Declined(f"mlx-dspark 0.20.3 has no dflash/{req.kind}: no DSpark-on-DFlash extension")
    return _dflash_modules(req)


class _StopIds:
    """What mlx-dspark's loops read of a tokenizer when given `prompt_ids`: the stop ids
    (generate.eos_token_ids) and the text of the result (decoded, not checked)."""

    def __init__(self, eos):
        self.eos_token_ids = [int(t) for t in eos]

    def decode(self, ids) -> str:
        return ""


def _dflash_loop(req) -> dict:
    """mlx-dspark's DFlash loop, `generate.dflash_generate`, at T=0 on the prompt ids, its target
    its `Target` over the case's mlx-lm checkpoint; the rounds from its `on_round` callback."""
    import mlx.core as mx
    from mlx_dspark.generate import dflash_generate
    from mlx_dspark.load import load_dflash
    from mlx_dspark.target import Target
    from mlx_lm.utils import load_model

    dtype = getattr(mx, req.dtype)
    drafter, _ = load_dflash(str(req.drafter), quantize=False)
    drafter.set_dtype(dtype)
    model = load_model(req.target, lazy=False)[0]
    model.set_dtype(dtype)
    o, rounds = req.options, []
    result = dflash_generate(Target(model, None), _StopIds(o["eos"]), drafter, prompt_ids=req.prompt[0].tolist(),
                             max_new_tokens=o["max_tokens"], temperature=0.0, apply_chat_template=False,
                             on_round=lambda **r: rounds.append((r["drafted"], r["accepted"], r["committed"])))
    tokens = [t for t in result.token_ids if t not in o["eos"]]
    r = np.array(rounds, np.int32).reshape(-1, 3)
    return {"stream.tokens": np.array(tokens, np.int32), "stream.drafted": r[:, 0], "stream.accepted": r[:, 1],
            "stream.emitted": r[:, 2], "tau": np.array([r[:, 2].mean() if len(r) else 0.0])}


def _dflash_modules(req) -> dict:
    """Forced-commit rounds with mlx-dspark's DFlash drafter (`load.load_dflash`, unquantized;
    `bind` to the target; a block is `drafter(block, taps, cache, logits_start=1)` and its argmax,
    as `dflash_generate` drafts; the hidden recorded by calling its `forward_hidden`)."""
    import mlx.core as mx
    from mlx_dspark.load import load_dflash

    from spec_parity.port import targets

    dtype = getattr(mx, req.dtype)
    target = targets.load(req.target, dtype)
    drafter, config = load_dflash(str(req.drafter), quantize=False)
    drafter.set_dtype(dtype)
    drafter.bind(target.model)
    mask = [int(config.mask_token_id)] * (int(config.block_size) - 1)
    seen = []
    inner = drafter.forward_hidden

    def recording(*args, **kw):
        h = inner(*args, **kw)
        seen.append(h)
        return h
    drafter.forward_hidden = recording

    def block(anchor, taps, cache):
        logits = drafter(mx.array([[anchor] + mask]), taps, cache, logits_start=1)
        return mx.argmax(logits, axis=-1), seen[-1], logits
    return third_party.dflash_rounds(req, target, list(config.target_layer_ids), drafter.layers, block,
                                     drafter.make_cache)


def _load(req):
    """mlx-dspark's drafter (unquantized) and its Target over the case's mlx-lm target, both at
    the request's dtype."""
    import mlx.core as mx
    from mlx_dspark.load import load_drafter
    from mlx_dspark.target import Target
    from mlx_lm.utils import load_model

    dtype = getattr(mx, req.dtype)
    drafter, config = load_drafter(str(req.drafter), quantize=False)
    drafter.set_dtype(dtype)
    model = load_model(req.target, lazy=False)[0]
    model.set_dtype(dtype)
    return drafter, config, Target(model, None)


def _kept(conf: np.ndarray, t: float) -> int:
    """Tokens mlx-dspark's loop keeps at threshold t: while the running product of the
    confidences stays >= t; at least one."""
    surv, keep = 1.0, 0
    for i, c in enumerate(conf.tolist()):
        surv *= c
        if surv < t:
            break
        keep = i + 1
    return max(keep, 1)


def _modules(req) -> dict:
    import mlx.core as mx

    from spec_parity.checks import layer_feeds
    from spec_parity.oracles.layers import as_numpy

    drafter, config, target = _load(req)
    tap = list(config.target_layer_ids)
    p = req.prompt.shape[1]
    logits, taps = target.run(mx.array(req.prompt.astype(np.int32)), target.make_cache(), tap)
    anchor = int(mx.argmax(logits[0, -1]).item())
    recorded: dict = {}
    caches, hidden = _draft(drafter, taps, anchor, p, recorded)
    head = drafter.head_slice(hidden, drafter.max_draft)
    base = drafter.compute_logits(head)[0]
    tokens = drafter.sample_block(base, first_prev_token=anchor)
    prev = mx.concatenate([mx.array([anchor], dtype=tokens.dtype), tokens[:-1]])
    corrected = base if drafter.markov_head is None else mx.stack(
        [base[i] + drafter.markov_head.step_bias(prev[i:i + 1])[0] for i in range(base.shape[0])])
    out = {"anchor": np.array([anchor], np.int32), "taps": taps[0], "context": drafter.fuse_target(taps)[0],
           "block_hidden": head[0], "base_logits": base, "logits": corrected, "tokens": tokens.astype(mx.int32)}
    conf = drafter.confidence_logits(head[0], prev)
    if conf is not None:
        out["confidence"] = conf.reshape(-1)
    for i, c in enumerate(caches):
        out[f"context_k.{i}"], out[f"context_v.{i}"] = c.k[0], c.v[0]
    probs = np.array(mx.sigmoid(conf.reshape(-1).astype(mx.float32))) if conf is not None else None
    toks = np.array(tokens).astype(np.int32)
    for t in req.options["thresholds"]:
        n = len(toks) if probs is None else _kept(probs, t)
        out[f"prefix@{t}"], out[f"proposal@{t}"] = np.array([n], np.int32), toks[:n]
    feed = layer_feeds(req.inputs)
    if feed:        # round 0 again on fresh caches, each layer fed the reference's previous layer
        _draft(drafter, taps, anchor, p, recorded, feed)
    return {**{k: np.array(v) for k, v in out.items()}, **as_numpy(recorded)}


def _draft(drafter, taps, anchor: int, p: int, recorded: dict, feed: dict | None = None):
    """Fresh context caches filled with the prompt's taps, then one block from `anchor`:
    (caches, the block's final hidden [1, B, H]); layer outputs into `recorded`."""
    import mlx.core as mx

    from spec_parity.oracles.layers import mlx_recorded

    caches = drafter.make_ctx_cache()
    drafter.update_context(taps, 0, caches)
    noise = drafter.embed(mx.array([[anchor] + [drafter.mask_token_id] * (drafter.block_size - 1)]))
    with mlx_recorded(drafter.layers, recorded, "own" if feed else "layer", feed):
        hidden = drafter.backbone(noise, p, caches)
    return caches, hidden

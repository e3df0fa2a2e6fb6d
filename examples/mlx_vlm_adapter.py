"""mlx-vlm 0.7.10 (PyPI, Blaizzy) behind dflash/modules and /loop, dspark/modules, assistant/step.

An example of checking a third-party port through the plug-in seam, never part of spec-parity:

    pip install --no-deps --target /tmp/vlm-peers mlx-vlm==0.7.10 requests urllib3 charset-normalizer
    PYTHONPATH=$PWD:$PWD/examples:/tmp/vlm-peers python -m spec_parity.cli run --module dflash \\
        --port dflash=mlx_vlm_adapter:make_port --source golden

mlx-vlm declares transformers>=5.14 and its media stack; its drafters need neither: importing
them imports mlx_vlm.utils, which needs only transformers' AutoProcessor and ProcessorMixin (in
5.12.1) and requests (hence the three small packages), so it goes in `--no-deps` beside
transformers 5.12.1.

Every drafter is loaded as mlx-vlm loads one: `mlx_vlm.utils.load_model` on the case's
checkpoint, which picks the drafter package and its config class from config.json
(`utils.get_model_type`: a `dflash_config` makes a Qwen3 checkpoint `qwen3_dflash`). The target
is the case's mlx-lm checkpoint (mlx-vlm's own models are multimodal; its DFlash drafter binds to
any model with `embed_tokens`, `DFlashDraftModel.bind`), run by spec-parity's mlx-lm target
(spec_parity.port.targets, which the targets pair holds to transformers); the taps are its layer outputs
`hidden[l + 1]`, as mlx-vlm's targets capture them for its round loop (the output of layer l:
models/gemma4/language.py, `capture_layer_ids`).

dflash/modules runs the forced-commit rounds with mlx-vlm's calls: `draft_block` (its greedy
block, the sampler an argmax) on the new context rows and its own caches (`make_cache`); the
block hidden is recorded by wrapping the drafter instance's `_hidden` (its output unchanged) and
the logits are that hidden through its `_logits`, as draft_block computes them. Context K/V are
its `KVCache` states (a sliding layer's `RotatingKVCache` is a ring whose row positions it does
not give: not returned). Each drafter layer's output in round 0 is recorded from outside
(spec_parity.oracles.layers), and once more fed the reference's layers (`own.*`).

dspark/modules (`gemma4_dspark`, and any checkpoint the loader routes to a DSpark drafter) runs
the first block after the prompt (`_dspark_modules`). A DSpark drafter's `bind` checks the target
for mlx-vlm's speculative cache rollback, which only its round loop uses; the adapter turns that
check off on the instance (module cases roll nothing back).

assistant/step (`gemma4_assistant`, `gemma4_unified_assistant`) runs `gamma` greedy steps of its
`draft_block` from the case's anchor and donor K/V (`set_shared_kv`); each step's hidden and
logits are recorded by wrapping the instance's `_forward_hidden`.

dflash/loop runs mlx-vlm's DFlash round loop, `speculative.utils.run_speculative_rounds` (what
`generate_step` calls after its prefill), at T=0. mlx-vlm's own loader makes `qwen3` and
`gemma4_text` models of the cases' targets, which ignore `capture_layer_ids` and return no hidden
states (generate_step then fails at speculative/utils.py:409), so the target is spec-parity's
behind `_Capturing`, called as the loop calls a target; the rest (draft, verify, walk, the cache
transaction that rolls the target's caches back, the adaptive block size) is mlx-vlm's. The
rounds are recorded from the drafter instance's `draft_block_greedy` calls and its `accept_lens`.

Declined, with the reason: dspark cases whose checkpoint mlx-vlm's loader routes to a non-drafter
model (DeepSpec's flat Qwen3DSparkModel config has no `dflash_config`, so get_model_type gives
`qwen3`: mlx-vlm reads Qwen3 DSpark only in its dflash_config layout); loops on a target with
sliding layers (Gemma-4), whose mlx-lm caches mlx-vlm's cache transaction cannot roll back; the
DSpark and MTP loops (and their sampled cases), which need from the target what the adapter would
have to write (a speculative cache rollback; hidden states and shared K/V from its forward); the
extension cases (mlx-vlm has no DSpark-on-DFlash extension).
"""

from __future__ import annotations

import json

import numpy as np

from spec_parity import ports, third_party

_ROLLBACK = ("its cache transaction (speculative/cache_state.py:166) rolls back only mlx-vlm's own "
             "RotatingKVCache, and the target's sliding layers are mlx-lm's")


def make_port() -> ports.Port:
    import mlx_vlm

    return ports.Port("mlx-vlm", mlx_vlm.__version__,
                      {"dflash": run_dflash, "dspark": run_dspark, "assistant": run_assistant},
                      (__file__, ports.package_dir("mlx_vlm")))


def run_dflash(req) -> dict:
    if req.kind == "loop":
        return _dflash_loop(req)
    if req.kind != "modules":
        raise ports.Declined(f"mlx-vlm 0.7.10 has no dflash/{req.kind}: no DSpark-on-DFlash extension")
    return _dflash_modules(req)


def run_dspark(req) -> dict:
    model_type = _routed(req.drafter)
    if model_type not in ("dspark", "gemma4_dspark", "qwen3_dspark"):
        raise ports.Declined("mlx-vlm 0.7.10's loader routes the drafter's config.json to "
                             f"model_type {model_type!r} (utils.get_model_type), not a DSpark drafter: it reads "
                             "Qwen3 DSpark only with a dflash_config")
    if req.kind != "modules":
        raise ports.Declined(f"mlx-vlm 0.7.10's DSpark loop ({req.kind}) needs a target with its speculative "
                             "cache rollback: drafters/compatibility.py:47 refuses the gemma4_text model its "
                             "loader makes of the case's target, and this adapter writes none")
    return _dspark_modules(req)


def _dspark_modules(req) -> dict:
    """The first DSpark block after the prompt with mlx-vlm's calls: `draft_block` (argmax
    sampler, through its Markov head) on fresh caches, the block hidden recorded from `_hidden`,
    base logits through `_logits`, each Markov-corrected row by `markov_head.apply_step_logits`,
    the confidence by `confidence`. mlx-vlm's loop never truncates a block on confidence, so every
    threshold's proposal is the whole block."""
    import mlx.core as mx

    from spec_parity.checks import layer_feeds
    from spec_parity.oracles.layers import as_numpy, mlx_recorded
    from spec_parity.port import targets

    target, draft = _load(req)
    ids, bs = list(draft.config.target_layer_ids), int(draft.config.block_size)
    t = targets.forward(target, mx.array(req.prompt.astype(np.int32)))
    taps = mx.concatenate([t.hidden[i + 1] for i in ids], axis=-1)
    anchor = int(mx.argmax(t.logits[0, -1]).item())
    hidden = []
    inner = draft._hidden

    def recording(*args):
        h = inner(*args)
        hidden.append(h)
        return h
    draft._hidden = recording

    recorded = {}
    cache = draft.make_cache()
    with mlx_recorded(draft.layers, recorded):
        tokens = _block(draft, anchor, taps, cache, bs).astype(mx.int32)
    h = hidden[-1] if draft.config.sample_from_anchor else hidden[-1][:, 1:]
    base = draft._logits(h)
    prev = mx.concatenate([mx.array([[anchor]], dtype=mx.int32), tokens[:, :-1]], axis=1)
    logits = mx.stack([draft.markov_head.apply_step_logits(base[:, i], prev[:, i]) for i in range(base.shape[1])],
                      axis=1)
    out = {"anchor": mx.array([anchor], dtype=mx.int32), "taps": taps[0],
           "context": draft.hidden_norm(draft.fc(taps))[0], "block_hidden": h[0], "base_logits": base[0],
           "logits": logits[0], "tokens": tokens[0]}
    conf = draft.confidence(h, mx.array([anchor], dtype=mx.int32), tokens)
    if conf is not None:
        out["confidence"] = conf.reshape(-1)
    for i, c in enumerate(cache):
        if type(c).__name__ == "KVCache" and c.keys is not None:
            out[f"context_k.{i}"], out[f"context_v.{i}"] = (x[0] for x in c.state)
    for th in req.options["thresholds"]:
        out[f"prefix@{th}"], out[f"proposal@{th}"] = mx.array([tokens.shape[1]], dtype=mx.int32), tokens[0]
    feed = layer_feeds(req.inputs)
    if feed:        # fresh caches, the block again, each layer fed the reference's previous layer
        with mlx_recorded(draft.layers, recorded, "own", feed):
            _block(draft, anchor, taps, draft.make_cache(), bs)
    return {**{k: np.array(v) for k, v in out.items()}, **as_numpy(recorded)}


def run_assistant(req) -> dict:
    if req.kind != "step":
        raise ports.Declined(f"mlx-vlm 0.7.10's MTP loop ({req.kind}) reads the target forward's hidden states "
                             "and shared K/V (speculative/utils.py:307-308), which the gemma4_text model its "
                             "loader makes of the case's target does not return; behind spec-parity's target "
                             + _ROLLBACK)
    return _assistant_steps(req)


def _assistant_steps(req) -> dict:
    """`gamma` greedy steps of mlx-vlm's `draft_block` from the case's anchor (token, hidden,
    position, donor K/V: the case's `in.*`, or spec-parity's target where the case feeds none),
    as its MTP loop hands them over (`set_shared_kv`)."""
    import mlx.core as mx

    from spec_parity.checks import layer_feeds
    from spec_parity.drafters.assistant.adapter import step_inputs
    from spec_parity.oracles.layers import as_numpy, mlx_recorded
    from spec_parity.port import targets

    dtype = getattr(mx, req.dtype)
    target = targets.load(req.target, dtype)
    draft = _drafter(req.drafter, dtype).bind(target.model)
    inputs = {k: v for k, v in req.inputs.items() if k.startswith("in.")} or step_inputs(
        req.target, req.prompt, req.dtype, target)
    donors = {f"{n}_attention": tuple(mx.array(inputs[f"in.donor.{n}.{x}"]).astype(dtype) for x in "kv")
              for n in ("sliding", "full")}
    position = int(inputs["in.position"][0])
    seen = []
    inner = draft._forward_hidden

    def recording(*args, **kw):
        out = inner(*args, **kw)
        seen.append(out)
        return out
    draft._forward_hidden = recording

    def steps(n):
        draft.set_shared_kv(donors, kv_offset=position, position=position)
        return draft.draft_block(int(inputs["in.anchor.token"][0]), mx.array(inputs["in.anchor.hidden"]).astype(dtype),
                                 None, n + 1, lambda logits: mx.argmax(logits[:, -1], axis=-1)[:, None])

    recorded = {}
    with mlx_recorded(draft.model.layers, recorded):
        tokens = steps(req.options["gamma"])
    out = {}
    for i, (nxt, h) in enumerate(seen):
        out[f"step{i}.logits"] = draft._lm_head_fn(h)[0, -1]
        out[f"step{i}.next_hidden"], out[f"step{i}.token"] = nxt, tokens[0, i: i + 1].astype(mx.int32)
    feed = layer_feeds(req.inputs)
    if feed:
        with mlx_recorded(draft.model.layers, recorded, "own", feed):
            steps(1)
    return {**{k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v) for k, v in out.items()},
            **as_numpy(recorded)}


def _drafter(path, dtype):
    """mlx-vlm's drafter for a checkpoint directory (`utils.load_model`), at `dtype`."""
    from mlx_vlm.utils import load_model

    draft = load_model(path)
    draft.set_dtype(dtype)
    return draft


def _routed(drafter) -> str:
    """The drafter package mlx-vlm's loader picks for a checkpoint directory."""
    from mlx_vlm.utils import get_model_type

    return get_model_type(json.loads((drafter / "config.json").read_text()))


def _load(req):
    """The case's target (spec-parity's mlx-lm target) and mlx-vlm's drafter bound to it, both
    at the request's dtype."""
    import mlx.core as mx

    from spec_parity.port import targets

    dtype = getattr(mx, req.dtype)
    target = targets.load(req.target, dtype)
    draft = _drafter(req.drafter, dtype)
    draft.validate_target_compatibility = lambda target_model: None
    draft.bind(target.model)
    return target, draft


def _dflash_modules(req) -> dict:
    target, draft = _load(req)
    bs = int(draft.config.block_size)
    hidden = []
    inner = draft._hidden

    def recording(*args):
        h = inner(*args)
        hidden.append(h)
        return h
    draft._hidden = recording

    def block(anchor, taps, cache):
        tokens = _block(draft, anchor, taps, cache, bs)
        return tokens, hidden[-1][:, 1:], draft._logits(hidden[-1][:, 1:])
    return third_party.dflash_rounds(req, target, list(draft.config.target_layer_ids), draft.layers, block,
                                     draft.make_cache)


class _Capturing:
    """The case's target as mlx-vlm's round loop calls one: `model(ids, cache=, capture_layer_ids=)`
    giving the logits and the captured layers' outputs (mlx-vlm's own Qwen3 and text Gemma-4,
    which load these checkpoints, capture nothing: models/qwen3/language.py)."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        """The rest is the mlx-lm model's: the drafter's `bind` reads its embedding and lm_head."""
        return getattr(self.target.model, name)

    def __call__(self, inputs, cache=None, capture_layer_ids=(), **_):
        from mlx_vlm.models.base import LanguageModelOutput

        from spec_parity.port import targets

        t = targets.forward(self.target, inputs, caches=cache)
        return LanguageModelOutput(logits=t.logits, hidden_states=[t.hidden[i + 1] for i in capture_layer_ids])


def _dflash_loop(req) -> dict:
    """mlx-vlm's DFlash round loop (`run_speculative_rounds`, as generate_step calls it after its
    prefill) at T=0 on the case's target, behind _Capturing; its rounds are recorded from the
    drafter's `draft_block_greedy` calls and the `accept_lens` the loop appends."""
    import mlx.core as mx
    from mlx_vlm.speculative.utils import run_speculative_rounds

    from spec_parity.port import targets

    target, draft = _load(req)
    caches = targets.make_caches(target)
    if any(type(c).__name__ != "KVCache" for c in caches):
        raise ports.Declined("mlx-vlm 0.7.10's DFlash loop behind spec-parity's target: " + _ROLLBACK)
    proposals, logits = [], []
    inner, hidden_of = draft.draft_block_greedy, draft._hidden

    def recording_hidden(*args):
        h = hidden_of(*args)
        logits.append(draft._logits(h[:, 1:])[0])
        return h

    def recording(*args, **kw):
        out = inner(*args, **kw)
        proposals.append(out[0])
        return out
    draft._hidden, draft.draft_block_greedy = recording_hidden, recording
    model = _Capturing(target)
    ids = mx.array(req.prompt.astype(np.int32))
    first = model(ids, cache=caches, capture_layer_ids=list(draft.config.target_layer_ids))
    token = mx.argmax(first.logits[:, -1], axis=-1)
    o, tokens, per_round = req.options, [], []
    for tok, _ in run_speculative_rounds(model, draft, caches, ids, token, first.logits[:, -1], first,
                                         draft_kind="dflash", max_tokens=o["max_tokens"],
                                         sampler=lambda x: mx.argmax(x, axis=-1), sampler_is_greedy=True):
        per_round.append(len(proposals))     # committed by the round drafted last (0: the prefill)
        if int(tok) in o["eos"]:
            break
        tokens.append(int(tok))
    emitted = np.bincount(per_round, minlength=len(proposals) + 1)[1:].astype(np.int32)
    accepted = np.array(draft.accept_lens, np.int32)[: len(proposals)]
    drafted = np.array([len(p) for p in proposals], np.int32)
    return {"stream.tokens": np.array(tokens, np.int32), "stream.drafted": drafted,
            "stream.accepted": accepted, "stream.emitted": emitted[: len(proposals)],
            "stream.proposals": np.concatenate([np.array(p) for p in proposals]).astype(np.int32)
            if proposals else np.zeros(0, np.int32),
            "stream.draft_logits": np.concatenate([np.array(x) for x in logits]).astype(np.float32)
            if logits else np.zeros((0, 0), np.float32),
            "tau": np.array([emitted.mean() if len(emitted) else 0.0])}


def _block(draft, anchor: int, taps, cache, bs: int):
    """mlx-vlm's greedy draft block after the context rows `taps`: [1, bs - 1] tokens."""
    import mlx.core as mx

    return draft.draft_block(anchor, taps, cache, bs, lambda logits: mx.argmax(logits, axis=-1))

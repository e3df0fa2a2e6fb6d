"""Our assistant port (port/assistant.py) behind protocols assistant/step and assistant/loop."""

from __future__ import annotations

import numpy as np

from spec_parity.oracles.layers import as_numpy, mlx_recorded

from ...adapters import loop
from ...checks import layer_feeds
from ...protocol import Request
from ...sampled import first_round_end, match_statistics

CONVENTIONS = {
    "optiq": {"positions": "optiq", "window": "optiq"},
    "hfpos": {"positions": "hf", "window": "optiq"},    # every draft step at position P
    "hfwin": {"positions": "optiq", "window": "hf"},    # transformers' own sliding mask (newest W+1)
}


def _np(a) -> np.ndarray:
    import mlx.core as mx

    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


def step_inputs(target_dir, prompt: np.ndarray, dtype: str, target=None) -> dict[str, np.ndarray]:
    """The anchor of the first draft round, from our target (mlx-lm): what the drafter steps of
    both sides start from (transformers is fed these)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from spec_parity.port import targets

    target = target or targets.load(target_dir, getattr(mx, dtype))
    caches = make_prompt_cache(target.model)
    h = target.model.model(mx.array(prompt), cache=caches)[:, -1:, :]
    token = int(mx.argmax(targets.head(target, h)[0, 0]).item())
    out = {"in.anchor.token": np.array([token], np.int32), "in.anchor.hidden": _np(h),
           "in.position": np.array([caches[0].offset], np.int32),
           "in.embed_table": _np(targets.embed_scaled(target, mx.arange(target.config["vocab_size"])[None])[0])}
    for name, (k, v) in targets.donor_view(target, caches).items():
        out[f"in.donor.{name.split('_')[0]}.k"], out[f"in.donor.{name.split('_')[0]}.v"] = _np(k), _np(v)
    return out


def run(req: Request) -> dict:
    return {"loop": run_loop, "sampled": run_sampled}.get(req.kind, run_steps)(req)


def run_steps(req: Request) -> dict:
    import mlx.core as mx

    from spec_parity.port import assistant, targets

    dt = getattr(mx, req.dtype)
    target = targets.load(req.target, dt)
    drafter = assistant.load(req.drafter, dt, head_rows=req.options["head_rows"])
    assistant.check_pairing(drafter, target)
    inputs = {k: v for k, v in req.inputs.items() if k.startswith("in.")} or step_inputs(req.target, req.prompt,
                                                                                        req.dtype, target)
    donors = {f"{n}_attention": (mx.array(inputs[f"in.donor.{n}.k"]).astype(dt), mx.array(inputs[f"in.donor.{n}.v"]).astype(dt))
              for n in ("sliding", "full")}
    conv = CONVENTIONS[req.options["convention"]]

    def chain(n):
        return assistant.draft_chain(drafter, target, donors, int(inputs["in.anchor.token"][0]),
                                     mx.array(inputs["in.anchor.hidden"]).astype(dt), int(inputs["in.position"][0]),
                                     n, positions=conv["positions"], window=conv["window"])

    recorded = {}
    with mlx_recorded(drafter.model.layers, recorded):      # step 0's layers (`layer.i`)
        steps = chain(req.options["gamma"])
    feed = layer_feeds(req.inputs)
    if feed:                    # the own-error run: each layer of step 0 on the reference's input
        with mlx_recorded(drafter.model.layers, recorded, "own", feed):
            chain(1)
    k, v = assistant.sliding_view(*donors["sliding_attention"], drafter.args.sliding_window, conv["window"])
    out = {"anchor.token": inputs["in.anchor.token"], "anchor.hidden": inputs["in.anchor.hidden"],
           "donor.sliding_attention.k": _np(k), "donor.sliding_attention.v": _np(v),
           "donor.full_attention.k": _np(donors["full_attention"][0]),
           "donor.full_attention.v": _np(donors["full_attention"][1])}
    for i, s in enumerate(steps):
        out[f"step{i}.logits"], out[f"step{i}.next_hidden"] = _np(s.logits), _np(s.next_hidden)
        out[f"step{i}.token"] = np.array([s.token], np.int32)
    return {**out, **as_numpy(recorded)}


def run_loop(req: Request) -> dict:
    import mlx.core as mx

    from spec_parity.port import targets
    from spec_parity.port.sources.assistant import AssistantProvider

    dt = getattr(mx, req.dtype)
    return loop.run(targets.load(req.target, dt), req.prompt, req.options["max_tokens"],
                    AssistantProvider(req.drafter, dtype=dt), req.options["gamma"], {req.options["eos"]})


def run_sampled(req: Request) -> dict:
    """Our loop (token match) at the temperature, once per seed: spec_parity.sampled's statistics."""
    import mlx.core as mx

    from spec_parity.port import targets
    from spec_parity.port.sources.assistant import AssistantProvider

    o, dt = req.options, getattr(mx, req.dtype)
    target = targets.load(req.target, dt)
    requests = loop.seeded_requests(target, req.prompt, o["max_tokens"], AssistantProvider(req.drafter, dtype=dt),
                                    o["gamma"], o)
    return {**match_statistics([[(d, a) for d, a, _ in t] for _, t in requests], o["gamma"], o["max_tokens"]),
            **first_round_end([loop.first_round(*r) for r in requests], target.config["vocab_size"])}

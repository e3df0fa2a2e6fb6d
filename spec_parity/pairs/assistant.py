"""Pair: the Gemma-4 assistant drafter (port/assistant.py) against optiq (MLX, L1) and
transformers (torch, L2), on tiny Gemma-4 targets.

Step cases: prefill the target on a prompt that crosses the sliding window, then gamma chained
draft steps from the anchor (the target's greedy next token and the hidden that predicted it).
optiq computes everything itself from the same mlx-lm target, so the port must match it
bit-exactly, donor view included. transformers gets the port's inputs (donor K/V, anchor hidden,
the scaled embedding table) with position and window set explicitly, so only the drafter is
compared.
"""

from __future__ import annotations

import numpy as np

from .. import controls, shared
from ..case import Case
from ..compare import Result, check_tensor, stream_metrics, trace_metrics

NAME = "assistant"
ORACLE = "optiq"

TARGETS = {
    "gemma4": {},
    "gemma4-keqv": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "gemma4-ple-kvshared": {"hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2,
                            "use_double_wide_mlp": True},
}
HEADS = {
    "centroid": {},
    "tied": {"use_ordered_embeddings": False},
    "unified": {"model_type": "gemma4_unified_assistant", "use_ordered_embeddings": False},
}
STEP_PAIRS = [("gemma4", "centroid"), ("gemma4", "tied"), ("gemma4", "unified"),
              ("gemma4-keqv", "centroid"), ("gemma4-ple-kvshared", "tied")]
TIER = {"optiq": "L1", "transformers": "L2"}

# Planted bugs the step comparisons must catch (each against both oracles' goldens), from
# spec_parity/controls/assistant.py.
STEP_CONTROLS = ("scale", "position", "window", "donor", "ordering")


def drafter_overrides(target: str, head: str) -> dict:
    ov = dict(HEADS[head])
    t = TARGETS[target]
    if t.get("attention_k_eq_v"):
        ov["text_config"] = {"attention_k_eq_v": True,
                             "num_global_key_value_heads": t["num_global_key_value_heads"]}
    return ov


# Where the references differ (REFERENCES.md "Reference deltas"), the port offers transformers'
# convention as an option; these cases hold it to transformers under that convention.
CONVENTIONS = {
    "optiq": {"positions": "optiq", "window": "optiq"},
    "hfpos": {"positions": "hf", "window": "optiq"},    # every draft step at position P
    "hfwin": {"positions": "optiq", "window": "hf"},    # transformers' own sliding mask (newest W+1)
}


def step_case(target: str, head: str, oracle: str, control: str | None = None, convention: str = "optiq",
              dtype: str = "float32") -> Case:
    name = (f"step-{target}-{head}-{oracle}" + ("" if convention == "optiq" else f"-{convention}")
            + ("" if dtype == "float32" else "-bf16"))
    params = {"prompt_len": 20, "gamma": 4, "drafter": ["gemma4-assistant", 0, drafter_overrides(target, head)],
              "convention": convention}
    ctl = None
    if control:
        ctl = controls.case_control(NAME, control, name)
        name = f"{name}-control-{control}"
    return Case(NAME, name, TIER[oracle], "gemma4-target", 0, TARGETS[target], params, dtype=dtype,
                control=ctl, oracle=oracle)


# Planted bugs in the serve loop (spec_parity/controls/serve.py: trim, eos, bonus), caught by the
# loop comparisons against optiq's spec_generate.

def loop_case(head: str, gamma: int, drafter: str = "random", control: str | None = None, eos: int = -1) -> Case:
    """eos -1: no stop token, every case runs max_tokens; eos 1 (the config's): ends at EOS."""
    name = f"loop-{drafter}-{head}-g{gamma}" + ("-eos" if eos >= 0 else "")
    kind = "gemma4-assistant" if drafter == "random" else "gemma4-assistant-agreeing"
    target = "gemma4-target" if drafter == "random" else "gemma4-target-agreeing"
    params = {"loop": True, "prompt_len": 12, "gamma": gamma, "max_tokens": 40, "eos": eos,
              "drafter": [kind, 0, drafter_overrides("gemma4", head)]}
    ctl = None
    if control:
        ctl = controls.case_control("serve", control, name)
        name = f"{name}-control-{control}"
    return Case(NAME, name, "L2", target, 0, {}, params, control=ctl, oracle="optiq")


def cases() -> list[Case]:
    out = [step_case(t, h, o) for o in ("optiq", "transformers") for t, h in STEP_PAIRS]
    out += [step_case("gemma4", "centroid", "transformers", convention=c) for c in ("hfpos", "hfwin")]
    out += [step_case("gemma4", h, "optiq", dtype="bfloat16") for h in ("centroid", "tied")]
    for o in ("optiq", "transformers"):
        for bug in STEP_CONTROLS:
            out.append(step_case("gemma4", "centroid", o, bug))
    out += [loop_case(h, g) for h in ("centroid", "tied") for g in (1, 2, 3, 4)]
    out += [loop_case(h, g, "agreeing") for h in ("centroid", "tied", "unified") for g in (1, 2, 3, 4)]
    out.append(loop_case("centroid", 2, eos=EOS))
    out.append(loop_case("centroid", 2, control="trim"))
    out.append(loop_case("centroid", 3, "agreeing", control="trim"))
    out.append(loop_case("centroid", 2, control="eos", eos=EOS))
    out.append(loop_case("centroid", 3, "agreeing", control="bonus"))
    return out


def oracle_status(oracle: str = ORACLE) -> str | None:
    from oracles.assistant import status

    return status(oracle)


def prompt(case: Case) -> np.ndarray:
    return np.random.default_rng([case.seed, 11]).integers(3, 128, (1, case.params["prompt_len"])).astype(np.int32)


def _np(a) -> np.ndarray:
    import mlx.core as mx

    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def step_inputs(case: Case, target=None) -> dict[str, np.ndarray]:
    """The anchor of the first draft round, from the port's target (mlx-lm): what the drafter
    steps of both sides start from."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from port import targets

    target = target or targets.load(case.checkpoint_dir(), _dtype(case))
    caches = make_prompt_cache(target.model)
    h = target.model.model(mx.array(prompt(case)), cache=caches)[:, -1:, :]
    token = int(mx.argmax(targets.head(target, h)[0, 0]).item())
    out = {"in.anchor.token": np.array([token], np.int32), "in.anchor.hidden": _np(h),
           "in.position": np.array([caches[0].offset], np.int32),
           "in.embed_table": _np(targets.embed_scaled(target, mx.arange(target.config["vocab_size"])[None])[0])}
    for name, (k, v) in targets.donor_view(target, caches).items():
        out[f"in.donor.{name.split('_')[0]}.k"], out[f"in.donor.{name.split('_')[0]}.v"] = _np(k), _np(v)
    return out


def _dtype(case: Case):
    import mlx.core as mx

    return getattr(mx, case.dtype)


def run_oracle(case: Case):
    from oracles import assistant as oracle

    name = case.oracle
    if case.params.get("loop"):
        arrays = oracle.optiq_spec_generate(case.checkpoint_dir(), case.drafter_dir(), prompt(case),
                                            case.params["gamma"], case.params["max_tokens"], case.params["eos"])
    elif name == "optiq":
        arrays = oracle.optiq_draft_steps(case.checkpoint_dir(), case.drafter_dir(), prompt(case), case.params["gamma"],
                                          case.dtype)
    else:
        inputs = step_inputs(case)
        conv = CONVENTIONS[case.params["convention"]]
        keep = None if conv["window"] == "hf" else _window(case) - 1
        arrays = {**inputs, **oracle.hf_draft_steps(case.drafter_dir(), inputs, case.params["gamma"], keep,
                                                    conv["positions"])}
    return arrays, {"reference": {"name": name, "versions": oracle.versions(name)}}


def _window(case: Case) -> int:
    import json

    return json.loads((case.checkpoint_dir() / "config.json").read_text())["sliding_window"]


EOS = 1


def run_port(case: Case, ref: dict) -> dict:
    if case.params.get("loop"):
        return run_port_loop(case)
    import mlx.core as mx

    from port import assistant, targets

    target = targets.load(case.checkpoint_dir(), _dtype(case))
    drafter = assistant.load(case.drafter_dir(), _dtype(case))
    assistant.check_pairing(drafter, target)
    inputs = step_inputs(case, target) if case.oracle == "optiq" else {k: v for k, v in ref.items() if k.startswith("in.")}
    dt = _dtype(case)
    donors = {f"{n}_attention": (mx.array(inputs[f"in.donor.{n}.k"]).astype(dt), mx.array(inputs[f"in.donor.{n}.v"]).astype(dt))
              for n in ("sliding", "full")}
    conv = CONVENTIONS[case.params["convention"]]
    steps = assistant.draft_chain(drafter, target, donors, int(inputs["in.anchor.token"][0]),
                                  mx.array(inputs["in.anchor.hidden"]).astype(dt), int(inputs["in.position"][0]),
                                  case.params["gamma"], positions=conv["positions"], window=conv["window"])
    k, v = assistant.sliding_view(*donors["sliding_attention"], drafter.args.sliding_window, conv["window"])
    out = {"anchor.token": inputs["in.anchor.token"], "anchor.hidden": inputs["in.anchor.hidden"],
           "donor.sliding_attention.k": _np(k), "donor.sliding_attention.v": _np(v),
           "donor.full_attention.k": _np(donors["full_attention"][0]),
           "donor.full_attention.v": _np(donors["full_attention"][1])}
    for i, s in enumerate(steps):
        out[f"step{i}.logits"], out[f"step{i}.next_hidden"] = _np(s.logits), _np(s.next_hidden)
        out[f"step{i}.token"] = np.array([s.token], np.int32)
    return out


def run_port_loop(case: Case) -> dict:
    """Our serve loop with the AssistantSource, and the target's plain greedy decoding to hold it
    to: tokens, and the logits row of every committed token along the shared path."""
    import mlx.core as mx

    from port import assistant, serve, targets

    target = targets.load(case.checkpoint_dir())
    p, n = prompt(case), case.params["max_tokens"]
    eos = {case.params["eos"]}
    tokens, stats = serve.generate(target, p[0].tolist(), n, assistant.AssistantProvider(case.drafter_dir()),
                                   gamma=case.params["gamma"], eos=eos, record=True)
    plain, plain_logits = shared.greedy(case.checkpoint_dir(), p, n, eos)
    return {"stream.tokens": np.array(tokens, np.int32), "stream.trace": np.array(stats.trace, np.int32).reshape(-1, 3),
            "stream.stats": np.array([stats.drafted, stats.accepted, stats.target_calls, stats.emitted], np.int32),
            "stream.logits": np.array(mx.stack(stats.logits)), "greedy.tokens": np.array(plain, np.int32),
            "greedy.logits": np.array(plain_logits)}


def compare_loop(case: Case, port: dict, ref: dict, result: Result) -> None:
    """L2 for the loop: our content stream and per-round trace equal optiq's (optiq yields the EOS
    token as an event; EOS is not content for us), and our stream equals the target's plain greedy
    stream (lossless) with the logits along the path within budget."""
    eos = case.params["eos"]
    ref_tokens = ref["stream.tokens"].tolist()
    if ref_tokens and ref_tokens[-1] == eos:
        ref_tokens = ref_tokens[:-1]
    s = stream_metrics(port["stream.tokens"], ref_tokens, port["greedy.logits"], case.dtype)
    result.metrics["stream_vs_optiq"] = s
    if not s["ok"]:
        result.fail(f"token stream differs from optiq's at {s['first_divergence']} "
                    f"(port {s.get('port_token')} vs optiq {s.get('ref_token')}; lengths {s['length']})")
    t = trace_metrics(port["stream.trace"], ref["stream.trace"])
    result.metrics["trace_vs_optiq"] = t
    if not t["ok"]:
        result.fail(f"accept trace differs from optiq's at round {t['first_differing_round']} "
                    f"(port {t.get('port_round')} vs optiq {t.get('ref_round')})")
    if not np.array_equal(port["stream.stats"][:3], ref["stream.stats"][:3]):
        result.fail(f"drafted/accepted/target calls {port['stream.stats'][:3].tolist()} != optiq's "
                    f"{ref['stream.stats'][:3].tolist()}")
    plain = port["greedy.tokens"].tolist()
    plain = plain[:-1] if plain and plain[-1] == eos else plain
    g = stream_metrics(port["stream.tokens"], plain, port["greedy.logits"], case.dtype)
    result.metrics["lossless_vs_greedy"] = g
    if not g["ok"]:
        result.fail(f"not lossless: diverges from the target's greedy stream at {g['first_divergence']}")
    n = min(len(port["stream.logits"]), len(port["greedy.logits"]))
    check_tensor(result, "path_logits_vs_greedy", port["stream.logits"][:n], port["greedy.logits"][:n], NAME,
                 "path_logits", case.dtype)
    acc = port["stream.stats"]
    result.metrics["acceptance"] = {"drafted": int(acc[0]), "accepted": int(acc[1]),
                                    "rate": float(acc[1] / acc[0]) if acc[0] else 0.0, "ok": True}


def compare(case: Case, port: dict, ref: dict, result: Result) -> None:
    if case.params.get("loop"):
        return compare_loop(case, port, ref, result)
    dt, gamma = case.dtype, case.params["gamma"]
    if case.oracle == "optiq":
        for key in ("anchor.token", "anchor.hidden", "donor.sliding_attention.k", "donor.sliding_attention.v",
                    "donor.full_attention.k", "donor.full_attention.v"):
            check_tensor(result, key, port[key], ref[key], NAME, key, dt)
    for i in range(gamma):
        check_tensor(result, f"step{i}.next_hidden", port[f"step{i}.next_hidden"], ref[f"step{i}.next_hidden"],
                     NAME, "next_hidden", dt)
        p, r = port[f"step{i}.logits"], ref[f"step{i}.logits"]
        if result.tier == "L1":
            check_tensor(result, f"step{i}.logits", p, r, NAME, "logits", dt)
        else:
            _compare_l2_logits(result, f"step{i}.logits", p, r, dt)
    s = stream_metrics([int(port[f"step{i}.token"][0]) for i in range(gamma)],
                       [int(ref[f"step{i}.token"][0]) for i in range(gamma)],
                       np.stack([ref[f"step{i}.logits"] for i in range(gamma)]), dt)
    result.metrics["draft_tokens"] = s
    if not s["ok"]:
        result.fail(f"draft token {s['first_divergence']} differs (port {s.get('port_token')} vs ref {s.get('ref_token')})")


def _compare_l2_logits(result: Result, name: str, port: np.ndarray, ref: np.ndarray, dt: str) -> None:
    """Centroid heads fill non-candidates differently (optiq/port -1e30, transformers min-1): compare
    the candidate sets, then the logits on them."""
    port_cand = port > -1e29
    if port_cand.all():
        check_tensor(result, name, port, ref, NAME, "logits", dt)
        return
    ref_cand = ref > ref.min()
    if not np.array_equal(port_cand, ref_cand):
        result.metrics[name + ".candidates"] = {"ok": False, "port_only": np.flatnonzero(port_cand & ~ref_cand)[:8].tolist(),
                                                "ref_only": np.flatnonzero(ref_cand & ~port_cand)[:8].tolist()}
        result.fail(f"{name}: centroid candidate sets differ")
        return
    check_tensor(result, name, port[port_cand], ref[port_cand], NAME, "logits", dt)


def quantities(port: dict, ref: dict) -> dict[str, float]:
    if "greedy.logits" in port:
        n = min(len(port["stream.logits"]), len(port["greedy.logits"]))
        return {"path_logits": float(np.abs(port["stream.logits"][:n] - port["greedy.logits"][:n]).max())}
    out = {"logits": 0.0, "next_hidden": 0.0}
    for k in ref:
        if k.endswith(".next_hidden"):
            out["next_hidden"] = max(out["next_hidden"], float(np.abs(port[k] - ref[k]).max()))
        if k.endswith(".logits"):
            m = (port[k] > -1e29) & (ref[k] > ref[k].min()) if (port[k] <= -1e29).any() else np.ones_like(port[k], bool)
            out["logits"] = max(out["logits"], float(np.abs(port[k][m] - ref[k][m]).max()))
    return out

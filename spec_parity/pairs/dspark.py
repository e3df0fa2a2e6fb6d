"""Pair: DeepSeek's DSpark drafter (port/dspark.py) against DeepSpec (oracles/dspark.py), at L2.

Module cases compare the first draft round after prefill module by module: taps, projected
context, per-layer context K/V, block hidden, base logits, Markov-corrected logits, draft tokens,
confidence logits, the prefix length at several thresholds (0 tokens included) and the proposal.
Loop cases run our serve loop with the DeepspecSource against DeepSpec's own T=0 decoding loop:
token stream, per-round proposal sizes, accepted lengths and draft tokens, and tau; and hold our
stream to the target's plain greedy one. DeepSpec's DFlash variant (Markov rank 0, no confidence
head) runs through the same port by config.
"""

from __future__ import annotations

import numpy as np

from .. import controls, shared
from ..case import Case
from ..compare import Result, check_tensor, stream_metrics, trace_metrics

NAME = "dspark"
ORACLE = "deepspec"
KEQV = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
THRESHOLDS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]

VARIANTS = {
    "gemma4": {},
    "gemma4-keqv": {"target_overrides": KEQV},
    "qwen3": {"target_kind": "qwen3-target"},
    "gemma4-gated": {"markov_head_type": "gated"},
    "gemma4-rnn": {"markov_head_type": "rnn"},
    "qwen3-embtap": {"target_kind": "qwen3-target", "target_layer_ids": [-1, 2, 4]},
    "gemma4-dflash": {"markov_rank": 0, "confidence_head_alpha": 0.0},
    "qwen3-dflash": {"target_kind": "qwen3-target", "markov_rank": 0, "confidence_head_alpha": 0.0},
}
LOOPS = [("gemma4", 0.0), ("gemma4", 0.5), ("gemma4-keqv", 0.5), ("qwen3", 0.0), ("qwen3", 0.3),
         ("gemma4-rnn", 0.0), ("gemma4-dflash", 0.0), ("qwen3-dflash", 0.0)]
# Agreeing pairs (spec_parity/agreeing.py): the Markov head carries the target's successor on a
# share `agree_frac` of the vocabulary; 1.0 accepts every draft (tau = block size + 1 = 8).
AGREEING = [("gemma4", 1.0, 0.0), ("gemma4", 0.8, 0.0), ("gemma4-keqv", 0.8, 0.5), ("qwen3", 0.8, 0.0),
            ("qwen3", 0.6, 0.5), ("gemma4-rnn", 0.8, 0.0)]

# Planted bugs (spec_parity/controls/dspark.py) and the case that must catch each.
CONTROLS = {
    "markov_before_softcap": "mod-gemma4",
    "cumulative_truncation": "mod-qwen3",
    "rope_on_v": "mod-gemma4",
    "no_embed_scale": "mod-gemma4",
    "anchor_not_predicting": "mod-gemma4",
    "tap_index": "mod-gemma4",
    "rejected_rows": "loop-gemma4-t0.0",
}


def _case(name: str, variant: str, params: dict, agree_frac: float | None = None) -> Case:
    ov = dict(VARIANTS[variant])
    target = ov.get("target_kind", "gemma4-target")
    kind = "dspark-drafter"
    if agree_frac is not None:
        target = target.replace("-target", "-target-agreeing")
        ov.update(target_kind=target, agree_frac=agree_frac)
        kind = "dspark-drafter-agreeing"
    return Case(NAME, name, "L2", target, 0, ov.get("target_overrides", {}), {**params, "drafter": [kind, 0, ov]})


def cases() -> list[Case]:
    out = [_case(f"mod-{v}", v, {"prompt_len": 12, "thresholds": THRESHOLDS}) for v in VARIANTS]
    loop = {"loop": True, "prompt_len": 12, "max_new_tokens": 24}
    out += [_case(f"loop-{v}-t{t}", v, {**loop, "threshold": t}) for v, t in LOOPS]
    out += [_case(f"loop-agree{f}-{v}-t{t}", v, {**loop, "max_new_tokens": 32, "threshold": t}, f) for v, f, t in AGREEING]
    by_name = {c.name: c for c in out}
    for bug, base in CONTROLS.items():
        b = by_name[base]
        out.append(Case(NAME, f"{base}-control-{bug}", b.tier, b.kind, b.seed, b.overrides, dict(b.params),
                        control=controls.case_control(NAME, bug, base)))
    return out


def oracle_status(oracle: str = ORACLE) -> str | None:
    from oracles.dspark import status

    return status()


def prompt(case: Case) -> np.ndarray:
    return np.random.default_rng([case.seed, 13]).integers(3, 128, (1, case.params["prompt_len"])).astype(np.int32)


def run_oracle(case: Case):
    from oracles import dspark as oracle

    if case.params.get("loop"):
        arrays = oracle.loop(case.checkpoint_dir(), case.drafter_dir(), prompt(case), case.params["max_new_tokens"],
                             case.params["threshold"])
    else:
        arrays = oracle.modules(case.checkpoint_dir(), case.drafter_dir(), prompt(case), case.params["thresholds"])
    return arrays, {"reference": {"name": ORACLE, "versions": oracle.versions()}}


def run_port(case: Case, ref: dict) -> dict:
    import mlx.core as mx

    from port import dspark, serve, targets

    target = targets.load(case.checkpoint_dir())
    p = prompt(case)
    if case.params.get("loop"):
        provider = dspark.DeepspecProvider(case.drafter_dir(), case.params["threshold"])
        n = case.params["max_new_tokens"]
        # DeepSpec runs a round while fewer than n + 1 tokens are committed, then trims to n.
        tokens, stats = serve.generate(target, p[0].tolist(), n + 1, provider, gamma=provider.trained_gamma,
                                       eos=set(), record=True)
        plain, plain_logits = shared.greedy(case.checkpoint_dir(), p, n + 1, set())
        return {"stream.tokens": np.array(tokens[:n], np.int32),
                "stream.accepted": np.array([k for _, k, _ in stats.trace], np.int32),
                "stream.proposed": np.array([d for d, _, _ in stats.trace], np.int32),
                "stream.proposals": np.array([t for q in stats.proposals for t in q], np.int32),
                "stream.logits": np.array(mx.stack(stats.logits)), "greedy.tokens": np.array(plain, np.int32),
                "greedy.logits": np.array(plain_logits), "tau": np.array([stats.tau])}
    m = dspark.load(case.drafter_dir())
    dspark.check_pairing(m, target)
    trace = targets.forward(target, mx.array(p))
    taps = m.taps(trace.hidden)
    c = m.project(taps)
    kv = m.context_kv(c, 0)
    anchor = int(mx.argmax(trace.logits[0, -1]).item())
    block = m.draft_block(anchor, kv, p.shape[1])
    out = {"anchor": np.array([anchor], np.int32), "taps": taps[0], "context": c[0], "block_hidden": block.hidden,
           "base_logits": block.base_logits, "logits": block.logits, "tokens": np.array(block.tokens, np.int32)}
    for i, (k, v) in enumerate(kv):
        out[f"context_k.{i}"], out[f"context_v.{i}"] = k[0], v[0]
    if block.confidence is not None:
        out["confidence"] = block.confidence
    for t in case.params["thresholds"]:
        n = m.prefix_length(block.confidence, t)
        out[f"prefix@{t}"] = np.array([n], np.int32)
        out[f"proposal@{t}"] = np.array(block.tokens[:n], np.int32)
    return {k: np.array(v) for k, v in out.items()}


MODULE_TENSORS = [("taps", "taps"), ("context", "context"), ("block_hidden", "block_hidden"),
                  ("base_logits", "logits"), ("logits", "logits"), ("confidence", "confidence")]


def compare(case: Case, port: dict, ref: dict, result: Result) -> None:
    if case.params.get("loop"):
        return compare_loop(case, port, ref, result)
    dt = case.dtype
    if int(port["anchor"][0]) != int(ref["anchor"][0]):
        result.fail(f"anchor token {int(port['anchor'][0])} != DeepSpec's {int(ref['anchor'][0])}")
    for key, quantity in MODULE_TENSORS:
        if key in ref or key in port:
            check_tensor(result, key, port.get(key), ref.get(key), NAME, quantity, dt)
    for key in sorted(k for k in ref if k.startswith("context_")):
        check_tensor(result, key, port[key], ref[key], NAME, "context_kv", dt)
    s = stream_metrics(port["tokens"], ref["tokens"], ref["logits"], dt)
    result.metrics["tokens"] = s
    if not s["ok"]:
        result.fail(f"draft token {s['first_divergence']} differs (port {s.get('port_token')} vs DeepSpec {s.get('ref_token')})")
    for t in case.params["thresholds"]:
        p, r = int(port[f"prefix@{t}"][0]), int(ref[f"prefix@{t}"][0])
        same = p == r and port[f"proposal@{t}"].tolist() == ref[f"proposal@{t}"].tolist()
        result.metrics[f"proposal@{t}"] = {"ok": same, "port_len": p, "ref_len": r}
        if not same:
            result.fail(f"proposal at threshold {t}: port keeps {p} tokens {port[f'proposal@{t}'].tolist()}, "
                        f"DeepSpec {r} {ref[f'proposal@{t}'].tolist()}")


def compare_loop(case: Case, port: dict, ref: dict, result: Result) -> None:
    dt = case.dtype
    s = stream_metrics(port["stream.tokens"], ref["stream.tokens"], port["greedy.logits"], dt)
    result.metrics["stream_vs_deepspec"] = s
    if not s["ok"]:
        result.fail(f"token stream differs from DeepSpec's at {s['first_divergence']}")
    rounds = trace_metrics(np.stack([port["stream.proposed"], port["stream.accepted"]], 1),
                           np.stack([ref["stream.proposed"], ref["stream.accepted"]], 1))
    result.metrics["rounds_vs_deepspec"] = rounds
    if not rounds["ok"]:
        result.fail(f"per-round (proposed, accepted) differs from DeepSpec's at round {rounds['first_differing_round']} "
                    f"(port {rounds.get('port_round')} vs DeepSpec {rounds.get('ref_round')})")
    if port["stream.proposals"].tolist() != ref["stream.proposals"].tolist():
        first = next((i for i, (a, b) in enumerate(zip(port["stream.proposals"], ref["stream.proposals"])) if a != b),
                     min(len(port["stream.proposals"]), len(ref["stream.proposals"])))
        result.fail(f"draft tokens differ from DeepSpec's at draft {first}")
    tau_ref = float(np.mean(ref["stream.acceptance_lengths"])) if len(ref["stream.acceptance_lengths"]) else 0.0
    result.metrics["tau"] = {"ok": abs(float(port["tau"][0]) - tau_ref) < 1e-9, "port": float(port["tau"][0]),
                             "deepspec": tau_ref}
    if not result.metrics["tau"]["ok"]:
        result.fail(f"tau {float(port['tau'][0]):.4f} != DeepSpec's {tau_ref:.4f}")
    n = len(port["stream.tokens"])
    g = stream_metrics(port["stream.tokens"], port["greedy.tokens"][:n], port["greedy.logits"], dt)
    result.metrics["lossless_vs_greedy"] = g
    if not g["ok"]:
        result.fail(f"not lossless: diverges from the target's greedy stream at {g['first_divergence']}")
    m = min(len(port["stream.logits"]), len(port["greedy.logits"]))
    check_tensor(result, "path_logits_vs_greedy", port["stream.logits"][:m], port["greedy.logits"][:m], NAME,
                 "path_logits", dt)


def quantities(port: dict, ref: dict) -> dict[str, float]:
    if "greedy.logits" in port:
        m = min(len(port["stream.logits"]), len(port["greedy.logits"]))
        return {"path_logits": float(np.abs(port["stream.logits"][:m] - port["greedy.logits"][:m]).max())}
    out = {}
    for key, quantity in MODULE_TENSORS:
        if key in ref:
            out[quantity] = max(out.get(quantity, 0.0), float(np.abs(port[key] - ref[key]).max()))
    out["context_kv"] = max(float(np.abs(port[k] - ref[k]).max()) for k in ref if k.startswith("context_"))
    return out

"""Pair: target forward. Port = mlx-lm's model classes (port/targets.py); oracle = transformers
(oracles/targets.py). Compared at L2: logits, every hidden state / tap, the final norm, the
Gemma-4 donor K/V, a greedy stream that crosses the sliding window (with logits along the shared
path and a teacher-forced score), and the first divergent layer."""

from __future__ import annotations

import importlib.util

import numpy as np

from .. import controls
from ..case import Case
from ..compare import Result, check_tensor, stream_metrics, teacher_forced
from ..layers import localize

NAME = "targets"
ORACLE = "transformers"

GEMMA4 = {
    "gemma4": {},
    "gemma4-keqv": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "gemma4-ple-kvshared": {"hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2,
                            "use_double_wide_mlp": True},
}
PARAMS = {"prompt_len": 20, "new_tokens": 32}


def cases() -> list[Case]:
    out = [Case(NAME, name, "L2", "gemma4-target", 0, ov, dict(PARAMS)) for name, ov in GEMMA4.items()]
    out.append(Case(NAME, "qwen3", "L2", "qwen3-target", 0, {}, dict(PARAMS)))
    for base, kind, layer in (("gemma4", "gemma4-target", 3), ("qwen3", "qwen3-target", 1)):
        ov = GEMMA4.get(base, {})
        out.append(Case(NAME, f"{base}-control-rope-L{layer}", "L2", kind, 0, ov, dict(PARAMS),
                        control=controls.case_control(NAME, f"rope-L{layer}", base, layer=layer)))
    return out


def oracle_status(oracle: str = ORACLE) -> str | None:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        from oracles.targets import INSTALL

        return f"{', '.join(missing)} not installed: {INSTALL}"
    return None


def prompt(case: Case) -> np.ndarray:
    """Deterministic prompt ids (never the special ids 0-2), longer than the sliding window."""
    rng = np.random.default_rng([case.seed, 7])
    vocab = 128 if not case.path else _vocab(case)
    return rng.integers(3, vocab, (1, case.params["prompt_len"])).astype(np.int32)


def _vocab(case: Case) -> int:
    import json

    cfg = json.loads((case.checkpoint_dir() / "config.json").read_text())
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def run_oracle(case: Case):
    from oracles import targets as oracle

    model = oracle.load(case.checkpoint_dir())
    ids = prompt(case).astype(np.int64)
    arrays = oracle.forward(model, ids)
    arrays.update(oracle.greedy(model, ids, case.params["new_tokens"]))
    provenance = {"reference": {"name": ORACLE, "versions": oracle.versions()}}
    return arrays, provenance


def run_port(case: Case, ref: dict) -> dict:
    import mlx.core as mx

    from port import targets as port

    target = port.load(case.checkpoint_dir())
    ids = prompt(case)
    trace = port.forward(target, mx.array(ids))
    L = target.num_layers
    own = port.forward(target, mx.array(ids), layer_inputs=[mx.array(ref[f"hidden.{i}"])[None] for i in range(L)])
    tokens, step_logits = port.greedy(target, mx.array(ids), case.params["new_tokens"])
    forced = np.concatenate([ids[0], ref["stream.tokens"][:-1]])[None]
    tf_logits = port.forward(target, mx.array(forced)).logits[0, ids.shape[1] - 1:]
    out = {"logits": trace.logits[0], "final": trace.final[0], "stream.logits": step_logits,
           "tf.logits": tf_logits, "stream.tokens": mx.array(tokens, dtype=mx.int32)}
    for i, h in enumerate(trace.hidden):
        out[f"hidden.{i}"] = h[0]
    for i in range(L):
        out[f"own.{i + 1}"] = own.hidden[i + 1][0]
    for name, (k, v) in trace.donors.items():
        out[f"donor.{name}.k"], out[f"donor.{name}.v"] = k[0], v[0]
    return {k: np.array(v) for k, v in out.items()}


def compare(case: Case, port: dict, ref: dict, result: Result) -> None:
    m, dt = NAME, case.dtype
    L = sum(1 for k in ref if k.startswith("hidden.")) - 1
    check_tensor(result, "logits", port["logits"], ref["logits"], m, "logits", dt)
    check_tensor(result, "final", port["final"], ref["final"], m, "final", dt)
    for i in range(L + 1):
        check_tensor(result, f"hidden.{i}", port[f"hidden.{i}"], ref[f"hidden.{i}"], m, "hidden", dt)
    for k in sorted(k for k in ref if k.startswith("donor.")):
        check_tensor(result, k, port.get(k), ref[k], m, "donor", dt)
    layers = localize([port[f"hidden.{i + 1}"] for i in range(L)], [port[f"own.{i + 1}"] for i in range(L)],
                      [ref[f"hidden.{i + 1}"] for i in range(L)], m, dt)
    result.metrics["layers"] = layers
    if layers["first_divergent_layer"] is not None:
        result.fail(f"first divergent layer: {layers['first_divergent_layer']} (its own, teacher-forced error "
                    f"{layers['own_max_abs'][layers['first_divergent_layer']]:.3e} exceeds {layers['budget']})")
    s = stream_metrics(port["stream.tokens"], ref["stream.tokens"], ref["stream.logits"], dt)
    result.metrics["stream"] = s
    if not s["equal"]:
        if s["ok"]:
            result.note(f"greedy stream diverges at {s['first_divergence']}: excused knife-edge (ref margin "
                        f"{s['ref_margin']:.2e} < bound {s['knife_edge_bound']:.2e})")
        else:
            result.fail(f"greedy stream diverges at token {s['first_divergence']} "
                        f"(port {s.get('port_token')} vs ref {s.get('ref_token')}, ref margin {s.get('ref_margin', 0):.3e})")
    shared = s["first_divergence"] if s["first_divergence"] is not None else len(ref["stream.tokens"])
    check_tensor(result, "stream.logits[shared]", port["stream.logits"][:shared], ref["stream.logits"][:shared],
                 m, "stream_logits", dt)
    result.metrics["teacher_forced"] = teacher_forced(port["tf.logits"], ref["stream.logits"], ref["stream.tokens"])


def quantities(port: dict, ref: dict) -> dict[str, float]:
    """Max |Δ| per budget quantity (what `spec-parity measure` aggregates into budgets.py)."""
    def worst(keys, pkey=lambda k: k):
        return max(float(np.max(np.abs(port[pkey(k)].astype(np.float64) - ref[k]))) for k in keys)

    hidden = [k for k in ref if k.startswith("hidden.")]
    out = {"logits": worst(["logits"]), "final": worst(["final"]), "hidden": worst(hidden),
           "hidden_own": worst(hidden[1:], lambda k: k.replace("hidden.", "own."))}
    donors = [k for k in ref if k.startswith("donor.")]
    if donors:
        out["donor"] = worst(donors)
    n = min(len(port["stream.tokens"]), len(ref["stream.tokens"]))
    same = port["stream.tokens"][:n] == ref["stream.tokens"][:n]
    n = n if same.all() else int(np.argmin(same))
    if n:
        out["stream_logits"] = float(np.max(np.abs(port["stream.logits"][:n] - ref["stream.logits"][:n])))
    return out

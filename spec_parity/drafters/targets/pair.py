"""Pair: target forward. Port = mlx-lm's model classes (port/targets.py); oracle = transformers
(oracles/targets.py). Compared at L2: logits, every hidden state / tap, the final norm, the
Gemma-4 donor K/V, a greedy stream that crosses the sliding window (with logits along the shared
path and a teacher-forced score), and the first divergent layer."""

from __future__ import annotations

import importlib.util

import numpy as np

from ... import controls
from ...case import Case
from ...checks import Layers, P, Plan, R, Scored, Tensor, Tokens
from ...pair import Pair
from ...params import TargetForward
from .checkpoints import GEMMA4_VARIANTS

NAME = "targets"
ORACLE = "transformers"

PARAMS = TargetForward(prompt_len=20, new_tokens=32)


PROMPT = (7, None)      # (seed salt, id bound): None = the checkpoint's vocabulary on a real target, else 128


class Targets(Pair):
    NAME, ORACLE, PROMPT = NAME, ORACLE, PROMPT

    def cases(self) -> list[Case]:
        out = [Case(NAME, name, "L2", "gemma4-target", 0, ov, PARAMS) for name, ov in GEMMA4_VARIANTS.items()]
        out.append(Case(NAME, "qwen3", "L2", "qwen3-target", 0, {}, PARAMS))
        for base, kind, layer in (("gemma4", "gemma4-target", 3), ("qwen3", "qwen3-target", 1)):
            ov = GEMMA4_VARIANTS.get(base, {})
            out.append(Case(NAME, f"{base}-control-rope-L{layer}", "L2", kind, 0, ov, PARAMS,
                            control=controls.case_control(NAME, f"rope-L{layer}", base, layer=layer)))
        return out

    def oracle_status(self, oracle: str) -> str | None:
        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            from spec_parity.oracles.targets import INSTALL

            return f"{', '.join(missing)} not installed: {INSTALL}"
        return None

    def run_oracle(self, case: Case):
        from spec_parity.oracles import targets as oracle

        model = oracle.load(case.checkpoint_dir())
        ids = case.prompt(*PROMPT).astype(np.int64)
        arrays = oracle.forward(model, ids)
        arrays.update(oracle.greedy(model, ids, case.params.new_tokens))
        provenance = {"reference": {"name": ORACLE, "versions": oracle.versions()}}
        return arrays, provenance

    def feeds(self, case: Case, ref: dict) -> dict:
        """The reference's input to each layer (the own-error run) and its greedy stream (teacher-forced)."""
        return {k: v for k, v in ref.items() if k.startswith("hidden.") or k == "stream.tokens"}

    def plan(self, case: Case, ref: dict) -> Plan:
        L = sum(1 for k in ref if k.startswith("hidden.")) - 1
        checks = [Tensor("logits", P("logits"), R("logits"), "logits"), Tensor("final", P("final"), R("final"), "final")]
        checks += [Tensor(f"hidden.{i}", P(f"hidden.{i}"), R(f"hidden.{i}"), "hidden") for i in range(L + 1)]
        checks += [Tensor(k, P(k), R(k), "donor") for k in sorted(k for k in ref if k.startswith("donor."))]
        checks.append(Layers(tuple(P(f"hidden.{i + 1}") for i in range(L)), tuple(P(f"own.{i + 1}") for i in range(L)),
                             tuple(R(f"hidden.{i + 1}") for i in range(L))))
        checks += [Tokens("stream", P("stream.tokens"), R("stream.tokens"), R("stream.logits"), "greedy stream"),
                   Tensor("stream.logits[shared]", P("stream.logits"), R("stream.logits"), "stream_logits", "stream",
                          upto="stream"),
                   Scored("teacher_forced", "teacher_forced", (P("tf.logits"), R("stream.logits"), R("stream.tokens")))]
        return Plan(checks)

    def quantities(self, case: Case, port: dict, ref: dict) -> dict[str, float]:
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


PAIR = Targets()

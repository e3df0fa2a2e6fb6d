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

from dataclasses import replace

import numpy as np

from ... import controls, layers
from ...case import Case
from ...checks import P, Plan, R, Round, Tensor, Tokens, drafter_layers, serve_loop
from ...pair import Pair
from ...params import AssistantLoop, AssistantSampled, AssistantStep
from ...sampled import FAMILY_ALPHA, Distribution
from ..targets.checkpoints import GEMMA4_VARIANTS
from .adapter import CONVENTIONS, step_inputs

NAME = "assistant"
ORACLE = "optiq"

TARGETS = GEMMA4_VARIANTS
HEADS = {
    "centroid": {},
    "centroid-untied": {"tie_word_embeddings": False},
    "tied": {"use_ordered_embeddings": False},
    "unified": {"model_type": "gemma4_unified_assistant", "use_ordered_embeddings": False},
}
STEP_PAIRS = [("gemma4", "centroid"), ("gemma4", "tied"), ("gemma4", "unified"),
              ("gemma4-keqv", "centroid"), ("gemma4-ple-kvshared", "tied"), ("gemma4", "centroid-untied")]
TIER = {"optiq": "L1", "transformers": "L2"}

# Planted bugs the step comparisons must catch (each against both oracles' goldens), from
# spec_parity/drafters/assistant/controls.py.
STEP_CONTROLS = ("scale", "position", "window", "donor", "ordering")
# The untied centroid head's candidates scored on the embedding (optiq's rows), caught against
# transformers, which scores them on lm_head.
ROWS_CONTROL = ("centroid-untied", "transformers", "head_rows")


def drafter_overrides(target: str, head: str) -> dict:
    ov = dict(HEADS[head])
    t = TARGETS[target]
    if t.get("attention_k_eq_v"):
        ov["text_config"] = {"attention_k_eq_v": True,
                             "num_global_key_value_heads": t["num_global_key_value_heads"]}
    return ov


# Where the references differ (docs/references.md), the port offers transformers' convention as an
# option (drafters/assistant/adapter.py CONVENTIONS); the hfpos/hfwin cases hold it to transformers under it.


def step_case(target: str, head: str, oracle: str, control: str | None = None, convention: str = "optiq",
              dtype: str = "float32") -> Case:
    name = (f"step-{target}-{head}-{oracle}" + ("" if convention == "optiq" else f"-{convention}")
            + ("" if dtype == "float32" else "-bf16"))
    params = AssistantStep(prompt_len=20, gamma=4, drafter=("gemma4-assistant", 0, drafter_overrides(target, head)),
                           convention=convention)
    ctl = None
    if control:
        ctl = controls.case_control(NAME, control, name)
        name = f"{name}-control-{control}"
    return Case(NAME, name, TIER[oracle], "gemma4-target", 0, TARGETS[target], params, dtype=dtype,
                control=ctl, oracle=oracle)


# Planted bugs in a loop case, caught by the loop comparisons against optiq's spec_generate, and
# the controls module each is written in: the serve loop's (trim one too few, EOS emitted as
# content, bonus dropped on a full accept), and a drafter bug that leaves a random drafter's
# acceptance as it is (only the drafts show it).
LOOP_CONTROLS = {"trim": "serve", "eos": "serve", "bonus": "serve", "scale": NAME}

def loop_case(head: str, gamma: int, drafter: str = "random", control: str | None = None, eos: int = -1) -> Case:
    """eos -1: no stop token, every case runs max_tokens; eos 1 (the config's): ends at EOS."""
    name = f"loop-{drafter}-{head}-g{gamma}" + ("-eos" if eos >= 0 else "")
    kind = "gemma4-assistant" if drafter == "random" else "gemma4-assistant-agreeing"
    target = "gemma4-target" if drafter == "random" else "gemma4-target-agreeing"
    params = AssistantLoop(prompt_len=12, gamma=gamma, max_tokens=40, eos=eos,
                           drafter=(kind, 0, drafter_overrides("gemma4", head)))
    ctl = None
    if control:
        ctl = controls.case_control(LOOP_CONTROLS[control], control, name)
        name = f"{name}-control-{control}"
    return Case(NAME, name, "L2", target, 0, {}, params, control=ctl, oracle="optiq")


# T > 0 against optiq's sampled loop (`assistant_generate_step` with mlx-lm's sampler: greedy drafts,
# token match): the agreeing pair at vocab 64 with the target's final softcap off (optiq samples the
# raw logits, docs/references.md), T = 3, 2 drafts a round, 10 tokens, 1000 requests a side, on the
# prompt whose first token is the flattest; each statistic at sampled.FAMILY_ALPHA with the power to
# see a bias of 0.33. The accepted lengths and rounds see the acceptance test; the first round's end
# token sees the correction and the bonus too. The controls (spec_parity/controls/sampling.py), one
# or more of each rule-bug family in its token-match form (the rule has no residual: its correction
# is the draw that rejected the draft), their p in docs/serve.md.
SMALL = {"vocab_size": 64, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
SAMPLED_TARGET = {**SMALL, "vocab_size_per_layer_input": 64, "hidden_size": 64, "final_logit_softcapping": None}
SAMPLED_DRAFTER = {"agree_frac": 0.8, "backbone_hidden_size": 64, "text_config": {**SMALL, "hidden_size": 16}}
SAMPLED_STATS = ("first", "second", "rounds_to_M", "end")
SAMPLED_CONTROLS = ("correction_redrawn", "bonus_wrong_row", "accept_wrong_row", "target_no_temperature")


def sampled_cases() -> list[Case]:
    params = AssistantSampled(prompt=(3, 4, 17), gamma=2, max_tokens=10, temperature=3.0, runs=1000,
                              drafter=("gemma4-assistant-agreeing", 0, SAMPLED_DRAFTER))
    base = Case(NAME, "sampled-agreeing-T3.0", "L2", "gemma4-target-agreeing", 0, SAMPLED_TARGET, params,
                oracle="optiq")
    return [base] + [replace(base, name=f"{base.name}-control-{bug}",
                             control=controls.case_control("sampling", bug, base.name)) for bug in SAMPLED_CONTROLS]


PROMPT = (11, 128)
EOS = 1


def _window(case: Case) -> int:
    import json

    return json.loads((case.checkpoint_dir() / "config.json").read_text())["sliding_window"]


class Assistant(Pair):
    NAME, ORACLE, PROMPT = NAME, ORACLE, PROMPT

    def cases(self) -> list[Case]:
        out = [step_case(t, h, o) for o in ("optiq", "transformers") for t, h in STEP_PAIRS]
        out += [step_case("gemma4", "centroid", "transformers", convention=c) for c in ("hfpos", "hfwin")]
        out += [step_case("gemma4", h, "optiq", dtype="bfloat16") for h in ("centroid", "tied")]
        for o in ("optiq", "transformers"):
            for bug in STEP_CONTROLS:
                out.append(step_case("gemma4", "centroid", o, bug))
            base = step_case("gemma4", "centroid", o)    # one drafter layer wrong: named at layer 2
            out.append(replace(base, name=f"{base.name}-control-layer2",
                               control=controls.case_control(NAME, "layer_scale", base.name, layer=2)))
        head, oracle, bug = ROWS_CONTROL
        out.append(step_case("gemma4", head, oracle, bug))
        out += [loop_case(h, g) for h in ("centroid", "tied") for g in (1, 2, 3, 4)]
        out += [loop_case(h, g, "agreeing") for h in ("centroid", "tied", "unified") for g in (1, 2, 3, 4)]
        out.append(loop_case("centroid", 2, eos=EOS))
        out.append(loop_case("centroid", 2, control="trim"))
        out.append(loop_case("centroid", 3, "agreeing", control="trim"))
        out.append(loop_case("centroid", 2, control="eos", eos=EOS))
        out.append(loop_case("centroid", 3, "agreeing", control="bonus"))
        out.append(loop_case("centroid", 2, control="scale"))
        return out + sampled_cases()

    def oracle_status(self, oracle: str) -> str | None:
        from spec_parity.oracles.assistant import status

        return status(oracle)

    def run_oracle(self, case: Case):
        from spec_parity.oracles import assistant as oracle

        name, o = case.oracle, case.params
        if isinstance(o, AssistantSampled):
            arrays = oracle.optiq_sampled_statistics(case.checkpoint_dir(), case.drafter_dir(), np.array([o.prompt], np.int32),
                                                     o.gamma, o.max_tokens, o.temperature,
                                                     list(range(o.ref_seed0, o.ref_seed0 + o.runs)))
            return arrays, {"reference": {"name": name, "versions": oracle.versions(name)}}
        p = case.prompt(*PROMPT)
        if isinstance(o, AssistantLoop):
            arrays = oracle.optiq_spec_generate(case.checkpoint_dir(), case.drafter_dir(), p, o.gamma, o.max_tokens, o.eos)
        elif name == "optiq":
            arrays = oracle.optiq_draft_steps(case.checkpoint_dir(), case.drafter_dir(), p, o.gamma, case.dtype)
        else:
            inputs = step_inputs(case.checkpoint_dir(), p, case.dtype)
            conv = CONVENTIONS[o.convention]
            keep = None if conv["window"] == "hf" else _window(case) - 1
            arrays = {**inputs, **oracle.hf_draft_steps(case.drafter_dir(), inputs, o.gamma, keep,
                                                        conv["positions"])}
        return arrays, {"reference": {"name": name, "versions": oracle.versions(name)}}

    def conventions(self, case: Case) -> dict:
        """Which rows an untied centroid head scores its candidates on (port/assistant.py HEAD_ROWS):
        optiq's embedding, or transformers' lm_head (deltas.py centroid-rows)."""
        if not isinstance(case.params, AssistantStep):
            return {}
        return {"head_rows": "embed" if case.oracle == "optiq" else "lm_head"}

    def feeds(self, case: Case, ref: dict) -> dict:
        """transformers is fed our target's anchor, donors and embedding table; so is the port."""
        inputs = {} if case.oracle == "optiq" else {k: v for k, v in ref.items() if k.startswith("in.")}
        return {**inputs, **super().feeds(case, ref)}

    def plan(self, case: Case, ref: dict) -> Plan:
        if isinstance(case.params, AssistantSampled):
            return Plan([Distribution(stat, P(f"sampled.{stat}"), R(f"sampled.{stat}"), FAMILY_ALPHA, max_bias=0.33)
                         for stat in SAMPLED_STATS])
        if isinstance(case.params, AssistantLoop):
            eos = {case.params.eos}
            return serve_loop("optiq", case.params.max_tokens, eos, ref_drop=eos, greedy_drop=eos,
                              schedule=(P("stream.drafted"), P("stream.accepted"), P("stream.emitted")),
                              ref_schedule=(R("stream.trace"),), draft_logits="loop_draft_logits",
                              drafts=Round(R("stream.trace", col=0), R("stream.trace", col=2), R("stream.proposals"),
                                           R("stream.draft_logits")))
        gamma = case.params.gamma
        checks = []
        if case.oracle == "optiq":
            checks += [Tensor(k, P(k), R(k), k) for k in ("anchor.token", "anchor.hidden", "donor.sliding_attention.k",
                                                          "donor.sliding_attention.v", "donor.full_attention.k",
                                                          "donor.full_attention.v")]
        for i in range(gamma):
            checks += [Tensor(f"step{i}.next_hidden", P(f"step{i}.next_hidden"), R(f"step{i}.next_hidden"),
                              chained("next_hidden", i)),
                       Tensor(f"step{i}.logits", P(f"step{i}.logits"), R(f"step{i}.logits"), chained("logits", i),
                              candidates=True)]
        steps = [f"step{i}" for i in range(gamma)]
        checks.append(Tokens("draft_tokens", P(*[s + ".token" for s in steps]), R(*[s + ".token" for s in steps]),
                             R(*[s + ".logits" for s in steps]), "draft token", finding="module"))
        return Plan(checks + drafter_layers(ref))

    def quantities(self, case: Case, port: dict, ref: dict) -> dict[str, float]:
        if "sampled.first" in port:
            return {}
        if "greedy.logits" in port:
            n = min(len(port["stream.logits"]), len(port["greedy.logits"]))
            return {"path_logits": float(np.abs(port["stream.logits"][:n] - port["greedy.logits"][:n]).max())}
        out = {"logits": 0.0, "next_hidden": 0.0}
        for k in ref:
            step, _, q = k.partition(".")
            if not step.startswith("step") or q not in ("next_hidden", "logits"):
                continue
            m = (port[k] > -1e29) & (ref[k] > ref[k].min()) if (port[k] <= -1e29).any() else np.ones_like(port[k], bool)
            q = chained(q, int(step[4:]))
            out[q] = max(out.get(q, 0.0), float(np.abs(port[k][m] - ref[k][m]).max()))
        return {**out, **layers.quantities(port, ref)}


def chained(quantity: str, step: int) -> str:
    """The budget quantity of draft step `step`: step 0 is one step's arithmetic; step k carries the
    earlier steps' rounding through the drafter's own gain, k times over (budgets.py), so each
    later step has its own budget."""
    return quantity if step == 0 else f"{quantity}.step{step}"


PAIR = Assistant()

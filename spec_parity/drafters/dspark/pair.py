"""Pair: DeepSeek's DSpark drafter (port/dspark.py) against DeepSpec (oracles/dspark.py), at L2.

Module cases compare the first draft round after prefill module by module: taps, projected
context, per-layer context K/V, block hidden, base logits, Markov-corrected logits, draft tokens,
confidence logits, the prefix length at several thresholds (0 tokens included) and the proposal.
Loop cases run our serve loop with the DeepspecSource against DeepSpec's own T=0 decoding loop:
token stream, per-round proposal sizes, accepted lengths and draft tokens, and tau; and hold our
stream to the target's plain greedy one. The sampled case holds the distribution of our loop's
accepted lengths, rounds and first-round end token at T > 0 to DeepSpec's sampled loop
(spec_parity/sampled.py). DeepSpec's DFlash variant (Markov rank 0, no confidence head) runs through
the same port by config.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ... import controls, layers
from ...case import Case
from ...checks import (
    P,
    Plan,
    R,
    Round,
    Same,
    Tensor,
    Tokens,
    drafter_layers,
    serve_loop,
)
from ...pair import Pair
from ...params import DsparkLoop, DsparkRounds, DsparkSampled
from ...sampled import FAMILY_ALPHA, Distribution
from ..targets.checkpoints import GEMMA4_VARIANTS

NAME = "dspark"
ORACLE = "deepspec"
THRESHOLDS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]

VARIANTS = {
    "gemma4": {},
    "gemma4-keqv": {"target_overrides": GEMMA4_VARIANTS["gemma4-keqv"]},
    "qwen3": {"target_kind": "qwen3-target"},
    "gemma4-gated": {"markov_head_type": "gated"},
    "gemma4-rnn": {"markov_head_type": "rnn"},
    "qwen3-embtap": {"target_kind": "qwen3-target", "target_layer_ids": [-1, 2, 4]},
    "gemma4-dflash": {"markov_rank": 0, "confidence_head_alpha": 0.0},
    "qwen3-dflash": {"target_kind": "qwen3-target", "markov_rank": 0, "confidence_head_alpha": 0.0},
}
LOOPS = [("gemma4", 0.0), ("gemma4", 0.5), ("gemma4-keqv", 0.5), ("qwen3", 0.0), ("qwen3", 0.3),
         ("gemma4-rnn", 0.0), ("gemma4-dflash", 0.0), ("qwen3-dflash", 0.0)]
# Agreeing pairs ("dspark-drafter-agreeing", spec_parity/drafters/dspark/checkpoints.py): the Markov head carries the target's successor on a
# share `agree_frac` of the vocabulary; 1.0 accepts every draft (tau = block size + 1 = 8).
AGREEING = [("gemma4", 1.0, 0.0), ("gemma4", 0.8, 0.0), ("gemma4-keqv", 0.8, 0.5), ("qwen3", 0.8, 0.0),
            ("qwen3", 0.6, 0.5), ("gemma4-rnn", 0.8, 0.0)]

# T > 0 against DeepSpec's rejection-sampling loop (`generate_decoding_sample`): the agreeing pair at
# T = 2, confidence threshold 0.5, 5 tokens a request, 600 requests a side, each statistic at
# sampled.FAMILY_ALPHA: the first round's accepted length and the rounds (they see the acceptance
# test) and the first round's end token (it sees the correction and the bonus too). The controls
# (spec_parity/controls/sampling.py), one or more of each rule-bug family, their p in docs/serve.md.
SAMPLED = DsparkSampled(prompt_len=12, max_new_tokens=5, threshold=0.5, temperature=2.0, runs=600)
SAMPLED_STATS = ("first", "rounds", "end")
SAMPLED_CONTROLS = ("residual_skipped", "residual_unnormalized", "bonus_wrong_row", "accept_inverted",
                    "target_no_temperature")

# Planted bugs (spec_parity/drafters/dspark/controls.py) and the case that must catch each.
CONTROLS = {
    "markov_before_softcap": "mod-gemma4",
    "cumulative_truncation": "mod-qwen3",
    "rope_on_v": "mod-gemma4",
    "no_embed_scale": "mod-gemma4",
    "anchor_not_predicting": "mod-gemma4",
    "tap_index": "mod-gemma4",
    "rejected_rows": "loop-gemma4-t0.0",
}


def _case(name: str, variant: str, params: DsparkRounds | DsparkLoop, agree_frac: float | None = None) -> Case:
    ov = dict(VARIANTS[variant])
    target = ov.get("target_kind", "gemma4-target")
    kind = "dspark-drafter"
    if agree_frac is not None:
        target = target.replace("-target", "-target-agreeing")
        ov.update(target_kind=target, agree_frac=agree_frac)
        kind = "dspark-drafter-agreeing"
    return Case(NAME, name, "L2", target, 0, ov.get("target_overrides", {}), replace(params, drafter=(kind, 0, ov)))


PROMPT = (13, 128)


MODULE_TENSORS = [("taps", "taps"), ("context", "context"), ("block_hidden", "block_hidden"),
                  ("base_logits", "logits"), ("logits", "logits"), ("confidence", "confidence")]


class DSpark(Pair):
    NAME, ORACLE, PROMPT = NAME, ORACLE, PROMPT

    def cases(self) -> list[Case]:
        out = [_case(f"mod-{v}", v, DsparkRounds(prompt_len=12, thresholds=THRESHOLDS)) for v in VARIANTS]
        out += [_case(f"loop-{v}-t{t}", v, DsparkLoop(prompt_len=12, max_new_tokens=24, threshold=t)) for v, t in LOOPS]
        out += [_case(f"loop-agree{f}-{v}-t{t}", v, DsparkLoop(prompt_len=12, max_new_tokens=32, threshold=t), f)
                for v, f, t in AGREEING]
        sampled = _case(f"sampled-agree0.8-gemma4-T{SAMPLED.temperature}", "gemma4", SAMPLED, 0.8)
        out += [sampled] + [replace(sampled, name=f"{sampled.name}-control-{bug}",
                                    control=controls.case_control("sampling", bug, sampled.name))
                            for bug in SAMPLED_CONTROLS]
        by_name = {c.name: c for c in out}
        for bug, base in CONTROLS.items():
            b = by_name[base]
            out.append(Case(NAME, f"{base}-control-{bug}", b.tier, b.kind, b.seed, b.overrides, b.params,
                            control=controls.case_control(NAME, bug, base)))
        out.append(replace(by_name["mod-gemma4"], name="mod-gemma4-control-layer1",
                           control=controls.case_control(NAME, "layer_scale", "mod-gemma4", layer=1)))
        return out

    def oracle_status(self, oracle: str) -> str | None:
        from spec_parity.oracles.dspark import status

        return status()

    def run_oracle(self, case: Case):
        from spec_parity.oracles import dspark as oracle

        p, o = case.prompt(*PROMPT), case.params
        if isinstance(o, DsparkSampled):
            arrays = oracle.loop_sampled_statistics(case.checkpoint_dir(), case.drafter_dir(), p, o.max_new_tokens,
                                                    o.threshold, o.temperature,
                                                    list(range(o.ref_seed0, o.ref_seed0 + o.runs)))
        elif isinstance(o, DsparkLoop):
            arrays = oracle.loop(case.checkpoint_dir(), case.drafter_dir(), p, o.max_new_tokens, o.threshold)
        else:
            arrays = oracle.modules(case.checkpoint_dir(), case.drafter_dir(), p, o.thresholds)
        return arrays, {"reference": {"name": ORACLE, "versions": oracle.versions()}}

    def feeds(self, case: Case, ref: dict) -> dict:
        """Module rounds: the reference's layer outputs and context K/V, so a layer's own error is its
        own and not the target's taps carried into the context."""
        feeds = super().feeds(case, ref)
        return {**feeds, **{k: v for k, v in ref.items() if k.startswith("context_")}} if feeds else feeds

    def plan(self, case: Case, ref: dict) -> Plan:
        if isinstance(case.params, DsparkSampled):
            return Plan([Distribution(stat, P(f"sampled.{stat}"), R(f"sampled.{stat}"), FAMILY_ALPHA)
                         for stat in SAMPLED_STATS])
        if isinstance(case.params, DsparkLoop):
            # DeepSpec decodes while fewer than n + 1 tokens are committed, then trims to n.
            return serve_loop("DeepSpec", case.params.max_new_tokens + 1, set(), greedy_prefix=True,
                              schedule=(P("stream.drafted"), P("stream.accepted")),
                              ref_schedule=(R("stream.proposed"), R("stream.accepted")),
                              tau=R("stream.acceptance_lengths"),
                              drafts=Round(R("stream.proposal_sizes"), R("stream.acceptance_lengths"), R("stream.proposals")))
        checks = [Same("anchor", P("anchor"), R("anchor"), "anchor token")]
        checks += [Tensor(key, P(key), R(key), quantity) for key, quantity in MODULE_TENSORS if key in ref]
        checks += [Tensor(k, P(k), R(k), "context_kv") for k in sorted(k for k in ref if k.startswith("context_"))]
        checks.append(Tokens("tokens", P("tokens"), R("tokens"), R("logits"), "draft token", finding="module"))
        for t in case.params.thresholds:
            checks += [Same(f"prefix@{t}", P(f"prefix@{t}"), R(f"prefix@{t}"), f"prefix length at threshold {t}"),
                       Same(f"proposal@{t}", P(f"proposal@{t}"), R(f"proposal@{t}"), f"proposal at threshold {t}")]
        return Plan(checks + drafter_layers(ref))

    def quantities(self, case: Case, port: dict, ref: dict) -> dict[str, float]:
        if "sampled.first" in port:
            return {}
        if "greedy.logits" in port:
            m = min(len(port["stream.logits"]), len(port["greedy.logits"]))
            return {"path_logits": float(np.abs(port["stream.logits"][:m] - port["greedy.logits"][:m]).max())}
        out = {}
        for key, quantity in MODULE_TENSORS:
            if key in ref:
                out[quantity] = max(out.get(quantity, 0.0), float(np.abs(port[key] - ref[key]).max()))
        out["context_kv"] = max(float(np.abs(port[k] - ref[k]).max()) for k in ref if k.startswith("context_"))
        return {**out, **layers.quantities(port, ref)}


PAIR = DSpark()

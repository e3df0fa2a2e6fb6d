"""Pair: z-lab's DFlash drafter (port/dflash.py) against z-lab's `dflash` 0.1.0 (oracles/dflash.py):
its MLX model `dflash.model_mlx` at L1 and its torch model `dflash.model` at L2.

Module cases (L1, bit-exact): z-lab's own prefill (`_prefill_target`: the prompt less its last
token, then the last token, taps through its layer hooks) and eight draft rounds with forced
commits (`accepts`: long, partial and empty ones, so one-row context updates on a full sliding
ring happen). Compared per round: the taps entering the context, the drafter's final-normed block
hidden, its logits (target head x output_multiplier, softcap) and greedy block, the next anchor,
and at the end every layer's context K/V as its next query attends them (spec_parity.attended:
in position order, a sliding layer's newest W-1 rows, wherever each side stores them; with an
all-sliding drafter the taps too). Same framework, same ops: identical bytes.

Loop cases (L2): our serve loop with the DflashSource against z-lab's `stream_generate` (T=0):
token stream, per-round (drafted, accepted, emitted), the draft tokens, and the drafter's logits
per round along the shared path (our loop prefills the prompt in one forward where z-lab splits off
its last token, so on Gemma-4 those differ in the last bits), held within a measured budget;
lossless against the target's plain greedy stream, with the logits of every committed token.

Sliding layers run with window="zlab-mlx" against z-lab MLX; the port's default ("positional")
differs from it after a one-row context update on a full ring (port/dflash.py, tests/test_dflash.py).

The same module and loop cases run at L2 against z-lab's torch model (`-torch` cases; transformers
5.15 in its own environment, driven through oracles/dflash_torch_runner.py) with the port in z-lab
torch's conventions: window "positional", embed "raw" (no Gemma sqrt(H) on the block embedding),
and z-lab torch's one-forward prefill. Tokens must be equal (a knife-edge excused only as
compare.stream_metrics allows); tensors within the measured budgets.

Extension cases (L3, `ext-*`): the DSpark-on-DFlash serve loop, pruning on and off, held to gates
(lossless, the pruning rule, the distribution shift); its Markov and confidence heads, DeepSpec's,
held at L2 to DeepSpec's own head functions on the same seeded rows, anchors and chain
(teacher-forced: the port is fed them), the case's oracle (HEADS) for those quantities only.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from ... import controls, layers
from ...budgets import L3_GATES
from ...case import Case
from ...checks import (
    FirstRound,
    G,
    P,
    Plan,
    Pruning,
    R,
    Round,
    Rows,
    Scored,
    Shift,
    Tensor,
    Tokens,
    Window,
    drafter_layers,
    serve_loop,
)
from ...pair import Pair
from ...params import DflashExtension, DflashLoop, DflashRounds
from ..targets.checkpoints import GEMMA4_VARIANTS

NAME = "dflash"
ORACLE = "zlab-mlx"
TORCH = "zlab-torch"

GEMMA4 = {"target_kind": "gemma4-target", "layer_types": ["sliding_attention", "full_attention"],
          "sliding_window": 10, "output_multiplier": 0.75, "input_embedding_scale": 1.25}
VARIANTS = {
    "qwen3": {},
    "qwen3-causal": {"is_causal": True},
    "qwen3-swa": {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 10},
    "qwen3-bs16": {"block_size": 16, "num_draft_layers": 3, "target_layer_ids": [1, 3]},
    "gemma4": GEMMA4,
    "gemma4-keqv": {**GEMMA4, "target_overrides": GEMMA4_VARIANTS["gemma4-keqv"]},
}
ACCEPTS = [3, 0, 0, 7, 0, 1, 0, 2]      # forced commits per module round (clipped to bs-1)
ACCEPTS_BS16 = [3, 0, 0, 15, 0, 1, 0, 9]
LOOPS = [("qwen3", []), ("qwen3", [4]),  # token 4 is 13th in the seed-0 stream: the stop path runs
         ("qwen3-swa", []), ("qwen3-bs16", []), ("gemma4", []), ("gemma4-keqv", [])]
MAX_TOKENS = 40
# Agreeing loops ("dflash-drafter-agreeing", spec_parity/drafters/dflash/checkpoints.py, on an agreeing target): drafts
# follow h along the chain, so long, partial and empty accepts all occur (every length 0..bs-1
# within max_tokens). (name, target kind, target overrides, drafter overrides, max_tokens); the
# slot maps are exact for hidden_size >= vocab_size.
AGREE_128 = {"hidden_size": 128}
AGREE_256 = {"hidden_size": 256, "vocab_size": 256}
AGREEING = [
    ("agree-qwen3", "qwen3-target-agreeing", AGREE_128, {"agree_frac": 0.8}, 80),
    ("agree-gemma4", "gemma4-target-agreeing", AGREE_128,
     {"target_kind": "gemma4-target-agreeing", "agree_frac": 0.7}, 80),
    ("agree-qwen3-bs16", "qwen3-target-agreeing", AGREE_256,
     {"target_overrides": AGREE_256, "agree_frac": 0.9, "block_size": 16, "num_attention_heads": 16}, 260),
]
TORCH_MODULES = list(VARIANTS)
TORCH_LOOPS = ["qwen3", "qwen3-swa", "qwen3-bs16", "gemma4", "gemma4-keqv"]

# Planted bugs (spec_parity/drafters/dflash/controls.py) and the cases that must catch each.
CONTROLS = [
    ("own_head", "mod-qwen3"), ("own_head", "mod-gemma4"),
    ("ctx_input_layernorm", "mod-qwen3"), ("ctx_input_layernorm", "mod-gemma4"),
    ("block_position_shift", "mod-qwen3"), ("block_position_shift", "mod-gemma4"),
    ("rejected_rows", "mod-qwen3"), ("rejected_rows", "loop-qwen3"), ("rejected_rows", "loop-gemma4"),
    ("own_head", "mod-gemma4-torch"), ("ctx_input_layernorm", "mod-qwen3-torch"),
    ("block_position_shift", "mod-qwen3-swa-torch"), ("rejected_rows", "loop-qwen3-torch"),
    ("window_one_short", "mod-qwen3-swa"), ("window_one_short", "mod-qwen3-swa-torch"),
    ("thresholds_ignored", "ext-qwen3"), ("markov_first_token", "ext-qwen3"), ("confidence_wrong_row", "ext-qwen3"),
]
# One drafter layer's output planted wrong (controls.one_layer_scaled): the first divergent layer must be 1.
LAYER_CONTROLS = ("mod-qwen3", "mod-qwen3-torch")
# The DSpark-on-DFlash extension (L3: no reference implements it): a vanilla Markov head and a
# confidence head on the DFlash drafter, pruning at one threshold for every position. Its heads are
# DeepSpec's, so the case's reference for them is DeepSpec's own head functions (HEADS,
# oracles/dspark.py extension_heads), fed the same rows as the port's heads, teacher-forced.
HEADS = "DeepSpec (heads)"
EXT_EXTRAS = {"markov_rank": 8, "markov_head_type": "vanilla", "confidence": True}
EXT_THRESHOLDS = [0.6]
HEAD_BLOCKS = 4
HEAD_INPUTS = ("heads.hidden", "heads.base_logits", "heads.anchor", "heads.tokens")
# (check, array, budget quantity): the heads' outputs held to DeepSpec's.
HEAD_CHECKS = (("markov_rows_vs_deepspec", "heads.logits", "ext_markov_rows"),
               ("confidence_vs_deepspec", "heads.confidence", "ext_confidence"))


def window(variant: str) -> str:
    return "zlab-mlx" if "sliding_attention" in (VARIANTS[variant].get("layer_types") or []) else "positional"


def _case(name: str, variant: str, params: DflashRounds | DflashLoop, tier: str, oracle: str = ORACLE) -> Case:
    ov = VARIANTS[variant]
    conventions = ({"window": window(variant), "embed": "scaled", "prefill": "split"} if oracle == ORACLE
                   else {"window": "positional", "embed": "raw", "prefill": "whole"})
    return Case(NAME, name, tier, ov.get("target_kind", "qwen3-target"), 0, ov.get("target_overrides", {}),
                replace(params, **conventions, drafter=("dflash-drafter", 0, ov)), oracle=oracle)


def _module_params(variant: str) -> DflashRounds:
    return DflashRounds(prompt_len=12, accepts=ACCEPTS_BS16 if "bs16" in variant else ACCEPTS)


def _agreeing(name: str, tk: str, tov: dict, ov: dict, n: int, oracle: str, embed: str, prefill: str) -> Case:
    return Case(NAME, name, "L2", tk, 0, tov,
                DflashLoop(prompt_len=12, max_tokens=n, eos=(), window="positional", embed=embed, prefill=prefill,
                           drafter=("dflash-drafter-agreeing", 0, ov)), oracle=oracle)


PROMPT = (17, 120)


def _heads_reference(case: Case):
    """DeepSpec's heads (the extension's L2 component) on the rows `_head_inputs` seeds: the
    inputs, the chain's tokens (the port is fed them: teacher-forced), rows and confidence."""
    from spec_parity.oracles import dspark

    x = _head_inputs(case)
    ref = dspark.extension_heads(case.drafter_dir(), x["heads.hidden"], x["heads.base_logits"], x["heads.anchor"])
    return {**x, **ref}, {"reference": {"name": "DeepSpec's Markov and confidence heads", "versions": dspark.versions()}}


def _head_inputs(case: Case) -> dict:
    """The rows both sides' heads are fed: HEAD_BLOCKS blocks of block_size - 1 slots, seeded by
    the case: final hidden rows ~ N(0, 1), base rows (after any softcap) ~ N(0, 4), and an anchor
    per block that is neither a special id (0-2) nor the mask token, so that a first slot reading
    anything but the anchor moves its row."""
    cfg = json.loads((case.drafter_dir() / "config.json").read_text())
    d = cfg["dflash_config"]
    n, H, V = int(d.get("block_size", cfg.get("block_size", 16))) - 1, int(cfg["hidden_size"]), int(cfg["vocab_size"])
    rng = np.random.default_rng([case.seed, PROMPT[0], HEAD_BLOCKS])
    anchors = rng.integers(3, V, HEAD_BLOCKS)
    anchors[anchors == int(d["mask_token_id"])] = 3 if int(d["mask_token_id"]) != 3 else 4
    return {"heads.hidden": rng.standard_normal((HEAD_BLOCKS, n, H)).astype(np.float32),
            "heads.base_logits": (2.0 * rng.standard_normal((HEAD_BLOCKS, n, V))).astype(np.float32),
            "heads.anchor": anchors.astype(np.int32)}


def _sliding(case: Case) -> tuple[list[bool], int | None]:
    """Which drafter layers are sliding, and the window W, as the drafter's config.json says."""
    cfg = json.loads((case.drafter_dir() / "config.json").read_text())
    types = cfg.get("layer_types") or ["full_attention"] * int(cfg["num_hidden_layers"])
    return [t == "sliding_attention" for t in types], cfg.get("sliding_window")


def _stored_positions(case: Case, ref: dict, key: str, sliding: bool, W: int | None) -> tuple[int, ...] | None:
    """Each stored row's position in a reference's context K/V (which records none): z-lab MLX's
    sliding layers hold mlx-lm's ring buffer (replayed, spec_parity.oracles.dflash.ring_positions), the rest
    (its full layers, every z-lab torch layer) the newest rows in time order. The rows entering
    the context per round are the reference's own taps."""
    from spec_parity.oracles import dflash as oracle

    rounds = len(case.params.accepts)
    if any(f"taps.{r}" not in ref for r in range(rounds)):
        return None
    sizes = [len(ref[f"taps.{r}"]) for r in range(rounds)]
    start = case.params.prompt_len - sizes[0]
    if sliding and case.oracle == ORACLE:
        return oracle.ring_positions(start, sizes, W)
    n = start + sum(sizes)
    return tuple(range(n - ref[key].shape[-2], n))


class DFlash(Pair):
    NAME, ORACLE, PROMPT = NAME, ORACLE, PROMPT

    def cases(self) -> list[Case]:
        out = [_case(f"mod-{v}", v, _module_params(v), "L1") for v in VARIANTS]
        out += [_case(f"loop-{v}" + ("-eos" if eos else ""), v, DflashLoop(prompt_len=12, max_tokens=MAX_TOKENS, eos=eos),
                      "L2") for v, eos in LOOPS]
        out += [_agreeing(f"loop-{name}", tk, tov, ov, n, ORACLE, "scaled", "split") for name, tk, tov, ov, n in AGREEING]
        # The Qwen3 agreeing loops against z-lab's torch loop too (Qwen3 has no embedding scale, so the
        # torch model's raw block embedding is the same construction).
        out += [_agreeing(f"loop-{name}-torch", tk, tov, ov, n, TORCH, "raw", "whole")
                for name, tk, tov, ov, n in AGREEING if tk.startswith("qwen3")]
        out += [_case(f"mod-{v}-torch", v, _module_params(v), "L2", TORCH) for v in TORCH_MODULES]
        out += [_case(f"loop-{v}-torch", v, DflashLoop(prompt_len=12, max_tokens=MAX_TOKENS, eos=()), "L2", TORCH)
                for v in TORCH_LOOPS]
        out += [Case(NAME, f"ext-{v}", "L3", VARIANTS[v].get("target_kind", "qwen3-target"), 0, {},
                     DflashExtension(prompt_len=12, max_tokens=MAX_TOKENS, thresholds=EXT_THRESHOLDS,
                                     drafter=("dflash-drafter", 0, {**VARIANTS[v], "dspark_extras": EXT_EXTRAS})),
                     oracle=HEADS)
                for v in ("qwen3", "gemma4")]
        by_name = {c.name: c for c in out}
        for bug, base in CONTROLS:
            b = by_name[base]
            out.append(Case(NAME, f"{base}-control-{bug}", b.tier, b.kind, b.seed, b.overrides, b.params,
                            control=controls.case_control(NAME, bug, base), oracle=b.oracle))
        out += [replace(by_name[base], name=f"{base}-control-layer1",
                        control=controls.case_control(NAME, "layer_scale", base, layer=1))
                for base in LAYER_CONTROLS]
        return out

    def oracle_status(self, oracle: str) -> str | None:
        from spec_parity.oracles import dflash as o

        if oracle == HEADS:
            from spec_parity.oracles import dspark

            return dspark.status()
        return o.torch_status() if oracle == TORCH else o.status()

    def run_oracle(self, case: Case):
        from spec_parity.oracles import dflash as oracle

        t, d, p, o, dt = case.checkpoint_dir(), case.drafter_dir(), case.prompt(*PROMPT), case.params, case.dtype
        if isinstance(o, DflashExtension):
            return _heads_reference(case)
        loop = isinstance(o, DflashLoop)
        if case.oracle == TORCH:
            arrays = (oracle.torch_loop(t, d, p, o.max_tokens, dt) if loop
                      else oracle.torch_modules(t, d, p, o.accepts, dt))
            return arrays, {"reference": {"name": "z-lab dflash.model (torch)", "versions": oracle.torch_versions()}}
        arrays = oracle.loop(t, d, p, o.max_tokens, o.eos, dt) if loop else oracle.modules(t, d, p, o.accepts, dt)
        return arrays, {"reference": {"name": "z-lab dflash.model_mlx", "versions": oracle.versions()}}

    def affinity(self, case: Case) -> str:
        """A z-lab torch case with its z-lab MLX twin: on a Qwen3 target the two loops share one port
        run (adapter.run_loop), on any target one loaded target and greedy stream."""
        return super().affinity(case).removesuffix("-torch")

    def conventions(self, case: Case) -> dict:
        """Where the drafter's scales are read (port/dflash.py SCALES): as z-lab MLX, or as z-lab torch."""
        return {"scales": "nested" if case.oracle == ORACLE else "either"}

    def feeds(self, case: Case, ref: dict) -> dict:
        """Module rounds: the reference's layer outputs and prefill taps (a layer's own error is its
        own, not the target's taps carried into the context); the extension: the rows and tokens its
        heads are fed (teacher-forced)."""
        if isinstance(case.params, DflashExtension):
            return {k: ref[k] for k in HEAD_INPUTS if k in ref}
        feeds = super().feeds(case, ref)
        return {**feeds, "taps.0": ref["taps.0"]} if feeds and "taps.0" in ref else feeds

    def plan(self, case: Case, ref: dict) -> Plan:
        if isinstance(case.params, DflashExtension):
            return Plan([Tokens("lossless_vs_greedy", P("stream.tokens"), G("greedy.tokens"), G("greedy.logits"),
                                "not lossless: the stream vs the target's greedy one", "lossless"),
                         Pruning("pruning", P("ext.confidence"), P("ext.block_len"), P("ext.proposed"),
                                 case.params.thresholds),
                         Shift("shift", P("unpruned.base_logits"), P("unpruned.logits"), L3_GATES[(NAME, "extension")]),
                         Scored("acceptance", "acceptance", (P("stream.drafted"), P("stream.accepted"), P("tau")))]
                        + [Tensor(name, P(key), R(key), q, "heads") for name, key, q in HEAD_CHECKS if key in ref],
                        greedy=(case.params.max_tokens, frozenset()))
        if isinstance(case.params, DflashLoop):
            eos = set(case.params.eos)
            cols = ("stream.drafted", "stream.accepted", "stream.emitted")
            return serve_loop("z-lab", case.params.max_tokens, eos, ref_drop=eos, greedy_prefix=True,
                              schedule=tuple(P(c) for c in cols), ref_schedule=tuple(R(c) for c in cols),
                              drafts=Round(R(cols[0]), R(cols[2]), R("stream.proposals"), R("stream.draft_logits")),
                              draft_logits="loop_draft_logits_torch" if case.oracle == TORCH else "loop_draft_logits",
                              whole_block=True)
        rounds, (sliding, W) = len(case.params.accepts), _sliding(case)

        def taps(k):  # an all-sliding drafter attends no context row older than the newest W-1
            return Window(k, Rows(P(k)), Rows(R(k)), "taps", W - 1) if all(sliding) else Tensor(k, P(k), R(k), "taps")
        checks = [taps("taps.0")]
        for r in range(rounds):  # in the order they are computed, so the reason names the first one off
            checks += [Tensor(f"{k}.{r}", P(f"{k}.{r}"), R(f"{k}.{r}"), k) for k in ("hidden", "logits")]
            checks.append(Tensor(f"tokens.{r}", P(f"tokens.{r}"), R(f"tokens.{r}"), "tokens") if case.tier == "L1" else
                          Tokens(f"tokens.{r}", P(f"tokens.{r}"), R(f"tokens.{r}"), R(f"logits.{r}"), f"round {r}'s draft",
                                 finding="module"))
            checks.append(taps(f"taps.{r + 1}"))
        checks.append(Tensor("anchors", P("anchors"), R("anchors"), "anchors"))
        for k in sorted(k for k in ref if k.startswith(("ctx_k.", "ctx_v."))):
            i = int(k.split(".")[1])
            pos = f"ctx_pos.{i}"
            known = None if pos in ref else _stored_positions(case, ref, k, sliding[i], W)
            checks.append(Window(k, Rows(P(k), pos), Rows(R(k), pos, known), "context_kv", W - 1 if sliding[i] else None))
        checks.append(FirstRound("rounds", tuple(f"logits.{r}" for r in range(rounds))))
        return Plan(checks + drafter_layers(ref))

    def quantities(self, case: Case, port: dict, ref: dict) -> dict[str, float]:
        def gap(a, b):
            m = min(len(a), len(b))
            return float(np.abs(a[:m].astype(np.float64) - b[:m].astype(np.float64)).max()) if m else 0.0

        torch = case.oracle == TORCH
        if "ext.confidence" in port:
            return {q: gap(port[k], ref[k]) for _, k, q in HEAD_CHECKS if k in port and k in ref}
        if "greedy.logits" in port:
            return {"path_logits": gap(port["stream.logits"], port["greedy.logits"]),
                    "loop_draft_logits" + ("_torch" if torch else ""): gap(port["stream.draft_logits"],
                                                                            ref["stream.draft_logits"])}
        out: dict[str, float] = {}
        for key in ref:
            q = {"ctx_k": "context_kv", "ctx_v": "context_kv"}.get(key.split(".")[0], key.split(".")[0])
            if q in ("tokens", "anchors", "layer"):
                continue
            if key in port and port[key].shape == ref[key].shape:
                out[q] = max(out.get(q, 0.0), gap(port[key], ref[key]))
        return {**out, **layers.quantities(port, ref)}


PAIR = DFlash()

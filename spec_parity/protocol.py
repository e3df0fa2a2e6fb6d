"""The port protocol: what a port is given for a case, and the arrays it returns.

Written once, here, and rendered into docs/protocol.md (`spec-parity protocol`). Every port, ours
included, implements it: a `Port` maps a module name to a function `Request -> dict of arrays`.
Required quantities are the public outputs every port has (draft tokens and logits, a generated
stream); optional ones are internals (taps, context K/V, block hidden, per-layer outputs). A port
that leaves an optional one out gets no check on it, and is told so in the report; a port that
exposes it gets the finer checks and the layer localization built on it.

Shapes are symbolic: P prompt length, V vocabulary, H hidden size, L layers, N generated tokens,
g gamma (draft steps), B block size, R rounds, D drafted tokens in all, T taps x H.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Request:
    """What a port receives for one case: checkpoint directories, the prompt, the case's run
    options (gamma, the forced accept schedule, max tokens, EOS, thresholds, the reference's
    conventions) and the reference arrays it is fed (teacher-forced inputs)."""

    module: str
    case: str
    kind: str
    target: Path
    drafter: Path | None
    prompt: np.ndarray
    options: dict
    dtype: str = "float32"
    inputs: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Quantity:
    name: str            # a key, or a pattern with * (hidden.*)
    shape: str
    dtype: str
    meaning: str
    required: bool = False


@dataclass(frozen=True)
class Protocol:
    module: str
    kind: str
    what: str
    options: dict        # option name -> meaning
    inputs: dict         # input name -> meaning (arrays the harness feeds the port)
    returns: tuple[Quantity, ...]

    def quantity(self, key: str) -> Quantity | None:
        return next((q for q in self.returns if fnmatch.fnmatchcase(key, q.name)), None)

    def optional(self, key: str) -> bool:
        q = self.quantity(key)
        return q is not None and not q.required


LOOP_OPTIONS = {"max_tokens / max_new_tokens": "tokens to generate", "gamma": "draft tokens per round (assistant)",
                "eos": "stop token id(s); EOS is not content", "threshold": "DSpark confidence threshold",
                "window / embed / prefill": "the reference's conventions (DFlash)"}
LOOP_RETURNS = (
    Quantity("stream.tokens", "[N]", "int32", "the generated content tokens (T=0)", True),
    Quantity("stream.drafted", "[R]", "int32", "tokens proposed per round"),
    Quantity("stream.accepted", "[R]", "int32", "drafts accepted per round"),
    Quantity("stream.emitted", "[R]", "int32", "tokens committed per round"),
    Quantity("stream.prefilled", "[1]", "int32", "tokens committed before round 0 (absent: 1, the prefill's greedy "
             "token; 0 where round 0 drafts it)"),
    Quantity("stream.proposals", "[D]", "int32", "every round's draft tokens, in order"),
    Quantity("stream.draft_logits", "[D, V]", "float32", "the drafter's logits of each proposed token"),
    Quantity("stream.logits", "[N, V]", "float32", "the target's logits each committed token was chosen from"),
    Quantity("tau", "[1]", "float32", "mean tokens committed per round"),
)


LAYER_INPUTS = {"layer.*": "the reference's output of each drafter layer in the first draft (block or step 0), "
                          "for the own-error run"}
LAYER_RETURNS = (
    Quantity("layer.*", "[n, H]", "float32", "drafter layer i's output in the first draft (n: block rows, 1 for a step)"),
    Quantity("own.*", "[n, H]", "float32", "layer i fed the reference's layer.{i-1} (own error; own.0 = layer.0)"),
)


SAMPLED_OPTIONS = {"temperature": "the sampler's temperature", "runs": "requests to run, one seed each",
                   "seed0": "the first seed (seeds seed0 .. seed0 + runs - 1)",
                   "max_new_tokens / max_tokens": "tokens a request generates (as the module's loop counts them)",
                   "threshold / gamma": "the module's loop option (DSpark confidence threshold, assistant drafts per round)"}


SAMPLED_END = Quantity("sampled.end", "[runs]", "int32", "the token the first drafting round ends with: the "
                       "correction's id, V + the bonus's id after a full accept, 2V where the request stops "
                       "before it (V the vocabulary)", True)


def _sampled(module: str, returns: tuple[Quantity, ...]) -> Protocol:
    return Protocol(module, "sampled", "the serve loop at T > 0, once per seed: per request a few small integers, "
                    "compared as distributions with the reference's sampled loop (two-sample chi-square)",
                    SAMPLED_OPTIONS, {}, returns)


def _loop(module: str) -> Protocol:
    return Protocol(module, "loop", "the serve loop: draft, one batched verify, accept, trim, at T=0",
                    LOOP_OPTIONS, {}, LOOP_RETURNS)


PROTOCOLS = {p.module + "/" + p.kind: p for p in (
    Protocol("targets", "forward", "the target's forward on the prompt, and its greedy stream",
             {"new_tokens": "greedy tokens to generate"},
             {"hidden.*": "the reference's input to each layer (hidden.0 = embeddings), for the own-error run",
              "stream.tokens": "the reference's greedy stream, for the teacher-forced score"},
             (Quantity("logits", "[P, V]", "float32", "logits at every prompt position", True),
              Quantity("stream.tokens", "[N]", "int32", "greedy continuation", True),
              Quantity("final", "[P, H]", "float32", "the final norm's output"),
              Quantity("hidden.*", "[P, H]", "float32", "hidden.0 the embeddings, hidden.i layer i's output"),
              Quantity("own.*", "[P, H]", "float32", "layer i fed the reference's hidden.{i-1} (own error)"),
              Quantity("donor.*", "[1, heads, S, d]", "float32", "K/V of the last sliding / full layer (Gemma-4)"),
              Quantity("stream.logits", "[N, V]", "float32", "the logits each greedy token was chosen from"),
              Quantity("tf.logits", "[N, V]", "float32", "logits on the reference's stream (teacher-forced)"))),
    Protocol("assistant", "step", "the assistant drafter's chained draft steps from the first anchor",
             {"gamma": "draft steps", "convention": "positions / window convention (optiq, hfpos, hfwin)"},
             {"in.*": "transformers cases: the anchor, position, donor K/V and embedding table to draft from",
              **LAYER_INPUTS},
             (Quantity("step*.token", "[1]", "int32", "the draft token of step i", True),
              Quantity("step*.logits", "[V]", "float32", "the drafter's logits of step i", True),
              Quantity("step*.next_hidden", "[1, 1, H]", "float32", "the hidden the next step is fed"),
              Quantity("anchor.*", "[1] / [1, 1, H]", "", "the anchor token and hidden (from the target)"),
              Quantity("donor.*", "[1, heads, S, d]", "float32", "the donor K/V views the drafter attends"))
             + LAYER_RETURNS),
    Protocol("dspark", "modules", "the first DSpark draft round after prefill, module by module",
             {"thresholds": "confidence thresholds for the proposal"}, LAYER_INPUTS,
             (Quantity("tokens", "[B-1]", "int32", "the block's draft tokens", True),
              Quantity("logits", "[B-1, V]", "float32", "Markov-corrected logits", True),
              Quantity("prefix@*", "[1]", "int32", "tokens kept at threshold t", True),
              Quantity("proposal@*", "[n]", "int32", "the proposal at threshold t", True),
              Quantity("anchor", "[1]", "int32", "the target's greedy next token"),
              Quantity("taps", "[P, T]", "float32", "the tapped target hiddens"),
              Quantity("context", "[P, H]", "float32", "the projected context"),
              Quantity("context_*", "[heads, P, d]", "float32", "each drafter layer's context K/V (no window: "
                       "every prompt row, in position order)"),
              Quantity("block_hidden", "[B-1, H]", "float32", "the block's final hidden (the rows that draft)"),
              Quantity("base_logits", "[B-1, V]", "float32", "logits before the Markov head"),
              Quantity("confidence", "[B-1]", "float32", "the confidence head's logits")) + LAYER_RETURNS),
    Protocol("dflash", "modules", "DFlash draft rounds with forced commits (the accept schedule)",
             {"accepts": "forced accepted count per round", "window / embed / prefill": "the reference's conventions"},
             LAYER_INPUTS, (Quantity("tokens.*", "[B-1]", "int32", "round r's draft tokens", True),
                  Quantity("logits.*", "[B-1, V]", "float32", "round r's drafter logits", True),
                  Quantity("anchors", "[R+1]", "int32", "each round's anchor", True),
                  Quantity("hidden.*", "[B-1, H]", "float32", "round r's final-normed block hidden (rows 1..B-1)"),
                  Quantity("taps.*", "[n, T]", "float32", "the tap rows entering the context before round r"),
                  Quantity("ctx_[kv].*", "[heads, S, d]", "float32", "each layer's context K/V at the end, in any "
                           "layout (compared as attended: by position, a sliding layer's newest W-1 rows)"),
                  Quantity("ctx_pos.*", "[S]", "int32", "each ctx_k/ctx_v row's absolute position (absent: "
                           "in position order, the newest last)"))
             + LAYER_RETURNS),
    _loop("assistant"), _loop("dspark"), _loop("dflash"),
    _sampled("assistant", (Quantity("sampled.first", "[runs]", "int32", "each request's first drafting round's "
                                    "accepted length", True),
                           Quantity("sampled.second", "[runs]", "int32", "the second round's accepted length", True),
                           Quantity("sampled.rounds_to_M", "[runs]", "int32", "rounds to commit max_tokens - gamma - 1 "
                                    "tokens (the prefill's counts)", True), SAMPLED_END)),
    _sampled("dspark", (Quantity("sampled.first", "[runs]", "int32", "each request's first-round accepted length", True),
                        Quantity("sampled.rounds", "[runs]", "int32", "each request's verify rounds", True),
                        SAMPLED_END)),
    Protocol("dflash", "extension", "the DSpark-on-DFlash extension (no reference: L3), extras on, at T=0",
             {"thresholds": "confidence thresholds (one for every position, or one per position)",
              "max_tokens": "tokens to generate"}, {},
             LOOP_RETURNS + (
                 Quantity("ext.confidence", "[sum n_r]", "float32", "every block's confidence logits", True),
                 Quantity("ext.block_len", "[R]", "int32", "each block's length n_r", True),
                 Quantity("ext.proposed", "[R]", "int32", "tokens proposed from each block (after pruning)", True),
                 Quantity("ext.*", "[sum n_r, V]", "float32", "base (before the Markov head) and extended rows"),
                 Quantity("unpruned.base_logits", "[D, V]", "float32", "pruning off: the base draft rows", True),
                 Quantity("unpruned.logits", "[D, V]", "float32", "pruning off: the extended draft rows", True))),
)}


MODULES = tuple(dict.fromkeys(key.split("/")[0] for key in PROTOCOLS))
"""The modules a port may answer, in the protocol's order."""


def get(module: str, kind: str) -> Protocol:
    return PROTOCOLS[f"{module}/{kind}"]


def markdown() -> str:
    """Every protocol as tables: docs/protocol.md's first part (exchange.markdown adds the files)."""
    lines = ["# The port protocol", "", "Generated by `spec-parity protocol` from spec_parity/protocol.py; "
             "do not edit by hand.", "", __doc__.split("\n\n", 1)[1].strip(), ""]
    for key, p in PROTOCOLS.items():
        lines += [f"## {key}", "", p.what + ".", ""]
        if p.options:
            lines += ["Options: " + "; ".join(f"`{k}` {v}" for k, v in p.options.items()) + ".", ""]
        if p.inputs:
            lines += ["Inputs: " + "; ".join(f"`{k}` {v}" for k, v in p.inputs.items()) + ".", ""]
        lines += ["| array | shape | dtype | required | meaning |", "|---|---|---|---|---|"]
        lines += [f"| `{q.name}` | {q.shape} | {q.dtype} | {'yes' if q.required else 'no'} | {q.meaning} |"
                  for q in p.returns]
        lines.append("")
    return "\n".join(lines)

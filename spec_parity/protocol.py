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

    def undocumented(self, options: dict) -> list[str]:
        """The keys of a case's options (harness.options) this protocol does not document."""
        return sorted(set(options) - set(self.options))


REQUEST = {
    "module": "the module the case belongs to (`targets`, `assistant`, `dspark`, `dflash`)",
    "case": "the case's name within its module (e.g. `mod-qwen3`)",
    "kind": "the protocol the case follows: the sections below are `module/kind`",
    "target": "the target checkpoint's directory, as it is on disk (config.json and safetensors)",
    "drafter": "the drafter checkpoint's directory; None for a `targets` case",
    "prompt": "the prompt's token ids, int32 [1, P]",
    "options": "how to run the case, name -> value: the keys listed under each protocol below, and "
               "only those (the case's parameters over the reference's conventions)",
    "dtype": "the precision to load the checkpoints and compute in (`float32`, or `bfloat16` / `float16` "
             "for a case in that dtype), whatever dtype the weights are stored in: a checkpoint stored in "
             "bfloat16 is cast on load, as the reference casts it; the returned arrays keep the dtypes the "
             "tables give",
    "inputs": "the reference arrays the port is fed, name -> numpy array (Inputs below; empty where none)",
}
"""Request's fields and what each holds (docs/protocol.md; a test holds it to the dataclass)."""


def choice(what: str, values: dict) -> str:
    """An option's meaning and each value it takes."""
    return what + ": " + "; ".join(f'`"{v}"` {meaning}' for v, meaning in values.items())


PROMPT_LEN = {"prompt_len": "P, the prompt's length (the ids are `Request.prompt`)"}
GAMMA = {"gamma": "draft tokens per round"}
DFLASH_SCALES = {"scales": choice(
    "where the drafter's `input_embedding_scale` and `output_multiplier` are read from config.json", {
        "nested": "from `dflash_config` only, a top-level key is not read (z-lab MLX)",
        "either": "`dflash_config` first, then the config's top level (z-lab torch); the two agree on a "
                  "checkpoint that nests both"})}
DFLASH_CONVENTIONS = {
    "window": choice("the context window of the drafter's sliding layers; the two differ only after a one-row "
                     "context update on a full ring", {
                         "positional": "by position: the window drops the oldest context rows (z-lab torch)",
                         "zlab-mlx": "mlx-lm's rotating buffer attended as it lies, masked by buffer index: "
                                     "the block loses the newest context rows instead of the oldest (z-lab MLX)"}),
    "embed": choice("the block's embedding (anchor and mask tokens through the target's embedding)", {
        "scaled": "times the target's embedding scale, Gemma-4's sqrt(H) (z-lab MLX)",
        "raw": "the raw embedding rows (z-lab torch); on a target with no scale (Qwen3) the two agree"}),
    "prefill": choice("how the target prefills the prompt, which makes the first tap rows (`taps.0`) and the first "
                      "anchor", {
                          "split": "the prompt less its last token in one forward, then the last token on its "
                                   "own (z-lab MLX)",
                          "whole": "the whole prompt in one forward (z-lab torch)"})
               + ". On a Gemma-4 target the two give `taps.0` (and the logits drafted from it) different last "
                 "bits, so a z-lab MLX module case (L1, bit-exact) prefilled whole fails there; on a Qwen3 "
                 "target they agree bit for bit. A loop case prefills as the port's serve loop does (its L2 "
                 "budgets allow the difference)",
    **DFLASH_SCALES,
}
"""The reference's conventions a DFlash case names (spec_parity/deltas.py: one delta each): the port
must follow the value the case gives, the one its reference uses."""

DFLASH_EOS = {"eos": "stop token ids, a list (empty: none); a stop token ends the stream and is not content"}
LOOP_OPTIONS = {
    "assistant": {**PROMPT_LEN, **GAMMA, "max_tokens": "tokens to generate",
                  "eos": "a stop token id (-1: none); it ends the stream and is not content"},
    "dspark": {**PROMPT_LEN, "max_new_tokens": "tokens to generate (DeepSpec's count)",
               "threshold": "the confidence threshold each block's proposal is pruned at"},
    "dflash": {**DFLASH_CONVENTIONS, **PROMPT_LEN, "max_tokens": "tokens to generate", **DFLASH_EOS},
}
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
    Quantity("tau", "[1]", "float64", "mean tokens committed per round"),
)


LAYER_INPUTS = {"layer.*": "the reference's output of each drafter layer in the first draft (block or step 0), "
                          "for the own-error run"}
LAYER_RETURNS = (
    Quantity("layer.*", "[n, H]", "float32", "drafter layer i's output in the first draft (n: block rows, 1 for a step)"),
    Quantity("own.*", "[n, H]", "float32", "layer i fed the reference's layer.{i-1} and any other own-error "
             "input (own error; layer 0 on its own input)"),
)


SAMPLED = {"temperature": "the sampler's temperature", "runs": "requests to run, one seed each",
           "seed0": "the first seed (request i samples with seed seed0 + i)",
           "ref_seed0": "the reference's first seed, so its draws are independent of the port's; a port ignores it"}
SAMPLED_OPTIONS = {
    "assistant": {"prompt": "the fixed prompt's ids (also `Request.prompt`)", **GAMMA,
                  "max_tokens": "tokens a request generates (as the assistant's loop counts them)", **SAMPLED},
    "dspark": {**PROMPT_LEN, "max_new_tokens": "tokens a request generates (DeepSpec's count)",
               "threshold": "the confidence threshold each block's proposal is pruned at", **SAMPLED},
}


SAMPLED_END = Quantity("sampled.end", "[runs]", "int32", "the token the first drafting round ends with: the "
                       "correction's id, V + the bonus's id after a full accept, 2V where the request stops "
                       "before it (V the vocabulary)", True)


def _sampled(module: str, returns: tuple[Quantity, ...]) -> Protocol:
    return Protocol(module, "sampled", "the serve loop at T > 0, once per seed: per request a few small integers, "
                    "compared as distributions with the reference's sampled loop (two-sample chi-square)",
                    SAMPLED_OPTIONS[module], {}, returns)


def _loop(module: str) -> Protocol:
    return Protocol(module, "loop", "the serve loop: draft, one batched verify, accept, trim, at T=0",
                    LOOP_OPTIONS[module], {}, LOOP_RETURNS)


PROTOCOLS = {p.module + "/" + p.kind: p for p in (
    Protocol("targets", "forward", "the target's forward on the prompt, and its greedy stream",
             {**PROMPT_LEN, "new_tokens": "N, greedy tokens to generate after the prompt"},
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
             {**PROMPT_LEN, "gamma": "draft steps to chain", "convention": choice(
                 "the reference's draft-step convention (spec_parity/drafters/assistant/adapter.py CONVENTIONS)", {
                     "optiq": "step k at position P+k, the donor sliding view the newest W-1 entries (optiq)",
                     "hfpos": "every step at position P (transformers), the donor view as optiq's",
                     "hfwin": "positions as optiq's, the donor sliding view transformers' own mask: the newest "
                              "W+1 entries"}),
              "head_rows": choice("an untied centroid head's candidate rows (absent: tied or no centroid head)", {
                  "embed": "the candidates scored on the embedding's rows (optiq)",
                  "lm_head": "the candidates scored on lm_head.weight's rows (transformers)"})},
             {"in.*": "transformers cases: the anchor, position, donor K/V and embedding table to draft from",
              **LAYER_INPUTS},
             (Quantity("step*.token", "[1]", "int32", "the draft token of step i", True),
              Quantity("step*.logits", "[V]", "float32", "the drafter's logits of step i", True),
              Quantity("step*.next_hidden", "[1, 1, H]", "float32", "the hidden the next step is fed"),
              Quantity("anchor.token", "[1]", "int32", "the anchor token (from the target)"),
              Quantity("anchor.hidden", "[1, 1, H]", "float32", "the anchor hidden (from the target)"),
              Quantity("donor.*", "[1, heads, S, d]", "float32", "the donor K/V views the drafter attends"))
             + LAYER_RETURNS),
    Protocol("dspark", "modules", "the first DSpark draft round after prefill, module by module",
             {**PROMPT_LEN, "thresholds": "the confidence thresholds t of `prefix@t` and `proposal@t`"},
             {**LAYER_INPUTS, "context_*": "the reference's context K/V of each drafter layer, for the own-error "
                                           "run: each layer sees the reference's context, not one built from the "
                                           "port's taps"},
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
             {**DFLASH_CONVENTIONS, **PROMPT_LEN,
              "accepts": "one entry a round: round r accepts its first min(accepts[r], B-1) drafts whatever the "
                         "target says; the next anchor is the target's greedy token after them"},
             {**LAYER_INPUTS, "taps.0": "the reference's prefill taps, for the own-error run: the drafter's "
                                        "context from them, not from the port's taps"},
             (Quantity("tokens.*", "[B-1]", "int32", "round r's draft tokens", True),
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
    Protocol("dflash", "extension", "the DSpark-on-DFlash extension (no reference: L3; its heads: DeepSpec's), extras on, at T=0",
             {**DFLASH_SCALES, "extension": "true: the case is the extension's (its kind says so too)",
              **PROMPT_LEN, "max_tokens": "tokens to generate",
              "thresholds": "confidence thresholds (one for every position, or one per position)"},
             {"heads.hidden": "[blocks, n, H] final hidden rows the heads are fed (teacher-forced, with the "
                              "rest of heads.*)",
              "heads.base_logits": "[blocks, n, V] the base rows (after any softcap) the Markov bias joins",
              "heads.anchor": "[blocks] each block's anchor: the first slot's previous token",
              "heads.tokens": "[blocks, n] the chain's tokens: slot k's previous token is token k-1"},
             LOOP_RETURNS + (
                 Quantity("ext.confidence", "[sum n_r]", "float32", "every block's confidence logits", True),
                 Quantity("ext.block_len", "[R]", "int32", "each block's length n_r", True),
                 Quantity("ext.proposed", "[R]", "int32", "tokens proposed from each block (after pruning)", True),
                 Quantity("ext.*", "[sum n_r, V]", "float32", "base (before the Markov head) and extended rows"),
                 Quantity("unpruned.base_logits", "[D, V]", "float32", "pruning off: the base draft rows", True),
                 Quantity("unpruned.logits", "[D, V]", "float32", "pruning off: the extended draft rows", True),
                 Quantity("heads.logits", "[blocks, n, V]", "float32", "the Markov head's rows on the fed heads.* "
                          "(compared with DeepSpec's)"),
                 Quantity("heads.confidence", "[blocks, n]", "float32", "the confidence head's logits on the fed "
                          "heads.* (compared with DeepSpec's)"))),
)}


MODULES = tuple(dict.fromkeys(key.split("/")[0] for key in PROTOCOLS))
"""The modules a port may answer, in the protocol's order."""


def get(module: str, kind: str) -> Protocol:
    return PROTOCOLS[f"{module}/{kind}"]


def _request_section() -> list[str]:
    """What a port is handed (Request), and how it declines a case."""
    from .ports import DECLINE_EXIT

    return ["## The request", "", "A port's run is called with one `spec_parity.protocol.Request` per case "
            "(through the file protocol: request.json and inputs.safetensors, below):", "",
            *[f"- `{name}`: {meaning}." for name, meaning in REQUEST.items()], "",
            "A port that does not implement a case (a kind, or a checkpoint variant it has no counterpart for) "
            "raises `spec_parity.ports.Declined(reason)`; a `--port-cmd` command exits with status "
            f"{DECLINE_EXIT}, its last line of stderr the reason. The case reads DECLINED with that reason: "
            "counted apart, never as a pass. Any other exception, or exit status, is the case's ERROR.", ""]


def markdown() -> str:
    """Every protocol as tables: docs/protocol.md's first part (exchange.markdown adds the files)."""
    lines = ["# The port protocol", "", "Generated by `spec-parity protocol` from spec_parity/protocol.py; "
             "do not edit by hand.", "", __doc__.split("\n\n", 1)[1].strip(), "", *_request_section()]
    for key, p in PROTOCOLS.items():
        lines += [f"## {key}", "", p.what + ".", ""]
        if p.options:
            lines += ["Options:", "", *[f"- `{k}`: {v}." for k, v in p.options.items()], ""]
        if p.inputs:
            lines += ["Inputs: " + "; ".join(f"`{k}` {v}" for k, v in p.inputs.items()) + ".", ""]
        lines += ["| array | shape | dtype | required | meaning |", "|---|---|---|---|---|"]
        lines += [f"| `{q.name}` | {q.shape} | {q.dtype} | {'yes' if q.required else 'no'} | {q.meaning} |"
                  for q in p.returns]
        lines.append("")
    return "\n".join(lines)

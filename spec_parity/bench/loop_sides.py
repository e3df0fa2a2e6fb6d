"""The generation loops `spec-parity bench --serve` puts side by side (bench/loops.py), each on one
case's target and drafter: the target's plain decode (mlx-lm), our serve loop (spec_parity.port.serve.generate,
default and bucketed, through bench/port_sides.py) and every peer's OWN loop, called through its
oracle's or adapter's functions (oracles/, spec_parity/third_party.py):

  optiq          `spec_generate` (optiq 0.7.7, the Gemma-4 assistant; spec_parity.oracles.assistant.optiq_stream)
  zlab-mlx       `dflash.model_mlx.stream_generate` (z-lab dflash 0.1.0; spec_parity.oracles.dflash.stream)
  dflash-mlx     `stream_dflash_generate` (0.1.8; verify_mode "dflash", fixed blocks)
  dspark-mlx     `generate_eager` (0.1.0, its DeepSpec-matched loop, threshold 0)
  deepspec-torch DeepSpec's evaluator loop `generate_decoding_sample` (torch; CUDA unless forced)

A loop side is a `Side` (bench/sides.py) whose `build(ckpt, env) -> Loop` loads the models with the
side's own loader inside `serve_weights` (every side gets the same arrays) and returns
`generate(prompt, n) -> Run`, one fresh request. A loop is observed from outside (its events, its
stats, the wall clock), never changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import mlx.core as mx

from .. import third_party
from . import port_sides
from .peers import SIDES as PEER_SIDES
from .peers import _load_state
from .serve import _probe, _rounds, _timed_forward
from .shapes import SOURCES, Checkpoints, serve_weights
from .sides import Side, Skip


@dataclass
class Run:
    """One request: the stream and when the host had it."""

    tokens: list[int]
    t_first: float          # the first group of tokens on the host (the prefill's token, or round 1)
    t_end: float            # the last token on the host
    n_first: int            # tokens in that first group: not counted as decode
    rounds: int             # verify rounds after the first group
    drafted: int | None = None
    accepted: int | None = None
    split: list[dict] | None = None   # per round (draft_s, verify_s, accept_trim_s, ...) where exposed

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - self.n_first

    @property
    def decode_s(self) -> float:
        return self.t_end - self.t_first


@dataclass
class Loop:
    generate: Callable[[list[int], int], Run]
    framework: str = "mlx"
    device: str = ""
    notes: list[str] = field(default_factory=list)
    split: Callable[[list[int], int], list[dict]] | None = None   # one observed request, round split
    keep: object = None


def _mlx_target(ckpt: Checkpoints):
    """The target as the peers load it: mlx-lm's `load_model`."""
    from mlx_lm.utils import load_model

    with serve_weights(ckpt):
        return load_model(ckpt.target_dir)[0]


def _timed(events):
    """Drain a loop's event generator: (events, arrival time of each)."""
    out, times = [], []
    for e in events:
        out.append(e)
        times.append(time.perf_counter())
    return out, times


# ---- the target's plain decode and our loop --------------------------------------------------------

def plain_side(ckpt: Checkpoints, env) -> Loop:
    """mlx-lm's `generate_step` (greedy) on the target: one target forward per token."""
    from mlx_lm.generate import generate_step

    model = _mlx_target(ckpt)

    def generate(prompt, n):
        events, times = _timed(generate_step(mx.array(prompt), model, max_tokens=n))
        return Run([int(tok) for tok, _ in events], times[0], times[-1], 1, len(events) - 1)

    return Loop(generate, keep=model, notes=["mlx_lm.generate.generate_step, argmax"])


def port_side(ckpt: Checkpoints, env, path: str = "", verify: str = "auto", pipeline: str = "auto") -> Loop:
    """spec_parity.port.serve.generate on one of the port's paths (port_sides.PATHS), verify forwards and loops,
    wrapped as the bench's serve section wraps it (bench/serve.py `_probe`): the first draft marks
    the prefill's end; `split` times one request's rounds (`_timed_forward`, `_rounds`: the drafts
    evaluated in the draft, the forward in the verify; a pipelined loop is then sequential in
    effect). The notes name the loop a request ran ("pipelined" or "sequential")."""
    target = port_sides.load_target(ckpt)
    provider = port_sides.PortProvider(ckpt, path)
    gamma = ckpt.case.shapes.gamma

    def request(prompt, n, events, split=False):
        tokens, stats = port_sides.generate(target, prompt, n, _probe(provider, events, split=split), gamma, verify,
                                            pipeline)
        return tokens, stats, time.perf_counter()

    def generate(prompt, n):
        events: list = []
        tokens, stats, t_end = request(prompt, n, events)
        first = next((e[1] for e in events if e[0] == "draft"), t_end)
        loop = "pipelined" if stats.pipeline == "on" else "sequential"
        if loop not in notes:
            notes.append(loop)
        return Run(tokens, first, t_end, 1, len(stats.trace), stats.drafted, stats.accepted)

    def split(prompt, n):
        events: list = []
        with _timed_forward(events):
            _, _, t_end = request(prompt, n, events, split=True)
        return _rounds(events, t_end)

    options = port_sides.PATHS[path][ckpt.source]
    notes = [", ".join([f"{k}={v}" for k, v in options.items()] + port_sides.resolved(provider.drafter)
                       + [port_sides.verify_note(target, provider, verify)])]
    return Loop(generate, notes=notes, split=split, keep=(target, provider))


# ---- the peers' own loops ------------------------------------------------------------------------

def optiq_side(ckpt: Checkpoints, env) -> Loop:
    """optiq's `spec_generate` (gamma drafts per round, greedy verify) on token ids; rounds, drafts
    and accepts from its own SpecStats."""
    from spec_parity.oracles import assistant

    model = _mlx_target(ckpt)
    with serve_weights(ckpt):
        drafter = assistant.optiq_drafter(ckpt.drafter_dir)

    def generate(prompt, n):  # no stop token (-1): every side decodes n tokens
        events, times = _timed(assistant.optiq_stream(model, drafter, prompt, ckpt.case.shapes.gamma, n, -1))
        at = [t for e, t in zip(events, times) if e.kind == "token"]
        stats = events[-1].stats
        return Run([e.token_id for e in events if e.kind == "token"], at[0], at[-1], 1, stats.n_target_calls - 1,
                   stats.n_drafted, stats.n_accepted)

    return Loop(generate, keep=(model, drafter))


def zlab_mlx_side(ckpt: Checkpoints, env) -> Loop:
    """z-lab's `stream_generate` at T=0: one response per round (spec_parity.oracles.dflash builds the models,
    at the run's dtype as every side, and the id-only tokenizer)."""
    from spec_parity.oracles import dflash

    with serve_weights(ckpt):
        model, draft = dflash._load(ckpt.target_dir, ckpt.drafter_dir, ckpt.dtype)

    def generate(prompt, n):
        responses, times = _timed(dflash.stream(model, draft, prompt, n, set()))
        got = [(r, t) for r, t in zip(responses, times) if r.tokens]
        tokens = [x for r, _ in got for x in r.tokens]
        rounds = [len(r.tokens) - 1 for r, _ in got[1:]]
        return Run(tokens, got[0][1], got[-1][1], len(got[0][0].tokens), len(rounds), None, sum(rounds))

    return Loop(generate, keep=(model, draft))


def dflash_mlx_side(ckpt: Checkpoints, env) -> Loop:
    """dflash-mlx's `stream_dflash_generate` with `EagerDraftBackend`, verify_mode "dflash" (fixed
    blocks; its default "adaptive" shortens blocks on wall-clock timing) and cycle events on: per
    round its own draft / verify / acceptance + rollback times. Its prompt lookup ("copyspec")
    stays on, as it ships."""
    model = _mlx_target(ckpt)
    ops = third_party.dflash_mlx_target_ops(model)
    with serve_weights(ckpt):
        draft = third_party.dflash_mlx_draft(ckpt.drafter_dir)
    third_party.dflash_mlx_bind(draft, model, ops)
    token_event, cycle_event = third_party.dflash_mlx_event_types()

    def generate(prompt, n):
        with third_party.dflash_mlx_hooks(model, ops):   # its hooks for its own requests only
            events, times = _timed(third_party.dflash_mlx_generate(model, ops, draft, prompt, n))
        at = [t for e, t in zip(events, times) if isinstance(e, token_event)]
        cycles = [e for e in events if isinstance(e, cycle_event)]
        split = [{"draft_s": c.draft_us / 1e6, "verify_s": c.verify_us / 1e6,
                  "accept_trim_s": (c.acceptance_us + c.rollback_us) / 1e6,
                  "other_s": (c.hidden_extraction_us + c.other_us) / 1e6, "round_s": c.cycle_total_us / 1e6}
                 for c in cycles]
        return Run([e.token_id for e in events if isinstance(e, token_event)], at[0], at[-1], 1, len(cycles),
                   sum(c.block_len - 1 for c in cycles), sum(c.acceptance_len for c in cycles), split)

    return Loop(generate, keep=(model, draft), notes=["verify_mode dflash, EagerDraftBackend, cycle events on"])


def dspark_mlx_side(ckpt: Checkpoints, env) -> Loop:
    """dspark-mlx's `generate_eager` (T=0, threshold 0) on its own mlx-lm host (Qwen3 targets). Its
    loop starts from the prompt's last token: its first group is round 1's tokens. One round = its
    n_accepted drafts + one token."""
    if not ckpt.target_config.get("model_type", "").startswith("qwen3"):
        raise Skip("dspark-mlx's host for a Gemma-4 target is mlx-vlm's model, which does not load an mlx-lm "
                   "gemma4_text checkpoint: Qwen3 targets only")
    model = _mlx_target(ckpt)
    with serve_weights(ckpt):
        drafter, config = third_party.dspark_mlx_draft(ckpt.drafter_dir)
    token_event, summary_event = third_party.dspark_mlx_event_types()

    def generate(prompt, n):
        events, times = _timed(third_party.dspark_mlx_generate(model, drafter, config["target_layer_ids"], prompt, n))
        tokens = [(e, t) for e, t in zip(events, times) if isinstance(e, token_event)]
        summary = next(e for e in events if isinstance(e, summary_event))
        starts, at = [], 0
        while at < len(tokens):          # a round yields n_accepted + 1 events, each carrying it
            starts.append(at)
            at += tokens[at][0].n_accepted + 1
        first = starts[1] if len(starts) > 1 else len(tokens)
        return Run([e.token for e, _ in tokens], tokens[first - 1][1], tokens[-1][1], first, len(starts) - 1,
                   summary.n_drafted, summary.n_accepted)

    return Loop(generate, keep=(model, drafter), notes=["generate_eager, threshold 0"])


def deepspec_side(ckpt: Checkpoints, env) -> Loop:
    """DeepSpec's evaluator loop `generate_decoding_sample` with its DSpark evaluator's
    `_init_context` / `_propose` / `_update` (spec_parity.oracles.dspark.evaluator / decode), T=0, threshold 0,
    on transformers' target; both models built from the checkpoints' configs and filled with the
    case's arrays. `init_context` runs right after the prefill: it marks the decode's start."""
    from spec_parity.oracles import dspark

    why = dspark.status()
    if why:
        raise Skip(why)
    import torch

    dev, tdt = torch.device(env.torch_device), getattr(torch, ckpt.dtype)
    target = dspark.empty_target(ckpt.target_dir, tdt, dev)
    draft = dspark.empty_drafter(ckpt.drafter_dir, tdt, dev)
    _load_state(target, ckpt.weights("target"), dev, tdt, "transformers' target")
    _load_state(draft, ckpt.weights("drafter"), dev, tdt, "DeepSpec's DSpark")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def generate(prompt, n):
        ev, mark = dspark.evaluator(target, draft, n, 0.0), {}

        def init_context(**kw):
            sync()
            mark["t"] = time.perf_counter()
            return ev._init_context(**kw)

        with torch.inference_mode():
            res = dspark.decode(ev, torch.tensor([prompt], device=dev), init_context=init_context)
            sync()
        t_end = time.perf_counter()
        tokens = res.output_ids[0, res.num_input_tokens:].tolist()
        return Run(tokens, mark.get("t", t_end), t_end, 1, len(res.acceptance_lengths),
                   sum(res.proposal_lengths), sum(res.accepted_draft_lengths))

    return Loop(generate, "torch", str(dev), keep=(target, draft), notes=[f"torch {dev}, {ckpt.dtype}"])


PLAIN_VERIFY = "port-plain-verify"  # our default loop with its verify op by op (before port/fast/verify.py)
COMPILED_VERIFY = "port-compiled-verify"  # our default loop, its compiled verify on mx.fast's attention (before verify="kernel")
SEQUENTIAL = "port-sequential"      # our default loop, its rounds one after the other (before serve._pipelined)
AGAIN = "port-again"                # our default loop once more: the A/A control of a run's side-by-side ratios

# plain first (the reference stream and the baseline), then ours, then the peers' loops: each peer's
# Side of the step bench (its name, sources, framework, modules and install line) with its loop.
_PEERS = {s.name: s for s in PEER_SIDES}
SIDES: dict[str, Side] = {s.name: s for s in (
    Side("plain", SOURCES, plain_side, peer=False, needs=("mlx_lm",), install="mlx-lm"),
    *(Side(port_sides.path_name(p), tuple(by_source), partial(port_side, path=p), peer=False)
      for p, by_source in port_sides.PATHS.items() if p != "bucketed-2seg"),
    Side(PLAIN_VERIFY, ("dspark", "dflash"), partial(port_side, verify="plain"), peer=False),
    Side(COMPILED_VERIFY, ("dspark", "dflash"), partial(port_side, verify="compiled"), peer=False),
    Side(SEQUENTIAL, ("dspark", "dflash"), partial(port_side, pipeline="off"), peer=False),
    Side(AGAIN, SOURCES, port_side, peer=False),
    *(replace(_PEERS[name], build=build) for name, build in (
        ("optiq", optiq_side), ("zlab-mlx", zlab_mlx_side), ("dflash-mlx", dflash_mlx_side),
        ("dspark-mlx", dspark_mlx_side), ("deepspec-torch", deepspec_side))),
)}
OURS = tuple(port_sides.path_name(p) for p in port_sides.PATHS) + (PLAIN_VERIFY, COMPILED_VERIFY, SEQUENTIAL, AGAIN)


ALWAYS = ("plain", "port")   # the baseline and our default path: in every --serve run, as in the step bench


def sides_for(source: str, wanted: list[str] | None) -> list[Side]:
    """plain and our default first, then those of `wanted` (None: every side) that serve the source."""
    return [s for s in SIDES.values() if source in s.sources and (s.name in ALWAYS or wanted is None
                                                                   or s.name in wanted)]

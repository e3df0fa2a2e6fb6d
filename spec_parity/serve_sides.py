"""The generation loops `spec-parity bench --serve` puts side by side, each on one case's target and
drafter: the target's plain decode (mlx-lm), our serve loop (port.serve.generate, default and
bucketed), and every peer's OWN loop, called here and nowhere else:

  optiq          `spec_generate` (optiq 0.7.7, the Gemma-4 assistant)
  zlab-mlx       `dflash.model_mlx.stream_generate` (z-lab dflash 0.1.0)
  dflash-mlx     `dflash_mlx.runtime.stream_dflash_generate` (0.1.8; verify_mode "dflash", fixed blocks)
  dspark-mlx     `dspark_mlx.generate_eager` (0.1.0, its DeepSpec-matched loop, threshold 0)
  deepspec-torch DeepSpec's evaluator loop `generate_decoding_sample` (torch; CUDA unless forced)

A side is `(case, env) -> Loop`: it loads the models with its own loader inside `serve_weights`
(every side gets the same arrays) and returns `generate(prompt, n) -> Run`, one fresh request.
A loop is observed from outside (its events, its stats, the wall clock), never changed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import mlx.core as mx

from .bench import _probe, _rounds, _timed_forward, bucketed_loop
from .bench_shapes import Case, serve_weights
from .bench_sides import PortProvider, Skip, _load_state


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


def _mlx_target(case: Case):
    from mlx_lm.utils import load_model

    with serve_weights(case):
        return load_model(case.target_dir)[0]


# ---- the target's plain decode and our loop --------------------------------------------------------

def plain_side(case: Case, env) -> Loop:
    """mlx-lm's `generate_step` (greedy) on the target: one target forward per token."""
    from mlx_lm.generate import generate_step

    model = _mlx_target(case)

    def generate(prompt, n):
        tokens, times = [], []
        for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
            tokens.append(int(tok))
            times.append(time.perf_counter())
        return Run(tokens, times[0], times[-1], 1, len(tokens) - 1)

    return Loop(generate, keep=model, notes=["mlx_lm.generate.generate_step, argmax"])


def port_side(case: Case, env, bucketed: bool = False) -> Loop:
    """port.serve.generate, wrapped as the bench's serve section wraps it (bench._probe): the first
    draft marks the prefill's end; `split` times one request's rounds (bench._timed_forward and
    bench._rounds: the drafts evaluated in the draft, the forward in the verify)."""
    from port import serve, targets

    with serve_weights(case):
        target = targets.load(case.target_dir)
    options = bucketed_loop(case) if bucketed else {"provider": PortProvider(case), "kv_bucket": None}

    def request(prompt, n, events, split=False):
        tokens, stats = serve.generate(target, prompt, n, _probe(options["provider"], events, split=split),
                                       gamma=case.spec.gamma, eos=set(), kv_bucket=options["kv_bucket"])
        return tokens, stats, time.perf_counter()

    def generate(prompt, n):
        events: list = []
        tokens, stats, t_end = request(prompt, n, events)
        first = next((e[1] for e in events if e[0] == "draft"), t_end)
        return Run(tokens, first, t_end, 1, len(stats.trace), stats.drafted, stats.accepted)

    def split(prompt, n):
        events: list = []
        with _timed_forward(events):
            _, _, t_end = request(prompt, n, events, split=True)
        return _rounds(events, t_end)

    notes = [f"kv_bucket={options['kv_bucket']}, bucketed drafter"] if bucketed else []
    return Loop(generate, notes=notes, split=split, keep=(target, options))


def port_bucketed_side(case: Case, env) -> Loop:
    return port_side(case, env, bucketed=True)


# ---- the peers' own loops ------------------------------------------------------------------------

def _timed(events):
    """Drain a peer's event generator: (events, arrival time of each)."""
    out, times = [], []
    for e in events:
        out.append(e)
        times.append(time.perf_counter())
    return out, times


def optiq_side(case: Case, env) -> Loop:
    """optiq's `spec_generate` (gamma drafts per round, greedy verify) with a word tokenizer over
    token ids (oracles.assistant.WordTokenizer); rounds, drafts and accepts from its own SpecStats."""
    from optiq.runtime.spec import SpecConfig, spec_generate
    from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantDrafter

    from oracles.assistant import WordTokenizer

    model = _mlx_target(case)
    with serve_weights(case):
        drafter = GemmaAssistantDrafter.from_pretrained(str(case.drafter_dir))
    tok = WordTokenizer(-1)  # no stop token: every side decodes n tokens

    def generate(prompt, n):
        events, times = _timed(spec_generate(model, drafter, tok, tok.decode(prompt),
                                             SpecConfig(gamma=case.spec.gamma, max_tokens=n, eos_token_id=-1)))
        at = [t for e, t in zip(events, times) if e.kind == "token"]
        stats = events[-1].stats
        return Run([e.token_id for e in events if e.kind == "token"], at[0], at[-1], 1, stats.n_target_calls - 1,
                   stats.n_drafted, stats.n_accepted)

    return Loop(generate, keep=(model, drafter))


def zlab_mlx_side(case: Case, env) -> Loop:
    """z-lab's `stream_generate` at T=0: one response per round (oracles.dflash builds the models
    and the id-only tokenizer)."""
    from dflash import model_mlx as z

    from oracles import dflash as zo

    with serve_weights(case):
        model, draft = zo._load(case.target_dir, case.drafter_dir)
    tokenizer = zo._tokenizer(set())

    def generate(prompt, n):
        responses, times = _timed(z.stream_generate(model, draft, tokenizer, mx.array(prompt), max_tokens=n,
                                                    temperature=0.0))
        got = [(r, t) for r, t in zip(responses, times) if r.tokens]
        tokens = [x for r, _ in got for x in r.tokens]
        rounds = [len(r.tokens) - 1 for r, _ in got[1:]]
        return Run(tokens, got[0][1], got[-1][1], len(got[0][0].tokens), len(rounds), None, sum(rounds))

    return Loop(generate, keep=(model, draft))


def dflash_mlx_side(case: Case, env) -> Loop:
    """dflash-mlx's `stream_dflash_generate` with `EagerDraftBackend`, verify_mode "dflash" (fixed
    blocks; its default "adaptive" shortens blocks on wall-clock timing) and cycle events on: per
    round its own draft / verify / acceptance + rollback times. Its prompt lookup ("copyspec")
    stays on, as it ships."""
    from dflash_mlx.diagnostics import DiagnosticsConfig, TraceConfig
    from dflash_mlx.draft_backend import EagerDraftBackend
    from dflash_mlx.engine.events import CycleCompleteEvent, TokenEvent
    from dflash_mlx.engine.target_ops import bind_draft_to_target, resolve_target_ops
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.context import build_offline_runtime_config, build_runtime_context
    from dflash_mlx.runtime.loading import load_draft_bundle

    model = _mlx_target(case)
    ops = resolve_target_ops(model)
    ops.install_speculative_hooks(model)
    with serve_weights(case):
        draft, _ = load_draft_bundle(str(case.drafter_dir), lazy=False)
    bind_draft_to_target(draft, model, target_ops=ops)

    def generate(prompt, n):
        context = build_runtime_context(build_offline_runtime_config(verify_mode="dflash"),
                                        DiagnosticsConfig(trace=TraceConfig(cycle_events=True)))
        events, times = _timed(stream_dflash_generate(
            target_model=model, target_ops=ops, draft_model=draft, draft_backend=EagerDraftBackend(),
            prompt_tokens_override=list(prompt), max_new_tokens=n, stop_token_ids=[], runtime_context=context))
        at = [t for e, t in zip(events, times) if isinstance(e, TokenEvent)]
        cycles = [e for e in events if isinstance(e, CycleCompleteEvent)]
        split = [{"draft_s": c.draft_us / 1e6, "verify_s": c.verify_us / 1e6,
                  "accept_trim_s": (c.acceptance_us + c.rollback_us) / 1e6,
                  "other_s": (c.hidden_extraction_us + c.other_us) / 1e6, "round_s": c.cycle_total_us / 1e6}
                 for c in cycles]
        return Run([e.token_id for e in events if isinstance(e, TokenEvent)], at[0], at[-1], 1, len(cycles),
                   sum(c.block_len - 1 for c in cycles), sum(c.acceptance_len for c in cycles), split)

    return Loop(generate, keep=(model, draft), notes=["verify_mode dflash, EagerDraftBackend, cycle events on"])


def dspark_mlx_side(case: Case, env) -> Loop:
    """dspark-mlx's `generate_eager` (T=0, threshold 0) on its own mlx-lm host
    (`hosts.MlxLmHostAdapter`, Qwen3 targets). Its loop starts from the prompt's last token: its
    first group is round 1's tokens. One round = its n_accepted drafts + one token."""
    import dspark_mlx
    from dspark_mlx import SummaryEvent, TokenEvent, generate_eager
    from dspark_mlx.hosts import MlxLmHostAdapter

    if not case.target_config.get("model_type", "").startswith("qwen3"):
        raise Skip("dspark-mlx's host for a Gemma-4 target is mlx-vlm's model, which does not load an mlx-lm "
                   "gemma4_text checkpoint: Qwen3 targets only")
    model = _mlx_target(case)
    with serve_weights(case):
        drafter, config = dspark_mlx.load_draft(str(case.drafter_dir))

    def generate(prompt, n):
        host = MlxLmHostAdapter(model, config["target_layer_ids"])
        events, times = _timed(generate_eager(host, drafter, list(prompt), n))
        tokens = [(e, t) for e, t in zip(events, times) if isinstance(e, TokenEvent)]
        summary = next(e for e in events if isinstance(e, SummaryEvent))
        starts, at = [], 0
        while at < len(tokens):          # a round yields n_accepted + 1 events, each carrying it
            starts.append(at)
            at += tokens[at][0].n_accepted + 1
        first = starts[1] if len(starts) > 1 else len(tokens)
        return Run([e.token for e, _ in tokens], tokens[first - 1][1], tokens[-1][1], first, len(starts) - 1,
                   summary.n_drafted, summary.n_accepted)

    return Loop(generate, keep=(model, drafter), notes=["generate_eager, threshold 0"])


def deepspec_side(case: Case, env) -> Loop:
    """DeepSpec's evaluator loop `generate_decoding_sample` with its DSpark evaluator's
    `_init_context` / `_propose` / `_update` (as oracles/dspark.py drives it), T=0, threshold 0,
    on transformers' target; both models built from the checkpoints' configs and filled with the
    case's arrays. `init_context` runs right after the prefill: it marks the decode's start."""
    if env.torch_device is None:
        raise Skip(env.torch_reason)
    src = os.environ.get("DEEPSPEC_SRC")
    if not src or not os.path.isdir(os.path.join(src, "deepspec")):
        raise Skip("DEEPSPEC_SRC is not set to a DeepSpec checkout (see README, dspark)")
    if src not in sys.path:
        sys.path.insert(0, src)
    import torch
    from deepspec.eval.base_evaluator import generate_decoding_sample
    from deepspec.eval.dspark.evaluator import Gemma4DSparkEvaluator, Qwen3DSparkEvaluator
    from deepspec.modeling.dspark import Gemma4DSparkModel, Qwen3DSparkModel
    from transformers import AutoConfig, AutoModelForCausalLM

    dev, tdt = torch.device(env.torch_device), getattr(torch, case.dtype)
    gemma = case.target_config.get("model_type") == "gemma4_text"
    cls = Gemma4DSparkModel if gemma else Qwen3DSparkModel
    dconfig = cls.config_class.from_pretrained(case.drafter_dir)
    dconfig._attn_implementation = "sdpa"
    with torch.device(dev):
        target = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(case.target_dir), dtype=tdt,
                                                  attn_implementation="sdpa").eval()
        draft = cls(dconfig).to(tdt).eval()
    _load_state(target, case.weights("target"), dev, tdt, "transformers' target")
    _load_state(draft, case.weights("drafter"), dev, tdt, "DeepSpec's DSpark")
    ev = object.__new__(Gemma4DSparkEvaluator if gemma else Qwen3DSparkEvaluator)
    ev.draft_model, ev.target_model, ev.confidence_head_recorder = draft, target, None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def generate(prompt, n):
        ev.args = SimpleNamespace(max_new_tokens=n, temperature=0.0, confidence_threshold=0.0)
        mark = {}

        def init_context(**kw):
            sync()
            mark["t"] = time.perf_counter()
            return ev._init_context(**kw)

        with torch.inference_mode():
            res = generate_decoding_sample(target_model=target, input_ids=torch.tensor([prompt], device=dev),
                                           max_new_tokens=n, max_proposal_tokens=ev.max_proposal_tokens,
                                           temperature=0.0, stop_token_ids=None, init_context=init_context,
                                           propose=ev._propose, update=ev._update)
            sync()
        t_end = time.perf_counter()
        tokens = res.output_ids[0, res.num_input_tokens:].tolist()
        return Run(tokens, mark.get("t", t_end), t_end, 1, len(res.acceptance_lengths),
                   sum(res.proposal_lengths), sum(res.accepted_draft_lengths))

    return Loop(generate, "torch", str(dev), keep=(target, draft), notes=[f"torch {dev}, {case.dtype}"])


# name -> (sources it serves, the side, what to install if it is missing)
SIDES: dict[str, tuple[tuple[str, ...], Callable[[Case, object], Loop], str]] = {
    "plain": (("assistant", "dspark", "dflash"), plain_side, "mlx-lm"),
    "port": (("assistant", "dspark", "dflash"), port_side, ""),
    "port-bucketed": (("assistant", "dspark", "dflash"), port_bucketed_side, ""),
    "optiq": (("assistant",), optiq_side, "pip install --no-deps mlx-optiq==0.7.7 (+ huggingface_hub)"),
    "zlab-mlx": (("dflash",), zlab_mlx_side, "pip install --no-deps dflash==0.1.0 (+ huggingface_hub)"),
    "dflash-mlx": (("dflash",), dflash_mlx_side, "pip install --no-deps dflash-mlx==0.1.8"),
    "dspark-mlx": (("dspark",), dspark_mlx_side, "pip install --no-deps dspark-mlx==0.1.0"),
    "deepspec-torch": (("dspark",), deepspec_side, "export DEEPSPEC_SRC=<DeepSpec checkout>; torch, transformers"),
}
OURS = ("port", "port-bucketed")


def sides_for(source: str, wanted: list[str] | None) -> list[str]:
    """plain first (the reference stream and the baseline), then ours, then the peers."""
    names = [n for n, (srcs, *_) in SIDES.items() if source in srcs]
    return [n for n in names if n == "plain" or wanted is None or n in wanted]

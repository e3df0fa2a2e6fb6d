"""The sides `spec-parity bench` puts side by side on one case: our port and the peers.

A side is a function `(prep) -> Stepper`: it loads its drafter from the case's directories with
its OWN loader (inside `serve_weights`, so every side gets the same arrays), brings it to the
state after the context prefill, and returns `step`: one draft step chain (assistant: `gamma`
chained steps, as its loop drafts them) or one draft block (DSpark, DFlash) in that side's own
calls. A block step first appends one committed row to the context (the verify's tap row of the
anchor, as a round that accepted nothing commits), so the context grows by one row per step on
every side alike. Peers are imported lazily: a missing package or a failing call is the side's
recorded reason, never a crash. Nothing of a peer is re-implemented here; its own functions are
called in the order its own loop calls them (named in each side's docstring).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .bench_shapes import Case, serve_weights


@dataclass
class Prep:
    """What every side of one case starts from (built once, shared)."""

    case: Case
    target: object            # port.targets.Target (mlx-lm model + config), shared by the MLX sides
    caches: list              # the target's caches after the context prefill: the donor K/V
    taps: mx.array | None     # [1, ctx, n*H] the context rows' concatenated taps (block sources)
    row: mx.array | None      # [1, 1 + gamma, n*H] a verify's taps; row 0 joins the context per step
    anchor: int               # the token the first draft follows (the target's greedy next token)
    anchor_hidden: mx.array   # [1, 1, H] the target hidden that predicted it
    torch_device: str | None  # "cuda" / "cpu" for the torch sides, None: torch sides skipped
    torch_reason: str = ""    # why torch sides are skipped

    @property
    def gamma(self) -> int:
        return self.case.spec.gamma

    @property
    def ctx(self) -> int:
        return self.case.spec.ctx


@dataclass
class Stepper:
    step: Callable[[], object]
    framework: str = "mlx"            # "mlx" | "torch": how the loop synchronizes and reads memory
    device: str = ""
    notes: list[str] = field(default_factory=list)
    keep: object = None               # what must stay alive while the stepper runs (models, caches)
    tokens: Callable[[object], list[int]] = list  # the draft tokens in a step's output


class Skip(RuntimeError):
    """A side that does not run here by design (torch without CUDA, DEEPSPEC_SRC unset): its
    message is the whole reason."""


def _draft_config(prep: Prep) -> dict:
    return prep.case.drafter_config


# ---- our port --------------------------------------------------------------------------------

def port_side(prep: Prep, **bucketed) -> Stepper:
    """Our port through the serve loop's seam: the source's `draft_device` (what the loop drafts
    with: the tokens stay on the device until the verify; and `commit` of one row); `bucketed`
    (kv_bucket, bucket_attention): its opt-in bucketed path (port/fast/). No host read in
    the step, as in the peers' steps: on MLX CUDA a host read of more than 8 bytes costs the next
    step 0.1-0.56 ms of unified-memory faults (docs/benchmarks.md)."""
    from port import serve

    view = serve.TargetView(prep.target, prep.caches)
    src = open_port_source(prep.case, view, **bucketed)
    tok, hid, g = prep.anchor, prep.anchor_hidden, prep.gamma
    notes = [f"{k}={v}" for k, v in bucketed.items()]
    if prep.case.spec.source == "assistant":
        return Stepper(lambda: src.draft_device([tok], g, hid), keep=src, tokens=_host_list, notes=notes)
    src.prefill(list(range(prep.ctx)), [prep.taps])
    mx.eval(src.draft_device([tok], g, hid))

    def step():
        src.commit(g, 0, [prep.row])
        return src.draft_device([tok], g, hid)

    return Stepper(step, keep=src, tokens=_host_list, notes=notes)


def _host_list(tokens: mx.array) -> list[int]:
    return tokens.tolist()


BUCKET = 256  # mlx-lm KVCache's own growth step


def bucketed_options(case: Case, attention: str = "sdpa") -> dict:
    """The port's opt-in bucketed drafter: blocks with kv_bucket=BUCKET (the whole block one compiled
    call over the context buffer), the assistant with bucketed=True (one compiled step over the
    target's cache buffers)."""
    if case.spec.source == "assistant":
        return {"bucketed": True}
    return {"kv_bucket": BUCKET, "bucket_attention": attention}


def port_bucketed_side(prep: Prep, attention: str = "sdpa") -> Stepper:
    """Our port's opt-in bucketed path (bucketed_options). Within fp32 tolerance of the port."""
    return port_side(prep, **bucketed_options(prep.case, attention))


def port_bucketed_2seg_side(prep: Prep) -> Stepper:
    """port-bucketed with the two-segment softmax (no copy of the context, more ops)."""
    return port_bucketed_side(prep, "two-segment")


class PortProvider:
    """A `DraftProvider` over the port's in-memory drafter (the providers themselves read paths
    only through the port's loaders, which `serve_weights` feeds); `bucketed`: the loader's
    options (bucketed_options)."""

    trained_gamma = None
    weights_bytes = 0

    def __init__(self, case: Case, **bucketed):
        self.case, self.id = case, case.spec.name
        self.drafter = load_port_drafter(case, **bucketed)

    def open(self, view):
        return _source_class(self.case)(self.drafter, view)

    def dispose(self) -> None:
        self.drafter = None


def _source_class(case: Case):
    from port.sources import assistant, dflash, dspark

    return {"assistant": assistant.AssistantSource, "dspark": dspark.DeepspecSource,
            "dflash": dflash.DflashSource}[case.spec.source]


def load_port_drafter(case: Case, **bucketed):
    from port.fast import assistant, dflash, dspark

    mod = {"assistant": assistant, "dspark": dspark, "dflash": dflash}[case.spec.source]
    with serve_weights(case):
        return mod.load(case.drafter_dir, **bucketed)


def open_port_source(case: Case, view, **bucketed):
    return _source_class(case)(load_port_drafter(case, **bucketed), view)


# ---- MLX peers -------------------------------------------------------------------------------

def optiq_side(prep: Prep) -> Stepper:
    """optiq 0.7.7: `GemmaAssistantDrafter.from_pretrained`; per draft call what `spec_generate`
    does: `extract_typed_kv`, then gamma x (`_target_embed`, `drafter.forward` at position P+k,
    `int(mx.argmax(logits))`), chained on the returned hidden."""
    from optiq.runtime.spec import runtime
    from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantDrafter
    from optiq.runtime.spec.kv_view import extract_typed_kv

    with serve_weights(prep.case):
        drafter = GemmaAssistantDrafter.from_pretrained(str(prep.case.drafter_dir))
    model, caches = prep.target.model, prep.caches

    def step():
        position = caches[0].offset
        shared = extract_typed_kv(model, caches)
        tok, h, out = prep.anchor, prep.anchor_hidden, []
        for k in range(prep.gamma):
            logits, h = drafter.forward(last_token_emb=runtime._target_embed(model, tok), target_hidden=h,
                                        shared_kv=shared, position=position + k)
            tok = int(mx.argmax(logits))
            out.append(tok)
        return out

    return Stepper(step, keep=drafter)


@contextlib.contextmanager
def _zlab_local():
    """z-lab's `load_draft` resolves its argument with huggingface_hub's snapshot_download; for a
    local directory that is the identity (as in oracles/dflash.py)."""
    from dflash import model_mlx as z

    saved = z.snapshot_download
    z.snapshot_download = lambda repo_id, **kw: str(repo_id)
    try:
        yield z
    finally:
        z.snapshot_download = saved


def zlab_mlx_side(prep: Prep) -> Stepper:
    """z-lab `dflash.model_mlx` 0.1.0: `load_draft`, `bind(target)`, `make_prompt_cache`, then per
    block `hidden_states(block, new taps, cache, logits_start=1)` + `compute_logits` + argmax."""
    from mlx_lm.models.cache import make_prompt_cache

    with _zlab_local() as z, serve_weights(prep.case):
        draft = z.load_draft(str(prep.case.drafter_dir))
    draft.bind(prep.target.model)
    cache = make_prompt_cache(draft)
    cfg = draft.config
    block = mx.array([[prep.anchor] + [int(cfg.mask_token_id)] * (int(cfg.block_size) - 1)])

    def draft_block(rows):
        h = draft.hidden_states(block, rows, cache, logits_start=1)
        return mx.argmax(draft.compute_logits(h), axis=-1)

    mx.eval(draft_block(prep.taps))
    return Stepper(lambda: draft_block(prep.row[:, :1]), keep=(draft, cache), tokens=lambda t: t.tolist()[0])


def dflash_mlx_side(prep: Prep) -> Stepper:
    """dflash-mlx 0.1.8: `load_draft_bundle`, `resolve_target_ops` + `bind_draft_to_target`,
    `EagerDraftBackend.make_cache` (full-context layers, window over the whole context: exact
    DFlash), then per block `project_target_hidden(new taps)` + `draft_greedy`."""
    from dflash_mlx.draft_backend import EagerDraftBackend
    from dflash_mlx.engine.target_ops import bind_draft_to_target, resolve_target_ops
    from dflash_mlx.runtime.loading import load_draft_bundle

    with serve_weights(prep.case):
        draft, _ = load_draft_bundle(str(prep.case.drafter_dir), lazy=False)
    model = prep.target.model
    ops = bind_draft_to_target(draft, model, target_ops=resolve_target_ops(model))
    backend = EagerDraftBackend()
    cache = backend.make_cache(draft_model=draft, sink_size=64, window_size=prep.ctx + 65536,
                               allow_full_context_layers=True)
    bs = int(draft.block_size)
    first = mx.array([prep.anchor], dtype=mx.uint32)
    tail = mx.full((bs - 1,), int(draft.mask_token_id), dtype=mx.uint32)

    def draft_block(rows):
        return backend.draft_greedy(target_model=model, target_ops=ops, draft_model=draft, draft_cache=cache,
                                    staged_first=first, draft_context=draft.project_target_hidden(rows),
                                    block_len=bs, mask_token_tail=tail, suppress_token_mask=None,
                                    async_launch=False)

    mx.eval(draft_block(prep.taps))
    return Stepper(lambda: draft_block(prep.row[:, :1]), keep=(draft, cache), tokens=lambda t: t.tolist(),
                   notes=["EagerDraftBackend, FullContextDraftKVCache"])


def dspark_mlx_side(prep: Prep) -> Stepper:
    """dspark-mlx 0.1.0: `load_draft`, then what `generate_eager` does per cycle at T=0, threshold
    0: `extend_context(committed taps)` + `draft(anchor)`, of which it reads the ids only."""
    import dspark_mlx

    with serve_weights(prep.case):
        drafter, _ = dspark_mlx.load_draft(str(prep.case.drafter_dir))
    drafter.reset()
    drafter.extend_context(prep.taps)
    anchor = mx.array([prep.anchor], dtype=mx.int32)
    mx.eval(drafter.draft(anchor))

    def step():
        drafter.extend_context(prep.row[:, :1])
        return drafter.draft(anchor)[0]

    return Stepper(step, keep=drafter, tokens=lambda ids: ids.tolist()[0][1:])


# ---- torch references --------------------------------------------------------------------------

TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _torch(prep: Prep):
    if prep.torch_device is None:
        raise Skip(prep.torch_reason)
    import torch

    return torch, torch.device(prep.torch_device), getattr(torch, TORCH_DTYPES[prep.case.dtype])


def to_torch(a: mx.array, device, dtype=None):
    """MLX -> torch, bit for bit (bf16 through its uint16 view: numpy has no bf16)."""
    import torch

    if a.dtype == mx.bfloat16:
        t = torch.from_numpy(np.array(a.view(mx.uint16))).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(a))
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to(device)


def _load_state(model, tensors: dict, device, dtype, what: str) -> None:
    sd = {k: to_torch(v, device, dtype) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in sd if k in params}
    missing = [k for k in missing if not k.endswith("inv_freq") and id(params.get(k)) not in loaded]
    if missing:
        raise RuntimeError(f"{what}: the checkpoint lacks tensors the model declares: {missing[:6]}")


def hf_assistant_side(prep: Prep) -> Stepper:
    """transformers' `Gemma4AssistantForCausalLM` (or the unified class) from the checkpoint's
    config: per step `model(inputs_embeds=[scaled target embedding ; hidden], position_ids=P+k,
    shared_kv_states=donor K/V)`, argmax, chained on `last_hidden_state` (as oracles/assistant.py)."""
    torch, dev, tdt = _torch(prep)
    from transformers import AutoConfig, AutoModelForCausalLM

    from port import assistant, targets

    config = AutoConfig.from_pretrained(prep.case.drafter_dir)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=tdt, attn_implementation="sdpa").eval()
    _load_state(model, prep.case.weights("drafter"), dev, tdt, "transformers' assistant")
    donors = targets.donor_view(prep.target, prep.caches)
    window = prep.case.target_config["sliding_window"]
    k, v = assistant.sliding_view(*donors["sliding_attention"], window)
    shared = {"sliding_attention": (to_torch(k, dev), to_torch(v, dev)),
              "full_attention": tuple(to_torch(a, dev) for a in donors["full_attention"])}
    tm = prep.target.model.model
    table = to_torch(tm.embed_tokens.weight, dev)
    scale = float(getattr(tm, "embed_scale", 1.0))
    h0 = to_torch(prep.anchor_hidden, dev)
    position = prep.caches[0].offset

    def step():
        tok, h, out = prep.anchor, h0, []
        with torch.inference_mode():
            for k in range(prep.gamma):
                e = (table[tok] * scale).to(h.dtype)[None, None]
                r = model(inputs_embeds=torch.cat([e, h], dim=-1), position_ids=torch.tensor([[position + k]], device=dev),
                          shared_kv_states=shared)
                tok, h = int(r.logits[0, 0].argmax()), r.last_hidden_state
                out.append(tok)
        return out

    return Stepper(step, "torch", str(dev), keep=model)


def _target_shim(prep: Prep, torch, dev):
    """The target as z-lab's helpers read it: `get_input_embeddings()` and `lm_head`."""
    nn = torch.nn
    t = prep.case.weights("target")
    emb = to_torch(t["model.embed_tokens.weight"], dev)
    head_w = to_torch(t["lm_head.weight"], dev) if "lm_head.weight" in t else emb

    class Shim(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(emb.shape[0], emb.shape[1], _weight=emb)
            self.lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False)
            self.lm_head.weight = nn.Parameter(head_w, requires_grad=False)

        def get_input_embeddings(self):
            return self.embed_tokens

        def get_output_embeddings(self):
            return self.lm_head

    return Shim()


def zlab_torch_side(prep: Prep) -> Stepper:
    """z-lab `dflash.model` (torch): `DFlashDraftModel` from its Qwen3 config, `_make_cache`; per
    block (as `dflash_generate`): forward(target_hidden=new taps, noise_embedding=
    `_raw_input_embeddings`, position_ids, past_key_values) -> `_crop_to(start)` ->
    `compute_logits(h, _output_head(target))` -> argmax. It needs transformers >= 5.15."""
    torch, dev, tdt = _torch(prep)
    from dflash import model as z
    from transformers import Qwen3Config

    config = Qwen3Config.from_pretrained(prep.case.drafter_dir)
    with torch.device(dev):
        m = z.DFlashDraftModel(config).to(tdt).eval()
    _load_state(m, prep.case.weights("drafter"), dev, tdt, "z-lab's torch DFlash")
    shim = _target_shim(prep, torch, dev)
    bs = int(m.block_size)
    ies = float(z._draft_value(m.config, "input_embedding_scale", 1.0))
    block = torch.full((1, bs), int(m.mask_token_id), dtype=torch.long, device=dev)
    block[0, 0] = prep.anchor
    positions = torch.arange(prep.ctx + 65536 + bs, device=dev).unsqueeze(0)
    cache = z._make_cache(m.config)
    taps, row = to_torch(prep.taps, dev), to_torch(prep.row[:, :1], dev)
    state = {"start": 0}

    def draft_block(rows):
        with torch.inference_mode():
            n, start = rows.shape[1], state["start"] + rows.shape[1]
            h = m(target_hidden=rows, noise_embedding=z._raw_input_embeddings(shim, block, ies),
                  position_ids=positions[:, start - n: start + bs], past_key_values=cache, use_cache=True)[:, 1 - bs:, :]
            z._crop_to(cache, start)
            state["start"] = start
            return m.compute_logits(h, z._output_head(shim)).argmax(-1)

    draft_block(taps)
    return Stepper(lambda: draft_block(row), "torch", str(dev), keep=(m, shim, cache), tokens=lambda t: t.tolist()[0])


def deepspec_side(prep: Prep) -> Stepper:
    """DeepSpec (DEEPSPEC_SRC) `Qwen3DSparkModel` / `Gemma4DSparkModel` from the checkpoint's
    config; per block what its evaluator's `_propose` calls: `forward_dspark_draft_block` then
    `build_dspark_proposal` (T=0, threshold 0)."""
    torch, dev, tdt = _torch(prep)
    src = os.environ.get("DEEPSPEC_SRC")
    if not src or not (Path(src) / "deepspec").is_dir():
        raise Skip("DEEPSPEC_SRC is not set to a DeepSpec checkout (see README, dspark)")
    if src not in sys.path:
        sys.path.insert(0, src)
    from deepspec.eval.dspark.draft_ops import build_dspark_proposal, forward_dspark_draft_block
    from deepspec.modeling.dspark import Gemma4DSparkModel, Qwen3DSparkModel
    from transformers import DynamicCache

    cls = Gemma4DSparkModel if _draft_config(prep).get("model_type") == "gemma4_text" else Qwen3DSparkModel
    config = cls.config_class.from_pretrained(prep.case.drafter_dir)
    config._attn_implementation = "sdpa"
    with torch.device(dev):
        m = cls(config).to(tdt).eval()
    _load_state(m, prep.case.weights("drafter"), dev, tdt, "DeepSpec's DSpark")
    bs = int(m.block_size)
    ids = torch.full((1, bs), int(m.mask_token_id), dtype=torch.long, device=dev)
    ids[0, 0] = prep.anchor
    positions = torch.arange(prep.ctx + 65536 + bs, device=dev).unsqueeze(0)
    cache = DynamicCache()
    taps, row = to_torch(prep.taps, dev), to_torch(prep.row[:, :1], dev)
    state = {"start": 0}

    def draft_block(rows):
        with torch.inference_mode():
            start = state["start"] + rows.shape[1]
            h = forward_dspark_draft_block(m, draft_input_ids=ids, position_ids=positions, past_key_values_draft=cache,
                                           target_hidden_states=rows, start=start, block_size=bs)
            state["start"] = start
            return build_dspark_proposal(m, draft_input_ids=ids, block_hidden=h, block_size=bs, temperature=0.0,
                                         confidence_threshold=0.0).verify_input_ids

    draft_block(taps)
    return Stepper(lambda: draft_block(row), "torch", str(dev), keep=(m, cache), tokens=lambda t: t.tolist()[0][1:])


# name -> (sources it serves, the side, what to install if it is missing)
PEERS: dict[str, tuple[tuple[str, ...], Callable[[Prep], Stepper], str]] = {
    "optiq": (("assistant",), optiq_side, "pip install --no-deps mlx-optiq==0.7.7 (+ huggingface_hub)"),
    "hf-torch": (("assistant",), hf_assistant_side, "pip install torch transformers (CUDA)"),
    "zlab-mlx": (("dflash",), zlab_mlx_side, "pip install --no-deps dflash==0.1.0 (+ huggingface_hub)"),
    "dflash-mlx": (("dflash",), dflash_mlx_side, "pip install --no-deps dflash-mlx==0.1.8"),
    "zlab-torch": (("dflash",), zlab_torch_side, "pip install --no-deps dflash==0.1.0; transformers>=5.15"),
    "dspark-mlx": (("dspark",), dspark_mlx_side, "pip install --no-deps dspark-mlx==0.1.0"),
    "deepspec-torch": (("dspark",), deepspec_side, "export DEEPSPEC_SRC=<DeepSpec checkout>; torch, transformers"),
}


def framework(side: str) -> str:
    """A side's framework from its name (torch sides are named '<peer>-torch'): known before the
    side is built, so a real-shape MLX side is built only for the passes that use it."""
    return "torch" if side.endswith("-torch") else "mlx"


# Our port's opt-in paths, measured as extra sides after the port (ours, never a peer; selected
# with the peers): name -> (sources it serves, the side).
PORT_OPTIONS: dict[str, tuple[tuple[str, ...], Callable[[Prep], Stepper]]] = {
    "port-bucketed": (("assistant", "dspark", "dflash"), port_bucketed_side),
    "port-bucketed-2seg": (("dspark", "dflash"), port_bucketed_2seg_side),
}
OURS = ("port", *PORT_OPTIONS)


def side(name: str) -> Callable[[Prep], Stepper]:
    return PORT_OPTIONS[name][1] if name in PORT_OPTIONS else PEERS[name][1]


def peers_for(source: str, wanted: list[str] | None) -> list[str]:
    """The other sides of a source (our opt-in paths first, then the peers): all of them (wanted
    None), or those of `wanted` that serve it."""
    names = [n for n, (srcs, *_) in {**PORT_OPTIONS, **PEERS}.items() if source in srcs]
    return names if wanted is None else [n for n in names if n in wanted]


def torch_device(choice: str) -> tuple[str | None, str]:
    """auto: CUDA if torch sees one, else the torch sides are skipped (their figures would be
    CPU ones); cpu / cuda force it."""
    if choice == "none":
        return None, "torch sides off (--torch-device none)"
    try:
        import torch
    except Exception as e:  # torch absent or broken: a reason, not a crash
        return None, f"torch not importable: {type(e).__name__}: {e}"
    if choice == "auto":
        if torch.cuda.is_available():
            return "cuda", ""
        return None, "no CUDA device visible to torch (torch references run on CUDA; --torch-device cpu forces CPU)"
    if choice == "cuda" and not torch.cuda.is_available():
        return None, "--torch-device cuda but torch.cuda.is_available() is False"
    return choice, ""


"""The peers `spec-parity bench` puts beside our port: the MLX ports (optiq, z-lab's MLX DFlash,
dflash-mlx, dspark-mlx) and the torch references (transformers' assistant, z-lab's torch DFlash,
DeepSpec). Each peer is driven through the functions its parity oracle or adapter uses too
(oracles/, spec_parity/third_party.py), in the order its own loop calls them (named in each side's
docstring); this module only brings them to a case's state and times nothing. Peers are imported
when their side is built: a missing package or a failing call is the side's recorded reason,
never a crash.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import third_party
from . import port_sides
from .shapes import serve_weights
from .sides import Prep, Side, Skip, Stepper

# ---- MLX peers -------------------------------------------------------------------------------


def optiq_side(prep: Prep) -> Stepper:
    """optiq 0.7.7: `GemmaAssistantDrafter.from_pretrained`; per draft call what `spec_generate`
    does: `extract_typed_kv`, then gamma x (`_target_embed`, `drafter.forward` at position P+k,
    `int(mx.argmax(logits))`), chained on the returned hidden (oracles/assistant.py)."""
    from spec_parity.oracles import assistant

    with serve_weights(prep.ckpt):
        drafter = assistant.optiq_drafter(prep.ckpt.drafter_dir)
    model, caches = prep.target.model, prep.caches

    def step():
        position = caches[0].offset
        shared = assistant.optiq_donors(model, caches)
        tok, h, out = prep.anchor, prep.anchor_hidden, []
        for k in range(prep.gamma):
            _, _, h, tok = assistant.optiq_step(drafter, model, tok, h, shared, position + k)
            out.append(tok)
        return out

    return Stepper(step, keep=drafter)


def zlab_mlx_side(prep: Prep) -> Stepper:
    """z-lab `dflash.model_mlx` 0.1.0: `load_draft`, `bind(target)`, `make_prompt_cache`, then per
    block `hidden_states(block, new taps, cache, logits_start=1)` + `compute_logits` + argmax
    (oracles/dflash.py)."""
    from spec_parity.oracles import dflash

    with serve_weights(prep.ckpt):
        draft = dflash.load_draft(prep.ckpt.drafter_dir)
    cache = dflash.bind(draft, prep.target.model)
    cfg = draft.config
    block = mx.array([[prep.anchor] + [int(cfg.mask_token_id)] * (int(cfg.block_size) - 1)])

    def draft_block(rows):
        return mx.argmax(dflash.draft_block(draft, block, rows, cache)[1], axis=-1)

    mx.eval(draft_block(prep.taps))
    return Stepper(lambda: draft_block(prep.row[:, :1]), keep=(draft, cache), tokens=lambda t: t.tolist()[0])


def dflash_mlx_side(prep: Prep) -> Stepper:
    """dflash-mlx 0.1.8: `load_draft_bundle`, `resolve_target_ops` + `bind_draft_to_target`,
    `EagerDraftBackend.make_cache` (full-context layers, window over the whole context: exact
    DFlash), then per block `project_target_hidden(new taps)` + `draft_greedy`."""
    with serve_weights(prep.ckpt):
        draft = third_party.dflash_mlx_draft(prep.ckpt.drafter_dir)
    model = prep.target.model
    ops = third_party.dflash_mlx_bind(draft, model, third_party.dflash_mlx_target_ops(model))
    backend = third_party.dflash_mlx_backend()
    cache = third_party.dflash_mlx_cache(backend, draft, 64, prep.ctx + 65536, True)
    first = mx.array([prep.anchor], dtype=mx.uint32)
    tail = third_party.dflash_mlx_tail(draft)

    def draft_block(rows):
        return third_party.dflash_mlx_block(backend, model, ops, draft, cache, first, tail, rows)

    mx.eval(draft_block(prep.taps))
    return Stepper(lambda: draft_block(prep.row[:, :1]), keep=(draft, cache), tokens=lambda t: t.tolist(),
                   notes=["EagerDraftBackend, FullContextDraftKVCache"])


def dspark_mlx_side(prep: Prep) -> Stepper:
    """dspark-mlx 0.1.0: `load_draft`, then what `generate_eager` does per cycle at T=0, threshold
    0: `extend_context(committed taps)` + `draft(anchor)`, of which it reads the ids only."""
    with serve_weights(prep.ckpt):
        drafter, _ = third_party.dspark_mlx_draft(prep.ckpt.drafter_dir)
    anchor = mx.array([prep.anchor], dtype=mx.int32)
    mx.eval(third_party.dspark_mlx_first(drafter, prep.taps, anchor))
    return Stepper(lambda: third_party.dspark_mlx_next(drafter, prep.row[:, :1], anchor)[0], keep=drafter,
                   tokens=lambda ids: ids.tolist()[0][1:])


# ---- torch references --------------------------------------------------------------------------

TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _torch(prep: Prep):
    """torch, the side's device and dtype (run_side has skipped the torch sides without a device)."""
    import torch

    return torch, torch.device(prep.torch_device), getattr(torch, TORCH_DTYPES[prep.ckpt.dtype])


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
    shared_kv_states=donor K/V)`, argmax, chained on `last_hidden_state` (oracles/assistant.py)."""
    torch, dev, tdt = _torch(prep)
    from spec_parity.oracles import assistant

    model = assistant.hf_drafter_from_config(prep.ckpt.drafter_dir, tdt, dev)
    _load_state(model, prep.ckpt.weights("drafter"), dev, tdt, "transformers' assistant")
    shared = {name: tuple(to_torch(a, dev) for a in kv) for name, kv in port_sides.donor_kv(prep).items()}
    tm = prep.target.model.model
    table = to_torch(tm.embed_tokens.weight, dev)
    scale = float(getattr(tm, "embed_scale", 1.0))
    h0 = to_torch(prep.anchor_hidden, dev)
    position = prep.caches[0].offset

    def step():
        tok, h, out = prep.anchor, h0, []
        with torch.inference_mode():
            for k in range(prep.gamma):
                logits, h = assistant.hf_step(model, (table[tok] * scale).to(h.dtype)[None, None], h, position + k,
                                              shared)
                tok = int(logits.argmax())
                out.append(tok)
        return out

    return Stepper(step, "torch", str(dev), keep=model)


def _target_shim(prep: Prep, torch, dev):
    """The target as z-lab's helpers read it: `get_input_embeddings()` and `lm_head`."""
    nn = torch.nn
    t = prep.ckpt.weights("target")
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
    `compute_logits(h, _output_head(target))` -> argmax (oracles/dflash_torch_runner.py). It needs
    transformers >= 5.15."""
    torch, dev, tdt = _torch(prep)
    from spec_parity.oracles import dflash_torch_runner as zlab

    m = zlab.empty_drafter(prep.ckpt.drafter_dir, tdt, dev)
    _load_state(m, prep.ckpt.weights("drafter"), dev, tdt, "z-lab's torch DFlash")
    shim = _target_shim(prep, torch, dev)
    bs = int(m.block_size)
    ies = zlab.embedding_scale(m)
    block = torch.full((1, bs), int(m.mask_token_id), dtype=torch.long, device=dev)
    block[0, 0] = prep.anchor
    positions = torch.arange(prep.ctx + 65536 + bs, device=dev).unsqueeze(0)
    cache = zlab.make_cache(m)
    taps, row = to_torch(prep.taps, dev), to_torch(prep.row[:, :1], dev)
    state = {"start": 0}

    def draft_block(rows):
        with torch.inference_mode():
            start = state["start"] + rows.shape[1]
            _, logits = zlab.draft_block(m, shim, block, ies, rows, positions, start, cache)
            state["start"] = start
            return logits.argmax(-1)

    draft_block(taps)
    return Stepper(lambda: draft_block(row), "torch", str(dev), keep=(m, shim, cache), tokens=lambda t: t.tolist()[0])


def deepspec_side(prep: Prep) -> Stepper:
    """DeepSpec (DEEPSPEC_SRC) `Qwen3DSparkModel` / `Gemma4DSparkModel` from the checkpoint's
    config; per block what its evaluator's `_propose` calls: `forward_dspark_draft_block` then
    `build_dspark_proposal` (T=0, threshold 0; oracles/dspark.py)."""
    torch, dev, tdt = _torch(prep)
    from spec_parity.oracles import dspark

    why = dspark.status()
    if why:
        raise Skip(why)
    from transformers import DynamicCache

    m = dspark.empty_drafter(prep.ckpt.drafter_dir, tdt, dev)
    _load_state(m, prep.ckpt.weights("drafter"), dev, tdt, "DeepSpec's DSpark")
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
            h = dspark.draft_block(m, ids, positions, cache, rows, start)
            state["start"] = start
            return dspark.proposal(m, ids, h, 0.0).verify_input_ids

    draft_block(taps)
    return Stepper(lambda: draft_block(row), "torch", str(dev), keep=(m, cache), tokens=lambda t: t.tolist()[0][1:])


SIDES = (
    Side("optiq", ("assistant",), optiq_side, needs=("optiq",),
         install="pip install --no-deps mlx-optiq==0.7.7 (+ huggingface_hub)"),
    Side("hf-torch", ("assistant",), hf_assistant_side, "torch", needs=("torch", "transformers"),
         install="pip install torch transformers (CUDA)"),
    Side("zlab-mlx", ("dflash",), zlab_mlx_side, needs=("dflash.model_mlx",),
         install="pip install --no-deps dflash==0.1.0 (+ huggingface_hub)"),
    Side("dflash-mlx", ("dflash",), dflash_mlx_side, needs=("dflash_mlx",),
         install="pip install --no-deps dflash-mlx==0.1.8"),
    Side("zlab-torch", ("dflash",), zlab_torch_side, "torch", needs=("torch", "dflash.model"),
         install="pip install --no-deps dflash==0.1.0; transformers>=5.15"),
    Side("dspark-mlx", ("dspark",), dspark_mlx_side, needs=("dspark_mlx",),
         install="pip install --no-deps dspark-mlx==0.1.0"),
    Side("deepspec-torch", ("dspark",), deepspec_side, "torch", needs=("torch", "transformers"),
         install="export DEEPSPEC_SRC=<DeepSpec checkout>; torch, transformers"),
)

"""Runs z-lab's torch DFlash (`dflash.model`, dflash 0.1.0) in its own environment and writes arrays.

z-lab's torch model needs transformers 5.15 (on 5.12.1 `DynamicCache.crop(0)` empties the cache
after prefill and `activate_past_recording` is missing), so it cannot share the main environment
(transformers 5.12.1 for the other torch references). `oracles/dflash.py` calls this file as a
script with that environment's python:

    python dflash_torch_runner.py request.json out.npz

request: {"mode": "modules" | "loop" | "save", "target": dir, "drafter": dir, "prompt": [ids],
          "accepts": [a per round] (modules), "max_tokens": n (loop), "out": dir (save),
          "dtype": "float32" (default) | "bfloat16" | "float16" (modules, loop)}

Floating arrays come back as float32 (`.float()`: every half type, exactly), as the MLX side
returns them.

It imports only numpy, torch, transformers and z-lab's `dflash.model`, and calls z-lab's own
functions: `DFlashDraftModel.from_pretrained`, `extract_context_feature`, `_make_cache`,
`_crop_to`, `_raw_input_embeddings`, `_output_head`, the drafter's forward and `compute_logits`,
and the T=0 loop `dflash_generate` (with return_stats=True for its per-round acceptance lengths;
its timing helper calls torch.cuda.synchronize(), so that one helper is replaced by
time.perf_counter on CPU). The loop is observed through wrappers that record what the drafter's
`compute_logits` and the target's forward return; nothing they compute is changed. The bench's
zlab-torch side (spec_parity/bench/peers.py) imports this file as `spec_parity.oracles.dflash_torch_runner`
for the same block calls (`empty_drafter`, `make_cache`, `draft_block`), in its own process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# Run as a script, this file's folder (oracles/, which holds oracles/dflash.py) would shadow z-lab's
# `dflash` package: drop it from the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402


def _load(target_dir: str, drafter_dir: str, dtype: str = "float32"):
    """The target and z-lab's drafter cast to `dtype` on load, whatever dtype they are stored in."""
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    dt = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(Path(target_dir), dtype=dt, attn_implementation="eager").eval()
    draft = DFlashDraftModel.from_pretrained(Path(drafter_dir), dtype=dt).eval()
    return target, draft


def _recorder(out: dict, i: int):
    """A forward hook that keeps layer i's output (returns None: the output is not replaced)."""
    def hook(module, args, y):
        out[f"layer.{i}"] = y[0]
    return hook


def empty_drafter(drafter_dir, dtype, device):
    """z-lab's `DFlashDraftModel` from the checkpoint's Qwen3 config on `device`, its weights left
    to the caller (the bench, in the main environment, loads them from memory)."""
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config.from_pretrained(drafter_dir)
    with torch.device(device):
        return DFlashDraftModel(config).to(dtype).eval()


def make_cache(model):
    """z-lab's `_make_cache` for a model (the drafter or the target)."""
    from dflash import model as z

    return z._make_cache(model.config)


def embedding_scale(m) -> float:
    """The drafter's `input_embedding_scale` as z-lab reads it (`_draft_value`)."""
    from dflash import model as z

    return float(z._draft_value(m.config, "input_embedding_scale", 1.0))


def draft_block(m, target, block, scale: float, hidden, positions, start: int, cache) -> tuple:
    """One draft block as `dflash_generate` drafts it: the drafter's forward on the new context rows
    `hidden` (the committed length is `start`; positions start - len(hidden) .. start + bs - 1)
    with the block's `_raw_input_embeddings`, the draft cache cropped back to `start` (`_crop_to`),
    `compute_logits` with the target's `_output_head`. (block hidden [1, bs-1, H], logits)."""
    from dflash import model as z

    bs = block.shape[1]
    h = m(target_hidden=hidden, noise_embedding=z._raw_input_embeddings(target, block, scale),
          position_ids=positions[:, start - hidden.shape[1]: start + bs], past_key_values=cache,
          use_cache=True)[:, 1 - bs:, :]
    z._crop_to(cache, start)
    return h, m.compute_logits(h, z._output_head(target))


def modules(req: dict) -> dict:
    """The module rounds of the MLX oracle, on z-lab's torch pieces: one prefill of the prompt with
    hidden states, then per round the block through the drafter's forward (context = the new taps,
    positions start - ctx .. start + bs - 1, draft cache cropped back to start), compute_logits
    with the target's head, a verify of [anchor, drafts] through the target, the target cache
    cropped to the committed length, and the verify's taps of the anchor + `a` drafts. In the first
    round each drafter layer's output is recorded through a forward hook (`layer.i`, [bs, H])."""
    import torch
    from dflash import model as z

    target, m = _load(req["target"], req["drafter"], req.get("dtype", "float32"))
    ids = torch.tensor([req["prompt"]], dtype=torch.long)
    P, bs = ids.shape[1], int(m.block_size)
    ies = embedding_scale(m)
    positions = torch.arange(P + bs * (len(req["accepts"]) + 1) + 1).unsqueeze(0)
    tcache, dcache = make_cache(target), make_cache(m)
    out = {}
    with torch.inference_mode():
        res = target(ids, position_ids=positions[:, :P], past_key_values=tcache, use_cache=True,
                     output_hidden_states=True)
        hidden = z.extract_context_feature(res.hidden_states, m.target_layer_ids)
        z._crop_to(tcache, P)  # as dflash_generate does after its prefill (sliding layers back to W-1)
        out["taps.0"] = hidden[0]
        anchor = int(res.logits[0, -1].argmax())
        anchors, start = [anchor], P
        for r, a in enumerate(req["accepts"]):
            block = torch.full((1, bs), int(m.mask_token_id), dtype=torch.long)
            block[0, 0] = anchor
            hooks = [layer.register_forward_hook(_recorder(out, i)) for i, layer in enumerate(m.layers)] if r == 0 else []
            h, logits = draft_block(m, target, block, ies, hidden, positions, start, dcache)
            for hook in hooks:
                hook.remove()
            tokens = logits.argmax(-1)
            out[f"hidden.{r}"], out[f"logits.{r}"], out[f"tokens.{r}"] = h[0], logits[0], tokens[0].to(torch.int32)
            block[0, 1:] = tokens[0]
            v = target(block, position_ids=positions[:, start: start + bs], past_key_values=tcache, use_cache=True,
                       output_hidden_states=True)
            a = min(a, bs - 1)
            anchor = int(v.logits[0, a].argmax())
            anchors.append(anchor)
            start += a + 1
            z._crop_to(tcache, start)
            hidden = z.extract_context_feature(v.hidden_states, m.target_layer_ids)[:, : a + 1, :]
            out[f"taps.{r + 1}"] = hidden[0]
        for i, layer in enumerate(dcache.layers):
            out[f"ctx_k.{i}"], out[f"ctx_v.{i}"] = layer.keys[0], layer.values[0]
        out["anchors"] = torch.tensor(anchors, dtype=torch.int32)
    return {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy() for k, v in out.items()}


def loop(req: dict) -> dict:
    """z-lab's `dflash_generate` at T=0, no stop tokens; recorded per round: the drafter's logits,
    the verify's argmax, and z-lab's own acceptance_lengths (tokens committed per round)."""
    import torch
    from dflash import model as z

    target, m = _load(req["target"], req["drafter"], req.get("dtype", "float32"))
    drafts, verifies = [], []
    compute_logits, forward = m.compute_logits, target.forward

    def recorded_logits(*args, **kw):
        out = compute_logits(*args, **kw)
        drafts.append(out)
        return out

    def recorded_forward(*args, **kw):
        out = forward(*args, **kw)
        verifies.append(out.logits)
        return out

    m.compute_logits, target.forward = recorded_logits, recorded_forward
    z._cuda_time = time.perf_counter  # return_stats=True only times with it; CPU has no cuda.synchronize
    ids = torch.tensor([req["prompt"]], dtype=torch.long)
    n = int(req["max_tokens"])
    with torch.inference_mode():
        res = z.dflash_generate(m, target, ids, max_new_tokens=n, stop_token_ids=None, temperature=0.0,
                                return_stats=True)
    rounds = verifies[1:]  # the first forward is the prefill
    drafted, accepted, proposals = [], [], []
    for d, v in zip(drafts, rounds):
        toks = d[0].argmax(-1).tolist()
        t = v[0].argmax(-1).tolist()
        k = next((i for i in range(len(toks)) if toks[i] != t[i]), len(toks))
        drafted.append(len(toks))
        accepted.append(k)
        proposals += toks
    V = int(target.config.get_text_config().vocab_size)
    return {"stream.tokens": res.output_ids[0, ids.shape[1]:].numpy().astype(np.int32),
            "stream.drafted": np.array(drafted, np.int32), "stream.accepted": np.array(accepted, np.int32),
            "stream.emitted": np.array(res.acceptance_lengths, np.int32),
            "stream.proposals": np.array(proposals, np.int32),
            "stream.draft_logits": torch.cat([d[0] for d in drafts]).float().numpy() if drafts
            else np.zeros((0, V), np.float32)}


def save(req: dict) -> dict:
    """z-lab's own save path: `DFlashDraftModel.from_pretrained(drafter).save_pretrained(out)`."""
    import torch
    from dflash.model import DFlashDraftModel

    DFlashDraftModel.from_pretrained(Path(req["drafter"]), dtype=torch.float32).save_pretrained(Path(req["out"]))
    return {}


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("dflash", "torch", "transformers")}


def main(argv: list[str]) -> int:
    req = json.loads(Path(argv[1]).read_text())
    if req["mode"] == "versions":
        arrays = {}
    else:
        arrays = {"modules": modules, "loop": loop, "save": save}[req["mode"]](req)
    arrays["__versions__"] = np.frombuffer(json.dumps(versions()).encode(), np.uint8)
    np.savez(argv[2], **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

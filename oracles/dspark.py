"""Reference for the DSpark drafter: DeepSeek's DeepSpec, imported from DEEPSPEC_SRC.

DeepSpec is not on PyPI and its code never enters this repository: fetch github
deepseek-ai/DeepSpec, extract it outside the repo, `export DEEPSPEC_SRC=/path/to/DeepSpec`
(see README). Everything here imports and calls DeepSpec's own functions: the config path
(`build_draft_config`), `extract_context_feature`, `forward_dspark_draft_block`,
`compute_logits`, `sample_draft_tokens`, `predict_confidence_step`, `_confident_prefix_length`,
`build_dspark_proposal`, and the evaluator's T=0 decoding loop `generate_decoding_sample`; for
the DSpark-on-DFlash extension its Markov and confidence heads alone (`build_markov_head`,
`AcceptRatePredictor`, `sample_block_tokens`, `predict_confidence_step`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .layers import as_numpy, torch_recorded

INSTALL = ("fetch github deepseek-ai/DeepSpec (HEAD afdfa7c), extract it outside this repo and "
           "`export DEEPSPEC_SRC=/path/to/DeepSpec`; it needs torch==2.13.0 transformers==5.12.1")


def status() -> str | None:
    src = os.environ.get("DEEPSPEC_SRC")
    if not src:
        return f"DEEPSPEC_SRC is not set: {INSTALL}"
    if not (Path(src) / "deepspec" / "modeling" / "dspark").is_dir():
        return f"DEEPSPEC_SRC={src} holds no deepspec/modeling/dspark: {INSTALL}"
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} not installed: pip install torch==2.13.0 transformers==5.12.1"
    return None


def _import():
    src = os.environ["DEEPSPEC_SRC"]
    if src not in sys.path:
        sys.path.insert(0, src)


def commit() -> str:
    src = Path(os.environ["DEEPSPEC_SRC"])
    if (src / ".git").exists():
        return subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    marker = src / "COMMIT"
    return marker.read_text().strip() if marker.exists() else "unknown"


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"deepspec": commit(), "torch": torch.__version__, "transformers": transformers.__version__}


def _models(target_dir: Path, drafter_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    _import()
    from deepspec.modeling.dspark import Gemma4DSparkModel, Qwen3DSparkModel

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    target = AutoModelForCausalLM.from_pretrained(Path(target_dir), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    cls = Gemma4DSparkModel if target.config.model_type == "gemma4_text" else Qwen3DSparkModel
    draft = cls.from_pretrained(Path(drafter_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    return target, draft


def empty_drafter(drafter_dir: Path, dtype, device):
    """DeepSpec's `Qwen3DSparkModel` / `Gemma4DSparkModel` (by the drafter config's model_type) from
    the checkpoint's config, sdpa, on `device`, its weights left to the caller (the bench loads
    them from memory)."""
    import torch

    _import()
    from deepspec.modeling.dspark import Gemma4DSparkModel, Qwen3DSparkModel

    gemma = json.loads((Path(drafter_dir) / "config.json").read_text()).get("model_type") == "gemma4_text"
    cls = Gemma4DSparkModel if gemma else Qwen3DSparkModel
    config = cls.config_class.from_pretrained(drafter_dir)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return cls(config).to(dtype).eval()


def draft_block(m, ids, positions, cache, taps, start: int):
    """The block's hidden states after the new context rows `taps` (committed length `start`):
    `forward_dspark_draft_block`."""
    _import()
    from deepspec.eval.dspark.draft_ops import forward_dspark_draft_block

    return forward_dspark_draft_block(m, draft_input_ids=ids, position_ids=positions, past_key_values_draft=cache,
                                      target_hidden_states=taps, start=start, block_size=int(m.block_size))


def proposal(m, ids, block, threshold: float):
    """DeepSpec's T=0 proposal of a block (`build_dspark_proposal`)."""
    _import()
    from deepspec.eval.dspark.draft_ops import build_dspark_proposal

    return build_dspark_proposal(m, draft_input_ids=ids, block_hidden=block, block_size=int(m.block_size),
                                 temperature=0.0, confidence_threshold=threshold)


def draft_config(target_dir: Path, args: dict) -> dict:
    """DeepSpec's own config path: `build_draft_config(target_config, model_args)` (Gemma-4 wants
    the multimodal top-level config, so the tiny text config is wrapped in a Gemma4Config)."""
    import transformers
    from transformers import AutoConfig

    _import()
    text = AutoConfig.from_pretrained(Path(target_dir))
    model_args = _Args(args)
    if text.model_type == "gemma4_text":
        from deepspec.modeling.dspark.gemma4.config import build_draft_config

        top = transformers.Gemma4Config(text_config=text.to_dict())
        cfg = build_draft_config(top, model_args)
    else:
        from deepspec.modeling.dspark.qwen3.config import build_draft_config

        cfg = build_draft_config(text, model_args)
    return cfg.to_dict()


class _Args(dict):
    """DeepSpec's model_args: attribute access plus `in`."""

    __getattr__ = dict.__getitem__


def modules(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, thresholds: list[float]) -> dict:
    """First draft round after prefill, module by module, through DeepSpec's functions; each drafter
    layer's output in the block (`layer.i`) through forward hooks."""
    import torch
    from transformers import DynamicCache

    _import()
    from deepspec.eval.dspark.draft_ops import _confident_prefix_length, _predict_confidence_logits
    from deepspec.modeling.dspark import extract_context_feature

    target, m = _models(target_dir, drafter_dir)
    bs = int(m.block_size)
    ids = torch.from_numpy(prompt.astype(np.int64))
    P = ids.shape[1]
    out, layers = {}, {}
    with torch.no_grad():
        res = target(input_ids=ids, use_cache=False, output_hidden_states=True)
        anchor = int(res.logits[0, -1].argmax())
        taps = extract_context_feature(res.hidden_states, m.target_layer_ids)
        out["taps"] = taps[0]
        out["context"] = m.hidden_norm(m.fc(taps))[0]
        draft_ids = torch.full((1, bs), int(m.mask_token_id), dtype=torch.long)
        draft_ids[:, 0] = anchor
        position_ids = torch.arange(P + bs + 1).unsqueeze(0)
        cache = DynamicCache()
        with torch_recorded(m.layers, layers):
            block = draft_block(m, draft_ids, position_ids, cache, taps, P)
        for i, layer in enumerate(cache.layers):
            out[f"context_k.{i}"], out[f"context_v.{i}"] = layer.keys[0], layer.values[0]
        out["block_hidden"] = block[0, :bs]
        base = m.compute_logits(block[:, :bs])
        out["base_logits"] = base[0]
        tokens, logits = m.sample_draft_tokens(base, first_prev_token_ids=draft_ids[:, 0], temperature=0.0,
                                               hidden_states=block[:, :bs])
        out["logits"], out["tokens"] = logits[0], tokens[0].to(torch.int32)
        out["anchor"] = torch.tensor([anchor], dtype=torch.int32)
        conf = _predict_confidence_logits(m, proposal_hidden_states=block[:, :bs], draft_input_ids=draft_ids,
                                          sampled_tokens=tokens, block_size=bs)
        if conf is not None:
            out["confidence"] = conf[0]
        for t in thresholds:
            n = _confident_prefix_length(conf, block_size=bs, threshold=t) if conf is not None else bs
            prop = proposal(m, draft_ids, block, t)
            out[f"prefix@{t}"] = torch.tensor([n], dtype=torch.int32)
            out[f"proposal@{t}"] = prop.verify_input_ids[0, 1:].to(torch.int32)
    return {**{k: v.detach().float().numpy() if v.is_floating_point() else v.numpy() for k, v in out.items()},
            **as_numpy(layers)}


def empty_target(target_dir: Path, dtype, device):
    """transformers' target from the checkpoint's config, sdpa, on `device`, its weights left to the
    caller (the bench loads them from memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target_dir), dtype=dtype,
                                                attn_implementation="sdpa").eval()


def evaluator(target, m, max_new_tokens: int, threshold: float):
    """DeepSpec's DSpark evaluator (by the target's model_type) over the two models, T=0: what its
    `_init_context` / `_propose` / `_update` run on."""
    _import()
    from deepspec.eval.dspark.evaluator import Gemma4DSparkEvaluator, Qwen3DSparkEvaluator

    cls = Gemma4DSparkEvaluator if target.config.model_type == "gemma4_text" else Qwen3DSparkEvaluator
    ev = object.__new__(cls)
    ev.draft_model, ev.target_model, ev.confidence_head_recorder = m, target, None
    ev.args = SimpleNamespace(max_new_tokens=max_new_tokens, temperature=0.0, confidence_threshold=threshold)
    return ev


def decode(ev, ids, init_context=None, propose=None):
    """DeepSpec's own T=0 decoding loop, `generate_decoding_sample`, with the evaluator's hooks
    (`init_context` / `propose`: the evaluator's own unless given, e.g. observed)."""
    _import()
    from deepspec.eval.base_evaluator import generate_decoding_sample

    n = ev.args.max_new_tokens
    return generate_decoding_sample(target_model=ev.target_model, input_ids=ids, max_new_tokens=n,
                                    max_proposal_tokens=ev.max_proposal_tokens, temperature=0.0, stop_token_ids=None,
                                    init_context=init_context or ev._init_context, propose=propose or ev._propose,
                                    update=ev._update)


def loop(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, max_new_tokens: int, threshold: float) -> dict:
    """DeepSpec's own T=0 decoding loop (`generate_decoding_sample` with the DSpark evaluator's
    `_init_context` / `_propose` / `_update`); the proposals are observed, not changed."""
    import torch

    target, m = _models(target_dir, drafter_dir)
    ev = evaluator(target, m, max_new_tokens, threshold)
    proposals = []

    def propose(**kw):
        p = ev._propose(**kw)
        proposals.append(p.verify_input_ids[0, 1:].tolist())
        return p

    torch.manual_seed(0)
    ids = torch.from_numpy(prompt.astype(np.int64))
    res = decode(ev, ids, propose=propose)
    flat = [t for p in proposals for t in p]
    return {"stream.tokens": res.output_ids[0, res.num_input_tokens:].numpy().astype(np.int32),
            "stream.accepted": np.array(res.accepted_draft_lengths, np.int32),
            "stream.proposed": np.array(res.proposal_lengths, np.int32),
            "stream.acceptance_lengths": np.array(res.acceptance_lengths, np.int32),
            "stream.proposals": np.array(flat, np.int32),
            "stream.proposal_sizes": np.array([len(p) for p in proposals], np.int32)}


def extension_heads(drafter_dir: Path, hidden: np.ndarray, base: np.ndarray, anchors: np.ndarray) -> dict:
    """DeepSpec's Markov and confidence heads on given rows, with the weights of a DFlash drafter's
    DSpark extras (`markov_head.*`, `confidence_head.proj.*`; config keys read from dflash_config
    first, then the top level, as the port's extension reads them): `build_markov_head` and
    `AcceptRatePredictor` built and loaded strictly; per block the chain from its anchor
    (`sample_block_tokens` at temperature 0: the first slot's previous token is the anchor), the
    corrected rows, and the confidence logits (`predict_confidence_step`, the same function in both
    of DeepSpec's model families, on the chain's previous tokens). hidden [B, n, H], base [B, n, V]
    (after any softcap), anchors [B]."""
    import torch
    from safetensors.torch import load_file

    _import()
    from deepspec.modeling.dspark.common import AcceptRatePredictor
    from deepspec.modeling.dspark.markov_head import build_markov_head
    from deepspec.modeling.dspark.qwen3.modeling import Qwen3DSparkModel

    c = json.loads((Path(drafter_dir) / "config.json").read_text())
    c = {**c, **c.get("dflash_config", {})}
    tensors = {k: v for f in sorted(Path(drafter_dir).glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    def loaded(module, prefix):
        module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
        return module.float().eval()

    cfg = SimpleNamespace(markov_rank=int(c.get("markov_rank", 0)), markov_head_type=c.get("markov_head_type", "vanilla"),
                          vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]))
    markov = build_markov_head(cfg)
    markov = loaded(markov, "markov_head.") if markov is not None else None
    with_markov = bool(c.get("confidence_head_with_markov", False))
    confidence = None
    if c.get("enable_confidence_head", False):
        confidence = loaded(AcceptRatePredictor(cfg.hidden_size + (cfg.markov_rank if with_markov else 0)),
                            "confidence_head.")
    owner = SimpleNamespace(markov_head=markov, confidence_head=confidence, confidence_head_with_markov=with_markov)
    h, b = torch.from_numpy(np.ascontiguousarray(hidden)), torch.from_numpy(np.ascontiguousarray(base))
    first = torch.from_numpy(anchors.astype(np.int64))
    out = {}
    with torch.no_grad():
        if markov is None:
            tokens, rows = b.argmax(-1), b
        else:
            tokens, rows = markov.sample_block_tokens(b, first_prev_token_ids=first, hidden_states=h, temperature=0.0)
        out["heads.tokens"], out["heads.logits"] = tokens.to(torch.int32).numpy(), rows.float().numpy()
        prev = torch.cat([first[:, None], tokens[:, :-1]], dim=1)
        conf = Qwen3DSparkModel.predict_confidence_step(owner, h, prev_token_ids=prev)
        if conf is not None:
            out["heads.confidence"] = conf.reshape(conf.shape[0], -1).float().numpy()
    return out


def save_via_deepspec(target_dir: Path, drafter_dir: Path, args: dict, out_dir: Path) -> Path:
    """Build the drafter the way DeepSpec does (its `build_draft_config` on the target config, its
    model class), fill it with the given checkpoint's tensors (strict), and `save_pretrained` it:
    the files a DeepSpec training run writes, for the port to load."""
    import torch
    from safetensors.torch import load_file

    _import()
    from deepspec.modeling.dspark import Gemma4DSparkModel, Qwen3DSparkModel

    cfg_dict = draft_config(target_dir, args)
    gemma = cfg_dict["architectures"] == ["Gemma4DSparkModel"]
    cls = Gemma4DSparkModel if gemma else Qwen3DSparkModel
    config = cls.config_class.from_dict(cfg_dict)
    model = cls(config).to(torch.float32)
    tensors = {k: v for f in sorted(Path(drafter_dir).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"DeepSpec's model and the checkpoint disagree: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir)
    return Path(out_dir)


def loop_sampled(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, max_new_tokens: int, threshold: float,
                 temperature: float, seeds: list[int]) -> dict:
    """DeepSpec's own decoding loop at temperature > 0 — `generate_decoding_sample` with the DSpark
    evaluator's `_init_context` / `_propose` / `_update`, so its sampled proposal
    (`build_dspark_proposal` at the temperature: drafts drawn from softmax(logits / T) through the
    Markov head, q = those probabilities) and its rejection-sampling `verify_draft_tokens` — once
    per seed (`torch.manual_seed(seed)`), the models loaded once; its verifications are observed,
    not changed. Returns the tokens ([runs, max_new_tokens], -1 past the end) and per run the
    rounds' accepted lengths, proposal sizes and the token each round ends with (its correction or
    bonus, the verification's `next_token`: the trimmed tokens may not reach it)."""
    import torch

    _import()
    from deepspec.eval.base_evaluator import generate_decoding_sample

    target, m = _models(target_dir, drafter_dir)
    ev = evaluator(target, m, max_new_tokens, threshold)
    ev.args.temperature = float(temperature)
    ids = torch.from_numpy(prompt.astype(np.int64))
    tokens = np.full((len(seeds), max_new_tokens), -1, np.int32)
    accepted, proposed, ends, seen = [], [], [], []

    def update(context, verification):
        seen.append(int(verification.next_token.reshape(-1)[0]))
        ev._update(context, verification)

    for i, seed in enumerate(seeds):
        torch.manual_seed(int(seed))
        res = generate_decoding_sample(target_model=target, input_ids=ids, max_new_tokens=max_new_tokens,
                                       max_proposal_tokens=ev.max_proposal_tokens, temperature=float(temperature),
                                       stop_token_ids=None, init_context=ev._init_context, propose=ev._propose,
                                       update=update)
        out = res.output_ids[0, res.num_input_tokens:].numpy()
        tokens[i, : len(out)] = out
        accepted.append(list(res.accepted_draft_lengths))
        proposed.append(list(res.proposal_lengths))
        ends.append(seen[len(seen) - len(res.accepted_draft_lengths):])
    return {"tokens": tokens, "accepted": accepted, "proposed": proposed, "ends": ends}


def loop_sampled_statistics(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, max_new_tokens: int,
                            threshold: float, temperature: float, seeds: list[int]) -> dict:
    """`loop_sampled`, per request the arrays spec_parity.sampled compares: the first round's
    accepted length, the rounds, and the first round's end (`first_round_end`)."""
    from spec_parity.sampled import first_and_rounds, first_round_end

    ref = loop_sampled(target_dir, drafter_dir, prompt, max_new_tokens, threshold, temperature, seeds)
    vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
    # DeepSpec decodes while fewer than n + 1 tokens are committed: the first round's end is one of
    # them where 1 + k <= n (the prefill's token first); past that, as our loop, not reached.
    first = [(n[0], a[0], e[0] if 1 + a[0] <= max_new_tokens else None)
             for n, a, e in zip(ref["proposed"], ref["accepted"], ref["ends"])]
    return {**first_and_rounds(ref["accepted"]), **first_round_end(first, vocab)}

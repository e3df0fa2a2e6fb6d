"""References for the Gemma-4 assistant drafter.

optiq 0.7.7 (MLX): `GemmaAssistantDrafter.from_pretrained` + its runtime helpers on an mlx-lm
target, and its `spec_generate` loop. transformers 5.12.1 (torch): `Gemma4AssistantForCausalLM`
(or the unified class) fed `shared_kv_states` from `Gemma4ForCausalLM(return_shared_kv_states=
True)`, with position and window set explicitly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import numpy as np

from .layers import as_numpy, mlx_recorded, torch_recorded

OPTIQ_INSTALL = "pip install --no-deps mlx-optiq==0.7.7"
HF_INSTALL = "pip install torch==2.13.0 transformers==5.12.1   (or: pip install -e '.[oracle]')"


def status(oracle: str) -> str | None:
    need = {"optiq": (["optiq"], OPTIQ_INSTALL), "transformers": (["torch", "transformers"], HF_INSTALL)}[oracle]
    missing = [m for m in need[0] if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed: {need[1]}" if missing else None


def versions(oracle: str) -> dict[str, str]:
    from importlib.metadata import version

    pkgs = {"optiq": ["mlx-optiq", "mlx", "mlx-lm"], "transformers": ["torch", "transformers"]}[oracle]
    return {p: version(p) for p in pkgs}


# ---- optiq (MLX) ----------------------------------------------------------------------------

def _np(a) -> np.ndarray:
    """MLX -> numpy; bf16 and fp16 go through fp32, which holds each of their values exactly."""
    import mlx.core as mx

    return np.array(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


def optiq_drafter(drafter_dir: Path):
    """optiq's drafter from a checkpoint directory (`GemmaAssistantDrafter.from_pretrained`). It
    reads the first *.safetensors only: a sharded checkpoint is handed to it as one file holding
    every shard's tensors (the same bytes), in a folder removed once it has loaded."""
    import tempfile

    import mlx.core as mx
    from optiq.runtime.spec.drafters.gemma_assistant import GemmaAssistantDrafter

    shards = sorted(Path(drafter_dir).glob("*.safetensors"))
    if len(shards) <= 1:
        return GemmaAssistantDrafter.from_pretrained(str(drafter_dir))
    with tempfile.TemporaryDirectory(prefix="spec-parity-optiq-") as tmp:
        (Path(tmp) / "config.json").write_bytes((Path(drafter_dir) / "config.json").read_bytes())
        mx.save_safetensors(str(Path(tmp) / "model.safetensors"),
                            {k: v for f in shards for k, v in mx.load(str(f)).items()}, metadata={"format": "pt"})
        return GemmaAssistantDrafter.from_pretrained(tmp)


def optiq_donors(target, caches: list) -> dict:
    """The donor K/V optiq's drafter reads, per layer type (`extract_typed_kv` of the target's caches)."""
    from optiq.runtime.spec.kv_view import extract_typed_kv

    return extract_typed_kv(target, caches)


def optiq_step(drafter, target, token: int, hidden, shared: dict, position: int) -> tuple:
    """One draft step as optiq's spec_generate drafts it: the target's embedding of `token`
    (`_target_embed`), `drafter.forward` at `position`, the argmax. (embedding, logits, next
    hidden, next token)."""
    import mlx.core as mx
    from optiq.runtime.spec import runtime

    emb = runtime._target_embed(target, token)
    logits, h = drafter.forward(last_token_emb=emb, target_hidden=hidden, shared_kv=shared, position=position)
    return emb, logits, h, int(mx.argmax(logits))


def loaded(target_dir: Path, drafter_dir: Path, dtype: str = "float32"):
    """The mlx-lm target and optiq's drafter, their floating weights cast to `dtype` (the case's):
    a checkpoint stored in bf16 or fp16 computes at float32 as the float32 cases do (the cast is
    exact); "bfloat16" casts both, as a bf16 deployment would."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    target, _ = load_model(Path(target_dir))
    drafter = optiq_drafter(drafter_dir)
    target.set_dtype(getattr(mx, dtype))
    drafter.set_dtype(getattr(mx, dtype))
    return target, drafter


def optiq_draft_steps(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, gamma: int,
                      dtype: str = "float32") -> dict:
    """Prefill the mlx-lm target with optiq's helpers, then gamma drafter steps as optiq's
    spec_generate drafts them (donor view from `extract_typed_kv`, position P+k, chained), at
    `dtype` (loaded)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from optiq.runtime.spec import runtime

    target, drafter = loaded(target_dir, drafter_dir, dtype)
    caches = make_prompt_cache(target)
    hidden, logits = runtime._target_step(target, mx.array(prompt), caches)
    token = runtime._greedy(logits)
    h = hidden[:, -1:, :]
    position = caches[0].offset
    shared = optiq_donors(target, caches)
    out = {"anchor.token": np.array([token], np.int32), "anchor.hidden": _np(h),
           "position": np.array([position], np.int32)}
    for name, (k, v) in shared.items():
        out[f"donor.{name}.k"], out[f"donor.{name}.v"] = _np(k), _np(v)
    tok, layers = token, {}
    for k in range(gamma):
        with mlx_recorded(drafter.layers, layers) if k == 0 else contextlib.nullcontext():
            emb, lg, h, tok = optiq_step(drafter, target, tok, h, shared, position + k)
        if k == 0:
            out["anchor.emb"] = _np(emb)
        out[f"step{k}.logits"], out[f"step{k}.next_hidden"] = _np(lg), _np(h)
        out[f"step{k}.token"] = np.array([tok], np.int32)
    return {**out, **as_numpy(layers)}


class WordTokenizer:
    """optiq's spec_generate takes a prompt string and a tokenizer: token ids written as words."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


def optiq_stream(target, drafter, prompt: list[int], gamma: int, max_tokens: int, eos: int):
    """optiq's own loop, `spec_generate`, on token ids (WordTokenizer): its events, as it yields them."""
    from optiq.runtime.spec import SpecConfig, spec_generate

    tok = WordTokenizer(eos)
    return spec_generate(target, drafter, tok, tok.decode(prompt),
                         SpecConfig(gamma=gamma, max_tokens=max_tokens, eos_token_id=eos))


def optiq_spec_generate(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, gamma: int,
                        max_tokens: int, eos: int) -> dict:
    """optiq's own loop. The per-round trace is read off its events: each round emits the
    accepted drafts (from_draft=True) then one correction/bonus token. The drafter's logits of
    every draft step are observed on its `forward` (optiq drafts gamma per round, each the
    argmax of its step), never changed."""
    import mlx.core as mx

    target, drafter = loaded(target_dir, drafter_dir)
    rows, forward = [], drafter.forward

    def observed(*args, **kw):
        out = forward(*args, **kw)
        rows.append(out[0].reshape(-1))
        return out

    drafter.forward = observed
    events = list(optiq_stream(target, drafter, prompt[0].tolist(), gamma, max_tokens, eos))
    tokens = [e.token_id for e in events if e.kind == "token"]
    stats = events[-1].stats
    trace, accepted = [], 0
    for e in [e for e in events if e.kind == "token"][1:]:
        if e.from_draft:
            accepted += 1
        else:
            trace.append((gamma, accepted, accepted + 1))
            accepted = 0
    if accepted:
        trace.append((gamma, accepted, accepted))
    logits = mx.stack(rows) if rows else mx.zeros((0, 0))
    return {"stream.tokens": np.array(tokens, np.int32), "stream.trace": np.array(trace, np.int32).reshape(-1, 3),
            "stream.stats": np.array([stats.n_drafted, stats.n_accepted, stats.n_target_calls, stats.n_emitted],
                                     np.int32),
            "stream.proposals": np.array(mx.argmax(logits, axis=-1), np.int32), "stream.draft_logits": _np(logits)}


def optiq_generate_step_sampled(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, gamma: int,
                                max_tokens: int, temperature: float, seeds: list[int]) -> dict:
    """optiq's own sampled loop, `assistant_generate_step` (mlx-lm generate_step form): greedy
    drafts, the target samples every verify row with mlx-lm's `make_sampler(temp)`, drafts
    accepted while they equal the samples (token match). Once per seed (`mx.random.seed`), models
    loaded once. Its first pass feeds the last prompt token without drafts; the first drafting
    round is its second pass. Per run: the tokens, that round's accepted count (read off
    SpecStats when the third pass yields, or at the end), the totals, and `rounds`: per drafting
    pass (drafted, accepted), read off SpecStats at the first yield of the next pass (which
    yields the pending token before updating the counts) or at the end."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler
    from optiq.runtime.spec.runtime import SpecStats, assistant_generate_step

    target, drafter = loaded(target_dir, drafter_dir)
    tokens = np.full((len(seeds), max_tokens), -1, np.int32)
    first, accepted, drafted, calls, rounds = [], [], [], [], []
    for i, seed in enumerate(seeds):
        mx.random.seed(int(seed))
        stats = SpecStats()
        got, first_round = [], None
        after = {}                                   # pass c -> cumulative (drafted, accepted) after it
        for tok, _ in assistant_generate_step(mx.array(prompt[0]), target, drafter=drafter, gamma=gamma,
                                              max_tokens=max_tokens, sampler=make_sampler(temp=temperature),
                                              stats=stats):
            got.append(int(tok))
            after.setdefault(stats.n_target_calls - 1, (stats.n_drafted, stats.n_accepted))
            if first_round is None and stats.n_target_calls >= 3:
                first_round = stats.n_accepted
        last = stats.n_target_calls
        if stats.n_accepted > after.get(last - 1, (0, 0))[1]:
            after[last] = (stats.n_drafted, stats.n_accepted)   # it ended inside its last pass's drafts
        cum = [after[c] for c in range(1, max(after) + 1)]      # pass 1 feeds the prompt's last token
        rounds.append([(d1 - d0, a1 - a0) for (d0, a0), (d1, a1) in zip(cum, cum[1:])])
        tokens[i, : len(got)] = got
        first.append(stats.n_accepted if first_round is None else first_round)
        accepted.append(stats.n_accepted)
        drafted.append(stats.n_drafted)
        calls.append(stats.n_target_calls)
    return {"tokens": tokens, "first_accepted": np.array(first, np.int32), "accepted": np.array(accepted, np.int32),
            "drafted": np.array(drafted, np.int32), "target_calls": np.array(calls, np.int32), "rounds": rounds}


def optiq_sampled_statistics(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, gamma: int, max_tokens: int,
                             temperature: float, seeds: list[int]) -> dict:
    """`optiq_generate_step_sampled`, per request spec_parity.sampled's token-match statistics and
    the first drafting round's end token (its first pass yields the prefill's token, tokens[0])."""
    from spec_parity.sampled import first_round_end, match_statistics

    ref = optiq_generate_step_sampled(target_dir, drafter_dir, prompt, gamma, max_tokens, temperature, seeds)
    vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
    first = []
    for toks, rounds in zip(ref["tokens"], ref["rounds"]):
        (n, k), end = rounds[0], (int(toks[1 + rounds[0][1]]) if 1 + rounds[0][1] < len(toks) else -1)
        first.append((n, k, end if end >= 0 else None))
    return {**match_statistics(ref["rounds"], gamma, max_tokens), **first_round_end(first, vocab)}


# ---- transformers (torch) ---------------------------------------------------------------------

def hf_drafter_from_config(drafter_dir: Path, dtype, device):
    """transformers' assistant (`AutoModelForCausalLM.from_config` of the checkpoint's config, sdpa)
    on `device`, its weights left to the caller (the bench loads them from memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(drafter_dir)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def hf_step(drafter, emb, hidden, position: int, shared: dict) -> tuple:
    """One draft step of transformers' assistant: `inputs_embeds` = [target embedding ; hidden]
    [1, 1, 2H], at `position`, attending to `shared_kv_states`. (logits [V], last_hidden_state)."""
    import torch

    r = drafter(inputs_embeds=torch.cat([emb, hidden], dim=-1),
                position_ids=torch.tensor([[position]], device=hidden.device), shared_kv_states=shared)
    return r.logits[0, 0], r.last_hidden_state


def hf_draft_steps(drafter_dir: Path, inputs: dict, gamma: int, window_keep: int | None,
                   positions: str = "optiq") -> dict:
    """transformers' assistant drafts `gamma` chained steps from the given inputs (the anchor
    token/hidden, the donor K/V, the anchor position and the target's scaled embedding table).
    The sliding donor K/V is cut to the newest `window_keep` entries (None: all, and transformers'
    own mask picks the newest W+1) and step k sits at position P+k ("optiq") or P ("hf"): both set
    explicitly, since the references differ there."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    drafter = AutoModelForCausalLM.from_pretrained(Path(drafter_dir), dtype=torch.float32,
                                                   attn_implementation="eager").eval()
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
    k, v = t["in.donor.sliding.k"], t["in.donor.sliding.v"]
    keep = window_keep or k.shape[2]
    shared = {"sliding_attention": (k[..., -keep:, :], v[..., -keep:, :]),
              "full_attention": (t["in.donor.full.k"], t["in.donor.full.v"])}
    table, h = t["in.embed_table"], t["in.anchor.hidden"]
    tok, P = int(inputs["in.anchor.token"][0]), int(inputs["in.position"][0])
    out, layers = {}, {}
    with torch.no_grad():
        for step in range(gamma):
            pos = P + step if positions == "optiq" else P
            with torch_recorded(_layer_list(drafter), layers) if step == 0 else contextlib.nullcontext():
                lg, h = hf_step(drafter, table[tok][None, None], h, pos, shared)
            tok = int(lg.argmax())
            out[f"step{step}.logits"], out[f"step{step}.next_hidden"] = lg.numpy(), h.numpy()
            out[f"step{step}.token"] = np.array([tok], np.int32)
    return {**out, **as_numpy(layers)}


def _layer_list(model):
    """The drafter's decoder layers: the one ModuleList named `layers`."""
    import torch

    found = [m for name, m in model.named_modules() if name.split(".")[-1] == "layers"
             and isinstance(m, torch.nn.ModuleList)]
    if len(found) != 1:
        raise RuntimeError(f"{type(model).__name__}: expected one `layers` ModuleList, found {len(found)}")
    return found[0]


def hf_assisted_generate_record(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, max_new_tokens: int,
                                num_assistant_tokens: int) -> dict:
    """transformers' own assisted generation (generate(assistant_model=...)), with a forward
    pre-hook recording what each drafter call was fed: the hidden half of inputs_embeds, its
    position_ids, and the length of the shared K/V it attended to."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    target = AutoModelForCausalLM.from_pretrained(Path(target_dir), dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    drafter = AutoModelForCausalLM.from_pretrained(Path(drafter_dir), dtype=torch.float32,
                                                   attn_implementation="eager").eval()
    drafter.generation_config.num_assistant_tokens = num_assistant_tokens
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    calls = []

    def record(module, args, kwargs):
        B = kwargs["inputs_embeds"].shape[-1] // 2
        calls.append({"hidden": kwargs["inputs_embeds"][0, 0, B:].clone(),
                      "position": int(kwargs["position_ids"][0, 0]),
                      "kv_len": int(kwargs["shared_kv_states"]["full_attention"][0].shape[2])})

    hook = drafter.register_forward_pre_hook(record, with_kwargs=True)
    ids = torch.from_numpy(prompt.astype(np.int64))
    try:
        with torch.no_grad():
            seq = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            hs = target(ids, output_hidden_states=True).hidden_states[-1][0]
    finally:
        hook.remove()
    return {"sequence": seq[0].numpy(), "calls": calls, "prompt_final_hidden": hs.numpy()}

"""Deterministic tiny checkpoints in the real on-disk format (config.json + model.safetensors).

`build(kind, seed, overrides)` returns a directory that transformers and mlx-lm load with their
normal loaders. The same arguments give the same bytes on every machine: every tensor is drawn
from its own numpy PCG64 stream keyed by (seed, tensor name), in float64, then cast. Directories
are created atomically in a cache (SPEC_PARITY_CACHE, default ~/.cache/spec-parity) so parallel
test workers can race safely.

A kind is a function `(seed, overrides) -> (config, tensors)` registered with `@kind(name)`;
later drafter issues add their kinds here.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

KINDS: dict[str, Callable[[int, dict], tuple[dict, dict[str, np.ndarray]]]] = {}
FILES = ("config.json", "model.safetensors")


def kind(name: str):
    def register(fn):
        KINDS[name] = fn
        return fn

    return register


def cache_root() -> Path:
    return Path(os.environ.get("SPEC_PARITY_CACHE", Path.home() / ".cache" / "spec-parity"))


@functools.cache
def _factory_digest() -> str:
    """The factory's own source: a changed kind must not be served from a stale cache entry."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in ("checkpoints.py", "agreeing.py", "dflash_checkpoints.py"))).hexdigest()


def _key(kind_name: str, seed: int, overrides: dict) -> str:
    blob = json.dumps([kind_name, seed, overrides, _factory_digest()], sort_keys=True).encode()
    return f"{kind_name}-s{seed}-{hashlib.sha256(blob).hexdigest()[:12]}"


def build(kind_name: str, seed: int = 0, overrides: dict | None = None, root: Path | None = None) -> Path:
    """Return the directory of the tiny checkpoint, creating it atomically if absent."""
    if kind_name not in KINDS:
        raise KeyError(f"unknown checkpoint kind {kind_name!r}; known: {sorted(KINDS)}")
    overrides = dict(overrides or {})
    root = Path(root or cache_root()) / "checkpoints"
    out = root / _key(kind_name, seed, overrides)
    if all((out / f).exists() for f in FILES):
        return out
    config, tensors = KINDS[kind_name](seed, overrides)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        write_checkpoint(tmp, config, tensors)
        try:
            os.rename(tmp, out)
        except OSError:
            if not all((out / f).exists() for f in FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_checkpoint(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> None:
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def checkpoint_hash(path: Path) -> str:
    """sha256 over the checkpoint's files; what goldens record to detect a changed checkpoint."""
    h = hashlib.sha256()
    for f in FILES:
        h.update(f.encode())
        h.update((Path(path) / f).read_bytes())
    return h.hexdigest()


class Draw:
    """Per-tensor deterministic random draws: each name gets its own stream."""

    def __init__(self, seed: int, dtype=np.float32):
        self.seed = seed
        self.dtype = dtype
        self.tensors: dict[str, np.ndarray] = {}

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def normal(self, name: str, shape: tuple, std: float) -> None:
        self.tensors[name] = (self._rng(name).standard_normal(shape) * std).astype(self.dtype)

    def linear(self, name: str, out_dim: int, in_dim: int, gain: float = 1.0) -> None:
        self.normal(name, (out_dim, in_dim), gain / np.sqrt(in_dim))

    def scale(self, name: str, shape: tuple, lo: float = 0.5, hi: float = 1.5) -> None:
        """Norm weights and layer scalars: random so a port that ignores them is caught."""
        self.tensors[name] = self._rng(name).uniform(lo, hi, shape).astype(self.dtype)

    def attention(self, p: str, H: int, heads: int, kv_heads: int, head_dim: int, v: bool = True) -> None:
        """q/k/(v)/o projections and the q/k norms of one attention block under prefix p."""
        self.linear(p + "self_attn.q_proj.weight", heads * head_dim, H)
        self.linear(p + "self_attn.k_proj.weight", kv_heads * head_dim, H)
        if v:
            self.linear(p + "self_attn.v_proj.weight", kv_heads * head_dim, H)
        self.linear(p + "self_attn.o_proj.weight", H, heads * head_dim)
        self.scale(p + "self_attn.q_norm.weight", (head_dim,))
        self.scale(p + "self_attn.k_norm.weight", (head_dim,))

    def mlp(self, p: str, H: int, inter: int) -> None:
        self.linear(p + "mlp.gate_proj.weight", inter, H)
        self.linear(p + "mlp.up_proj.weight", inter, H)
        self.linear(p + "mlp.down_proj.weight", H, inter)

    def norms(self, p: str, names: tuple[str, ...], dims: int) -> None:
        for n in names:
            self.scale(p + n + ".weight", (dims,))


QWEN_NORMS = ("input_layernorm", "post_attention_layernorm")
GEMMA_NORMS = QWEN_NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _merge(config: dict, overrides: dict) -> dict:
    config = copy.deepcopy(config)
    unknown = set(overrides) - set(config)
    if unknown:
        raise KeyError(f"override keys {sorted(unknown)} are not in this kind's config; known: {sorted(config)}")
    config.update(copy.deepcopy(overrides))
    return config


GEMMA4_TARGET = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                    "sliding_attention", "sliding_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": None,
    "head_dim": 16,
    "global_head_dim": 32,
    "attention_k_eq_v": False,
    "sliding_window": 8,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 128,
    "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
    "enable_moe_block": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "torch_dtype": "float32",
}


@kind("gemma4-target")
def gemma4_target(seed: int, overrides: dict):
    """Gemma-4 text target: sliding + full layers, proportional RoPE, softcap, optional
    attention_k_eq_v and per-layer inputs with kv-shared layers (real E2B/26B structure, scaled down)."""
    c = _merge(GEMMA4_TARGET, overrides)
    H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    first_shared = L - c["num_kv_shared_layers"]
    ple = c["hidden_size_per_layer_input"]
    d = Draw(seed)
    # Small embeddings and a large final norm: with a tied head, a large √H-scaled embedding makes
    # every token predict itself (constant greedy streams that test nothing); this mix gives
    # streams of 10-25 distinct tokens with top-1 margins well above the fp32 noise.
    d.normal("model.embed_tokens.weight", (V, H), 0.1)
    d.scale("model.norm.weight", (H,), 2.0, 6.0)
    if ple:
        d.normal("model.embed_tokens_per_layer.weight", (c["vocab_size_per_layer_input"], L * ple), 1.0)
        d.linear("model.per_layer_model_projection.weight", L * ple, H)
        d.scale("model.per_layer_projection_norm.weight", (ple,))
    for i, layer_type in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        full = layer_type == "full_attention"
        hd = c["global_head_dim"] if full else c["head_dim"]
        k_eq_v = c["attention_k_eq_v"] and full
        kv_heads = c["num_global_key_value_heads"] if k_eq_v and c["num_global_key_value_heads"] else c["num_key_value_heads"]
        inter = c["intermediate_size"] * (2 if c["use_double_wide_mlp"] and i >= first_shared > 0 else 1)
        d.scale(p + "layer_scalar", (1,))
        d.linear(p + "self_attn.q_proj.weight", c["num_attention_heads"] * hd, H)
        d.scale(p + "self_attn.q_norm.weight", (hd,))
        if i < first_shared:
            d.linear(p + "self_attn.k_proj.weight", kv_heads * hd, H)
            d.scale(p + "self_attn.k_norm.weight", (hd,))
            if not k_eq_v:
                d.linear(p + "self_attn.v_proj.weight", kv_heads * hd, H)
        d.linear(p + "self_attn.o_proj.weight", H, c["num_attention_heads"] * hd)
        d.mlp(p, H, inter)
        d.norms(p, GEMMA_NORMS, H)
        if ple:
            d.linear(p + "per_layer_input_gate.weight", ple, H)
            d.linear(p + "per_layer_projection.weight", H, ple)
            d.scale(p + "post_per_layer_input_norm.weight", (H,))
    if not c["tie_word_embeddings"]:
        d.linear("lm_head.weight", V, H)
    return c, d.tensors


QWEN3_TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "torch_dtype": "float32",
}


@kind("qwen3-target")
def qwen3_target(seed: int, overrides: dict):
    """Qwen3 target (8B/14B structure, untied head, q/k norms), scaled down."""
    c = _merge(QWEN3_TARGET, overrides)
    H, V, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = Draw(seed)
    d.normal("model.embed_tokens.weight", (V, H), 1.0)
    d.scale("model.norm.weight", (H,))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        d.attention(p, H, nh, nkv, hd)
        d.mlp(p, H, c["intermediate_size"])
        d.norms(p, QWEN_NORMS, H)
    if not c["tie_word_embeddings"]:
        d.linear("lm_head.weight", V, H, gain=4.0)
    return c, d.tensors


ASSISTANT_TEXT = {
    "model_type": "gemma4_text",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": None,
    "head_dim": 16,
    "global_head_dim": 32,
    "attention_k_eq_v": False,
    "sliding_window": 8,
    "final_logit_softcapping": None,
    "rope_parameters": GEMMA4_TARGET["rope_parameters"],
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "num_kv_shared_layers": 4,
    "use_double_wide_mlp": False,
    "enable_moe_block": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

ASSISTANT = {
    "model_type": "gemma4_assistant",
    "backbone_hidden_size": 64,
    "use_ordered_embeddings": True,
    "num_centroids": 8,
    "centroid_intermediate_top_k": 2,
    "tie_word_embeddings": True,
    "text_config": ASSISTANT_TEXT,
}


@kind("gemma4-assistant")
def gemma4_assistant(seed: int, overrides: dict):
    """Gemma-4 "-assistant" drafter (E2B/E4B: centroid head; 26B/31B: tied head; 12B: the
    `gemma4_unified_assistant` type), Q-only layers that read the target's donor K/V. Scaled down
    to the tiny Gemma-4 target: same head dims, KV heads and window. Override `text_config` keys
    through `text_config`, e.g. {"text_config": {"attention_k_eq_v": True}}."""
    ov = dict(overrides)
    text_ov = ov.pop("text_config", {})
    c = _merge(ASSISTANT, ov)
    c["text_config"] = _merge(ASSISTANT_TEXT, text_ov)
    unified = c["model_type"] == "gemma4_unified_assistant"
    if unified:
        c["text_config"]["model_type"] = "gemma4_unified_text"
        for k in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            c["text_config"].pop(k)
    c["architectures"] = ["Gemma4UnifiedAssistantForCausalLM" if unified else "Gemma4AssistantForCausalLM"]
    c["torch_dtype"] = "float32"
    t = c["text_config"]
    B, D, V = c["backbone_hidden_size"], t["hidden_size"], t["vocab_size"]
    d = Draw(seed)
    d.normal("model.embed_tokens.weight", (V, D), 1.0)
    d.scale("model.norm.weight", (D,))
    d.linear("pre_projection.weight", D, 2 * B)
    d.linear("post_projection.weight", B, D)
    for i, layer_type in enumerate(t["layer_types"]):
        p = f"model.layers.{i}."
        hd = t["global_head_dim"] if layer_type == "full_attention" else t["head_dim"]
        d.scale(p + "layer_scalar", (1,))
        d.linear(p + "self_attn.q_proj.weight", t["num_attention_heads"] * hd, D)
        d.scale(p + "self_attn.q_norm.weight", (hd,))
        d.linear(p + "self_attn.o_proj.weight", D, t["num_attention_heads"] * hd)
        d.mlp(p, D, t["intermediate_size"])
        d.norms(p, GEMMA_NORMS, D)
    if c["use_ordered_embeddings"]:
        if V % c["num_centroids"]:
            raise ValueError(f"vocab {V} is not divisible by num_centroids {c['num_centroids']}")
        d.linear("masked_embedding.centroids.weight", c["num_centroids"], D)
        order = np.random.default_rng([seed, zlib.crc32(b"token_ordering")]).permutation(V)
        d.tensors["masked_embedding.token_ordering"] = order.astype(np.int64)
    return c, d.tensors


DSPARK = {
    "target_kind": "gemma4-target",
    "target_overrides": {},
    "target_layer_ids": [1, 2, 4],
    "num_draft_layers": 2,
    "block_size": 7,
    "mask_token_id": 0,
    "num_anchors": 64,
    "markov_rank": 8,
    "markov_head_type": "vanilla",
    "confidence_head_alpha": 1.0,
    "confidence_head_with_markov": True,
}


def dspark_config(target: dict, args: dict) -> dict:
    """The draft config DeepSpec's `build_draft_config` derives from a target config (its config
    path is checked against this one in the oracle tests): the target's text config with the
    draft's layer count, all-full layers, an untied head and the DSpark fields."""
    c = copy.deepcopy(target)
    n_target = c["num_hidden_layers"]
    ids = [int(i) for i in args["target_layer_ids"]]
    if any(b <= a for a, b in zip(ids, ids[1:])) or any(i != -1 and not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {ids} must be strictly increasing in {{-1}} U [0, {n_target - 1}]")
    gemma = c["model_type"] == "gemma4_text"
    c.update({
        "architectures": ["Gemma4DSparkModel" if gemma else "Qwen3DSparkModel"],
        "num_target_layers": n_target,
        "num_hidden_layers": args["num_draft_layers"],
        "block_size": args["block_size"],
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * args["num_draft_layers"],
        "mask_token_id": args["mask_token_id"],
        "target_layer_ids": ids,
        "num_anchors": args["num_anchors"],
        "enable_confidence_head": args["confidence_head_alpha"] > 0,
        "markov_rank": args["markov_rank"],
    })
    if gemma:
        c["target_model_type"], c["target_text_model_type"] = "gemma4", "gemma4_text"
    elif "rope_theta" in c:  # transformers 5 writes Qwen3's RoPE as rope_parameters
        c["rope_parameters"] = {"rope_theta": c.pop("rope_theta"), "rope_type": "default"}
    if c["enable_confidence_head"]:
        c["confidence_head_with_markov"] = bool(args["confidence_head_with_markov"])
    if args["markov_rank"] > 0:
        c["markov_head_type"] = args["markov_head_type"]
    c.pop("torch_dtype", None)
    c["dtype"] = "float32"
    return c


@kind("dspark-drafter")
def dspark_drafter(seed: int, overrides: dict):
    """A DeepSpec DSpark drafter (Gemma-4 or Qwen3 family, by `target_kind`) in DeepSpec's own
    format: the state-dict names and config its `save_pretrained` writes. Its embedding and lm head
    are the target's (DeepSpec copies them at training start), so the target is built first.
    markov_rank 0 and confidence_head_alpha 0 give DeepSpec's DFlash variant."""
    a = _merge(DSPARK, overrides)
    target_cfg, target_tensors = KINDS[a["target_kind"]](a.get("target_seed", seed), a["target_overrides"])
    c = dspark_config(target_cfg, a)
    gemma = c["model_type"] == "gemma4_text"
    H, V, r = c["hidden_size"], c["vocab_size"], a["markov_rank"]
    d = Draw(seed)
    d.tensors["embed_tokens.weight"] = target_tensors["model.embed_tokens.weight"]
    d.tensors["lm_head.weight"] = target_tensors.get("lm_head.weight", target_tensors["model.embed_tokens.weight"])
    d.linear("fc.weight", H, len(c["target_layer_ids"]) * H)
    d.scale("hidden_norm.weight", (H,))
    d.scale("norm.weight", (H,))
    if gemma:
        hd = c["global_head_dim"]
        kv = c["num_global_key_value_heads"] if c["attention_k_eq_v"] else c["num_key_value_heads"]
    else:
        hd, kv = c["head_dim"], c["num_key_value_heads"]
    nh = c["num_attention_heads"]
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        d.attention(p, H, nh, kv, hd, v=not (gemma and c["attention_k_eq_v"]))
        d.mlp(p, H, c["intermediate_size"])
        d.norms(p, GEMMA_NORMS if gemma else QWEN_NORMS, H)
        if gemma:
            d.scale(p + "layer_scalar", (1,))
    if r:
        d.normal("markov_head.markov_w1.weight", (V, r), 1.0)
        d.linear("markov_head.markov_w2.weight", V, r, gain=2.0)
        if a["markov_head_type"] == "gated":
            d.linear("markov_head.gate_proj.weight", r, H + r)
            d.normal("markov_head.gate_proj.bias", (r,), 0.1)
        elif a["markov_head_type"] == "rnn":
            d.linear("markov_head.joint_proj.weight", 3 * r, 2 * r + H)
            d.normal("markov_head.joint_proj.bias", (3 * r,), 0.1)
    if c["enable_confidence_head"]:
        d.linear("confidence_head.proj.weight", 1, H + (r if c.get("confidence_head_with_markov") else 0), gain=4.0)
        d.normal("confidence_head.proj.bias", (1,), 0.5)
    return c, d.tensors


# The agreeing target/drafter kinds (controlled acceptance) live in their own module; importing it
# registers them.
from . import agreeing  # noqa: E402,F401
from .dflash_checkpoints import dflash_drafter  # noqa: E402,F401

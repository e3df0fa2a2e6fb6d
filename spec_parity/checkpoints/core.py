"""The factory's core: the kind registry, the per-tensor draws, the cache and the file format.

A kind is a function `(seed, overrides) -> (config, tensors)` registered with `@kind(name)` in a
drafter's checkpoints module (spec_parity/drafters/<name>/checkpoints.py); this module imports none
of them, and the package's __init__ imports them all.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import sys
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
    """The factory's own source, every module of this package and every module a registered kind
    is written in (each drafter's checkpoints.py): a changed kind must not be served from a stale
    cache entry."""
    here = Path(__file__).parent
    files = set(here.glob("*.py")) | {Path(sys.modules[fn.__module__].__file__) for fn in KINDS.values()}
    root = here.parent
    return hashlib.sha256(b"".join(str(f.relative_to(root)).encode() + f.read_bytes()
                                   for f in sorted(files))).hexdigest()


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

    def markov_head(self, H: int, V: int, r: int, head_type: str, gain: float) -> None:
        """DeepSpec's Markov head of rank r (DSpark drafters and the DSpark extras on DFlash)."""
        self.normal("markov_head.markov_w1.weight", (V, r), 1.0)
        self.linear("markov_head.markov_w2.weight", V, r, gain=gain)
        if head_type == "gated":
            self.linear("markov_head.gate_proj.weight", r, H + r)
            self.normal("markov_head.gate_proj.bias", (r,), 0.1)
        elif head_type == "rnn":
            self.linear("markov_head.joint_proj.weight", 3 * r, 2 * r + H)
            self.normal("markov_head.joint_proj.bias", (3 * r,), 0.1)
        elif head_type != "vanilla":
            raise ValueError(f"markov_head_type {head_type!r}: vanilla, gated or rnn")

    def confidence_head(self, in_dim: int) -> None:
        """DeepSpec's confidence head: one logit from [hidden ; Markov features] (in_dim wide)."""
        self.linear("confidence_head.proj.weight", 1, in_dim, gain=4.0)
        self.normal("confidence_head.proj.bias", (1,), 0.5)


_draw_class: type[Draw] = Draw


def draw(seed: int) -> Draw:
    """The Draw every kind draws through; `drawing_with` swaps its class."""
    return _draw_class(seed)


@contextlib.contextmanager
def drawing_with(cls: type[Draw]):
    """Kinds draw with `cls` meanwhile (the bench's in-memory mx.random draws)."""
    global _draw_class
    saved, _draw_class = _draw_class, cls
    try:
        yield
    finally:
        _draw_class = saved


QWEN_NORMS = ("input_layernorm", "post_attention_layernorm")
GEMMA_NORMS = QWEN_NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def _merge(config: dict, overrides: dict) -> dict:
    config = copy.deepcopy(config)
    unknown = set(overrides) - set(config)
    if unknown:
        raise KeyError(f"override keys {sorted(unknown)} are not in this kind's config; known: {sorted(config)}")
    config.update(copy.deepcopy(overrides))
    return config


# The Gemma-4 text config keys the target and the assistant's text config share.
GEMMA4_TEXT = {
    "model_type": "gemma4_text",
    "vocab_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": None,
    "head_dim": 16,
    "global_head_dim": 32,
    "attention_k_eq_v": False,
    "sliding_window": 8,
    "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "hidden_size_per_layer_input": 0,
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

"""Random-weight checkpoints from the published config.json files of fixtures/configs/.

The kind "published" takes {"file": <path under fixtures/configs/>, "sha256": <its digest>} and
writes that exact config, shrunk by one rule so it fits a CPU test (24 GiB, 2 cores, seconds):

* divided by WIDTH_FACTOR: the width keys WIDTH_KEYS (hidden, intermediate, backbone, head and
  global head dims, Markov rank), at the top level and in text_config;
* reduced to VOCAB: vocab_size (top level and text_config), when larger; a token id key of
  TOKEN_ID_KEYS outside the reduced vocabulary keeps its distance from the top
  (id -> VOCAB - (vocab_size - id)), so a mask token stays a real row;
* kept: every other key and value, layer counts, head counts, layer types, sliding window, RoPE
  parameters, tap layer ids, block size, num_centroids and its top-k.

Tensors are drawn from the factory's `draw(seed)` with the same writers the family's kind uses;
a config's family comes from `spec_parity.port.checkpoint.family`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from ..shipped import shipped
from .core import QWEN_NORMS, build, draw, kind

ROOT = shipped() / "configs"
WIDTH_FACTOR = 16
VOCAB = 4096
WIDTH_KEYS = ("hidden_size", "intermediate_size", "backbone_hidden_size", "head_dim", "global_head_dim",
              "markov_rank")
TOKEN_ID_KEYS = ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id")


def published_config(name: str) -> dict:
    """A published config.json as kept in fixtures/configs/ (name: <family>/<file>.json)."""
    return json.loads((ROOT / name).read_text())


def shrink(cfg: dict) -> dict:
    """`cfg` under the rule of the module docstring."""
    c = copy.deepcopy(cfg)
    for node in (c, c.get("text_config")):
        if not isinstance(node, dict):
            continue
        for k in WIDTH_KEYS:
            if isinstance(node.get(k), int):
                if node[k] % WIDTH_FACTOR:
                    raise ValueError(f"{k}={node[k]} is not divisible by the width factor {WIDTH_FACTOR}")
                node[k] //= WIDTH_FACTOR
        V = node.get("vocab_size")
        if isinstance(V, int) and V > VOCAB:
            node["vocab_size"] = VOCAB
            for k in TOKEN_ID_KEYS:
                if isinstance(node.get(k), int) and node[k] >= VOCAB:
                    node[k] = VOCAB - (V - node[k])
    return c


def _qwen3_target(c: dict, d) -> None:
    H, V = c["hidden_size"], c["vocab_size"]
    d.normal("model.embed_tokens.weight", (V, H), 1.0)
    d.scale("model.norm.weight", (H,))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        d.attention(p, H, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        d.mlp(p, H, c["intermediate_size"])
        d.norms(p, QWEN_NORMS, H)
    if not c["tie_word_embeddings"]:
        d.linear("lm_head.weight", V, H, gain=4.0)


def _dspark(c: dict, d) -> None:
    """DeepSpec's DSpark state dict (Qwen3 or Gemma-4 family); the embedding and lm head, which
    DeepSpec copies from the target, are drawn here."""
    from ..drafters.dspark.checkpoints import draw_dspark

    H, V = c["hidden_size"], c["vocab_size"]
    d.normal("embed_tokens.weight", (V, H), 1.0)
    d.linear("lm_head.weight", V, H, gain=4.0)
    draw_dspark(c, d)


def _assistant(c: dict, d, seed: int) -> None:
    from ..drafters.assistant.checkpoints import draw_assistant

    draw_assistant(c, d, seed)


@kind("published")
def published(seed: int, overrides: dict):
    """A published config (overrides: file, default the E2B assistant; sha256, which
    `build_published` passes so an edited file is not served from the cache) shrunk by the
    module's rule, random weights."""
    from spec_parity.port import checkpoint

    name = overrides.get("file", "assistant/gemma-4-E2B-it-assistant.json")
    raw = (ROOT / name).read_bytes()
    if hashlib.sha256(raw).hexdigest() != overrides.get("sha256", hashlib.sha256(raw).hexdigest()):
        raise ValueError(f"{name}: sha256 differs from the one asked for")
    c = shrink(json.loads(raw))
    fam = checkpoint.family(c)
    d = draw(seed)
    if fam == "qwen3":
        _qwen3_target(c, d)
    elif fam and fam.startswith("dspark"):
        _dspark(c, d)
    elif fam == "assistant":
        _assistant(c, d, seed)
    else:
        raise ValueError(f"{name}: family {fam!r} has no published writer")
    return c, d.tensors


def build_published(name: str, seed: int = 0, root: Path | None = None) -> Path:
    """The checkpoint directory of the published config `name` (see `published`)."""
    digest = hashlib.sha256((ROOT / name).read_bytes()).hexdigest()
    return build("published", seed, {"file": name, "sha256": digest}, root)


__all__ = ["ROOT", "TOKEN_ID_KEYS", "VOCAB", "WIDTH_FACTOR", "WIDTH_KEYS", "build_published",
           "published_config", "shrink"]

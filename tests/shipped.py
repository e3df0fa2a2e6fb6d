"""A factory checkpoint re-saved as real checkpoints ship: its floating tensors in bfloat16 or
float16 (config.json's torch_dtype saying so) and/or split into shards with their index, in the
layout transformers' save_pretrained(max_shard_size=...) writes (model-0000i-of-0000n.safetensors
and model.safetensors.index.json, whose weight_map names each tensor's shard).

The factory writes float32 in one model.safetensors (spec_parity.checkpoints); these copies
are what the real-checkpoint tests load through every path.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def reshipped(src: Path, dst: Path, dtype: str = "float32", shards: int = 1) -> Path:
    """`src` (config.json + model.safetensors) written to `dst` with its floating tensors cast to
    `dtype` and split into `shards` files (1: one model.safetensors), atomically."""
    import mlx.core as mx

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    tensors = mx.load(str(Path(src) / "model.safetensors"))
    tensors = {k: v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in sorted(tensors.items())}
    if not 1 <= shards <= len(tensors):
        raise ValueError(f"shards {shards}: between 1 and the {len(tensors)} tensors")
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dst.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(with_dtype(json.loads((Path(src) / "config.json").read_text()),
                                                               dtype), indent=2, sort_keys=True) + "\n")
        write_shards(tmp, tensors, shards)
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def with_dtype(config: dict, dtype: str) -> dict:
    """config.json declaring `dtype` where transformers reads it: torch_dtype, and dtype (its
    newer spelling) where the config has it, at the top and in text_config."""
    out = {**config, "torch_dtype": dtype, **({"dtype": dtype} if "dtype" in config else {})}
    if isinstance(config.get("text_config"), dict):
        out["text_config"] = with_dtype(config["text_config"], dtype)
    return out


def write_shards(path: Path, tensors: dict, shards: int) -> None:
    """`tensors` (name -> mx.array) as `shards` safetensors files of about equal tensor counts, in
    name order, plus the index naming each tensor's file; one shard: model.safetensors, no index."""
    import mlx.core as mx

    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "pt"})
        return
    names = list(tensors)
    total = sum(v.nbytes for v in tensors.values())
    groups = [names[i * len(names) // shards:(i + 1) * len(names) // shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / name), {k: tensors[k] for k in group}, metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

"""Deterministic tiny checkpoints in the real on-disk format (config.json + model.safetensors).

`build(kind, seed, overrides)` returns a directory that transformers and mlx-lm load with their
normal loaders. The same arguments give the same bytes on every machine: every tensor is drawn
from its own numpy PCG64 stream keyed by (seed, tensor name), in float64, then cast. Directories
are created atomically in a cache (SPEC_PARITY_CACHE, default ~/.cache/spec-parity) so parallel
test workers can race safely.

The package: `core` (registry, draws, cache, file format), `agreeing` (what the agreeing kinds
share) and `published` (shrunk published configs). Each drafter's random and agreeing kinds sit
side by side in its folder (spec_parity/drafters/<name>/checkpoints.py). A kind is a function
`(seed, overrides) -> (config, tensors)` registered with `@kind(name)`; importing every drafter's
checkpoints module below registers every kind.
"""

from ..drafters import DRAFTERS, piece
from . import agreeing, published
from .core import (
           FILES,
           KINDS,
           Draw,
           build,
           cache_root,
           checkpoint_hash,
           drawing_with,
           kind,
           write_checkpoint,
)

for _drafter in DRAFTERS:
    piece(_drafter, "checkpoints")

__all__ = ["FILES", "KINDS", "Draw", "agreeing", "build", "cache_root", "checkpoint_hash", "drawing_with",
           "kind", "published", "write_checkpoint"]

"""Deterministic tiny checkpoints in the real on-disk format (config.json + model.safetensors).

`build(kind, seed, overrides)` returns a directory that transformers and mlx-lm load with their
normal loaders. The same arguments give the same bytes on every machine: every tensor is drawn
from its own numpy PCG64 stream keyed by (seed, tensor name), in float64, then cast. Directories
are created atomically in a cache (SPEC_PARITY_CACHE, default ~/.cache/spec-parity) so parallel
test workers can race safely.

The package: `core` (registry, draws, cache, file format), `agreeing` (what the agreeing kinds
share) and one module per drafter family with its random and agreeing kinds side by side:
`targets`, `assistant`, `dspark`, `dflash`. A kind is a function `(seed, overrides) -> (config,
tensors)` registered with `@kind(name)`; the imports below register every kind.
"""

from . import agreeing, assistant, dflash, dspark, published, targets
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
from .dspark import DSPARK
from .targets import GEMMA4_VARIANTS

__all__ = ["DSPARK", "FILES", "GEMMA4_VARIANTS", "KINDS", "Draw", "agreeing", "assistant", "build",
           "cache_root", "checkpoint_hash", "dflash", "drawing_with", "dspark", "kind", "published", "targets",
           "write_checkpoint"]

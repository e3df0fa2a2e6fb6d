"""The parity harness. Its fp32 budgets are full-fp32 budgets (measured on the CPU), so it keeps
MLX's float32 matmuls at full precision where MLX would otherwise run them as TF32 (CUDA, Apple
M5): there a batched verify and a one-row decode of the same tokens differ by ~1e-2 in the
logits (measured on an H200, docs/benchmarks.md). Set MLX_ENABLE_TF32=1 yourself to measure TF32."""

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")

__version__ = "0.1.0"

"""The bucketed block's attention as two custom CUDA kernels (MLX CUDA only; the default there
with bf16 weights, see port/compiled.py resolve_attention).

Why: on MLX CUDA a draft block is host-bound, and the default bucketed attention
(compiled.joined_sdpa) costs five launches a layer: two copies to join the context buffer to the
block's K and two for V, then mx.fast's attention over the whole padded buffer with a float mask
(built by more ops). Here the context buffer is read in place up to `valid` (an array, so one
compiled kernel serves every context length and every bucket), the mask is computed from
positions inside the kernel, and padded rows cost nothing: two launches a layer.

Kernel 1 (split): one CUDA block per (split of the keys, KV head, group of query rows). GQA: every
query row of the KV head's query heads (rep x L rows) in one block, so K and V are read once.
Keys are [context rows 0..valid-1 ; block rows 0..L-1]; each split walks its share of them in
tiles of TK keys held in shared memory, the next tile's loads in flight while one is computed,
and keeps an online softmax per row (fp32: running max, sum, unnormalised output). Two versions:
MMA, bf16 with head_dim <= 128 (the default's): a warp owns 16 rows, both products on tensor
cores; SPLIT, the rest (fp32, fp16, head_dim 144-256): four threads share a row, a quarter of
the head dimension each, fp32 FMAs (slower on the GPU).
Kernel 2 (combine): the splits' partial results rescaled to the common max and summed, written
as [1, L, Hq, D] so that the layer's output projection reads its rows without a copy.

Masking, as compiled.bucketed_mask states it: a context row j is seen by block row i when
j < valid and (no window, or valid + i - j < window); a block row m when not causal or m <= i.
Scores are scale * q.k in fp32, exp by expf (no fast math): held to joined_sdpa within tolerance
on MLX CUDA (tests/test_kernels.py; docs/benchmarks.md "Parity on MLX CUDA")."""

from __future__ import annotations

import struct
from functools import cache

import mlx.core as mx

from .kernel_source import COMBINE, MMA, MMA_HEADER, SPLIT

ROWS = 64          # query rows per CUDA block at most (FMA: 4 threads a row; tensor cores: 16 a warp)
CTAS = 264         # CUDA blocks aimed at: two per SM of an H200 (132 SMs)
MMA_CAPABILITY = 8  # mma.sync's bf16 m16n8k16: compute capability 8.0 or newer (MLX CUDA runs from 7.5)


class KernelError(ValueError):
    pass


def available() -> bool:
    """The kernels run: MLX's CUDA backend, and the GPU the default device."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


@cache
def _kernels():
    """The kernels (built once; MLX compiles each per template): split (fp32 FMA), split on bf16
    tensor cores, combine."""
    names = ["q", "ck", "cv", "bk", "bv", "valid"]
    split = mx.fast.cuda_kernel(name="spec_parity_bucket_attention_split", input_names=names,
                                output_names=["po", "pm", "pl"], source=SPLIT, ensure_row_contiguous=False)
    mma = mx.fast.cuda_kernel(name="spec_parity_bucket_attention_mma", input_names=names,
                              output_names=["po", "pm", "pl"], source=MMA, header=MMA_HEADER,
                              ensure_row_contiguous=False)
    combine = mx.fast.cuda_kernel(name="spec_parity_bucket_attention_combine", input_names=["po", "pm", "pl"],
                                  output_names=["out"], source=COMBINE)
    return split, mma, combine


def device_valid(valid) -> mx.array:
    """`valid` (an int32 scalar array) as the kernels read it: four copies made by a GPU op, 16
    bytes. MLX CUDA (0.32) keeps every array of at most 8 bytes in a small pool of managed memory
    that the GPU reads where it lies (cudaMemAdviseSetAccessedBy), so each launch's read of a scalar
    array took ~17 us on an H100 (a kernel that reads only it: 18.2 us, 1.6 us with the value a
    constant: tools/kernel_fixed_cost.py); a larger array a GPU op makes is in device memory.
    Made once per block or verify, read by every layer's launch."""
    return valid + mx.zeros((4,), mx.int32)


def scale_bits(scale: float) -> int:
    """The scale as a template constant (its fp32 bits as an int; the kernel reads them back with
    __int_as_float), not an input array: a scalar array is read from MLX CUDA's small managed pool
    at every launch (device_valid says what that costs)."""
    return struct.unpack("<i", struct.pack("<f", scale))[0]


def fits(head_dim: int) -> bool:
    """The shapes the kernels take: a head dimension that is a multiple of 16, at most 256."""
    return head_dim % 16 == 0 and head_dim <= 256


@cache
def capability() -> int | None:
    """The GPU's compute capability (its major number) on MLX CUDA; None elsewhere."""
    return int(mx.device_info()["compute_capability_major"]) if mx.cuda.is_available() else None


def tensor_core_refusal(dtype: mx.Dtype, head_dim: int) -> str | None:
    """Why the split kernel does not run on bf16 tensor cores (MMA) but on its fp32 FMA path
    (SPLIT); None: it does. It needs bf16, a head_dim <= 128, and a GPU of compute capability
    MMA_CAPABILITY or newer: on a 7.5 GPU (T4, RTX 20xx: MLX CUDA runs there) the MMA source does
    not compile (ptxas: ".bf16 requires sm_80"; tests/test_kernels.py compiles it for both), the FMA
    one does. Off MLX CUDA the shapes decide: nothing launches the kernels there."""
    if (cap := capability()) is not None and cap < MMA_CAPABILITY:
        return f"run on bf16 tensor cores: compute capability {MMA_CAPABILITY}.0 or newer (this GPU: {cap}.x)"
    if dtype != mx.bfloat16 or head_dim > 128:
        return f"take bf16 activations and a head_dim <= 128 (this one: {dtype}, {head_dim})"
    return None


def tensor_cores(dtype: mx.Dtype, head_dim: int) -> bool:
    """The split kernel runs on bf16 tensor cores (tensor_core_refusal says why not)."""
    return tensor_core_refusal(dtype, head_dim) is None


def check(head_dim: int, error=None) -> None:
    """fits(), or `error` (the caller's error class; KernelError by default) naming the fix."""
    if not fits(head_dim):
        raise (error or KernelError)(f"bucket_attention='kernel' needs a head_dim that is a multiple of 16 and at most 256 "
                          f"(this drafter's: {head_dim}); use bucket_attention='sdpa'")


def split_launch(dtype: mx.Dtype, HQ: int, HKV: int, L: int, D: int, S: int) -> tuple[bool, int, list, int, int]:
    """The split kernel's launch for these shapes: (on tensor cores, threads a CUDA block, its
    template past the masking: WARPS or RPB, then TK; query-row groups, key splits)."""
    rows = HQ // HKV * L
    if tensor_cores(dtype, D):
        warps = min(-(-rows // 16), ROWS // 16)
        on_tensor_cores, threads, tk, launch, groups = True, warps * 32, 32, [("WARPS", warps)], -(-rows // (warps * 16))
    else:
        rpb = min(-(-rows // 8) * 8, ROWS)   # whole warps: the row's four threads shuffle
        tk = 32 if D <= 128 else 16
        on_tensor_cores, threads, launch, groups = False, rpb * 4, [("RPB", rpb)], -(-rows // rpb)
    splits = max(1, min(-(-(S + L) // tk), -(-CTAS // (HKV * groups))))
    return on_tensor_cores, threads, launch + [("TK", tk)], groups, splits


def attention(q, ctx_k, ctx_v, blk_k, blk_v, valid, scale: float, window: int | None = None,
              causal: bool = False):
    """softmax(scale q [ctx | block]^T, masked) [ctx | block], as a [1, Hq, L, D] view (its
    memory laid out [1, L, Hq, D]). q [1, Hq, L, D]; ctx_k / ctx_v [1, Hkv, S, D] the bucketed
    buffers, rows from valid[0] unused (`valid`: device_valid's array); blk_k / blk_v [1, Hkv, L, D]."""
    _, HQ, L, D = q.shape
    HKV, S = ctx_k.shape[1], ctx_k.shape[2]
    check(D)
    split, mma, combine = _kernels()
    inputs = [q, ctx_k, ctx_v, blk_k, blk_v, valid]
    masking = [("HQ", HQ), ("HKV", HKV), ("L", L), ("D", D), ("W", window or 0), ("CAUSAL", bool(causal)),
               ("SCALE", scale_bits(scale))]
    on_tensor_cores, threads, launch, groups, splits = split_launch(q.dtype, HQ, HKV, L, D, S)
    kernel, template = mma if on_tensor_cores else split, masking + launch
    po, pm, pl = kernel(inputs=inputs, template=template, grid=(splits * threads, HKV, groups),
                        threadgroup=(threads, 1, 1),
                        output_shapes=[(splits, HQ * L, D), (splits, HQ * L), (splits, HQ * L)],
                        output_dtypes=[mx.float32] * 3)
    out = combine(inputs=[po, pm, pl], template=[("T", q.dtype), ("HQ", HQ), ("L", L), ("D", D)],
                  grid=(HQ * L * D, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(1, L, HQ, D)],
                  output_dtypes=[q.dtype])[0]
    return out.transpose(0, 2, 1, 3)

"""A Qwen3 layer's Q and K norms and RoPE as one custom CUDA kernel (MLX CUDA only; the kernel
verify's, port/fast/verify.py, and the bucketed DFlash block's, port/fast/dflash.py, where
`unsupported` is None).

Why: a serving round on MLX CUDA is bound by the host, at 8-9 us of host time a launch
(docs/benchmarks.md "Session 22"), and mlx-lm's Qwen3 attention launches four kernels between its
projections and its attention: q_norm, k_norm (mx.fast.rms_norm) and RoPE on each
(mx.fast.rope); DFlash's draft layers the same. Here one launch does all four: 108 fewer a verify
of Qwen3-4B's 36 layers, 15 fewer a block of its DFlash drafter's 5.

One warp a (row, head) of [Q heads ; K heads]; a lane holds D / 32 of the head's elements, at
lane + 32 e, so the RoPE pair (j, j + D/2) of a non-traditional RoPE is in one lane (D a multiple
of 64). The norm is MLX's: the mean square in fp32, x * rsqrt(mean + eps) * w; the rotation is
mx.fast.rope's on MLX CUDA (inv_freq = exp2(-j / (D/2) * log2(base)), theta = scale * position *
inv_freq, cosf / sinf). The difference: the normed value is not rounded to the activations' dtype
before the rotation (mlx-lm's rounds it between its two kernels), so Q and K are one rounding
closer to fp32; held within tolerance of the unfused ops, and the verify within its bf16 tier, on
MLX CUDA (tests/test_norm_rope.py, tests/test_bucketed_verify.py)."""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from . import kernels

SOURCE = """
constexpr int H = HQ + HKV;
constexpr int E = D / 32;
const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
if (warp >= H * L) return;
const int i = warp / H, h = warp % H;
const bool isq = h < HQ;
const int hh = isq ? h : h - HQ;
const long long src = ((long long)i * (isq ? HQ : HKV) + hh) * D;
float y[E];
float ss = 0.f;
#pragma unroll
for (int e = 0; e < E; ++e) {
  y[e] = static_cast<float>(isq ? qp[src + lane + 32 * e] : kp[src + lane + 32 * e]);
  ss += y[e] * y[e];
}
#pragma unroll
for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, m);
const float r = rsqrtf(ss / D + __int_as_float(EPS));
#pragma unroll
for (int e = 0; e < E; ++e) {
  const int j = lane + 32 * e;
  y[e] = y[e] * r * static_cast<float>(isq ? qw[j] : kw[j]);
}
const float pos = __int_as_float(SCALE) * static_cast<float>(valid[0] + i);
const long long dst = ((long long)hh * L + i) * D;
#pragma unroll
for (int e = 0; e < E / 2; ++e) {
  const int j = lane + 32 * e;
  const float d = static_cast<float>(j) / static_cast<float>(D / 2);
  const float theta = pos * exp2f(-d * __int_as_float(LOG2BASE));
  const float c = cosf(theta), s = sinf(theta);
  const float a = y[e], b = y[e + E / 2];
  if (isq) {
    q[dst + j] = static_cast<T>(a * c - b * s);
    q[dst + j + D / 2] = static_cast<T>(a * s + b * c);
  } else {
    k[dst + j] = static_cast<T>(a * c - b * s);
    k[dst + j + D / 2] = static_cast<T>(a * s + b * c);
  }
}
"""


@cache
def _kernel():
    return mx.fast.cuda_kernel(name="spec_parity_qk_norm_rope", input_names=["qp", "kp", "qw", "kw", "valid"],
                               output_names=["q", "k"], source=SOURCE)


def unsupported(attn) -> str | None:
    """Why mlx-lm Qwen3 Attention `attn`'s norms and RoPE cannot be the one kernel (None: they can):
    the kernels do not run here, RoPE other than a plain non-traditional nn.RoPE over the whole head
    (scaled variants compute their frequencies otherwise), norms other than nn.RMSNorm of one eps,
    or a head_dim that is not a multiple of 64."""
    if not kernels.available():
        return "its kernel runs on MLX's CUDA backend only"
    rope, hd = attn.rope, attn.q_norm.weight.shape[0]
    if type(rope) is not nn.RoPE or rope.traditional or rope.dims != hd:
        return f"it takes a non-traditional nn.RoPE over the whole head (this one: {type(rope).__name__})"
    if not (type(attn.q_norm) is type(attn.k_norm) is nn.RMSNorm) or attn.q_norm.eps != attn.k_norm.eps:
        return "it takes nn.RMSNorm of one eps for q_norm and k_norm"
    if hd % 64:
        return f"it takes a head_dim that is a multiple of 64 (this one: {hd})"
    return None


def qk(attn, qp, kp, offset, valid):
    """A Qwen3-style attention (mlx-lm's, or a drafter's with the same q_norm, k_norm and rope) from
    its projected rows qp [.., L, Hq * D], kp [.., L, Hkv * D] to its attention's inputs: q [1, Hq,
    L, D] and k [1, Hkv, L, D], normed and rotated at positions valid[0] + row (`valid`:
    kernels.device_valid's array of the `offset`, read on the device, not from MLX's scalar pool)."""
    d = attn.q_norm.weight.shape[0]
    L, hq, hkv = qp.shape[-2], qp.shape[-1] // d, kp.shape[-1] // d
    template = [("T", qp.dtype), ("HQ", hq), ("HKV", hkv), ("L", L), ("D", d), ("EPS", kernels.scale_bits(attn.q_norm.eps)),
                ("SCALE", kernels.scale_bits(attn.rope.scale)), ("LOG2BASE", kernels.scale_bits(math.log2(attn.rope.base)))]
    warps = (hq + hkv) * L
    q, k = _kernel()(inputs=[qp, kp, attn.q_norm.weight, attn.k_norm.weight, valid], template=template,
                     grid=(warps * 32, 1, 1), threadgroup=(min(warps * 32, 256), 1, 1),
                     output_shapes=[(1, hq, L, d), (1, hkv, L, d)], output_dtypes=[qp.dtype, qp.dtype])
    return q, k

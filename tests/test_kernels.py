"""The bucketed attention's custom CUDA kernels (port/fast/kernels.py) against the attention they
replace (compiled.joined_sdpa over the joined keys with its float mask), on MLX CUDA.

The reference runs in fp32 on the same inputs; the kernels' output is held to it within the
budget of the inputs' dtype (fp32, bf16, fp16), over shapes that cross a tile and a
split boundary, GQA, a sliding window, causal blocks, and `valid` at 0, inside and at the end of
the buffer. Planted bugs, edited into the kernels' source from here (the port is not touched),
must fail the same comparison. On the CPU the refusal and the default's resolution run (the
kernels need MLX CUDA), and, where nvcc is installed, the kernels' source is compiled for sm_90a."""

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import budgets, checkpoints, compare
from spec_parity.port import compiled, dflash, dspark
from spec_parity.port.fast import dflash as fast_dflash
from spec_parity.port.fast import dspark as fast_dspark
from spec_parity.port.fast import kernels

CUDA = pytest.mark.skipif(not kernels.available(), reason="the kernels run on MLX CUDA only")

# (Hq, Hkv, L, D, S, valid, window, causal)
SHAPES = [
    (4, 2, 8, 16, 24, 13, None, False),        # the tiny drafters' shape
    (32, 8, 16, 128, 2304, 2048, None, False),  # Qwen3-4B DFlash, ctx 2048
    (32, 8, 7, 128, 512, 300, None, False),     # DSpark's block of 7
    (8, 1, 16, 256, 256, 256, None, False),     # Gemma-4's global head_dim, a full buffer
    (16, 4, 16, 64, 64, 0, None, True),         # no context yet, causal
    (32, 8, 16, 128, 2304, 2041, None, True),   # Qwen3-4B's verify (spec_parity.port.serve verify="kernel"): 16 new rows, causal
    (8, 2, 16, 128, 512, 333, 40, True),        # a sliding window, causal
    (8, 2, 16, 128, 512, 20, 64, False),        # a window wider than the context
]


def _inputs(shape, dtype, seed=0):
    Hq, Hkv, L, D, S, valid, window, causal = shape
    rng = np.random.default_rng(seed)

    def a(*s):
        return mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)

    return (a(1, Hq, L, D), a(1, Hkv, S, D), a(1, Hkv, S, D), a(1, Hkv, L, D), a(1, Hkv, L, D),
            mx.array(valid, mx.int32), D ** -0.5, window, causal)


def _reference(q, ck, cv, bk, bv, valid, scale, window, causal):
    f = [x.astype(mx.float32) for x in (q, ck, cv, bk, bv)]
    mask = compiled.bucketed_mask("sdpa", valid, q.shape[2], ck.shape[2], mx.float32, window, causal)
    return compiled.joined_sdpa(*f, mask, scale)


def _outside(shape, dtype) -> list:
    args = _inputs(shape, dtype)
    q, ck, cv, bk, bv, valid, *rest = args
    got = kernels.attention(q, ck, cv, bk, bv, kernels.device_valid(valid), *rest)
    budget = budgets.DTYPE_DEFAULTS[str(dtype).removeprefix("mlx.core.")]
    m = compare.tensor_metrics(got.astype(mx.float32), _reference(*args), budget)
    return [] if m["ok"] else [(shape, m.get("max_abs"), m.get("error"))]


@CUDA
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["fp32", "bf16", "fp16"])
def test_kernels_match_the_joined_attention(dtype):
    """fp16 takes the FMA path as fp32 does (the tensor-core path is bf16's), within fp16's budget."""
    bad = [b for shape in SHAPES for b in _outside(shape, dtype)]
    assert not bad, bad


# bug -> edits (source name, old, new): each applied where its text is (fp32 runs SPLIT, bf16 MMA)
PLANTED = {
    # each context key read from the next row (the last one kept in the valid rows)
    "context rows": [(name, "g * ck_strides[1] + n * ck_strides[2]", "g * ck_strides[1] + min(n + 1, nv - 1) * ck_strides[2]")
                     for name in ("SPLIT", "MMA")],
    # a window one row too wide
    "window": [("SPLIT", "nv + i - n < W", "nv + i - n <= W"), ("MMA", "nv + ii[x] - n < W", "nv + ii[x] - n <= W")],
    # the causal block sees the next row
    "causal": [("SPLIT", "n - nv <= i)", "n - nv <= i + 1)"), ("MMA", "n - nv <= ii[x])", "n - nv <= ii[x] + 1)")],
    # the running output not rescaled when the max moves
    "rescale": [("SPLIT", "acc[j].x *= alpha;", ""), ("MMA", "o[j][0] *= alpha[0];", "")],
    # the splits summed without their max
    "combine": [("COMBINE", "const float w = expf(m - mx_);", "const float w = 1.f;")],
}


@CUDA
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_kernel_bugs_fail(bug, dtype, monkeypatch):
    for name, old, new in PLANTED[bug]:
        source = getattr(kernels, name)
        assert old in source, (name, old)
        monkeypatch.setattr(kernels, name, source.replace(old, new))
    kernels._kernels.cache_clear()
    try:
        assert [b for shape in SHAPES for b in _outside(shape, dtype)], f"planted {bug!r} passed"
    finally:
        monkeypatch.undo()
        kernels._kernels.cache_clear()


@pytest.mark.skipif(kernels.available(), reason="the refusal off MLX CUDA")
def test_kernel_attention_is_refused_off_cuda():
    with pytest.raises(dflash.DFlashError, match="CUDA backend only"):
        fast_dflash.load(checkpoints.build("dflash-drafter", 0, {}), kv_bucket=8, bucket_attention="kernel")
    with pytest.raises(dspark.DSparkError, match="CUDA backend only"):
        fast_dspark.load(checkpoints.build("dspark-drafter", 0, {}), kv_bucket=8, bucket_attention="kernel")


@CUDA
def test_kernel_attention_refuses_a_head_dim_it_cannot_take():
    with pytest.raises(dflash.DFlashError, match="multiple of 16"):
        fast_dflash.load(checkpoints.build("dflash-drafter", 0, {"head_dim": 24}), kv_bucket=8,
                         bucket_attention="kernel")


def test_auto_attention_is_the_kernel_where_it_runs():
    """The default (compiled.AUTO): the kernels on MLX CUDA with bf16 weights (their tensor-core
    path), mx.fast's joined attention elsewhere: fp32 weights, the CPU, a head_dim they do not take."""
    for m in (fast_dflash.load(checkpoints.build("dflash-drafter", 0, {}), kv_bucket=8),
              fast_dspark.load(checkpoints.build("dspark-drafter", 0, {}), kv_bucket=8)):
        assert m.bucket_attention == "sdpa"
        m.set_dtype(mx.bfloat16)
        assert m.bucket_attention == ("kernel" if kernels.available() else "sdpa")
    odd = fast_dflash.load(checkpoints.build("dflash-drafter", 0, {"head_dim": 24}), kv_bucket=8)
    odd.set_dtype(mx.bfloat16)
    assert odd.bucket_attention == "sdpa"


NVCC = shutil.which("nvcc")
STUB = """#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
"""
CTYPES = {"float": "float", "bf16": "__nv_bfloat16"}


def _kernel(name: str, source: str, inputs: list, outputs: list, template: list) -> str:
    """One kernel as mx.fast.cuda_kernel writes it (MLX 0.32's custom_kernel.cpp): the signature
    from the input names, `<name>_shape` / `_strides` arguments where the source names them, the
    template as constants, the body inside namespace mlx::core::cu."""
    args = []
    for n, t, ndim in inputs:
        args.append(f"const {t}* {n}")
        args += [f"const __grid_constant__ {k} {n}_{s}" for k, s in (("Shape", "shape"), ("Strides", "strides"))
                 if ndim and f"{n}_{s}" in source]
    args += [f"{t}* {n}" for n, t in outputs]
    consts = "".join(f"  using {k} = {v};\n" if isinstance(v, str) else
                     f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};\n"
                     for k, v in template)
    return (f"namespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n__global__ void {name}(\n    "
            + ",\n    ".join(args) + f") {{\n{consts}{source}\n}}\n}}\n")


def _translation_unit(split: str, mma: str) -> str:
    """Every kernel variant the port launches, in one file over a stub of MLX's device header."""
    masking = [("HQ", 32), ("HKV", 8), ("L", 16), ("W", 40), ("CAUSAL", True), ("SCALE", kernels.scale_bits(0.125))]
    parts = [STUB, kernels.MMA_HEADER]
    for dtype, d, tk, kind in (("float", 128, 32, "split"), ("bf16", 256, 16, "split"), ("bf16", 128, 32, "mma")):
        t = CTYPES[dtype]
        inputs = [(n, t, 4) for n in ("q", "ck", "cv", "bk", "bv")] + [("valid", "int32_t", 0)]
        extra = [("RPB", 64), ("TK", tk)] if kind == "split" else [("WARPS", 4), ("TK", tk)]
        parts.append(_kernel(f"{kind}_{dtype}_{d}", split if kind == "split" else mma, inputs,
                             [("po", "float"), ("pm", "float"), ("pl", "float")], masking + [("D", d)] + extra))
        parts.append(_kernel(f"combine_{dtype}_{d}", kernels.COMBINE,
                             [("po", "float", 3), ("pm", "float", 2), ("pl", "float", 2)], [("out", t)],
                             [("T", t), ("HQ", 32), ("L", 16), ("D", d)]))
    return "\n".join(parts)


def _compiles(source: str, tmp_path, arch: str = "sm_90a") -> subprocess.CompletedProcess:
    (tmp_path / "k.cu").write_text(source)
    return subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-c", "k.cu", "-o", "k.o"], cwd=tmp_path,
                          capture_output=True, text=True)


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_kernel_sources_compile_for_the_h200(tmp_path):
    """The kernels' CUDA source compiles for sm_90a wherever nvcc is installed, so an edit is
    checked before it reaches the device. Control: a statement's semicolon dropped fails."""
    done = _compiles(_translation_unit(kernels.SPLIT, kernels.MMA), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    broken = kernels.MMA.replace("l[x] *= alpha[x];", "l[x] *= alpha[x]")
    assert _compiles(_translation_unit(kernels.SPLIT, broken), tmp_path).returncode != 0


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_only_the_fma_kernels_compile_for_compute_capability_7_5(tmp_path):
    """MLX CUDA runs on 7.5 (T4, RTX 20xx); the MMA kernel's bf16 m16n8k16 needs 8.0, so
    kernels.tensor_cores sends a 7.5 GPU to the FMA kernels: they compile for sm_75, the MMA one
    does not (for the reason the gate names), and both do for sm_80."""
    fma_only = _translation_unit(kernels.SPLIT, kernels.MMA).split("__global__ void mma_")[0]
    fma_only = fma_only[: fma_only.rindex("namespace mlx::core::cu {")]
    assert _compiles(fma_only, tmp_path, "sm_75").returncode == 0
    mma = _compiles(_translation_unit(kernels.SPLIT, kernels.MMA), tmp_path, "sm_75")
    assert mma.returncode != 0 and "requires .target sm_80" in mma.stderr, mma.stderr[-1000:]
    assert _compiles(_translation_unit(kernels.SPLIT, kernels.MMA), tmp_path, "sm_80").returncode == 0

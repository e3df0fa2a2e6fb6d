"""Where the bucket kernels' split kernel spends its time when it has little to do: the MMA kernel
(port/fast/kernels.py) as it is, with the valid length a template constant instead of read from
its array, with its partial results not written, and a kernel that only reads the valid length
(KEYS), each with `valid` made on the host and made by a GPU op. CUPTI kernel time per launch,
30 launches (spec_parity.bench.timing.kernel_profile); MLX CUDA only. On an H100 the read of a
scalar array was most of the kernel (docs/references.md, "What runs where").

    python3 tools/kernel_fixed_cost.py
"""

import mlx.core as mx
import numpy as np

from spec_parity.bench import timing
from spec_parity.bench.sides import Stepper
from spec_parity.port.fast import kernels as K

NAMES = ["q", "ck", "cv", "bk", "bv", "valid"]
CONSTANT = ("const int nv = valid[0];", "const int nv = NVT;")
PARTIALS = "reinterpret_cast<float2*>(po + row * D + 8 * j + tig * 2)[0] = make_float2(o[j][2 * x], o[j][2 * x + 1]);"
ONLY_KEYS = "if (threadIdx.x == 0) pm[blockIdx.x] = nv + n0;"
VARIANTS = {
    "as is": K.MMA,
    "nv a template constant": K.MMA.replace(*CONSTANT),
    "nv constant, no partial writes": K.MMA.replace(*CONSTANT).replace(PARTIALS, ""),
    "empty (keys only)": K.KEYS + ONLY_KEYS,
    "empty, nv constant": K.KEYS.replace(*CONSTANT) + ONLY_KEYS,
}
SHAPES = [(32, 8, 16, 128, 2304, 2041), (32, 8, 16, 128, 2304, 64)]   # (Hq, Hkv, L, D, S, valid)


def main() -> None:
    built = {name: mx.fast.cuda_kernel(name=f"probe_{i}", input_names=NAMES, output_names=["po", "pm", "pl"],
                                        source=src, header=K.MMA_HEADER, ensure_row_contiguous=False)
             for i, (name, src) in enumerate(VARIANTS.items())}
    for shape in SHAPES:
        probe(shape, built)


def probe(shape: tuple, built: dict) -> None:
    Hq, Hkv, L, D, S, valid = shape
    rng = np.random.default_rng(0)
    q, ck, cv, bk, bv = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(mx.bfloat16)
                         for s in ((1, Hq, L, D), (1, Hkv, S, D), (1, Hkv, S, D), (1, Hkv, L, D), (1, Hkv, L, D)))
    on_host, on_gpu = mx.array(valid, mx.int32), mx.array(valid, mx.int32) * 1
    mx.eval(q, ck, cv, bk, bv, on_host, on_gpu)
    _, threads, launch, groups, splits = K.split_launch(mx.bfloat16, Hq, Hkv, L, D, S)
    template = [("HQ", Hq), ("HKV", Hkv), ("L", L), ("D", D), ("W", 0), ("CAUSAL", True),
                ("SCALE", K.scale_bits(D ** -0.5))] + launch + [("NVT", valid)]
    for name, kernel in built.items():
        for where, v in (("valid made on the host", on_host), ("valid made on the GPU", on_gpu)):
            def call(kernel=kernel, v=v):
                return kernel(inputs=[q, ck, cv, bk, bv, v], template=template, grid=(splits * threads, Hkv, groups),
                              threadgroup=(threads, 1, 1),
                              output_shapes=[(splits, Hq * L, D), (splits, Hq * L), (splits, Hq * L)],
                              output_dtypes=[mx.float32] * 3)[1]
            s = timing.kernel_profile(Stepper(step=call), steps=30)
            print(f"{shape} {name}, {where}: kernels {s['kernel_us_per_call']:.1f} us", flush=True)


if __name__ == "__main__":
    main()

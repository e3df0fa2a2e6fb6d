"""Host time to issue one bucketed verify, op by op (targets.forward) against the compiled verify
(port/fast/verify.py), on a Qwen3 stand-in at Qwen3-4B's depth (36 layers) and tiny widths, so that
evaluation does not drown the host's part; and the trace, paid once per buffer length. Issue = the
call returning its lazy arrays; eval = mx.eval of them after (on MLX CUDA the kernels are encoded in
it: at these widths it is mostly host time). Medians of 30 verifies of 16 rows after 5; the caches
are trimmed back after each. Where the kernel verify runs (MLX CUDA; the target then in bf16),
"kernel" is the compiled verify with port/fast/kernels.py's attention (verify="kernel"): whether the
kernel verify costs the host more.

    python3 tools/verify_host_time.py
"""

import time

import mlx.core as mx
import numpy as np

from spec_parity import checkpoints
from spec_parity.port import targets
from spec_parity.port.fast import kernels, verify

LAYERS, ROWS, BUCKET, RUNS, WARM = 36, 16, 256, 30, 5

target = targets.load(checkpoints.build("qwen3-target", 0, {"num_hidden_layers": LAYERS}),
                      dtype=mx.bfloat16 if kernels.available() else None)
ids = mx.array([list(range(5, 5 + ROWS))])


def prefilled():
    caches = targets.make_caches(target, BUCKET)
    mx.eval(targets.forward(target, mx.array([list(range(3, 40))]), caches=caches).logits)
    return caches


def timed(forward, caches):
    t0 = time.perf_counter()
    trace = forward(caches)
    t1 = time.perf_counter()
    mx.eval(trace.logits, trace.final, *trace.hidden)
    t2 = time.perf_counter()
    for c in caches:
        c.offset -= ROWS
    return t1 - t0, t2 - t1


sides = {"op by op": lambda c: targets.forward(target, ids, caches=c),
         "compiled": lambda c: verify.forward(target, ids, c)}
if verify.kernel_unsupported(target, BUCKET) is None:
    sides["kernel"] = lambda c: verify.forward(target, ids, c, "kernel")
caches = {name: prefilled() for name in sides}
trace_s = timed(sides["compiled"], caches["compiled"])[0]
for _ in range(WARM):
    for name, f in sides.items():
        timed(f, caches[name])
samples = {name: [] for name in sides}
for _ in range(RUNS):  # the sides alternate, so a drift weighs on both
    for name, f in sides.items():
        samples[name].append(timed(f, caches[name]))
for name, s in samples.items():
    issue, ev = np.median(np.array(s), axis=0) * 1e3
    print(f"{name:9s} issue {issue:.2f} ms  eval {ev:.2f} ms")
print(f"trace (the compiled verify's first call at this buffer length): {trace_s * 1e3:.1f} ms")

"""Where a round's time goes on this backend, sequential against pipelined: one-row compiled
verifies (port/fast/verify.py forward_at, the pipelined loop's forward) on a Qwen3 stand-in at
Qwen3-4B's depth (36 layers) and tiny widths. Per step: build = the call returning its lazy arrays,
queue = mx.async_eval of them, wait = the host read of a step's token (the sequential loop reads
this step's, the pipelined one the last step's, after queuing this one). Where `queue` holds the
evaluation (the CPU backend: its work runs inside async_eval), there is nothing for a pipeline to
overlap; on MLX CUDA `queue` only encodes the kernels and `wait` is the device's time. Medians of 40
steps, the two loops alternating, two passes each.

    python3 tools/pipeline_overlap.py
"""

import time

import mlx.core as mx
import numpy as np

from spec_parity import checkpoints
from spec_parity.port import targets
from spec_parity.port.fast import verify

LAYERS, BUCKET, STEPS = 36, 256, 40

target = targets.load(checkpoints.build("qwen3-target", 0, {"num_hidden_layers": LAYERS}))
caches = targets.make_caches(target, BUCKET)
mx.eval(targets.forward(target, mx.array([list(range(3, 40))]), caches=caches).logits)
start = caches[0].offset


def steps(pipelined: bool) -> np.ndarray:
    """Per step (build, queue, wait) seconds; every step writes one row past the last."""
    offset, tok, last, out = mx.array(start, mx.int32), mx.array(5, mx.int32), None, []
    for i in range(STEPS):
        for c in caches:
            c.offset = start + i
        t0 = time.perf_counter()
        trace = verify.forward_at(target, tok.reshape(1, 1), caches, offset)
        tok, offset = mx.argmax(trace.logits[0, -1]).astype(mx.int32), offset + 1
        t1 = time.perf_counter()
        mx.async_eval(tok, offset)
        t2 = time.perf_counter()
        if not pipelined:
            tok.item()
        elif last is not None:
            last.item()
        out.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        last = tok
    mx.eval(tok, offset)
    return np.array(out)


steps(True)   # the trace
for p in range(2):
    for name, pipelined in (("sequential", False), ("pipelined", True)):
        build, queue, wait = np.median(steps(pipelined), axis=0) * 1e3
        print(f"pass {p + 1} {name:10s} build {build:.2f} ms  queue {queue:.2f} ms  wait {wait:.2f} ms")

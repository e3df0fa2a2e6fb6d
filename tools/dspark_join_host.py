"""Host time to build one pipelined DSpark draft: the verify's rows joined into every layer's
buffer op by op, then the compiled block (the path before the joined call, built here from the
port's public pieces: the block at a host length, as the sequential loop's), against
port/fast/dspark.py Bucketed.block_at, the join and the block in one compiled call, on the factory's
DSpark drafter with the 5 draft layers of the real shapes (spec_parity/bench/shapes.py). build = the
call returning its lazy arrays (the host's graph building, which the pipelined loop overlaps with
the device's work on MLX CUDA); the evaluation is not timed. Both paths' tokens are compared on
every step. Medians of 60 steps, two passes.

    python3 tools/dspark_join_host.py
"""

import time

import mlx.core as mx
import numpy as np

from spec_parity import checkpoints
from spec_parity.port import compiled as pieces
from spec_parity.port.fast import dspark as fast

STEPS, ROWS, LAYERS = 60, 8, 5

m = fast.load(checkpoints.build("dspark-drafter", 0, {"num_draft_layers": LAYERS}), kv_bucket=256)
taps = len(m.tap_layers()) * m.args.hidden_size
start = 300


def caches():
    out = [m.make_cache() for _ in m.layers]
    rows = mx.random.normal((1, start, taps), key=mx.random.key(1)).astype(m.fc.weight.dtype)
    for c, (k, v) in zip(out, m.context_kv(m.project(rows), 0)):
        c.update_and_fetch(k, v)
    mx.eval([c.keys for c in out])
    return out


def op_by_op(ctx, rows, at, valid, anchor, room):
    for c, (k, v) in zip(ctx, m.context_kv(m.project(rows), at)):
        c.offset = room
        c.reserve(k.shape[2], k.shape[:2] + (k.shape[3], v.shape[3]), k.dtype)
        c.keys, c.values = pieces.written(c.keys, c.values, k, v, pieces.rows_at(at, k.shape[2]))
        c.offset = room + 1   # the rows the block attends: those before `valid` (at + 1)
    return m.draft_block(anchor, ctx, room + 1)


def one_call(ctx, rows, at, valid, anchor, room):
    return m.block_at(anchor, ctx, rows, at, valid, room)


def steps(draft, ctx) -> tuple[np.ndarray, list]:
    out, tokens = [], []
    for i in range(STEPS):
        at = mx.array(start + i, mx.int32)
        rows = mx.random.normal((1, ROWS, taps), key=mx.random.key(i)).astype(m.fc.weight.dtype)
        anchor = mx.array(3 + i, mx.int32)
        mx.eval(rows, at, anchor)
        t0 = time.perf_counter()
        block = draft(ctx, rows, at, at + 1, anchor, start + i)
        out.append(time.perf_counter() - t0)
        tokens.append(block.token_ids.tolist())
    return np.array(out), tokens


paths = {"op by op": (op_by_op, caches()), "one call": (one_call, caches())}
for draft, ctx in paths.values():
    steps(draft, ctx)   # the traces
for p in range(2):
    seen = {name: steps(*path) for name, path in paths.items()}
    assert seen["op by op"][1] == seen["one call"][1], "the two paths drafted different tokens"
    print(f"pass {p + 1}: " + "  ".join(f"{name} build {np.median(t) * 1e3:.3f} ms [{np.percentile(t, 10) * 1e3:.3f}-"
                                       f"{np.percentile(t, 90) * 1e3:.3f}]" for name, (t, _) in seen.items()))

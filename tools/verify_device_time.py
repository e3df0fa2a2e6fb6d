"""One verify of the serve loop at the bench's shapes, op by op (targets.forward) against the
compiled verify (port/fast/verify.py), on the device this runs on: wall time per verify (issue +
evaluation), medians of RUNS in rotation, and where torch sees CUDA the kernels each launches
(CUPTI through torch.profiler, as `bench --kernels` counts a step): where one verify's time goes. A
third side, "traced, eager", runs the compiled verify's function without mx.compile: slow like the
compiled one, the cost is in what the function does (array offset, slice writes, masks); fast like
op by op, it is in the compilation. A fourth, "compiled, slice writes", is the compiled verify with
the K/V writes as they were before the scatter (tools/slice_writes.py): the before of the scatter.
Where the kernel verify runs (MLX CUDA, bf16), "compiled, kernel attention" is the compiled verify
with port/fast/kernels.py's attention (spec_parity.port.serve's verify="kernel").

    python3 tools/verify_device_time.py [--source dflash|dspark] [--scale 1] [--ctx 2048]

`--scale 8` divides the widths (a CPU can run it); the target is the bench's stand-in (Qwen3-4B's
width and its 36 layers), its random weights in memory.
"""

import argparse
import dataclasses
import time
from functools import partial

import mlx.core as mx
import numpy as np

from spec_parity import controls
from spec_parity.bench import port_sides, shapes, timing
from spec_parity.bench.sides import Stepper
from spec_parity.port import targets
from spec_parity.port.compiled import BUCKET
from spec_parity.port.fast import verify

RUNS, WARM, PROFILED = 30, 5, 10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=("dflash", "dspark"), default="dflash")
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--ctx", type=int, default=2048)
    a = p.parse_args()
    ckpt = shapes.real_block_case(a.source, a.ctx, a.scale)
    case, target = ckpt.case, port_sides.load_target(ckpt)
    rows = case.shapes.gamma + 1
    ids = mx.array([list(range(5, 5 + rows))])
    prompt = mx.array([[(7 * i) % 1000 + 3 for i in range(a.ctx)]])

    def prefilled():
        caches = targets.make_caches(target, BUCKET)
        mx.eval(targets.forward(target, prompt, caches=caches).logits)
        return caches

    def once(forward, caches):
        trace = forward(caches)
        mx.eval(trace.logits, trace.final, *trace.hidden)
        for c in caches:
            c.offset -= rows

    # Each side below on a target of its own (the same model, its own compiled calls): the eager
    # side's verify entry is the traced function itself, the slice-write side's is compiled under
    # the control that tools/slice_writes.py plants.
    eager = dataclasses.replace(target, compiled={("verify", BUCKET, "sdpa"): partial(verify.traced, target, BUCKET)})
    sliced = dataclasses.replace(target, compiled={})

    def slice_writes(c):
        with controls.planted("serve", "dynamic_slice_writes"):
            return verify.forward(sliced, ids, c)

    sides = {"op by op": lambda c: targets.forward(target, ids, caches=c),
             "compiled": lambda c: verify.forward(target, ids, c),
             "traced, eager": lambda c: verify.forward(eager, ids, c),
             "compiled, slice writes": slice_writes}
    if verify.kernel_unsupported(target, BUCKET) is None:
        sides["compiled, kernel attention"] = lambda c: verify.forward(target, ids, c, "kernel")
    caches = {name: prefilled() for name in sides}
    for _ in range(WARM):
        for name, f in sides.items():
            once(f, caches[name])
    samples = {name: [] for name in sides}
    for _ in range(RUNS):   # in rotation, so that a drift weighs on both
        for name, f in sides.items():
            t0 = time.perf_counter()
            once(f, caches[name])
            samples[name].append(time.perf_counter() - t0)
    print(f"{case.shapes.label}: verify of {rows} rows at context {a.ctx}, bucket {BUCKET}, {mx.default_device()}")
    for name, s in samples.items():
        q = np.percentile(np.array(s) * 1e3, [50, 10, 90])
        print(f"  {name:22s} {q[0]:.2f} ms [{q[1]:.2f}-{q[2]:.2f}]")
    for name, f in sides.items():
        print(f"  {name} kernels:", kernels(lambda f=f, c=caches[name]: once(f, c)))


def kernels(call) -> str:
    """The bench's kernel profile of `call` (timing.kernel_profile: CUPTI where torch sees CUDA),
    per verify: launches, busy and summed kernel µs, the classes and the top kernels."""
    s = timing.kernel_profile(Stepper(step=call), steps=PROFILED)
    if s["status"] != "ok":
        return f"not profiled: {s['reason']}"
    classes = ", ".join(f"{c['class']} {c['launches_per_call']:.0f}x {c['us_per_call']:.0f}us" for c in s["classes"])
    top = "; ".join(f"{t['kernel'][:70]} {t['launches_per_call']:.0f}x {t['us_per_call']:.0f}us" for t in s["top"][:6])
    return (f"{s['launches_per_call']:.0f} launches, busy {s['busy_us_per_call']:.0f} us, kernels "
            f"{s['kernel_us_per_call']:.0f} us, window {s['window_us_per_call']:.0f} us | {classes} | top: {top}")


if __name__ == "__main__":
    main()

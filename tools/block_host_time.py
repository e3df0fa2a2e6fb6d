"""Where a default draft block's wall time goes, on the device this runs on: the step of the step
bench's `port` side (spec_parity/bench/port_sides.py: one verify's rows committed, then
`draft_device`) split into build (draft_device returning its lazy tokens: Python, MLX's graph
building, the context rows' join, the compiled block's call), dispatch (mx.async_eval returning:
on MLX CUDA the kernels encoded and launched by this thread) and wait (mx.eval after it: the
device's work not yet done). Session 24's kernel profile left 0.54 ms of a DFlash block that
neither its kernels nor its launches explained; this found it in the wait: MLX CUDA launches the
block's CUDA graphs late (docs/benchmarks.md, "Session 25"). Medians and p10-p90 of RUNS steps
after WARM, the phases in one step.

    python3 tools/block_host_time.py [--source dflash|dspark|assistant-12b-tied|assistant-e4b-centroid]
                                     [--scale 1] [--ctx 2048]

An assistant case times the bench's call of that case: its γ steps chained (4), one eval.

`--scale 8` divides the widths (a CPU runs it; there async_eval hands the work to MLX's stream
thread, so dispatch is small and wait is the compute); the target is the bench's stand-in, its
random weights in memory.
"""

import argparse
import time

import mlx.core as mx
import numpy as np

from spec_parity.bench import port_sides, shapes

RUNS, WARM = 50, 10


def phases(step, rounds: int) -> dict[str, list[float]]:
    """step() -> the lazy draft tokens: the seconds of each phase over `rounds` steps."""
    out: dict[str, list[float]] = {"build": [], "dispatch": [], "wait": [], "total": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        tokens = step()
        t1 = time.perf_counter()
        mx.async_eval(tokens)
        t2 = time.perf_counter()
        mx.eval(tokens)
        t3 = time.perf_counter()
        for name, s in zip(out, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            out[name].append(s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=("dflash", "dspark", "assistant-12b-tied", "assistant-e4b-centroid"),
                   default="dflash")
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--ctx", type=int, default=2048)
    a = p.parse_args()
    ckpt = shapes.real_block_case(a.source, a.ctx, a.scale)
    prep = port_sides.prepare(ckpt, (None, "not used"), [(7 * i) % 1000 + 3 for i in range(a.ctx)])
    stepper = port_sides.port_side(prep)
    phases(stepper.step, WARM)
    samples = phases(stepper.step, RUNS)
    call = (f"one call of {prep.gamma} chained steps" if prep.source == "assistant"
            else "one block after one committed verify")
    print(f"{ckpt.case.shapes.label}: {call}, {mx.default_device()} "
          f"({', '.join(stepper.notes) or 'default options'})")
    for name, s in samples.items():
        q = np.percentile(np.array(s) * 1e3, [50, 10, 90])
        print(f"  {name:9s} {q[0]:.3f} ms [{q[1]:.3f}-{q[2]:.3f}]")


if __name__ == "__main__":
    main()

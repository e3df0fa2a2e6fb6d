"""Where a default draft block's wall time goes, on the device this runs on: the step of the step
bench's `port` side (spec_parity/bench/port_sides.py: one verify's rows committed, then
`draft_device`) split into build (draft_device returning its lazy tokens: Python, MLX's graph
building, the context rows' join, the compiled block's call), dispatch (mx.async_eval returning: on
MLX CUDA the kernels encoded and launched by this thread) and wait (mx.eval after it: the device's
work not yet done). A kernel profile left about half a millisecond of a DFlash block that neither
its kernels nor its launches explained; this finds it in the wait: MLX CUDA launches the block's
CUDA graphs late (docs/benchmarks.md, "Where a block's time goes"). Medians and p10-p90 of RUNS
steps after WARM, the phases in one step.

    python3 tools/block_host_time.py [--source dflash|dspark|assistant-12b-tied|assistant-e4b-centroid] [--verify]
                                     [--scale 1] [--ctx 2048]

An assistant case times the bench's call of that case: its γ steps chained (4), one eval.
`--verify` times instead the serve loop's verify of the case's target (γ + 1 rows, the verify
`spec_parity.port.serve` resolves by default over 256-row buckets; the caches stepped back after each): the
bulk of a round in serving.

`--scale 8` divides the widths (a CPU runs it; there async_eval hands the work to MLX's stream
thread, so dispatch is small and wait is the compute); the target is the bench's stand-in, its
random weights in memory.
"""

import argparse
import time

import mlx.core as mx
import numpy as np

from spec_parity.bench import port_sides, shapes
from spec_parity.port.compiled import BUCKET

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
    p.add_argument("--verify", action="store_true", help="the serve loop's verify of the case's target")
    a = p.parse_args()
    ckpt = shapes.real_block_case(a.source, a.ctx, a.scale)
    prompt = [(7 * i) % 1000 + 3 for i in range(a.ctx)]
    if a.verify:
        step, call, notes = verify_step(ckpt, prompt)
    else:
        prep = port_sides.prepare(ckpt, (None, "not used"), prompt)
        stepper = port_sides.port_side(prep)
        step, notes = stepper.step, ", ".join(stepper.notes) or "default options"
        call = (f"one call of {prep.gamma} chained steps" if prep.source == "assistant"
                else "one block after one committed verify")
    phases(step, WARM)
    samples = phases(step, RUNS)
    print(f"{ckpt.case.shapes.label}: {call}, {mx.default_device()} ({notes})")
    for name, s in samples.items():
        q = np.percentile(np.array(s) * 1e3, [50, 10, 90])
        print(f"  {name:9s} {q[0]:.3f} ms [{q[1]:.3f}-{q[2]:.3f}]")


def verify_step(ckpt, prompt: list[int]):
    """(step, what it is, notes): the loop's default verify of the case's target over `prompt`,
    each step on the same context (the caches' offsets set back to the prompt's before it)."""
    from spec_parity.port import serve, targets

    target = port_sides.load_target(ckpt)
    rows = ckpt.case.shapes.gamma + 1
    caches = targets.make_caches(target, BUCKET)
    mx.eval(targets.forward(target, mx.array([prompt]), caches=caches).logits)
    how = serve.resolve_verify("auto", target, BUCKET)
    ids = mx.array([list(range(5, 5 + rows))])
    start = [c.offset for c in caches]

    def step():
        for c, offset in zip(caches, start):
            c.offset = offset
        trace = serve.target_forward(target, ids, caches, how)
        return [trace.logits, trace.final, *trace.hidden]

    return step, f"one verify of {rows} rows", f"verify={how}, kv_bucket={BUCKET}"


if __name__ == "__main__":
    main()

"""Timing the sides: the one timing loop (`time_sides`), the cold and pre-pass calls of block sources
at real shapes, the GPU kernels per step (`kernel_profile`), and the two floors measured in the
same run: the copy / read bandwidth and the cost of one launch."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import Counter

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .counters import COUNT_RUNS
from .sides import Prep, Side, Stepper


def sync_fn(stepper: Stepper):
    if stepper.framework == "torch":
        import torch

        if stepper.device.startswith("cuda"):
            return lambda out: torch.cuda.synchronize()
        return lambda out: None

    def sync(out):
        arrays = [a for _, a in tree_flatten([out]) if isinstance(a, mx.array)]
        if arrays:
            mx.eval(*arrays)
    return sync


def _memory(stepper: Stepper):
    """(reset, active, peak) readers for the stepper's framework; None where there are none."""
    if stepper.framework == "torch":
        import torch

        if not stepper.device.startswith("cuda"):
            return None
        return torch.cuda.reset_peak_memory_stats, torch.cuda.memory_allocated, torch.cuda.max_memory_allocated
    return mx.reset_peak_memory, mx.get_active_memory, mx.get_peak_memory


def summary(samples: list[float]) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90)),
            "n": int(a.size)}


def time_sides(steppers: list[Stepper], warmup: int, iters: int) -> list[dict]:
    """The one timing loop, over every side of a case at once. Per side one first run (its draft
    tokens are kept: every side's first step sees the same state), then `warmup` synchronized
    runs (memory: the peak over them, with the active memory before). Then `iters` rounds in
    which each side runs once, timed, the sides in rotation (round r starts at side r mod n), so
    the ratios between sides are measured side by side in time, as a serving loop interleaves a
    drafter with the verify, not one side's minute against another's. Per timed run: wall and
    CPU seconds, and `graph_build_s` (the wall until `step()` returns, before the sync: for MLX
    the Python that builds the lazy graph, for torch its eager launches). A side whose call
    raises is "failed" with its reason; the others go on."""
    outs: list[dict] = [{} for _ in steppers]
    syncs = [sync_fn(s) for s in steppers]
    for stepper, sync, out in zip(steppers, syncs, outs):
        try:
            first = stepper.step()
            sync(first)
            out["first_tokens"] = [int(t) for t in stepper.tokens(first)]
            mem = _memory(stepper)
            if mem:
                mem[0]()
                active = int(mem[1]())
            for _ in range(warmup):
                sync(stepper.step())
            if mem:
                out["memory"] = {"active_before_bytes": active, "peak_bytes": int(mem[2]())}
        except Exception as e:
            out["error"] = e
    samples = [{"wall": [], "cpu": [], "graph": []} for _ in steppers]
    n = len(steppers)
    for r in range(iters):
        for j in range(n):
            i = (r + j) % n
            if "error" in outs[i]:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                out = steppers[i].step()
                graph = time.perf_counter() - t0
                syncs[i](out)
            except Exception as e:
                outs[i]["error"] = e
                continue
            samples[i]["wall"].append(time.perf_counter() - t0)
            samples[i]["cpu"].append(time.process_time() - c0)
            samples[i]["graph"].append(graph)
    for out, got in zip(outs, samples):
        if "error" not in out:
            out.update({"wall_s": summary(got["wall"]), "cpu_s": summary(got["cpu"]),
                        "graph_build_s": summary(got["graph"]), "samples_s": got["wall"],
                        "timing": f"{n} sides in rotation" if n > 1 else "alone"})
    return outs


COLD_CALLS = 8          # block sources: calls timed at never-seen context lengths (per side)
COLD_SPACING = 96       # context rows between two sides' cold ranges (> calls + block)


def cold(side: Side, prep: Prep, index: int) -> dict:
    """Per call at context lengths no side has reached (side number `index`'s own range below ctx):
    what a serving loop sees, whose context grows every round."""
    short = prep.ctx - COLD_SPACING * (index + 1)
    if short < prep.ctx // 2:
        return {"cold_note": "context too short for a separate cold range"}
    stepper = side.build(dataclasses.replace(prep, taps=prep.taps[:, :short]))
    sync, wall = sync_fn(stepper), []
    for _ in range(COLD_CALLS):
        t0 = time.perf_counter()
        sync(stepper.step())
        wall.append(time.perf_counter() - t0)
    del stepper
    gc.collect()
    return {"cold_wall_s": summary(wall), "cold_context": short}


def pre_pass(stepper: Stepper, warmup: int, iters: int) -> None:
    """Every call the timed loop and the counters will make, untimed: each context length the side
    reaches is then one it has seen (warm shapes for every side alike)."""
    sync = sync_fn(stepper)
    for _ in range(1 + warmup + iters + COUNT_RUNS):
        sync(stepper.step())


# ---- kernels per step (GPU) ---------------------------------------------------------------------

KERNEL_STEPS = 10
KERNEL_CLASSES = (  # first match wins; the names are MLX CUDA's, cuBLAS's and torch's kernels
    ("matmul", ("gemm", "gemv", "xmma", "cutlass", "matmul", "qmv", "qmm", "splitk", "cublas", "nvjet")),
    ("attention", ("sdpa", "attention", "flash", "fmha")),
    ("norm", ("rms", "layer_norm", "layernorm")),
    ("rope", ("rope",)),
    ("reduce / softmax / argmax", ("reduce", "softmax", "arg_", "argmax", "logsumexp", "scan")),
    ("copy / gather / concat", ("copy", "gather", "scatter", "concat", "slice", "memcpy", "memset")),
    ("fused elementwise", ("compiled", "fused", "binary", "unary", "ternary")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time the GPU ran at least one kernel
    (overlapping kernels on two streams count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kernel_summary(kernels: list[tuple[str, float, float]], steps: int, window_us: float) -> dict:
    """Per call of the stepper (the assistant's: gamma chained steps): launches, summed kernel
    time, GPU busy time (union), the profiled window's wall time, and the kernels grouped by name
    and by class. `kernels` = (name, start_us, end_us)."""
    by_name, count_name = Counter(), Counter()
    for name, a, b in kernels:
        by_name[name] += b - a
        count_name[name] += 1
    by_class, count_class = Counter(), Counter()
    for name, t in by_name.items():
        c = kernel_class(name)
        by_class[c] += t
        count_class[c] += count_name[name]
    total = sum(by_name.values())
    return {"calls": steps, "launches_per_call": len(kernels) / steps, "kernel_us_per_call": total / steps,
            "busy_us_per_call": busy_us([(a, b) for _, a, b in kernels]) / steps,
            "window_us_per_call": window_us / steps,
            "classes": [{"class": c, "launches_per_call": count_class[c] / steps, "us_per_call": t / steps}
                        for c, t in by_class.most_common()],
            "top": [{"kernel": n[:160], "launches_per_call": count_name[n] / steps, "us_per_call": t / steps}
                    for n, t in by_name.most_common(12)]}


def kernel_profile(stepper: Stepper, steps: int = KERNEL_STEPS) -> dict:
    """Every GPU kernel `steps` synchronized calls launch, with its device time: CUPTI activity
    records through torch.profiler, which sees every kernel of the process (MLX's too). Says why
    not where there is no CUDA torch. Profiling adds host time per launch: the window figure is
    above the timed loop's; the kernel and busy figures are the device's own."""
    if not stepper.device.startswith("cuda") and mx.default_device().type != mx.DeviceType.gpu:
        return {"status": "not run", "reason": "no GPU: kernels are profiled on CUDA only"}
    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:
        return {"status": "not run", "reason": f"torch.profiler not importable ({type(e).__name__}: {e}); "
                                               "it records the kernels (CUPTI)"}
    if not torch.cuda.is_available():
        return {"status": "not run", "reason": "torch sees no CUDA device: CUPTI through torch.profiler needs one"}
    sync = sync_fn(stepper)
    sync(stepper.step())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            sync(stepper.step())
        window = (time.perf_counter() - t0) * 1e6
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA]
    if not kernels:
        return {"status": "failed", "reason": "the profiler recorded no CUDA kernel"}
    return {"status": "ok", **kernel_summary(kernels, steps, window)}


# ---- the floor ---------------------------------------------------------------------------------

def bandwidth(nbytes: int, iters: int = 10, warmup: int = 3) -> dict:
    """Copy (y = x + 1: reads and writes nbytes) and read (x.sum(): reads nbytes) bandwidth, bytes/s
    (the median run), on the default device, bf16 elements."""
    n = nbytes // 2
    x = mx.random.uniform(shape=(n,), dtype=mx.bfloat16)
    mx.eval(x)

    def rate(fn, moved):
        for _ in range(warmup):
            mx.eval(fn())
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
        return moved / float(np.median(ts)), ts

    copy, copy_ts = rate(lambda: x + 1, 2 * n * 2)
    read, read_ts = rate(lambda: x.sum(), n * 2)
    return {"bytes": n * 2, "copy_bytes_per_s": copy, "read_bytes_per_s": read, "copy_samples_s": copy_ts,
            "read_samples_s": read_ts, "copy": "y = x + 1 over the buffer (read + write)", "read": "x.sum()"}


_ADD_ONE = """
    auto i = cooperative_groups::this_grid().thread_rank();
    if (i < NEL) y[i] = x[i] + T(1.0f);
"""


def launch_cost(n: int = 200, reps: int = 15, elements: int = 3840) -> dict:
    """The least a kernel launch costs through MLX on this device: the wall per op of a chain of
    n dependent `y + 1` on a small bf16 vector (the median of reps chains; the device's own work is
    ~1 us) and the part of it spent building the graph in Python. On CUDA also the same chain as a
    custom kernel (`mx.fast.cuda_kernel`), which a fused path would launch: it pays the same.
    A step's launches times this is its launch floor, what it costs however few bytes it reads."""
    x = mx.random.uniform(shape=(elements,), dtype=mx.bfloat16)
    mx.eval(x)

    def per_op(step) -> tuple[float, float]:
        def chain():
            y = x
            for _ in range(n):
                y = step(y)
            return y
        mx.eval(chain())
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            y = chain()
            t1 = time.perf_counter()
            mx.eval(y)
            runs.append((time.perf_counter() - t0, t1 - t0))
        wall, build = sorted(runs)[len(runs) // 2]
        return wall / n, build / n

    out = {"chain": f"{n} dependent y = y + 1 on {elements} bf16, median of {reps}"}
    out["primitive_s"], out["primitive_build_s"] = per_op(lambda y: y + 1)
    if mx.default_device().type != mx.DeviceType.gpu or not mx.cuda.is_available():
        out["custom_kernel"] = "not run: custom CUDA kernels need MLX CUDA"
        return out
    kernel = mx.fast.cuda_kernel(name="spec_parity_add_one", input_names=["x"], output_names=["y"], source=_ADD_ONE)
    out["custom_kernel_s"], out["custom_kernel_build_s"] = per_op(lambda y: kernel(
        inputs=[y], template=[("T", y.dtype), ("NEL", y.size)], grid=(y.size, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[y.shape], output_dtypes=[y.dtype])[0])
    return out

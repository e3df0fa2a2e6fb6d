"""`spec-parity bench`: how fast our drafters run, side by side with the peers, against the floor.

For each case (a draft source at a shape, spec_parity/bench_shapes.py) and each side (our port,
the peers: spec_parity/bench_sides.py), on the same weights and inputs:

  (a) one draft step chain (assistant: `gamma` chained steps) / one draft block: median and
      p10-p90 wall time over `iters` runs after `warmup`, each run synchronized (`mx.eval` of
      its outputs; torch: `torch.cuda.synchronize()`); CPU time too (this machine is shared);
  (c) host synchronizations per step, COUNTED (`HostSyncs`);
  (e) peak memory over the timed runs (mx.get_peak_memory after mx.reset_peak_memory; torch:
      max_memory_allocated), and the active memory before them;
  (f) graph ops per step: the primitives evaluated (`HostSyncs(ops=True)`).
For our port, through port.serve.generate (the loop itself, wrapped, never forked):
  (b) one spec round split into draft / verify / accept+trim;
  (c) host synchronizations and graph ops per round;
  (d) tokens/s on a fixed prompt.
The floor of a step = the bytes it must read (bench_shapes.step_bytes) / the bandwidth measured in
the same run on the same device (a large copy, and a large sum). The launch cost (`launch_cost`),
measured in the same run too, is the other floor: what one kernel launch costs through MLX however
few bytes it reads. Figures are reported, never asserted: this is a benchmark, not a test.

One code path for CPU and GPU: mx.default_device() decides. The module imports without torch,
transformers, optiq or dflash present: every peer is imported when its side is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import bench_shapes, bench_sides

PACKAGES = ("mlx", "mlx-cuda-13", "mlx-cuda", "mlx-metal", "mlx-cpu", "mlx-lm", "numpy", "safetensors", "torch",
            "transformers", "huggingface_hub", "mlx-optiq", "dflash", "dspark-mlx", "dflash-mlx", "scipy")


# ---- counting host synchronizations and graph ops ----------------------------------------------

_OP_NODE = re.compile(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}')


class HostSyncs:
    """Counts, while active, every call from Python that makes the host wait for MLX: the array
    methods `item`, `tolist`, `__int__`, `__float__`, `__bool__`, `__index__`, numpy's
    `np.array` / `np.asarray` of an mx.array, and `mx.eval`, `mx.synchronize`; `mx.async_eval`
    is counted apart (it does not wait). They are patched on the class / module for the duration,
    so a call from any code (ours, a peer's, mlx-lm's) counts, whether or not the array was already
    evaluated (an upper bound on real device round trips). Not seen: C++-internal waits and
    conversions through the buffer protocol other than np.array / np.asarray.

    With `ops=True` each such call first counts the primitives it is about to evaluate: the op
    nodes of the not-yet-evaluated graph behind its arrays (`mx.export_to_dot`), minus those an
    earlier `async_eval` already scheduled. `finish(outputs)` does the same for outputs the caller
    evaluates afterwards. A primitive is one graph node: a fused `Compiled` block counts one, and
    the CPU backend splits some `mx.fast` ops into several (so CPU and GPU counts differ).

    `reads` holds (sync number, bytes) of every array the host read (the methods and numpy): on
    MLX CUDA a read of more than 8 bytes moves the buffer into managed memory, where the next
    kernels that touch it fault (docs/benchmarks.md "Unified memory")."""

    METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    FUNCS = ("eval", "synchronize")

    def __init__(self, ops: bool = False):
        self.count_ops = ops
        self.calls: Counter = Counter()
        self.reads: list[tuple[int, int]] = []
        self.ops = 0
        self.kinds: Counter = Counter()
        self._scheduled: set[str] = set()
        self._held: list = []
        self._saved: list = []

    @property
    def syncs(self) -> int:
        return sum(n for k, n in self.calls.items() if k != "async_eval")

    def snapshot(self) -> tuple[int, int]:
        return self.syncs, self.ops

    def largest_read(self, after: int, upto: int) -> int:
        """Bytes of the largest array read by syncs after+1 .. upto (0: none)."""
        return max((b for i, b in self.reads if after < i <= upto), default=0)

    def _graph(self, roots: list) -> set[str]:
        arrays = [a for a in roots if isinstance(a, mx.array)]
        if not self.count_ops or not arrays:
            return set()
        buf = io.StringIO()
        mx.export_to_dot(buf, *arrays)
        nodes = {}
        for node, label in _OP_NODE.findall(buf.getvalue()):
            nodes[node] = label
        new = {n: lab for n, lab in nodes.items() if n not in self._scheduled}
        self.ops += len(new)
        self.kinds.update(new.values())
        return set(new)

    def _leaves(self, args) -> list:
        return [v for _, v in tree_flatten(list(args))]

    def __enter__(self):
        def method(name, orig):
            def wrapped(a, *args, **kwargs):
                self.calls[name] += 1
                self.reads.append((self.syncs, a.nbytes))
                self._graph([a])
                return orig(a, *args, **kwargs)
            return wrapped

        def func(name, orig):
            def wrapped(*args, **kwargs):
                self.calls[name] += 1
                if name == "async_eval":
                    leaves = self._leaves(args)
                    self._scheduled |= self._graph(leaves)
                    self._held.append(leaves)
                elif name == "eval":
                    self._graph(self._leaves(args))
                return orig(*args, **kwargs)
            return wrapped

        def numpy_fn(name, orig):
            def wrapped(*args, **kwargs):
                obj = args[0] if args else kwargs.get("object", kwargs.get("a"))
                if isinstance(obj, mx.array):
                    self.calls["numpy"] += 1
                    self.reads.append((self.syncs, obj.nbytes))
                    self._graph([obj])
                return orig(*args, **kwargs)
            return wrapped

        for name in self.METHODS:
            orig = getattr(mx.array, name)
            self._saved.append((mx.array, name, orig))
            setattr(mx.array, name, method(name, orig))
        for name in self.FUNCS + ("async_eval",):
            orig = getattr(mx, name)
            self._saved.append((mx, name, orig))
            setattr(mx, name, func(name, orig))
        for name in ("array", "asarray"):
            orig = getattr(np, name)
            self._saved.append((np, name, orig))
            setattr(np, name, numpy_fn(name, orig))
        return self

    def finish(self, outputs) -> None:
        """The caller is about to evaluate `outputs`: count their pending ops, and one sync if any."""
        leaves = [a for a in self._leaves([outputs]) if isinstance(a, mx.array)]
        if self._graph(leaves) or (leaves and not self.count_ops):
            self.calls["eval"] += 1

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()
        self._held.clear()
        return False


PORT_MODULES = ("port.assistant", "port.compiled", "port.dflash", "port.dspark", "port.heads", "port.sampling",
                "port.serve", "port.targets", "port.fast.assistant", "port.fast.dflash", "port.fast.dspark",
                "port.sources.assistant", "port.sources.dflash", "port.sources.dspark")
SCALAR_POOL_BYTES = 8  # MLX CUDA keeps buffers up to 8 bytes in a GPU-mapped scalar pool


class HostBuffers:
    """Counts, while active, the arrays the port's modules build from host data (`mx.array` of a
    list, a number or numpy) over 8 bytes. Why: on MLX CUDA such a buffer is managed memory the host
    has just written, and the first kernel that reads it page-faults (H200: the embedding Gather of
    a block 100-280 us instead of 3, docs/benchmarks.md); buffers up to 8 bytes live in MLX's
    GPU-mapped scalar pool and do not. The port modules' `mx` is swapped for the duration for one
    whose `array` records (isinstance checks keep working); other code is not watched."""

    def __init__(self):
        self.sizes: list[int] = []
        self._saved: list = []

    def __enter__(self):
        sizes = self.sizes

        class _Meta(type):
            def __instancecheck__(cls, obj):
                return isinstance(obj, mx.array)

            def __call__(cls, *args, **kwargs):
                out = mx.array(*args, **kwargs)
                if not (args and isinstance(args[0], mx.array)) and out.nbytes > SCALAR_POOL_BYTES:
                    sizes.append(out.nbytes)
                return out

        class _Mx:
            array = _Meta("array", (), {})

            def __getattr__(self, name):
                return getattr(mx, name)

        proxy = _Mx()
        for name in PORT_MODULES:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "mx", None) is mx:
                self._saved.append(module)
                module.mx = proxy
        return self

    def __exit__(self, *exc):
        for module in self._saved:
            module.mx = mx
        self._saved.clear()
        return False


# ---- the one timing loop -----------------------------------------------------------------------

def _sync_fn(stepper: bench_sides.Stepper):
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


def _memory(stepper: bench_sides.Stepper):
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


def time_loop(stepper: bench_sides.Stepper, warmup: int, iters: int) -> dict:
    """One first run (its draft tokens are kept: every side's first step sees the same state), then
    `warmup` synchronized runs, then `iters` timed ones (wall and CPU seconds each, and `graph_build_s`:
    the wall time until `step()` returns, before the sync: for MLX the Python that builds the lazy
    graph, for torch its eager launches; the rest of the wall is MLX's eval / the wait)."""
    sync = _sync_fn(stepper)
    first = stepper.step()
    sync(first)
    tokens = [int(t) for t in stepper.tokens(first)]
    for _ in range(warmup):
        sync(stepper.step())
    mem = _memory(stepper)
    if mem:
        mem[0]()
        active = int(mem[1]())
    wall, cpu, graph = [], [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        out = stepper.step()
        graph.append(time.perf_counter() - t0)
        sync(out)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out = {"wall_s": summary(wall), "cpu_s": summary(cpu), "graph_build_s": summary(graph), "samples_s": wall,
           "first_tokens": tokens}
    if mem:
        out["memory"] = {"active_before_bytes": active, "peak_bytes": int(mem[2]())}
    return out


COUNT_RUNS = 3


def count_step(stepper: bench_sides.Stepper, runs: int = COUNT_RUNS, port: bool = True) -> dict:
    """Host syncs and graph ops of one step (the median over `runs` steps; MLX sides only), and for
    a `port` side its host-filled buffers (HostBuffers watches the port's modules only: a peer's
    count would read 0 unmeasured)."""
    per = []
    for _ in range(runs):
        with HostSyncs(ops=True) as hs, HostBuffers() as hb:
            out = stepper.step()
            hs.finish(out)
        mx.eval(*[a for _, a in tree_flatten([out]) if isinstance(a, mx.array)] or [mx.array(0)])
        per.append((hs.syncs, hs.ops, dict(hs.calls), dict(hs.kinds), hb.sizes))
    per.sort(key=lambda p: (p[0], p[1]))
    syncs, ops, calls, kinds, host = per[len(per) // 2]
    figures = {"host_syncs": syncs, "graph_ops": ops, "sync_calls": calls,
               "op_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}
    return {**figures, "host_buffers": len(host), "host_buffer_bytes": host} if port else figures


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


def kernel_profile(stepper: bench_sides.Stepper, steps: int = KERNEL_STEPS) -> dict:
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
    sync = _sync_fn(stepper)
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


# ---- the serve loop, wrapped ---------------------------------------------------------------------

def _probe(provider, events: list, hook=None, split: bool = False):
    """`provider`, observed: each prefill / draft / commit of its sources timed into `events`;
    `hook` runs on the first draft (the end of the prefill). The loop's on-device drafts (it
    overlaps them with the verify) are the draft phase; in the split run they are evaluated
    inside it, so their work is counted in the draft, not the verify."""
    from port import serve

    def around(name, src, args, call):
        kind = "draft" if name.startswith("draft") else name
        if kind == "draft" and hook is not None and not any(e[0] == "draft" for e in events):
            hook()
        t0 = time.perf_counter()
        out = call()
        if name == "draft_device" and split:
            mx.eval(out)
        events.append((kind, t0, time.perf_counter()))
        return out
    return serve.Observed(provider, around)


@contextlib.contextmanager
def _timed_forward(events: list):
    """Time the loop's target forwards, evaluating what the loop reads of them (so the verify's
    work is counted in the verify, not in the acceptance that first reads it)."""
    from port import serve

    orig = serve.targets.forward

    def forward(*args, **kwargs):
        t0 = time.perf_counter()
        trace = orig(*args, **kwargs)
        mx.eval(trace.logits, trace.final, *trace.hidden)
        events.append(("forward", t0, time.perf_counter()))
        return trace

    serve.targets.forward = forward
    try:
        yield
    finally:
        serve.targets.forward = orig


def _rounds(events: list, t_end: float) -> list[dict]:
    """Per round: draft, verify (the target forward), accept+trim (the verify's end to the next
    draft: acceptance, cache trim, the source's commit), from the timestamps."""
    drafts = [e for e in events if e[0] == "draft"]
    forwards = [e for e in events if e[0] == "forward"][1:]  # the first forward is the prefill
    commits = [e for e in events if e[0] == "commit"]
    out = []
    for i, (d, f) in enumerate(zip(drafts, forwards)):
        end = drafts[i + 1][1] if i + 1 < len(drafts) else t_end
        c = commits[i] if i < len(commits) else None
        out.append({"draft_s": d[2] - d[1], "verify_s": f[2] - f[1], "accept_trim_s": end - f[2],
                    "commit_s": (c[2] - c[1]) if c else 0.0, "round_s": end - d[1]})
    return out


def serve_loop(case: bench_shapes.Case, target, prompt: list[int], max_tokens: int, runs: int,
               provider=None, cold: bool = False, kv_bucket: int | None = None) -> dict:
    """Our port in port.serve.generate on `prompt`: tokens/s (decode only: from the first draft on,
    and the loop's own figure with the prefill), the round split, host syncs and graph ops per round.
    `provider` (default: the port's drafter of the case) is what the loop drafts with; `kv_bucket`
    the loop's bucketed verify (None: the default one)."""
    from port import serve

    provider = provider or bench_sides.PortProvider(case)
    gamma = case.spec.gamma

    def run(events, hook=None, split=False, ids=prompt):
        t0 = time.perf_counter()
        _, stats = serve.generate(target, ids, max_tokens, _probe(provider, events, hook, split), gamma=gamma,
                                  eos=set(), kv_bucket=kv_bucket)
        return stats, t0, time.perf_counter()

    def medians(rounds: list[dict]) -> dict:
        return {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]} if rounds else {}

    run([])  # warm-up
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    decode, looped, rounds_n = [], [], 0
    for _ in range(runs):
        events: list = []
        stats, _, t_end = run(events)
        first = next(e[1] for e in events if e[0] == "draft")
        decode.append((stats.emitted - 1) / (t_end - first))
        looped.append(stats.tokens_per_s)
        rounds_n = len(stats.trace)
    peak = mx.get_peak_memory()
    events = []
    with _timed_forward(events):
        _, _, t_end = run(events, split=True)
    split = _rounds(events, t_end)
    steady = split[1:] or split
    mark = {}
    read = serve.read_at_end
    with HostSyncs(ops=True) as hs:
        serve.read_at_end = lambda groups: (mark.setdefault("end", hs.snapshot()), read(groups))[1]
        try:
            stats, _, _ = run([], hook=lambda: mark.setdefault("at", hs.snapshot()))
        finally:
            serve.read_at_end = read
    (syncs0, ops0), (syncs1, ops1) = mark.get("at", (0, 0)), mark.get("end", hs.snapshot())
    n = max(len(stats.trace), 1)
    med = medians(steady)
    cold_out = {}
    if cold:
        # A prompt of another length: every context length of this request is new to the drafter's
        # and the target's attention (the warm runs above repeat one request's lengths).
        events = []
        short = prompt[: len(prompt) - COLD_SPACING * 8]
        with _timed_forward(events):
            cstats, _, t_end = run(events, split=True, ids=short)
        first = next(e[1] for e in events if e[0] == "draft")
        cold_out = {"cold": {"prompt_len": len(short), "decode_tokens_per_s": (cstats.emitted - 1) / (t_end - first),
                             "round_median_s": medians(_rounds(events, t_end)[1:])}}
    return {**cold_out, "kv_bucket": kv_bucket, "gamma": gamma, "max_tokens": max_tokens, "prompt_len": len(prompt), "rounds": rounds_n,
            "tau": stats.tau, "acceptance": stats.acceptance,
            "decode_tokens_per_s": summary(decode), "loop_tokens_per_s": summary(looped),
            "round_median_s": med, "first_round_s": split[0] if split else {},
            "host_syncs_per_round": (syncs1 - syncs0) / n, "graph_ops_per_round": (ops1 - ops0) / n,
            "host_read_max_bytes_per_round": hs.largest_read(syncs0, syncs1), "host_syncs_at_end": hs.syncs - syncs1,
            "sync_calls": dict(hs.calls), "memory": {"active_before_bytes": int(active), "peak_bytes": int(peak)}}


# ---- one case ------------------------------------------------------------------------------------

@dataclass
class Options:
    shapes: str = "tiny"
    sources: tuple[str, ...] = bench_shapes.SOURCES
    peers: list[str] | None = None      # None: all that serve the source
    warmup: int = 3
    iters: int = 15
    dtype: str = "float32"
    ctx: int | None = None
    scale: int = 1
    target_layers: int | None = None
    gamma: int = 4
    max_tokens: int = 16
    serve_runs: int = 3
    bw_bytes: int = 256 << 20
    torch_device: str = "auto"
    cases: list[str] | None = None      # case names (default: every case of the sources)
    seed: int = 0
    kernels: bool = False               # also record each side's GPU kernels per step (kernel_profile)
    argv: list[str] = field(default_factory=list)


def _prepare(case: bench_shapes.Case, torch: tuple[str | None, str], seed: int) -> bench_sides.Prep:
    """Load the target once (port.targets.load, through `serve_weights`) and prefill a random
    context of ctx tokens: its caches hold the donor K/V, its hidden states give the taps."""
    from mlx_lm.models.cache import make_prompt_cache

    from port import targets

    with bench_shapes.serve_weights(case):
        target = targets.load(case.target_dir)
    mx.eval(target.model.parameters())
    s = case.spec
    prompt = _prompt(case, seed)
    caches = make_prompt_cache(target.model)
    trace = targets.forward(target, mx.array([prompt]), caches=caches)
    cfg = case.drafter_config
    taps = row = None
    if s.source != "assistant":
        ids = cfg.get("target_layer_ids") or cfg["dflash_config"]["target_layer_ids"]
        taps = mx.concatenate([trace.hidden[i + 1] for i in ids], axis=-1)
        row = taps[:, -1 - s.gamma:, :] + 0  # a verify's worth of tap rows (own buffer)
    anchor_hidden = trace.final[:, -1:, :]
    anchor = int(mx.argmax(targets.head(target, anchor_hidden)[0, 0]).item())
    mx.eval(anchor_hidden, taps if taps is not None else anchor_hidden, row if row is not None else anchor_hidden,
            [[c.keys, c.values] for c in caches if getattr(c, "keys", None) is not None])
    del trace
    return bench_sides.Prep(case, target, caches, taps, row, anchor, anchor_hidden, torch[0], torch[1])


def _prompt(case: bench_shapes.Case, seed: int) -> list[int]:
    vocab = case.target_config["vocab_size"]
    rng = np.random.default_rng([seed, case.spec.ctx])
    return [int(t) for t in rng.integers(3, vocab, size=case.spec.ctx)]


def _reason(e: BaseException, hint: str = "") -> str:
    """One line: the exception and where it was raised (a deliberate Skip: its message only;
    a missing module: what to install)."""
    if isinstance(e, bench_sides.Skip):
        return str(e)
    if isinstance(e, ImportError) and hint:
        return f"{type(e).__name__}: {e}; install: {hint}"[:400]
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{where}"[:400]


COLD_CALLS = 8          # block sources: calls timed at never-seen context lengths (per side)
COLD_SPACING = 96       # context rows between two sides' cold ranges (> calls + block)


def shape_passes(prep: bench_sides.Prep, opts: Options) -> bool:
    """Whether a block source's context length matters to the timing: on MLX CUDA an attention
    with a multi-row query builds its kernel plan once per key length (measured: ~60 ms of host
    time per new length on the H200, MLX 0.32.4), so the first side to reach a length would pay
    what every later side gets for free. Real shapes only; the tiny CPU cases have no such cost."""
    return opts.shapes == "real" and prep.case.spec.source != "assistant" and prep.taps is not None


def _cold(name: str, build, prep: bench_sides.Prep, index: int) -> dict:
    """Per call at context lengths no side has reached (this side's own range below ctx): what a
    serving loop sees, whose context grows every round."""
    short = prep.ctx - COLD_SPACING * (index + 1)
    if short < prep.ctx // 2:
        return {"cold_note": "context too short for a separate cold range"}
    stepper = build(dataclasses.replace(prep, taps=prep.taps[:, :short]))
    sync, wall = _sync_fn(stepper), []
    for _ in range(COLD_CALLS):
        t0 = time.perf_counter()
        sync(stepper.step())
        wall.append(time.perf_counter() - t0)
    del stepper
    gc.collect()
    return {"cold_wall_s": summary(wall), "cold_context": short}


def _pre_pass(stepper: bench_sides.Stepper, opts: Options) -> None:
    """Every call the timed loop and the counters will make, untimed: each context length the side
    reaches is then one it has seen (warm shapes for every side alike)."""
    sync = _sync_fn(stepper)
    for _ in range(1 + opts.warmup + opts.iters + COUNT_RUNS):
        sync(stepper.step())


def run_side(name: str, build, prep: bench_sides.Prep, opts: Options, index: int = 0) -> dict:
    """Build one side and measure it; any failure is the side's reason. Block sources at real
    shapes: first `_cold` (own never-seen lengths), then a pre-pass over the timed lengths on a
    side built for it, then the timed loop on a freshly built side."""
    t0 = time.perf_counter()
    cold = {}
    try:
        if shape_passes(prep, opts) and bench_sides.framework(name) == "mlx":
            cold = _cold(name, build, prep, index)
            stepper = build(prep)
            _pre_pass(stepper, opts)
            del stepper
            gc.collect()
        stepper = build(prep)
        if stepper.framework != bench_sides.framework(name):
            raise RuntimeError(f"side {name!r} runs on {stepper.framework}, its name says "
                               f"{bench_sides.framework(name)}: name torch sides '<peer>-torch'")
    except Exception as e:
        hint = bench_sides.PEERS[name][2] if name in bench_sides.PEERS else ""
        return {"side": name, "status": "not run", "reason": _reason(e, hint)}
    out = {"side": name, "status": "ok", "framework": stepper.framework, "notes": stepper.notes,
           "build_s": time.perf_counter() - t0, **cold}
    try:
        out.update(time_loop(stepper, opts.warmup, opts.iters))
        if stepper.framework == "mlx":
            out.update(count_step(stepper, port=name.startswith("port")))
        else:
            out["count_note"] = "host syncs / graph ops are counted on MLX sides only"
        if opts.kernels:
            out["kernels"] = kernel_profile(stepper)
    except Exception as e:
        out.update(status="failed", reason=_reason(e))
    torch_cuda = stepper.framework == "torch" and stepper.device.startswith("cuda")
    del stepper
    gc.collect()
    if torch_cuda:  # hand the torch side's cached blocks back before the next side
        import torch

        torch.cuda.empty_cache()
    return out


def run_case(spec: bench_shapes.Spec, opts: Options, torch: tuple[str | None, str], bw: dict, root: Path) -> dict:
    t0 = time.perf_counter()
    case = bench_shapes.build(spec, opts.shapes, opts.dtype, root)
    out = {"case": spec.name, "source": spec.source, "shape": spec.shape, "ctx": spec.ctx, "gamma": spec.gamma,
           "notes": spec.notes, "dtype": opts.dtype, "drafter_config": case.drafter_config}
    try:
        prep = _prepare(case, torch, opts.seed)
    except Exception as e:
        out.update(status="failed", reason=_reason(e))
        return out
    floor = bench_shapes.step_bytes(case)
    per_call = 1 if spec.source != "assistant" else spec.gamma
    floor["bytes_per_call"] = floor["total"] * per_call
    floor["copy_floor_s"] = floor["bytes_per_call"] / bw["copy_bytes_per_s"]
    floor["read_floor_s"] = floor["bytes_per_call"] / bw["read_bytes_per_s"]
    out["floor"] = floor
    out["steps_per_call"] = per_call
    sides = [run_side("port", bench_sides.port_side, prep, opts)]
    for i, name in enumerate(bench_sides.peers_for(spec.source, opts.peers), start=1):
        sides.append(run_side(name, bench_sides.side(name), prep, opts, i))
    out["sides"] = sides
    _ratios(out)
    bucketed = "port-bucketed" in bench_sides.peers_for(spec.source, opts.peers)
    for key in ("serve", "serve_bucketed") if bucketed else ("serve",):
        try:
            options = bucketed_loop(case) if key == "serve_bucketed" else {}
            out[key] = serve_loop(case, prep.target, _prompt(case, opts.seed), opts.max_tokens, opts.serve_runs,
                                  cold=opts.shapes == "real" and spec.ctx > COLD_SPACING * 16, **options)
        except Exception as e:
            out[key] = {"status": "failed", "reason": _reason(e)}
    out["status"] = "ok"
    out["wall_s"] = time.perf_counter() - t0
    del prep, case
    gc.collect()
    mx.clear_cache()
    return out


def bucketed_loop(case: bench_shapes.Case) -> dict:
    """serve_loop's options for the port-bucketed row: the bucketed drafter and the bucketed verify
    (kv_bucket=BUCKET)."""
    return {"provider": bench_sides.PortProvider(case, **bench_sides.bucketed_options(case)),
            "kv_bucket": bench_sides.BUCKET}


def _ratios(case: dict) -> None:
    """Each side's time / the best peer's and / the floor, and / the port's (the port's speed-up over
    that side: the "≥ 3× every peer" figure); whether its first draft equals the port's (same
    weights, same inputs: a side that disagrees is not computing the same drafter)."""
    ran = [s for s in case["sides"] if s.get("status") == "ok"]
    port = next((s for s in ran if s["side"] == "port"), None)
    for s in ran:
        if port is not None:
            a, b = s["first_tokens"], port["first_tokens"]
            s["agrees_with_port"] = a == b
            s["agreement"] = f"{sum(x == y for x, y in zip(a, b))}/{max(len(a), len(b))}"
    peers = [s for s in ran if s["side"] not in bench_sides.OURS]
    best = min(peers, key=lambda s: s["wall_s"]["median"], default=None)
    case["best_peer"] = best["side"] if best else None
    for s in ran:
        t = s["wall_s"]["median"]
        s["per_step_s"] = t / case["steps_per_call"]
        s["x_floor"] = t / case["floor"]["copy_floor_s"]
        s["x_best_peer"] = t / best["wall_s"]["median"] if best else None
        s["port_speedup"] = t / port["wall_s"]["median"] if port else None
        if best and "graph_ops" in s and "graph_ops" in best and best["graph_ops"]:
            s["ops_x_best_peer"] = s["graph_ops"] / best["graph_ops"]


# ---- facts about the run -------------------------------------------------------------------------

def machine() -> dict:
    info = {}
    with contextlib.suppress(Exception):
        info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in mx.device_info().items()}
    facts = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
             "python": platform.python_version(), "cpu_count": os.cpu_count(), "mlx_default_device": str(mx.default_device()),
             "mlx_device_info": info}
    with contextlib.suppress(OSError):
        facts["loadavg"] = os.getloadavg()
    return facts


def versions() -> dict:
    out = {}
    for p in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[p] = metadata.version(p)
    return out


def _git() -> str:
    here = Path(__file__).resolve().parent.parent
    with contextlib.suppress(Exception):
        r = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if r.returncode == 0:
            return r.stdout.strip() + ("+dirty" if dirty else "")
    return "unknown"


def run(opts: Options, progress=None) -> dict:
    """The whole bench; returns the results document (bench.json's content)."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    torch = bench_sides.torch_device(opts.torch_device)
    specs = (bench_shapes.tiny_specs(opts.ctx, opts.gamma) if opts.shapes == "tiny"
             else bench_shapes.real_specs(opts.ctx, opts.scale, opts.target_layers, opts.gamma))
    specs = [s for s in specs if s.source in opts.sources and (not opts.cases or s.name in opts.cases)]
    if opts.cases and not specs:
        raise ValueError(f"no case named {opts.cases} among the {opts.shapes} shapes of {list(opts.sources)}")
    say(f"bandwidth ({opts.bw_bytes >> 20} MiB)")
    bw = bandwidth(opts.bw_bytes)
    say("launch cost")
    launch = launch_cost()
    cases = []
    with tempfile.TemporaryDirectory(prefix="spec-parity-bench-") as tmp:
        for spec in specs:
            say(f"case {spec.name}")
            cases.append(run_case(spec, opts, torch, bw, Path(tmp)))
    cmd = shlex.join([sys.executable, "-m", "spec_parity.cli", *opts.argv])
    process = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    return {"command": cmd, "process": process, "cwd": os.getcwd(), "argv": opts.argv, "options": {k: v for k, v in vars(opts).items() if k != "argv"},
            "git": _git(), "machine": machine(), "versions": versions(), "torch_sides": torch[0] or torch[1],
            "bandwidth": bw, "launch": launch, "cases": cases, "wall_s": time.perf_counter() - t0,
            "what": {"a": "one draft call: assistant = gamma chained steps, blocks = one block after one "
                          "committed row; per_step_s = a / steps_per_call",
                     "c": HostSyncs.__doc__.split("\n\n")[0], "f": "primitives evaluated per step (graph nodes)",
                     "floor": bench_shapes.step_bytes.__doc__.split("\n")[0] + " / copy bandwidth",
                     "launch": "wall per op of a chain of dependent tiny ops: the least one launch costs"}}

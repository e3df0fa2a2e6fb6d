"""Counting what a draft step costs the host: host synchronizations and graph ops (`HostSyncs`),
the buffers the port builds from host data (`HostBuffers`), and both for one step (`count_step`)."""

from __future__ import annotations

import io
import re
import sys
from collections import Counter

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .port_sides import PORT_MODULES
from .sides import Stepper

_OP_NODE = re.compile(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}')


def graph_nodes(*arrays: mx.array) -> dict[str, str]:
    """The op nodes of the not-yet-evaluated graph behind `arrays` (`mx.export_to_dot`): node id ->
    the primitive's name (a fused `Compiled` block is one node)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return dict(_OP_NODE.findall(buf.getvalue()))


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
    kernels that touch it fault."""

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
        new = {n: lab for n, lab in graph_nodes(*arrays).items() if n not in self._scheduled}
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


SCALAR_POOL_BYTES = 8  # MLX CUDA keeps buffers up to 8 bytes in a GPU-mapped scalar pool


class HostBuffers:
    """Counts, while active, the arrays the port's modules build from host data (`mx.array` of a
    list, a number or numpy) over 8 bytes. Why: on MLX CUDA such a buffer is managed memory the host
    has just written, and the first kernel that reads it page-faults (H200: the embedding Gather of
    a block 100-280 us instead of 3); buffers up to 8 bytes live in MLX's
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


COUNT_RUNS = 3


def count_step(stepper: Stepper, runs: int = COUNT_RUNS, port: bool = True) -> dict:
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

"""Stacked projections for the fast paths: one batched matmul where the plain model runs several
of the same size over one input (a layer's K and V, an MLP's gate and up, every layer's context K).

`x @ stack.swapaxes(-1, -2)` with `stack` = [W_0, W_1, ...] of one shape gives [x @ W_0.T, ...],
each part a contiguous view (no copy before a norm), in one launch. On the CPU backend the parts
equal the separate products bit for bit (measured, and held: tests/test_fused.py); on MLX CUDA
docs/benchmarks.md states the tier measured on the H200.

A stack is built from the module's current weights and rebuilt when one of them is replaced (a
weight swapped after load is seen, as the compiled pieces see it). mx.compile, when it traces with
the module's state as an input, hands the module new array objects for the same weights: `seen`
records them after each compiled call, so a trace is not taken for a replacement. `adopt` hands the
module views into the stack in place of its own weights, so the weights are not held twice."""

from __future__ import annotations

import mlx.core as mx


class Stacks:
    """A model's stacked weights by name. A plain object: not part of the module's state."""

    def __init__(self):
        self.built: dict = {}

    def get(self, name: str, owners: list, attr: str = "weight", adopt: bool = False) -> mx.array:
        """[len(owners), ...]: `owner.<attr>` stacked (every one the same shape), rebuilt when one
        of them is no longer the array it was built from. `adopt`: each owner's attr becomes its
        view into the stack."""
        parts = [getattr(o, attr) for o in owners]
        hit = self.built.get(name)
        if hit is not None and len(hit[2]) == len(parts) and all(a is b for a, b in zip(hit[2], parts)):
            return hit[3]
        stack = mx.stack(parts)
        mx.eval(stack)
        if adopt:
            for i, o in enumerate(owners):
                setattr(o, attr, stack[i])
        # the parts stay referenced: no other array can take their identity
        self.built[name] = (owners, attr, [getattr(o, attr) for o in owners], stack)
        return stack

    def seen(self) -> None:
        """The weights as they are now are the ones the stacks were built from (after a compiled
        call: its trace re-wrapped them, it replaced none)."""
        for name, (owners, attr, _, stack) in self.built.items():
            self.built[name] = (owners, attr, [getattr(o, attr) for o in owners], stack)


def project(x: mx.array, stack: mx.array) -> mx.array:
    """[n, T, out]: x [1, T, in] through each of the n stacked [out, in] weights (x broadcast over
    the stack; not x[0], which MLX makes a Gather)."""
    return x @ stack.swapaxes(-1, -2)

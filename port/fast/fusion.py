"""Weights laid out for a fast path: stacked projections and transposed views.

Stacks (DSpark's Fused, port/fast/dspark.py): one batched matmul
where the plain model runs several of the same size over one input (a layer's K and V, an MLP's
gate and up, every layer's context K).

`x @ stack.swapaxes(-1, -2)` with `stack` = [W_0, W_1, ...] of one shape gives [x @ W_0.T, ...],
each part a contiguous view (no copy before a norm), in one launch. On the CPU backend the parts
equal the separate products bit for bit (measured, and held: tests/test_fused.py); on MLX CUDA
the fp32 tier holds them (tests/test_fused.py, docs/benchmarks.md "Parity on MLX CUDA").

A stack is built from the module's current weights and rebuilt when one of them is replaced (a
weight swapped after load is seen, as the compiled pieces see it). mx.compile, when it traces with
the module's state as an input, hands the module new array objects for the same weights: `seen`
records them after a call that traced, so a trace is not taken for a replacement. `adopt` hands the
module views into the stack in place of its own weights, so the weights are not held twice.

Transposed (DFlash's Bucketed, port/fast/dflash.py; the assistant's Compiled step,
port/fast/assistant.py): each projection's weight as its transposed view [in, out]. `x @ view` is the product `nn.Linear` computes as `x @ weight.T` (the
same array, the same strides: the same kernel and bits) without the Transpose node it adds to the
graph on every call; on MLX CUDA a block is host-bound, and every node costs host time."""

from __future__ import annotations

import mlx.core as mx


class Stacks:
    """A model's stacked weights by name, in the order they were added (a stack built from another
    one's adopted views comes after it). A plain object: not part of the module's state."""

    def __init__(self):
        self.entries: dict = {}   # name -> [owners, adopt, parts, stack]

    def add(self, name: str, owners: list, adopt: bool = False) -> None:
        """Stack `owner["weight"]` over `owners` (every one the same shape). `adopt`: each owner's
        weight becomes its view into the stack."""
        self.entries[name] = [owners, adopt, None, None]

    def current(self) -> dict:
        """name -> stack, each rebuilt if one of its weights is no longer the array it was built
        from (a dict lookup and an identity test per weight: no sync, no copy)."""
        for entry in self.entries.values():
            owners, adopt, parts, _ = entry
            if parts is None or any(o["weight"] is not p for o, p in zip(owners, parts)):
                stack = mx.stack([o["weight"] for o in owners])
                mx.eval(stack)
                if adopt:
                    for i, o in enumerate(owners):
                        o["weight"] = stack[i]
                # the parts stay referenced: no other array can take their identity
                entry[2:] = [[o["weight"] for o in owners], stack]
        return {name: entry[3] for name, entry in self.entries.items()}

    def seen(self) -> None:
        """The weights as they are now are the ones the stacks were built from (after a compiled
        call that traced: the trace re-wrapped them, it replaced none)."""
        for entry in self.entries.values():
            entry[2] = [o["weight"] for o in entry[0]]


def parts(y: mx.array) -> list[mx.array]:
    """project's output [n, T, out] as n views [1, T, out]: one Slice node each (unpacking the
    array would add a Split, then a Squeeze and an ExpandDims per part)."""
    return [y[i:i + 1] for i in range(y.shape[0])]


def project(x: mx.array, stack: mx.array) -> mx.array:
    """[n, T, out]: x [1, T, in] through each of the n stacked [out, in] weights (x broadcast over
    the stack; not x[0], which MLX makes a Gather)."""
    return x @ stack.swapaxes(-1, -2)


class Transposed:
    """Named modules' weights as transposed views, rebuilt when a weight is no longer the array
    they were taken from (a weight replaced after load; mx.compile's trace re-wraps the module's
    weights, so one rebuild follows each trace). A rebuilt view is evaluated with the first call
    that reads it (no sync of its own), a leaf from then on. A plain object: not part of the
    module's state."""

    def __init__(self, owners: dict):
        self.owners, self.parts, self.views = owners, None, None

    def current(self) -> dict:
        """name -> weight.T (an identity test per weight: no sync, no copy)."""
        if self.parts is None or any(o["weight"] is not p for o, p in zip(self.owners.values(), self.parts)):
            self.views = {name: o["weight"].T for name, o in self.owners.items()}
            self.parts = [o["weight"] for o in self.owners.values()]
        return self.views


def mlp_weights(i: int, mlp) -> dict:
    """Transposed's owners for layer i's gated MLP: "gate{i}", "up{i}", "down{i}"."""
    return {f"gate{i}": mlp.gate_proj, f"up{i}": mlp.up_proj, f"down{i}": mlp.down_proj}


def gated_mlp(act, w: dict, i: int, x):
    """down(act(gate(x)) * up(x)) of layer i on Transposed views `w` (mlp_weights' names): the
    product the plain MLP module computes, one matmul node per projection."""
    return (act(x @ w[f"gate{i}"]) * (x @ w[f"up{i}"])) @ w[f"down{i}"]

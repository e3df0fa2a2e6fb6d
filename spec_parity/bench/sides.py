"""What a side of `spec-parity bench` is: a named way to draft (our port, a peer) that builds a
Stepper for one case.

A side's `build(prep)` loads its drafter from the case's directories with its OWN loader (inside
`serve_weights`, so every side gets the same arrays), brings it to the state after the context
prefill, and returns `step`: one draft step chain (assistant: `gamma` chained steps, as its loop
drafts them) or one draft block (DSpark, DFlash) in that side's own calls. A block step first
appends one committed row to the context (the verify's tap row of the anchor, as a round that
accepted nothing commits), so the context grows by one row per step on every side alike. Our
port's sides: bench/port_sides.py; the peers: bench/peers.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from .shapes import Checkpoints


@dataclass
class Prep:
    """What every side of one case starts from (built once, shared)."""

    ckpt: Checkpoints
    target: object            # spec_parity.port.targets.Target (mlx-lm model + config), shared by the MLX sides
    caches: list              # the target's caches after the context prefill: the donor K/V
    taps: mx.array | None     # [1, ctx, n*H] the context rows' concatenated taps (block sources)
    row: mx.array | None      # [1, 1 + gamma, n*H] a verify's taps; row 0 joins the context per step
    anchor: int               # the token the first draft follows (the target's greedy next token)
    anchor_hidden: mx.array   # [1, 1, H] the target hidden that predicted it
    torch_device: str | None  # "cuda" / "cpu" for the torch sides, None: torch sides skipped
    torch_reason: str = ""    # why torch sides are skipped

    @property
    def source(self) -> str:
        return self.ckpt.source

    @property
    def gamma(self) -> int:
        return self.ckpt.case.shapes.gamma

    @property
    def ctx(self) -> int:
        return self.ckpt.case.shapes.ctx


@dataclass
class Stepper:
    step: Callable[[], object]
    framework: str = "mlx"            # "mlx" | "torch": how the loop synchronizes and reads memory
    device: str = ""
    notes: list[str] = field(default_factory=list)
    keep: object = None               # what must stay alive while the stepper runs (models, caches)
    tokens: Callable[[object], list[int]] = list  # the draft tokens in a step's output


@dataclass(frozen=True)
class Side:
    """One side: its name (the tables' and --peers'), the draft sources it serves, how it builds a
    Stepper (`build(prep)`; a --serve loop side, bench/loop_sides.py: `build(ckpt, env) -> Loop`),
    its framework (known before it is built: a real-shape MLX side is built only for the
    passes that use it, a torch side is skipped without a torch device), whether it counts as a
    peer (our own paths never do: no "best peer", no host-buffer count), the modules it imports
    (checked first, so a missing one is a reason) and what to install if they are missing."""

    name: str
    sources: tuple[str, ...]
    build: Callable[..., object]
    framework: str = "mlx"
    peer: bool = True
    needs: tuple[str, ...] = ()
    install: str = ""


class Skip(RuntimeError):
    """A side that does not run here by design (torch without CUDA, DEEPSPEC_SRC unset): its
    message is the whole reason."""


def torch_device(choice: str) -> tuple[str | None, str]:
    """auto: CUDA if torch sees one, else the torch sides are skipped (their figures would be
    CPU ones); cpu / cuda force it."""
    if choice == "none":
        return None, "torch sides off (--torch-device none)"
    try:
        import torch
    except Exception as e:  # torch absent or broken: a reason, not a crash
        return None, f"torch not importable: {type(e).__name__}: {e}"
    if choice == "auto":
        if torch.cuda.is_available():
            return "cuda", ""
        return None, "no CUDA device visible to torch (torch references run on CUDA; --torch-device cpu forces CPU)"
    if choice == "cuda" and not torch.cuda.is_available():
        return None, "--torch-device cuda but torch.cuda.is_available() is False"
    return choice, ""

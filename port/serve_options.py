"""How a request is served (`ServeOptions`), and the choices port/serve.py resolves for it: the
verify forward, fastest first, of those that run on this target."""

from __future__ import annotations

from dataclasses import dataclass

from . import sampling, targets
from .compiled import AUTO
from .fast import verify as fast_verify

VERIFIES = ("kernel", "compiled", "plain")   # fastest first: AUTO takes the first that runs
COMPILED = ("kernel", "compiled")             # the verifies port/fast/verify.py runs as one compiled call
PIPELINES = ("on", "off")


@dataclass(frozen=True)
class ServeOptions:
    """How port/serve.py's generate serves a request; the defaults are the greedy loop at its fastest.

    gamma: draft tokens per round. eos: the stop tokens (None: the target's own). record: keep the
    logits row each committed token came from (`Stats.logits`).

    `sampler` (spec_parity.port.sampling.Sampler), `processors` (callables (tokens, logits [1, V]) -> logits,
    mlx-lm's convention, applied to every verify row before acceptance and to the draft rows of a
    source with `draft_sampled`), `mode` ("match" or "rejection") and `draft_sampler` (rejection:
    what the drafts are drawn from; default the request's sampler) select the sampling verify, see
    port/sampling.py.

    `kv_bucket` (rows, or None): the bucketed verify (targets.make_caches): the target's caches
    are buffers a whole number of buckets long that every forward attends over whole, masked, so
    on MLX CUDA the attention plans a kernel once per bucket, not once per round's key length.
    Bit-exact with mlx-lm's caches on the CPU (tests/test_bucketed.py), within fp32 tolerance on
    MLX CUDA, the same greedy stream. Default "auto": the provider's own `kv_bucket` (DSpark and
    DFlash: compiled.BUCKET; the assistant and plain decoding: None) where the target's caches
    allow it (targets.make_caches); `stats.kv_bucket` says what the request ran with.

    `verify`: "compiled" (port/fast/verify.py: the bucketed verify as one compiled call, traced
    once per buffer length; needs a kv_bucket), "kernel" (the same with port/fast/kernels.py's
    attention: MLX CUDA from compute capability 8.0, Qwen3 targets with bf16 activations;
    1.03-1.41x the compiled verify's loop in serving: docs/benchmarks.md, "The kernel verify against
    the compiled one"), "plain" (targets.forward, op by op), or "auto" (default): the first of
    "kernel", "compiled", "plain" that runs here; `stats.verify` says which ran.

    `pipeline`: "on" (serve._pipelined: round r + 1 is built while the device runs round r; the
    greedy verify, compiled, and a source with `draft_pipelined` (DFlash, DSpark) or none), "off"
    (the sequential loop), or "auto" (default): on where it fits; `stats.pipeline` says which ran.

    port/serve.py's `_open` resolves every "auto" and refuses what cannot run, before the prefill."""

    gamma: int = 4
    eos: set[int] | None = None
    record: bool = False
    sampler: sampling.Sampler | None = None
    processors: tuple = ()
    mode: str = "match"
    draft_sampler: sampling.Sampler | None = None
    kv_bucket: int | str | None = AUTO
    verify: str = AUTO
    pipeline: str = AUTO


DEFAULT = ServeOptions()


def resolve_verify(verify: str, target: targets.Target, kv_bucket: int | None) -> str:
    """The request's verify forward: AUTO is the first of VERIFIES that port/fast/verify.py takes."""
    return resolve_choice("verify", verify, VERIFIES, {"kernel": fast_verify.kernel_unsupported(target, kv_bucket),
                                                 "compiled": fast_verify.unsupported(target, kv_bucket)})


def resolve_choice(option: str, value: str, choices: tuple[str, ...], why: dict[str, str | None]) -> str:
    """An option whose choices run fastest first, the last everywhere; `why`: why a choice cannot
    run here (None or absent: it can). AUTO is the first that can; one asked for where it cannot is
    refused with the reason and the fix (the next one that can)."""
    if value == AUTO:
        return next(c for c in choices if not why.get(c))
    if value not in choices:
        raise ValueError(f"{option}={value!r}: expected one of {choices} or {AUTO!r}")
    if why.get(value):
        fix = next(c for c in choices[choices.index(value) + 1:] if not why.get(c))
        raise ValueError(f"{option}={value!r} cannot run here: {why[value]}; use {option}={fix!r}")
    return value

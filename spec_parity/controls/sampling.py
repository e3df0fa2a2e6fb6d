"""Negative controls of the sampling verify (port/sampling.py): each must make the statistical
losslessness tests (tests/test_sampling.py) reject the loop's output."""

from __future__ import annotations

from . import control


@control("sampling", "residual_skipped",
         "on a rejection the correction is sampled from p_k instead of norm(max(0, p_k - q_k))")
def _skipped(case):
    import mlx.core as mx

    from port import sampling

    residual = sampling.residual
    return {(sampling, "residual"): lambda p, q: residual(p, mx.zeros_like(q))}


@control("sampling", "residual_unnormalized", "the residual max(0, p_k - q_k) is sampled without normalizing it")
def _unnormalized(case):
    import mlx.core as mx

    from port import sampling

    return {(sampling, "residual"): lambda p, q: mx.maximum(p - q, 0.0)}


@control("sampling", "target_no_temperature", "the temperature is applied to the draft's q but not to the target's p")
def _no_temperature(case):
    from port import sampling

    probs = sampling.verify_probs
    return {(sampling, "verify_probs"): lambda sampler, rows: probs(sampler.with_temperature(1.0), rows)}

"""Negative controls of the sampling verify (port/sampling.py), one or more per family of
rejection-sampling rule bug: the correction token (the residual), the bonus token (after a full
accept) and the acceptance test. Each must make the statistical losslessness tests
(tests/test_sampling_*.py) or the pairs' sampled cases (spec_parity/sampled.py) reject the loop's
output. A bug with a token-match form swaps that rule too: "match" is the assistant's, "rejection"
DSpark's."""

from __future__ import annotations

from . import control

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.sampling:accept_match", "spec_parity.port.sampling:accept_rejection",
    "spec_parity.port.sampling:accepted_prefix", "spec_parity.port.sampling:residual", "spec_parity.port.sampling:verify_probs",
)

# Each control's family (spec_parity.sampled.BUG_FAMILIES) and the acceptance modes whose rule it
# changes (the others run as they are).
FAMILIES = {"residual_skipped": "residual", "residual_unnormalized": "residual", "correction_redrawn": "residual",
            "bonus_wrong_row": "bonus", "bonus_greedy": "bonus",
            "accept_wrong_row": "acceptance", "accept_inverted": "acceptance", "target_no_temperature": "acceptance"}
BOTH = ("match", "rejection")
MODES = {"residual_skipped": ("rejection",), "residual_unnormalized": ("rejection",), "correction_redrawn": ("match",),
         "bonus_wrong_row": BOTH, "bonus_greedy": BOTH, "accept_wrong_row": BOTH, "accept_inverted": ("rejection",),
         "target_no_temperature": BOTH}


@control("sampling", "residual_skipped",
         "on a rejection the correction is sampled from p_k instead of norm(max(0, p_k - q_k))")
def _skipped(case):
    import mlx.core as mx

    from spec_parity.port import sampling

    residual = sampling.residual
    return {(sampling, "residual"): lambda p, q: residual(p, mx.zeros_like(q))}


@control("sampling", "residual_unnormalized", "the residual max(0, p_k - q_k) is sampled without normalizing it")
def _unnormalized(case):
    import mlx.core as mx

    from spec_parity.port import sampling

    return {(sampling, "residual"): lambda p, q: mx.maximum(p - q, 0.0)}


@control("sampling", "correction_redrawn",
         "token match: a mismatch's correction is a fresh draw from p_k, not the draw that rejected the draft")
def _redrawn(case):
    """Token match's form of the skipped residual (the correction may repeat the rejected draft):
    drawn again with the next row's uniform, which a mismatch leaves unused."""
    import mlx.core as mx

    from spec_parity.port import sampling

    match = sampling.accept_match

    def redrawn(drafts, p, u):
        k, nxt = match(drafts, p, u)
        n = drafts.shape[1]
        fresh = mx.take_along_axis(u, mx.minimum(k + 1, n)[:, None], axis=1)[:, 0]
        return k, mx.where(k < n, sampling.sample(sampling._row(p, k), fresh), nxt)

    return {(sampling, "accept_match"): redrawn}


def _on_full_accept(bonus):
    """Both rules' swaps: on a full accept the next token is bonus(p, u) (p [B, n+1, V], u [B] the
    uniform the bonus is drawn with) instead of a draw from p_n."""
    import mlx.core as mx

    from spec_parity.port import sampling

    match, rejection = sampling.accept_match, sampling.accept_rejection

    def full(drafts, k, nxt, p, u):
        return k, (mx.where(k == drafts.shape[1], bonus(p, u), nxt) if drafts.shape[1] else nxt)

    return {(sampling, "accept_match"): lambda d, p, u: full(d, *match(d, p, u), p, u[:, -1]),
            (sampling, "accept_rejection"): lambda d, q, p, ua, ur: full(d, *rejection(d, q, p, ua, ur), p, ur)}


@control("sampling", "bonus_wrong_row", "on a full accept the bonus token is drawn from the last draft's row p_{n-1}, not p_n")
def _bonus_row(case):
    from spec_parity.port import sampling

    return _on_full_accept(lambda p, u: sampling.sample(p[:, -2], u))


@control("sampling", "bonus_greedy", "on a full accept the bonus token is the argmax of p_n (drawn at T=0)")
def _bonus_greedy(case):
    import mlx.core as mx

    return _on_full_accept(lambda p, u: mx.argmax(p[:, -1], axis=-1).astype(mx.int32))


@control("sampling", "accept_wrong_row",
         "draft d_{i+1} is tested against the next row p_{i+1} (token match: its draw x_{i+1}), not p_i")
def _accept_row(case):
    import mlx.core as mx

    from spec_parity.port import sampling

    prefix = sampling.accepted_prefix

    def match_shifted(d, p, u):
        x = sampling.sample(p, u)
        k = sampling._prefix(d == x[:, 1:])
        return k, mx.take_along_axis(x, k[:, None], axis=1)[:, 0]

    return {(sampling, "accept_match"): match_shifted,
            (sampling, "accepted_prefix"): lambda d, q, p, u: prefix(d, q, p[:, 1:], u)}


@control("sampling", "accept_inverted", "a draft is accepted with probability min(1, q/p) instead of min(1, p/q)")
def _inverted(case):
    from spec_parity.port import sampling

    prefix = sampling.accepted_prefix
    return {(sampling, "accepted_prefix"): lambda d, q, p, u: prefix(d, p[:, : d.shape[1]], q, u)}


@control("sampling", "target_no_temperature", "the temperature is applied to the draft's q but not to the target's p")
def _no_temperature(case):
    from spec_parity.port import sampling

    probs = sampling.verify_probs
    return {(sampling, "verify_probs"): lambda sampler, rows: probs(sampler.with_temperature(1.0), rows)}

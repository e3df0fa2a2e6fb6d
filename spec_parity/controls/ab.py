"""Negative controls of the drafter A/B verdict (port/ab.py): each must make one of the seed's
properties in tests/test_ab.py fail. Each wraps the port's own function from outside."""

from __future__ import annotations

from dataclasses import replace

from . import control

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.ab:paired_verdict", "spec_parity.port.ab:summarize_arm",
)


@control("ab", "relative_delta", "the acceptance change as a relative % instead of absolute points")
def _relative(case):
    from spec_parity.port import ab

    verdict = ab.paired_verdict

    def relative(a_results, b_results, max_drop_pts=3):
        v = verdict(a_results, b_results, max_drop_pts)
        if not v.a.acceptance:
            return v
        return replace(v, acceptance_delta_pts=(v.b.acceptance - v.a.acceptance) / v.a.acceptance * 100)
    return {(ab, "paired_verdict"): relative}


@control("ab", "by_pos_over_prompts", "per-position acceptance divided by the prompts, not by what was drafted")
def _by_prompts(case):
    from spec_parity.port import ab

    summarize = ab.summarize_arm

    def over_prompts(results):
        s = summarize(results)
        rows = [(sum(r.accepted_by_pos[i] for r in results if i < len(r.accepted_by_pos)),
                 any(i < len(r.drafted_by_pos) and r.drafted_by_pos[i] for r in results))
                for i in range(len(s.acceptance_by_pos))]
        return replace(s, acceptance_by_pos=[a / len(results) if drafted else 0.0 for a, drafted in rows])
    return {(ab, "summarize_arm"): over_prompts}


@control("ab", "speed_not_strict", "B passes when exactly as fast as A (ratio >= 1, not > 1)")
def _not_strict(case):
    from spec_parity.port import ab

    verdict = ab.paired_verdict

    def not_strict(a_results, b_results, max_drop_pts=3):
        v = verdict(a_results, b_results, max_drop_pts)
        held = v.acceptance_delta_pts >= -max_drop_pts
        if v.speed_ratio == 1 and held:
            return replace(v, passed=True, verdict=ab.verdict_text(v.acceptance_delta_pts, 1.0, max_drop_pts, True, True))
        return v
    return {(ab, "paired_verdict"): not_strict}


@control("ab", "no_size_check", "arms of different sizes are paired up to the shorter one instead of refused")
def _no_size_check(case):
    from spec_parity.port import ab

    verdict = ab.paired_verdict

    def unchecked(a_results, b_results, max_drop_pts=3):
        n = min(len(a_results), len(b_results))
        return verdict(a_results[:n], b_results[:n], max_drop_pts)
    return {(ab, "paired_verdict"): unchecked}

"""A loop verdict is separate findings (spec_parity/checks.py serve_loop): lossless against the
target's greedy stream, the drafts against the reference drafter's on the same context, the
schedule against the reference loop's. The ports here are ours behind a wrapper (outside product
code): one that schedules its rounds otherwise (another gamma) reads as that, not as a wrong drafter."""

from dataclasses import replace

import numpy as np
import pytest

from spec_parity import harness, ports


def _case(case_id):
    return next(c for c in harness.all_cases() if c.id == case_id)


def test_other_schedule_right_drafts_reads_as_schedule():
    ours = ports.ours().runs["assistant"]
    port = ports.Port("gamma-2", "0", {"assistant": lambda req: ours(replace(req, options={**req.options, "gamma": 2}))},
                      (__file__,))
    r = harness.evaluate(_case("assistant/loop-agreeing-centroid-g3"), "golden", ports.Selection({"assistant": port}))
    assert r.verdict == "FAIL" and set(r.findings) == {"schedule"}, r.message()
    assert r.metrics["drafts_vs_ref"]["ok"] and r.metrics["drafts_vs_ref"]["rounds_compared"] > 0
    assert r.metrics["lossless_vs_greedy"]["ok"]


@pytest.mark.slow
def test_a_drafter_bug_with_unchanged_acceptance_fails_the_drafts():
    """A random drafter is never accepted: with its attention scale wrong the stream, the schedule
    and the acceptance are all as before, and only the drafts finding fails."""
    control = _case("assistant/loop-random-centroid-g2-control-scale")
    r = harness.evaluate(control, "golden")
    base = harness.evaluate(_case("assistant/loop-random-centroid-g2"), "golden")
    assert r.verdict == "FAIL" and set(r.findings) == {"drafts"}, r.message()
    assert r.metrics["acceptance"] == base.metrics["acceptance"]


def test_a_loop_that_says_it_starts_earlier_fails_the_schedule_start():
    """Control of `schedule_start` (drafting.drafts): our own DSpark loop, declaring from outside
    that it committed nothing before round 0, has the same drafts on shifted contexts, so its
    first round stands one token before DeepSpec's; the start is named as the schedule finding."""
    ours = ports.ours().runs["dspark"]
    port = ports.Port("starts-early", "0", {"dspark": lambda req: {**ours(req), "stream.prefilled": np.array([0], np.int32)}},
                      (__file__,))
    r = harness.evaluate(_case("dspark/loop-gemma4-t0.0"), "golden", ports.Selection({"dspark": port}))
    assert r.verdict == "FAIL" and "schedule" in r.findings, r.message()
    assert r.metrics["schedule_start"] == {"ok": False, "port": 0, "ref": 1}


def _block_of(out: dict, r: int, tokens: np.ndarray) -> dict:
    """Our loop's output with round r's block replaced by `tokens` (its logits rows cut to fit)."""
    sizes = np.asarray(out["stream.drafted"]).copy()
    at, n = int(sizes[:r].sum()), int(sizes[r])
    rows = out["stream.draft_logits"]
    sizes[r] = len(tokens)
    return {**out, "stream.drafted": sizes,
            "stream.accepted": np.minimum(out["stream.accepted"], sizes).astype(np.int32),
            "stream.proposals": np.concatenate([out["stream.proposals"][:at], tokens, out["stream.proposals"][at + n:]]),
            "stream.draft_logits": np.concatenate([rows[:at], rows[at:at + len(tokens)], rows[at + n:]])}


@pytest.mark.parametrize("shorter, findings", [(True, {"schedule"}), (False, {"drafts"})])
def test_a_dflash_block_of_another_length_is_not_compared(shorter, findings):
    """A DFlash block's every draft depends on its length (drafting.Drafts whole_block): a round
    that drafted a shorter block on the same context is a schedule finding, not a drafts one; the
    control, a block of the same length with other tokens, fails the drafts."""
    ours = ports.ours().runs["dflash"]

    def run(req):
        out = ours(req)
        r = 1
        at, n = int(np.sum(out["stream.drafted"][:r])), int(out["stream.drafted"][r])
        block = out["stream.proposals"][at:at + n] + 1
        return _block_of(out, r, block[: n // 2] if shorter else block)
    port = ports.Port(f"block-{'shorter' if shorter else 'other'}", "0", {"dflash": run}, (__file__,))
    r = harness.evaluate(_case("dflash/loop-qwen3"), "golden", ports.Selection({"dflash": port}))
    assert r.verdict == "FAIL" and set(r.findings) == findings, r.message()
    assert r.metrics["drafts_vs_ref"]["other_length"] == (1 if shorter else 0)

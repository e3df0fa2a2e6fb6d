"""Reference deltas as data (spec_parity/deltas.py): a plug-in port that follows the other
reference's convention is named by the delta, not failed; one that matches neither fails. The
plug-in ports here are our own port behind a wrapper that rewrites the request's option (the
convention the port "follows") and, for the control, perturbs an array: applied from outside."""

from dataclasses import replace

import pytest

from spec_parity import harness, ports


def _case(case_id):
    return next(c for c in harness.all_cases() if c.id == case_id)


def _following(module, perturb=None, **options):
    ours = ports.ours().runs[module]

    def run(req):
        out = ours(replace(req, options={**req.options, **options}))
        if perturb:
            out[perturb] = out[perturb] + 1e-3
        return out
    name = "follows-" + "-".join(f"{k}={v}" for k, v in options.items()) + (f"-perturbed-{perturb}" if perturb else "")
    return ports.Port(name, "0", {module: run}, (__file__,))     # its own identity: results cached apart


def _evaluate(case_id, port):
    case = _case(case_id)
    return harness.evaluate(case, "golden", ports.Selection({case.module: port}))


@pytest.mark.parametrize("case_id, options, named", harness.slow_except([
    ("dflash/mod-gemma4", {"window": "positional"}, ["window-ring"]),
    ("dflash/mod-gemma4", {"embed": "raw"}, ["block-embed-scale"]),
    ("dflash/mod-gemma4", {"window": "positional", "embed": "raw"}, ["window-ring", "block-embed-scale"]),
    ("assistant/step-gemma4-centroid-optiq", {"convention": "hfpos"}, ["draft-position"]),
    ("assistant/step-gemma4-centroid-untied-transformers", {"head_rows": "embed"}, ["centroid-rows"]),
    ("assistant/step-gemma4-centroid-untied-optiq", {"head_rows": "lm_head"}, ["centroid-rows"]),
], "dflash/mod-gemma4"))
def test_a_port_on_the_other_convention_is_named_by_its_delta(case_id, options, named):
    r = _evaluate(case_id, _following(case_id.split("/")[0], **options))
    assert r.verdict == "DELTA" and r.metrics["delta"]["deltas"] == named, r.message()
    assert all(f"delta {n}" in r.reason for n in named)


@pytest.mark.slow
def test_a_port_matching_neither_convention_fails():
    r = _evaluate("dflash/mod-gemma4", _following("dflash", perturb="logits.3", window="positional"))
    assert r.verdict == "FAIL" and "delta" not in r.metrics, r.message()


def test_our_port_is_never_excused():
    """Our port is held to each reference under the case's own convention: a planted bug that a
    delta could mimic stays a FAIL (the harness only explains plug-in ports)."""
    control = next(c for c in harness.all_cases(["dflash"]) if c.control)
    assert harness.evaluate(control, "golden").verdict == "FAIL"

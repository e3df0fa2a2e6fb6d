"""Reference deltas as data (spec_parity/deltas.py): a plug-in port that follows the other
reference's convention is named by the delta, not failed; one that matches neither fails. The
plug-in ports here are our own port behind a wrapper that rewrites the request's option (the
convention the port "follows") and, for the control, perturbs an array: applied from outside."""

from dataclasses import replace

import numpy as np
import pytest

from spec_parity import harness, ports


def _case(case_id):
    return next(c for c in harness.all_cases() if c.id == case_id)


def _following(module, perturb=None, fill=None, **options):
    """Our port on `options`; `fill` rewrites its masked logits (a centroid head's non-candidates)
    as another package does; `perturb` adds 1e-3 to one array (the control)."""
    ours = ports.ours().runs[module]

    def run(req):
        out = ours(replace(req, options={**req.options, **options}))
        if fill:
            out = {k: fill(v) if k.endswith(".logits") else v for k, v in out.items()}
        if perturb:
            out[perturb] = out[perturb] + 1e-3
        return out
    name = "follows-" + "-".join(f"{k}={v}" for k, v in options.items()) + (f"-perturbed-{perturb}" if perturb else "")
    name += f"-fill-{fill.__name__}" if fill else ""
    return ports.Port(name, "0", {module: run}, (__file__,))     # its own identity: results cached apart


def below_candidates(logits):
    """Non-candidates at min(candidates) - 1, as mlx-vlm's and transformers' centroid heads fill them."""
    masked = logits <= -1e29
    return np.where(masked, logits[~masked].min() - 1, logits).astype(logits.dtype) if masked.any() else logits


def promoted(logits):
    """below_candidates, and one non-candidate scored: a candidate set that is not the reference's."""
    out = below_candidates(logits).copy()
    out[int(np.argmax(logits <= -1e29))] = logits.max()
    return out


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


@pytest.mark.parametrize("case_id, options, named", [
    ("assistant/step-gemma4-centroid-transformers", {"convention": "hfpos"}, ["draft-position"]),
    ("assistant/step-gemma4-centroid-untied-transformers", {"convention": "hfpos", "head_rows": "embed"},
     ["draft-position", "centroid-rows"]),
])
def test_a_delta_is_named_whatever_the_ports_mask_fill(case_id, options, named):
    """Masked logits are compared as masked: a port filling its non-candidates with min - 1 is
    named by its delta against our port, which fills -1e30."""
    r = _evaluate(case_id, _following("assistant", fill=below_candidates, **options))
    assert r.verdict == "DELTA" and r.metrics["delta"]["deltas"] == named, r.message()


@pytest.mark.parametrize("perturb, fill", [("step1.next_hidden", below_candidates), (None, promoted)])
def test_a_real_bug_under_another_mask_fill_still_fails(perturb, fill):
    r = _evaluate("assistant/step-gemma4-centroid-transformers",
                  _following("assistant", perturb=perturb, fill=fill, convention="hfpos"))
    assert r.verdict == "FAIL" and "delta" not in r.metrics, r.message()


@pytest.mark.slow
def test_a_port_matching_neither_convention_fails():
    r = _evaluate("dflash/mod-gemma4", _following("dflash", perturb="logits.3", window="positional"))
    assert r.verdict == "FAIL" and "delta" not in r.metrics, r.message()


def test_our_port_is_never_excused():
    """Our port is held to each reference under the case's own convention: a planted bug that a
    delta could mimic stays a FAIL (the harness only explains plug-in ports)."""
    control = next(c for c in harness.all_cases(["dflash"]) if c.control)
    assert harness.evaluate(control, "golden").verdict == "FAIL"

"""Typed case parameters: a misspelt or missing one fails where the case is built, and every case's
parameters serialise to the dict its golden manifest and its port options hold."""

from dataclasses import FrozenInstanceError, replace

import pytest

from spec_parity import harness
from spec_parity.params import AssistantLoop, AssistantStep, DflashLoop, DflashRounds, Params


def test_misspelt_or_missing_parameter_fails_at_construction():
    with pytest.raises(TypeError, match="max_token"):
        AssistantLoop(gamma=2, max_token=40)
    with pytest.raises(TypeError, match="gamma"):
        AssistantLoop(max_tokens=40)
    with pytest.raises(TypeError, match="accepts"):
        DflashRounds(prompt_len=12)
    with pytest.raises(TypeError, match="window"):
        replace(AssistantStep(), window="hf")


def test_parameters_are_frozen():
    p = DflashLoop(eos=[4])
    assert p.eos == (4,)
    with pytest.raises(FrozenInstanceError):
        p.eos = ()


def test_as_dict_is_the_json_the_dicts_were():
    """The loop marker first-class in JSON, tuples as lists, unset fields left out."""
    p = DflashLoop(prompt_len=12, max_tokens=40, eos=[4], window="zlab-mlx", drafter=["dflash-drafter", 0, {}])
    assert p.as_dict() == {"loop": True, "prompt_len": 12, "max_tokens": 40, "eos": [4], "window": "zlab-mlx",
                           "embed": "scaled", "prefill": "split", "drafter": ["dflash-drafter", 0, {}]}
    assert replace(p, drafter=None, drafter_path="/x").as_dict()["drafter_path"] == "/x"


def test_every_case_has_typed_parameters():
    cases = harness.all_cases()
    assert all(type(c.params) is not Params for c in cases)
    assert {type(c.params).__name__ for c in cases} >= {"TargetForward", "AssistantStep", "AssistantLoop",
                                                       "DflashRounds", "DflashLoop", "DflashExtension",
                                                       "DsparkRounds", "DsparkLoop"}
    assert all(harness.pair(c.module).kind(c) == c.params.KIND for c in cases)

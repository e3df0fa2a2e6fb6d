"""The negative-control registry (spec_parity/controls): every control swaps attributes the port
has (a rename there cannot leave a control planting nothing), puts them back after its block, and
every case names one that exists; the port itself keeps no planted-bug switch."""

import re
from pathlib import Path

import pytest

from spec_parity import controls, harness
from spec_parity.port import dspark, serve

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", controls.MODULES)
def test_every_control_swaps_existing_port_attributes(module):
    known = controls.registry(module)
    assert known
    for key, c in known.items():
        swaps = c.swaps(None)
        assert swaps, key
        for (owner, name), value in swaps.items():
            assert hasattr(owner, name) and getattr(owner, name) is not value, (module, key, owner, name)


SEAMS = [(module, seam) for module in controls.MODULES for seam in controls.seams(module)]


@pytest.mark.parametrize("module, seam", SEAMS, ids=[f"{m}:{s}" for m, s in SEAMS])
def test_every_declared_seam_is_still_in_the_port(module, seam):
    """A renamed port internal fails here, named, before any control plants nothing on it."""
    controls.resolve(seam)


@pytest.mark.parametrize("module", controls.MODULES)
def test_every_control_swaps_only_its_declared_seam(module):
    for key, c in controls.registry(module).items():
        assert not controls.undeclared(module, c.swaps(None)), (module, key)


def test_a_seam_the_port_lost_is_named_and_an_undeclared_swap_refused(monkeypatch):
    """The negative controls of the two tests above: a seam renamed away, a swap left out of SEAMS."""
    monkeypatch.delattr(serve, "_kept")
    with pytest.raises(controls.ControlError, match="seam spec_parity.port.serve:_kept: .*rename it in SEAMS"):
        controls.resolve("spec_parity.port.serve:_kept")
    monkeypatch.undo()
    monkeypatch.setattr(controls.importlib.import_module("spec_parity.controls.serve"), "SEAMS",
                        ("spec_parity.port.serve:_kept", "spec_parity.port.serve:_verdict"))
    with pytest.raises(controls.ControlError, match="control serve/trim swaps spec_parity.port.serve:trim_caches, not in SEAMS"):
        with controls.planted("serve", "trim"):
            pass
    with controls.planted("serve", "bonus"):
        pass


def test_a_control_is_undone_after_its_block():
    plain = (dspark.Model.embed, serve._kept, serve._verdict)
    with controls.planted("dspark", "no_embed_scale"), controls.planted("serve", "bonus"):
        assert (dspark.Model.embed, serve._kept, serve._verdict) != plain
    assert (dspark.Model.embed, serve._kept, serve._verdict) == plain
    with pytest.raises(RuntimeError), controls.planted("serve", "trim"):
        raise RuntimeError
    assert serve.trim_caches.__module__ == "spec_parity.port.serve"


def test_an_inherited_attribute_is_removed_again():
    class Owner:
        pass

    class Child(Owner):
        pass

    Owner.f = 1
    with controls.swapped({(Child, "f"): 2}):
        assert Child.f == 2
    assert "f" not in vars(Child) and Child.f == 1


def test_every_case_names_a_registered_control():
    cases = [c for c in harness.all_cases() if c.control]
    assert cases
    for c in cases:
        got = controls.get(c.control.get("module", c.module), c.control["bug"])
        assert got.what == c.control["what"]


def test_unknown_controls_are_refused_with_the_known_ones():
    with pytest.raises(controls.ControlError, match=r"no control 'nope' in spec_parity/controls/sampling.py; "
                                                    r"known: \['accept_inverted'"):
        controls.get("sampling", "nope")
    with pytest.raises(controls.ControlError, match="unknown control module 'ports'"):
        controls.registry("ports")


def test_the_port_keeps_no_planted_bug_switch():
    switch = re.compile(r"\bbugs\b *[:=(]|BUGS *=|trim_bias|emit_eos|bonus: bool|planted control only")
    hits = [f"{p.name}:{i}" for p in sorted((ROOT / "port").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if switch.search(line)]
    assert not hits, hits

"""docs/protocol.md tells a port everything it is handed: every option key a built-in case gives
its port (harness.options), each named value of a convention option, every Request field, and how
a port declines. A port written from the docs alone must not meet an option they do not explain."""

from __future__ import annotations

from dataclasses import dataclass, fields

from spec_parity import exchange, harness, ports, protocol


def _undocumented(case, opts: dict) -> list[str]:
    """`opts`' keys the case's protocol does not document, and string values of a documented
    option that lists its values (`"value"` meaning) that are not among them."""
    p = protocol.get(case.module, harness.pair(case.module).kind(case))
    out = p.undocumented(opts)
    for key, value in opts.items():
        doc = p.options.get(key, "")
        if isinstance(value, str) and '`"' in doc and f'`"{value}"`' not in doc:
            out.append(f"{key}={value!r}")
    return [f"{case.id}: {u}" for u in out]


def test_every_option_a_case_hands_its_port_is_documented():
    cases = harness.all_cases()
    assert {c.module for c in cases} == set(protocol.MODULES)
    missing = [u for c in cases for u in _undocumented(c, harness.options(c))]
    assert not missing, f"undocumented in spec_parity/protocol.py: {missing}"


def test_control_an_undocumented_option_key_or_value_is_caught():
    case = next(c for c in harness.all_cases(["dflash"]) if c.params.KIND == "modules")
    opts = harness.options(case)
    assert _undocumented(case, {**opts, "knob": 1}) == [f"{case.id}: knob"]
    assert _undocumented(case, {**opts, "prefill": "halves"}) == [f"{case.id}: prefill='halves'"]


def _undocumented_fields(cls) -> set[str]:
    return {f.name for f in fields(cls)} ^ set(protocol.REQUEST)


def test_every_request_field_is_documented():
    assert not _undocumented_fields(protocol.Request)


def test_control_a_new_request_field_is_caught():
    @dataclass(frozen=True)
    class Wider(protocol.Request):
        seed: int = 0

    assert _undocumented_fields(Wider) == {"seed"}


def test_declining_is_documented_with_its_exit_status():
    doc = exchange.markdown()
    assert "spec_parity.ports.Declined(reason)" in doc
    assert f"exits with status {ports.DECLINE_EXIT}" in doc
    assert all(f"- `{name}`: " in doc for name in protocol.REQUEST)

"""A pair: one module's reference and what to hold our port to, with the defaults every pair
shares in one place (the role of test-backend-ops' test_case). A pair subclasses Pair and
overrides only what differs; a pair never compares: plan() says what to check, the harness judges.

What the harness reads of a pair:
  NAME, ORACLE             the module name and its default reference (a case may name another)
  PROMPT                   (seed salt, id bound) of its prompts (Case.prompt)
  cases() -> list[Case]    its built-in cases (controls included)
  oracle_status(oracle) -> str|None   None if that reference runs here, else what to install/set
  run_oracle(case) -> (arrays, provenance)
  kind(case) -> str        the protocol the case's port run follows (spec_parity.protocol)
  conventions(case) -> dict  the reference's conventions the port is told (port options no case param sets)
  feeds(case, ref) -> dict the reference arrays the port is given (teacher-forced inputs)
  plan(case, ref) -> Plan  what to check (spec_parity.checks)
  quantities(case, port, ref) -> dict  max |delta| per budget quantity (`spec-parity measure`)
"""

from __future__ import annotations

from .case import Case
from .checks import Plan, layer_feeds


class Pair:
    NAME: str
    ORACLE: str
    PROMPT: tuple[int, int | None]

    def cases(self) -> list[Case]:
        raise NotImplementedError(f"{type(self).__name__} has no cases()")

    def oracle_status(self, oracle: str) -> str | None:
        raise NotImplementedError(f"{type(self).__name__} has no oracle_status()")

    def run_oracle(self, case: Case) -> tuple[dict, dict]:
        raise NotImplementedError(f"{type(self).__name__} has no run_oracle()")

    def plan(self, case: Case, ref: dict) -> Plan:
        raise NotImplementedError(f"{type(self).__name__} has no plan()")

    def quantities(self, case: Case, port: dict, ref: dict) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} has no quantities()")

    def affinity(self, case: Case) -> str:
        """Cases of one affinity run in one process, where they share its results (spec_parity.shared):
        a case and its negative controls read one reference run."""
        return case.golden_name

    def kind(self, case: Case) -> str:
        """The protocol kind of the case's parameters."""
        return case.params.KIND

    def conventions(self, case: Case) -> dict:
        """None: the port's defaults are the reference's."""
        return {}

    def feeds(self, case: Case, ref: dict) -> dict:
        """The reference's layer outputs, for the port's own-error layer run."""
        return layer_feeds(ref)

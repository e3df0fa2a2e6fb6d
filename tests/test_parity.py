"""The parity tests (spec_parity/parity_tests.py: every pair's case against its golden and its live
reference), run here on the ports --port / --port-cmd choose and ours for the rest (conftest.py);
the pytest plugin runs the same tests in a port's own repository.

The dev loop runs every module case and control and the first serve loop of each checkpoint kind,
per module against the goldens and per reference live; checking a port (--port / --port-cmd) runs
every case of its modules but their negative controls, golden and live, and `-m oracle` every live
case (conftest.py). The live cases of z-lab's torch reference need `tox -e oracle-tf515`."""

from spec_parity.parity_tests import parity, test_vs_golden, test_vs_live  # noqa: F401  (collected here)

"""Suite-wide options: --regen-goldens, the one-line skip of a test whose oracle is absent, and the
hypothesis profile."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores under pytest -n auto: no oversubscription

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import spec_parity  # noqa: E402,F401  (full-fp32 MLX matmuls before any test imports mlx)

# Hypothesis's wall-clock checks (the per-example deadline, the too_slow health check) fail on a
# 2-core machine under `-n auto` or other load: timing, not the properties. Every other setting
# (the example count among them) is hypothesis's default. `--hypothesis-profile default` restores them.
settings.register_profile("spec-parity", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("spec-parity")


def pytest_addoption(parser):
    parser.addoption("--regen-goldens", action="store_true",
                     help="regenerate every golden from the live references before testing")


def pytest_sessionstart(session):
    if not session.config.getoption("--regen-goldens") or hasattr(session.config, "workerinput"):
        return
    from spec_parity import harness

    seen = set()
    for case in harness.all_cases():
        if case.control or (case.module, case.golden_name) in seen:
            continue
        seen.add((case.module, case.golden_name))
        harness.regen(case)


@pytest.fixture
def live_oracle():
    """Call with a module name: skips with one line naming what to install/set if its oracle is absent."""
    from spec_parity import harness

    def need(module: str, oracle: str = ""):
        name = oracle or harness.pair(module).ORACLE
        status = harness.pair(module).oracle_status(name)
        if status is not None:
            pytest.skip(f"{name} oracle unavailable: {status}")

    return need

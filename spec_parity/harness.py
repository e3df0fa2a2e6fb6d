"""The one path every module takes: Case -> run(oracle) / run(port) -> judge(plan) -> record.

A pair (spec_parity.pair.Pair: what the harness reads of one, with the defaults) is each
drafter's (spec_parity.drafters: DRAFTERS names them, PAIRS below holds their pairs); a pair never
compares: its plan says what to check, judge() here checks it.

The port is the one a `ports.Selection` names for the module (ours by default), handed to
all_cases() and evaluate() by whoever built it (the CLI, pytest's conftest.py, a test).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable

import numpy as np

from . import checks, controls, deltas, goldens, ports, protocol, shared
from .case import Case
from .compare import PARTIAL, Result, as_expected
from .drafters import DRAFTERS, piece
from .drafters.dflash.pair import HEADS

PAIRS = {d: piece(d, "pair").PAIR for d in DRAFTERS}


def pair(module: str):
    if module not in PAIRS:
        raise KeyError(f"unknown module {module!r}; known: {list(PAIRS)}")
    return PAIRS[module]


def all_cases(modules: Iterable[str] = PAIRS, selection: ports.Selection = ports.OURS_ONLY) -> list[Case]:
    """Every case of `modules`; a negative control plants a bug in our own port, so it runs only
    where our port answers the module in `selection`."""
    return [c for m in modules for c in pair(m).cases() if not c.control or selection.port(m).ours]


def prompt(case: Case) -> np.ndarray:
    """The case's own fixed prompt (a sampled case chooses its conditionals), else Case.prompt."""
    fixed = getattr(case.params, "prompt", None)
    return np.array([fixed], np.int32) if fixed else case.prompt(*pair(case.module).PROMPT)


def request(case: Case, ref: dict) -> protocol.Request:
    p = pair(case.module)
    drafter = case.drafter_dir() if case.params.has_drafter else None
    return protocol.Request(case.module, case.name, p.kind(case), case.checkpoint_dir(), drafter, prompt(case),
                            options(case), case.dtype, p.feeds(case, ref))


def options(case: Case) -> dict:
    """What the port is told to run: the case's parameters (less the checkpoint specs) over the
    pair's reference conventions for it (`conventions(case)`: ones no case parameter sets)."""
    params = {k: v for k, v in case.params.as_dict().items() if k not in ("drafter", "drafter_path", "loop")}
    return {**pair(case.module).conventions(case), **params}


def reference(case: Case, source: str = "auto"):
    """The reference arrays, a short label saying where they came from, and the reference's
    versions (recorded in the result's metrics).

    source: "live" runs the reference (error if it cannot run here), "golden" reads fixtures,
    "auto" prefers live and falls back to goldens. L3 cases: `components`.
    """
    name = oracle_name(case)
    if case.tier == "L3":
        return components(case, source)
    status = pair(case.module).oracle_status(name)
    if source == "live" or (source == "auto" and status is None):
        if status is not None:
            raise RuntimeError(f"{name} cannot run here: {status}")
        arrays, provenance = live(case)
        return arrays, f"{name} (live)", provenance["reference"]["versions"]
    if case.path:
        raise RuntimeError(f"{case.id} is on a real checkpoint: it needs the live {name} ({status})")
    arrays, manifest = goldens.load(case)
    return arrays, f"{name} (golden)", manifest.get("reference", {}).get("versions", {})


def components(case: Case, source: str):
    """L3: no reference implements the case, so its gates read the port and the target; the case's
    oracle is the reference of a component (the DSpark-on-DFlash extension's heads: DeepSpec's),
    live or golden as any reference. Where it can be neither (not installed here and asked live or on
    a real checkpoint, which has no golden), no arrays: the label says its checks were not run, and
    why; the gates still run."""
    name = oracle_name(case)
    status = pair(case.module).oracle_status(name)
    if status is None and source != "golden":
        arrays, provenance = live(case)
        return arrays, f"{name} (live)", provenance["reference"]["versions"]
    if not case.path and source != "live":
        arrays, manifest = goldens.load(case)
        return arrays, f"{name} (golden)", manifest.get("reference", {}).get("versions", {})
    why = status.split(": ")[0] if status else "a real checkpoint has no golden"
    return {}, f"{name}: not run ({why})", {}


def live(case: Case):
    """run_oracle(case), once per process for each manifest (spec_parity.shared). A case on a real
    checkpoint runs every time (its manifest would hash the weights, its arrays are large)."""
    run = pair(case.module).run_oracle
    if case.path:
        return run(case)

    def tiny():
        with one_torch_thread():
            return run(case)

    return shared.once(("oracle", oracle_name(case), shared.manifest_key(case)), tiny)


@contextlib.contextmanager
def one_torch_thread():
    """torch on one intra-op thread for the block: a factory checkpoint's ops are tiny, and a second
    thread only adds handoffs (DeepSpec's sampled loop on 2 cores: 7x the CPU seconds, 4x the wall
    time, the same bytes). Where torch is not installed, nothing to set."""
    try:
        import torch
    except ImportError:
        torch = None
    before = torch.get_num_threads() if torch else None
    if torch:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch:
            torch.set_num_threads(before)


def port_run(case: Case, ref: dict, port: ports.Port | None = None) -> dict:
    """`port` (default: ours) on the case, once per process for each port identity, case,
    reference bytes and controls planted around it (spec_parity.shared). Only our own port takes
    a planted bug (case.control: spec_parity.controls plants it around the run)."""
    port = port or ports.ours()
    run = port.runs[case.module]

    def go():
        req = request(case, ref)
        if not port.ours:
            return run(req)
        with controls.applied(case):
            return run(req)

    if case.path:
        return go()
    return shared.once(("port", port.identity, shared.case_key(case), shared.digest(ref), controls.active()), go)


def sides(case: Case, port: dict, ref: dict, plan: checks.Plan) -> dict:
    """The three sides a plan reads: the port's arrays, the reference's, and the target's plain
    greedy stream (computed here, by our target port, which the targets pair holds to transformers)."""
    from spec_parity.oracles.layers import to_numpy

    greedy = {}
    if plan.greedy is not None:
        n, eos = plan.greedy
        tokens, logits = shared.greedy(case.checkpoint_dir(), prompt(case), n, eos, case.dtype)
        greedy = {"greedy.tokens": np.array(tokens, np.int32), "greedy.logits": to_numpy(logits)}
    return {"port": port, "ref": ref, "greedy": greedy}


def judge(case: Case, port: dict, ref: dict, result: Result) -> Result:
    """Apply the pair's plan for `case` to a port's arrays: the only place verdicts are made."""
    p = pair(case.module)
    plan = p.plan(case, ref)
    checks.judge(plan, sides(case, port, ref, plan), case.module, case.dtype, result,
                 protocol.get(case.module, p.kind(case)))
    return result


def params(cases: list[Case]) -> list:
    """`cases` as pytest params (id: the case name) for a module's golden and live tests. The dev
    loop (plain `pytest`) runs every module case, every control and its base case, and the first
    serve-loop case of each checkpoint kind; the module's other serve-loop cases (the same loop on
    another gamma, EOS, window, head or torch twin) and the sampled (T > 0) cases are `slow`:
    `pytest --slow` and CI run them."""
    import pytest

    loops = [c for c in cases if c.params.KIND == "loop" and not c.control]
    first: dict[str, str] = {}
    for c in loops:
        first.setdefault(c.kind, c.name)
    slow = {c.name for c in loops} - set(first.values()) - {c.control["base"] for c in cases if c.control}
    slow |= {c.name for c in cases if c.params.KIND == "sampled"}   # hundreds of requests each
    return [pytest.param(c, id=c.name, marks=pytest.mark.slow if c.name in slow else ()) for c in cases]


def slow_except(values, *keep) -> list:
    """Parametrize values (plain, tuples or pytest.param) of a test whose every variant costs a
    serve loop or more: those whose first value or whole tuple of values is in `keep` stay in the
    dev loop, the others are marked `slow` (their own marks kept)."""
    import pytest
    from _pytest.mark import ParameterSet

    out = []
    for v in values:
        ps = v if isinstance(v, ParameterSet) else pytest.param(*(v if isinstance(v, tuple) else (v,)))
        out.append(ps if ps.values[0] in keep or tuple(ps.values) in keep else
                   pytest.param(*ps.values, id=ps.id, marks=[*ps.marks, pytest.mark.slow]))
    return out


def runs_live(case: Case) -> bool:
    """A case with a reference to run live: every L1/L2 case, and an L3 case only where one of its
    components has one (the DSpark-on-DFlash extension's heads: DeepSpec's)."""
    return case.tier != "L3" or case.oracle == HEADS


def affinity(case: Case) -> str:
    return pair(case.module).affinity(case)


def oracle_name(case: Case) -> str:
    return case.oracle or pair(case.module).ORACLE


@contextlib.contextmanager
def timed(phases: dict, name: str):
    """Adds the wall seconds of the block to phases[name]. A run's first case also pays the lazy
    imports (torch, transformers, mlx-lm) of the phase that first needs them; a shared result
    (spec_parity.shared: a control's reference run, a greedy stream) is paid by the first case
    that asks for it."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - t0, 4)


def evaluate(case: Case, source: str = "auto", selection: ports.Selection = ports.OURS_ONLY) -> Result:
    """The case's verdict on the port `selection` names for its module, against its reference
    (`source`: see reference()), and where its time went (Result.phases: the checkpoint factory,
    the reference, the port, the comparison; `delta` where a failure is explained)."""
    phases: dict = {}
    if not case.path:
        with timed(phases, "factory"):
            case.checkpoint_dir()
            if case.params.has_drafter:
                case.drafter_dir()
    with timed(phases, "reference"):
        ref, label, versions = reference(case, source)
    result = Result(case.module, case.name, label, case.tier, phases=phases)
    result.metrics["reference"] = {"ok": True, "versions": versions}
    port = selection.port(case.module)
    result.metrics["port"] = {"ok": True, "identity": port.identity}
    try:
        with timed(phases, "port"):
            arrays = port_run(case, ref, port)
    except ports.Declined as e:
        result.verdict = "DECLINED"
        result.note(f"{port.name} declines this case: {e}")
        return result
    with timed(phases, "compare"):
        judge(case, arrays, ref, result)
    if not result.ok and not port.ours and pair(case.module).kind(case) != "loop" and "contract" not in result.findings:
        failed = checks.reads(pair(case.module).plan(case, ref), result.first_failure or "")
        with timed(phases, "delta"):
            found = deltas.explain(case, options(case), arrays, lambda c: port_run(c, ref, ports.ours()), judge,
                                   failed)
        if found:
            result.verdict = "DELTA"
            result.note(deltas.describe(found[0], options(case)))
            result.metrics["delta"] = {"ok": True, "deltas": [d.name for d in found[0]]}
    if case.control:
        result.note(f"negative control ({case.control['what']}): expected to fail")
    return result


def measure(case: Case) -> dict[str, float]:
    """Max |Δ| per budget quantity of our port against the live reference on one case: what
    `spec-parity measure` aggregates into budgets.py, over seeds or over fuzzed configurations."""
    ref, _, _ = reference(case, "live")
    p = pair(case.module)
    both = sides(case, port_run(case, ref), ref, p.plan(case, ref))
    return {k: float(np.max(v)) for k, v in p.quantities(case, {**both["port"], **both["greedy"]}, ref).items()}


def check(case: Case, result: Result, require: tuple[str, ...] = ()) -> None:
    """The test-side verdict, read as `spec-parity run --require` reads it: a case must pass, a
    negative control must be caught; a PASS-PARTIAL fails unless `require` holds "outputs" (it is
    not green: checks did not run); a case a plug-in port declines is skipped with its reason."""
    if result.verdict == "DECLINED":
        import pytest

        pytest.skip(result.reason)
    if result.verdict == PARTIAL and not require:
        raise AssertionError(f"passed only what the port exposes, checks not run (--require outputs accepts "
                             f"it, --require internals fails it):\n{result.message()}")
    if not as_expected(result.verdict, case.expect, require):
        lead = "negative control was not caught" if case.control else "parity failed"
        raise AssertionError(f"{lead}:\n{result.message()}")


def regen(case: Case) -> str:
    """Write the golden of `case` from the live reference (controls share their base's golden)."""
    p = pair(case.module)
    status = p.oracle_status(oracle_name(case))
    if status is not None:
        raise RuntimeError(f"cannot regenerate {case.id}: {status}")
    arrays, provenance = p.run_oracle(case)
    return str(goldens.save(case, arrays, provenance))


def cpu_count_threads() -> None:
    """Keep torch from oversubscribing the 2-core CI machine under pytest-xdist."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")

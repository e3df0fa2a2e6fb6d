"""A differential fuzzer: configurations no built-in case uses, drawn by hypothesis from each
family's config space, the port against the live reference at the pair's tier.

A drawn configuration is plain JSON (`Config`): the built-in case it varies (its params, tier and
reference), the target kind and overrides, and the drafter overrides. It becomes a Case like any
other, so the harness judges it as it judges the matrix. Each example ends one of four ways:
  invalid   the factory cannot build it (its own validation: e.g. a tap past the target's layers)
  refused   the reference refuses it (an exception from the reference run): counted apart
  declined  the port refuses the checkpoint in one line, or a plug-in port declines the case
  delta     a plug-in port departs from the reference by a known reference delta (deltas as data)
  failed    a verdict that is not PASS: hypothesis shrinks it to a minimal configuration, written
            as a case folder (as `spec-parity export` writes) with the command that reproduces it.
Shrinking moves every choice toward its first option, which is the built-in case's value, so a
shrunk failure differs from a built-in case only where it must.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shlex
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import budgets, controls, exchange, harness, ports, runner
from .case import Case
from .compare import Result
from .goldens import atomic_write

SHRINK_S = 300.0     # shrinking stops after this long; the smallest failure found so far is kept


@dataclass(frozen=True)
class Config:
    """One drawn configuration, as JSON: enough to rebuild its case anywhere."""

    module: str
    base: str                      # the built-in case whose params, tier and reference it keeps
    target_kind: str
    target: dict = field(default_factory=dict)     # target overrides
    drafter: dict = field(default_factory=dict)    # drafter overrides (drafter pairs)
    seed: int = 0                                  # the drawn checkpoint's seed

    def to_json(self) -> str:
        return json.dumps({"module": self.module, "base": self.base, "target_kind": self.target_kind,
                           "target": self.target, "drafter": self.drafter, "seed": self.seed}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Config:
        try:
            d = json.loads(text)
            return cls(d["module"], d["base"], d["target_kind"], d.get("target", {}), d.get("drafter", {}),
                       int(d.get("seed", 0)))
        except (ValueError, KeyError, TypeError) as e:
            raise FuzzError(f"not a fuzz configuration ({type(e).__name__}: {e}); pass the fuzz-config.json "
                            f"a fuzz run wrote") from None

    @property
    def name(self) -> str:
        return f"fuzz-{self.base}-{hashlib.sha256(self.to_json().encode()).hexdigest()[:10]}"


class FuzzError(ValueError):
    """Misuse of the fuzzer (unknown module or reference, a config file it cannot read)."""


def _families() -> dict:
    """Each drafter's config space, where its folder has one (spec_parity/drafters/<name>/fuzz.py)."""
    from importlib.util import find_spec

    from .drafters import DRAFTERS, piece

    return {d: piece(d, "fuzz").FAMILY for d in DRAFTERS if find_spec(f"spec_parity.drafters.{d}.fuzz")}


def modules() -> tuple[str, ...]:
    return tuple(_families())


def case(config: Config) -> Case:
    """The Case a configuration stands for: its base case with the drawn checkpoints."""
    family = _families()[config.module]
    bases = {c.name: c for c in harness.pair(config.module).cases() if not c.control}
    if config.base not in bases:
        raise FuzzError(f"no base case {config.base!r} in module {config.module}; known: {sorted(bases)}")
    return family.build(replace(bases[config.base], name=config.name), config)


@dataclass
class Outcome:
    config: Config
    end: str                       # invalid | refused | declined | delta | passed | failed
    detail: str = ""
    result: Result | None = None


def _prepared(config: Config) -> Case | Outcome:
    """The configuration's case, built and its live reference run, or how it ended before any port
    ran: invalid (the factory cannot build it) or refused (the reference raised on it)."""
    try:
        c = case(config)
        c.checkpoint_dir()
        if c.params.has_drafter:
            c.drafter_dir()
    except (ValueError, KeyError, AssertionError) as e:
        return Outcome(config, "invalid", _line(e))
    try:
        harness.reference(c, "live")
    except Exception as e:     # the reference's own refusal of a configuration it does not support
        return Outcome(config, "refused", _line(e))
    return c


def evaluate(config: Config, selection: ports.Selection = ports.OURS_ONLY) -> Outcome:
    """One configuration through the harness, its end classified (module docstring)."""
    c = _prepared(config)
    if isinstance(c, Outcome):
        return c
    try:
        result = harness.evaluate(c, "live", selection)
    except Exception as e:
        if _refusal(e):
            return Outcome(config, "declined", _line(e))
        result = Result(c.module, c.name, "-", c.tier, verdict="ERROR", reason=_line(e))
    if result.verdict in ("DECLINED", "DELTA"):
        return Outcome(config, result.verdict.lower(), result.reason, result)
    return Outcome(config, "passed" if result.ok else "failed", result.reason, result)


def _refusal(e: BaseException) -> bool:
    """Our port's one-line refusal of a checkpoint it does not fully understand: a ValueError of a
    class the port defines (spec_parity.port.checkpoint.CheckpointError, spec_parity.port.dflash.DFlashError, ...)."""
    return isinstance(e, ValueError) and type(e).__module__.startswith("spec_parity.port.")


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


@dataclass
class Run:
    """What a fuzz run saw: every outcome, and the shrunk failure if one was found."""

    module: str
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    failure: Outcome | None = None
    seconds: float = 0.0
    streams: list[tuple[int, int]] = field(default_factory=list)   # (seed, examples) of each, --jobs > 1

    def counts(self) -> Counter:
        return Counter(o.end for o in self.outcomes)


def streams(seed: int, examples: int, jobs: int) -> list[tuple[int, int]]:
    """(seed, examples) of each of `jobs` independent draws that share the run's examples: the
    first draws the run's own seed (so --jobs 1 draws what the seed always drew), draw i > 0 the
    seed seed * 1000003 + i. A (seed, jobs) pair reproduces."""
    n = max(1, min(jobs, examples))
    return [(seed if i == 0 else seed * 1000003 + i, examples // n + (i < examples % n)) for i in range(n)]


def run_stream(args, selection: ports.Selection, stream: tuple[int, int]) -> Run:
    """One draw of a --jobs run, in its worker, under the run's --plant."""
    with controls.planted(*args.plant.split(":", 1)) if args.plant else nullcontext():
        return fuzz(args.module, stream[1], stream[0], selection, args.reference, args.shrink_s)


def fuzz_spread(args, prepare) -> Run:
    """`args.jobs` draws (`streams`), each fuzzed and shrunk in its own worker (`prepare()` -> a
    worker's run_stream); their outcomes in draw order, the failure the first draw's that found one."""
    t0, parts, draws = time.time(), {}, streams(args.seed, args.examples, args.jobs)
    for (stream,), done, error in runner.spread([[s] for s in draws], prepare, args.jobs):
        if error is not None:
            raise FuzzError(f"a fuzz worker died ({type(error).__name__}); --jobs 1 draws in this process")
        parts[stream] = done[0][0]
    ordered = [parts[s] for s in draws]
    run = Run(args.module, args.seed, [o for r in ordered for o in r.outcomes], streams=draws)
    run.failure = next((r.failure for r in ordered if r.failure), None)
    run.seconds = time.time() - t0
    return run


class _Stop(Exception):
    pass


def fuzz(module: str, examples: int, seed: int, selection: ports.Selection = ports.OURS_ONLY,
         reference: str | None = None, shrink_s: float = SHRINK_S) -> Run:
    """Draw `examples` configurations of `module` (seeded), stop at the first failure and shrink it."""
    from hypothesis import HealthCheck, Phase, assume, find, settings
    from hypothesis.errors import NoSuchExample

    family, refs = _references(module, reference)
    run, seen, t0 = Run(module, seed), {}, time.time()
    state = {"generated": 0, "shrink_from": None, "last_failure": None}

    def fails(config: Config) -> bool:
        if config.to_json() not in seen:
            seen[config.to_json()] = evaluate(config, selection)
            run.outcomes.append(seen[config.to_json()])
        outcome = seen[config.to_json()]
        assume(outcome.end not in ("invalid", "refused", "declined", "delta"))
        if outcome.end == "failed":
            state["last_failure"] = outcome
            state["shrink_from"] = state["shrink_from"] or time.time()
        elif state["shrink_from"] and time.time() - state["shrink_from"] > shrink_s:
            raise _Stop
        return outcome.end == "failed"

    opts = settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate, Phase.shrink],
                    suppress_health_check=list(HealthCheck))
    try:
        found = find(family.strategy(module, refs), fails, settings=opts, random=random.Random(seed))
        run.failure = seen[found.to_json()]
    except NoSuchExample:
        pass
    except _Stop:
        run.failure = state["last_failure"]
    run.seconds = time.time() - t0
    return run


def _references(module: str, reference: str | None):
    """The module's family and the references drawn from: `reference`, else every reference of
    the family that runs here; FuzzError where none does."""
    family = _families().get(module)
    if family is None:
        raise FuzzError(f"no config space for module {module!r}; fuzzable: {', '.join(modules())}")
    if reference is not None and reference not in family.references:
        raise FuzzError(f"{module}: reference {reference!r} is not fuzzed; one of {', '.join(family.references)}")
    refs = (reference,) if reference else family.references
    unavailable = {r: harness.pair(module).oracle_status(r) for r in refs}
    refs = tuple(r for r in refs if unavailable[r] is None)
    if not refs:
        raise FuzzError(f"{module}: no reference runs here: " + "; ".join(f"{r}: {s}" for r, s in unavailable.items()))
    return family, refs


def draw(module: str, examples: int, seed: int, refs: tuple[str, ...], wanted=lambda config: True) -> list[Config]:
    """`examples` distinct configurations of the module's space that are `wanted`, nothing run:
    hypothesis' generation seeded as fuzz() seeds it, so a seed draws the same configurations
    every time (fewer where the space holds fewer)."""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    drawn: dict[str, Config] = {}

    def keep(config: Config) -> bool:
        if wanted(config):
            drawn.setdefault(config.to_json(), config)
        if len(drawn) == examples:
            raise _Stop
        return False

    opts = settings(max_examples=20 * examples, database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))
    try:
        find(_families()[module].strategy(module, refs), keep, settings=opts, random=random.Random(seed))
    except (NoSuchExample, _Stop):
        pass
    return list(drawn.values())


@dataclass
class Measured:
    """Max |Δ| per budget quantity over fuzzed configurations (`spec-parity measure --fuzz`)."""

    module: str
    seed: int
    refs: tuple[str, ...]
    outcomes: list[Outcome] = field(default_factory=list)   # measured | invalid | refused | declined | error
    worst: dict[tuple[str, str], tuple[float, Config]] = field(default_factory=dict)  # (quantity, dtype): max, where
    seconds: float = 0.0

    def counts(self) -> Counter:
        return Counter(o.end for o in self.outcomes)

    def rows(self, budget_for=budgets.budget_for) -> list[tuple[str, str, float, float, Config]]:
        """(quantity, dtype, max |Δ|, the budget's atol, the configuration that gave the max)."""
        return [(q, dtype, v, budget_for(self.module, q, dtype).atol, config)
                for (q, dtype), (v, config) in sorted(self.worst.items())]

    def over(self, budget_for=budgets.budget_for) -> list[tuple[str, str, float, float, Config]]:
        """The rows whose max |Δ| exceeds the budget's atol."""
        return [r for r in self.rows(budget_for) if r[2] > r[3]]


def _budgeted(config: Config) -> bool:
    """A configuration a budget bounds: its case is L2 (an L1 case is held bit-exact)."""
    try:
        return case(config).tier == "L2"
    except (ValueError, KeyError, AssertionError):
        return True     # the factory's refusal, counted as invalid when measured


def measure(module: str, examples: int, seed: int, reference: str | None = None) -> Measured:
    """Draw `examples` L2 configurations (seeded) and measure our port on each against the live
    reference (harness.measure, as over seeds): the largest |Δ| per quantity and the configuration
    that gave it. A configuration the factory cannot build, the reference refuses or our port
    declines is counted apart; an error of our port is counted as one."""
    _, refs = _references(module, reference)
    run, t0 = Measured(module, seed, refs), time.time()
    for config in draw(module, examples, seed, refs, _budgeted):
        c = _prepared(config)
        if isinstance(c, Outcome):
            run.outcomes.append(c)
            continue
        try:
            values = harness.measure(c)
        except Exception as e:
            run.outcomes.append(Outcome(config, "declined" if _refusal(e) else "error", _line(e)))
            continue
        run.outcomes.append(Outcome(config, "measured"))
        for q, v in values.items():
            if v >= run.worst.get((q, c.dtype), (-1.0, None))[0]:
                run.worst[(q, c.dtype)] = (v, config)
    run.seconds = time.time() - t0
    return run


def measure_table(run: Measured) -> str:
    """What `measure --fuzz` prints: the counts, why configurations were skipped, and per quantity
    the max |Δ|, the budget's atol, their ratio and the configuration that gave the max."""
    n = run.counts()
    lines = [f"{run.module}: {len(run.outcomes)} configurations drawn (seed {run.seed}, references "
             f"{', '.join(run.refs)}) in {run.seconds:.0f} s: "
             + ", ".join(f"{n[k]} {k}" for k in ("measured", "error", "refused", "declined", "invalid") if n[k])]
    for end in ("error", "refused", "declined", "invalid"):
        reasons = Counter(_generic(o.detail) for o in run.outcomes if o.end == end)
        lines += [f"  {end} x{k} (skipped): {why}" for why, k in reasons.most_common(5)]
    lines.append(f"{'quantity':24s} {'dtype':8s} {'max |Δ|':>9s} {'atol':>8s} {'max/atol':>8s}  configuration")
    lines += [f"{q:24s} {dtype:8s} {v:9.2e} {atol:8.0e} {v / atol:8.2f}  {config.name}"
              for q, dtype, v, atol, config in run.rows()]
    for config in {r[4].name: r[4] for r in run.rows()}.values():
        lines.append(f"  {config.name}: {config.to_json()}")
    return "\n".join(lines)


def write_failure(outcome: Outcome, out: Path) -> Path:
    """The failing configuration as a case folder (`spec-parity export`'s layout: checkpoints,
    request, the reference's inputs and our port's outputs, where it ran) plus fuzz-config.json,
    the file the reproducing command reads."""
    c = case(outcome.config)
    ref, _, _ = harness.reference(c, "live")
    folder = Path(out) / c.module / re.sub(r"[^\w.+-]+", "-", c.name).strip("-")
    try:
        expected = harness.port_run(c, ref)
    except Exception:      # the failure is our port's error: the folder holds no outputs of ours
        expected = None
    exchange.write_case(harness.request(c, ref), folder, expected)
    (folder / "fuzz-config.json").write_text(outcome.config.to_json() + "\n")
    return folder


def _generic(detail: str) -> str:
    """A reason with the factory's cache paths cut to their kind, so equal reasons group."""
    return re.sub(r"\S*/checkpoints/([\w-]+?)-s\d+-[0-9a-f]{12}/", r"<\1>/", detail)


def summary(run: Run) -> str:
    n = run.counts()
    drawn = f"seed {run.seed}" + (f", {len(run.streams)} draws: seeds {', '.join(str(s) for s, _ in run.streams)}"
                                  if run.streams else "")
    lines = [f"{run.module}: {len(run.outcomes)} configurations in {run.seconds:.0f} s ({drawn}): "
             + ", ".join(f"{n[k]} {k}" for k in ("passed", "failed", "delta", "refused", "declined", "invalid") if n[k])]
    for end in ("refused", "declined", "delta"):
        reasons = Counter(_generic(o.detail) for o in run.outcomes if o.end == end)
        lines += [f"  {end} x{k}: {why}" for why, k in reasons.most_common(5)]
    if run.failure:
        r = run.failure.result
        lines.append(f"  shrunk failure: {run.failure.config.to_json()}")
        lines.append(f"  verdict: {r.verdict if r else '?'}: {(run.failure.detail or '')[:400]}")
    return "\n".join(lines)


def as_json(run: Run) -> dict:
    """Every outcome of a run (fuzz.json): the configuration, how it ended and why."""
    return {"module": run.module, "seed": run.seed, "seconds": round(run.seconds, 1), "counts": dict(run.counts()),
            "streams": [{"seed": s, "examples": n} for s, n in run.streams],
            "failure": json.loads(run.failure.config.to_json()) if run.failure else None,
            "outcomes": [{"config": json.loads(o.config.to_json()), "end": o.end, "detail": _generic(o.detail)}
                         for o in run.outcomes]}


def check_args(args) -> None:
    """`spec-parity fuzz`'s options, refused (FuzzError: one line, exit 2) before anything runs."""
    if args.module not in modules():
        raise FuzzError(f"--module {args.module}: no config space to fuzz; one of {', '.join(modules())}")
    if args.examples < 1:
        raise FuzzError(f"--examples {args.examples}: draw at least 1")
    if args.jobs < 1:
        raise FuzzError(f"--jobs {args.jobs}: at least 1 worker (1: one draw in this process)")
    if args.plant:
        module, _, key = args.plant.partition(":")
        try:
            controls.get(module, key)
        except controls.ControlError as e:
            raise FuzzError(f"--plant {args.plant}: {e}; give MODULE:KEY") from e


def command(args, selection: ports.Selection, prepare=None) -> int:
    """`spec-parity fuzz`: draw (or run --config again) under --plant, print the summary, write the
    shrunk failure's case folder and fuzz.json; 1 when a configuration failed. `prepare()` -> a
    worker's run_stream, for --jobs > 1."""
    if args.plant and not selection.port(args.module).ours:
        raise FuzzError(f"--plant {args.plant}: a control plants its bug in our own port; drop --port/--port-cmd "
                        "or --plant")
    with controls.planted(*args.plant.split(":", 1)) if args.plant else nullcontext():
        if args.config:
            config = _read_config(args.config, args.module)
            run = Run(config.module, args.seed, [evaluate(config, selection)])
            run.failure = run.outcomes[0] if run.outcomes[0].end == "failed" else None
        elif args.jobs > 1:
            run = fuzz_spread(args, prepare)
        else:
            run = fuzz(args.module, args.examples, args.seed, selection, args.reference, args.shrink_s)
        print(summary(run))
        if run.failure:
            folder = write_failure(run.failure, Path(args.out))
            print(f"  case folder: {folder}\n  reproduce: {reproduce(args, folder / 'fuzz-config.json')}")
    atomic_write(Path(args.out) / "fuzz.json", (json.dumps(as_json(run), indent=1, sort_keys=True) + "\n").encode())
    return 1 if run.failure else 0


def reproduce(args, config: Path) -> str:
    """The command that runs the written configuration again on the same port, plant included."""
    opts = [("--plant", args.plant), *(("--port", p) for p in args.port or ()), ("--port-cmd", args.port_cmd),
            ("--timeout", args.timeout), ("--port-id", args.port_id)]
    given = " ".join(f"{k} {shlex.quote(str(v))}" for k, v in opts if v is not None)
    return f"spec-parity fuzz --module {args.module} {given + ' ' if given else ''}--config {shlex.quote(str(config))}"


def _read_config(path: str, module: str) -> Config:
    try:
        config = Config.from_json(Path(path).read_text())
    except OSError as e:
        raise FuzzError(f"--config {path}: {e.strerror or e}; pass a fuzz-config.json a fuzz run wrote") from e
    if config.module != module:
        raise FuzzError(f"--config {path}: a {config.module} configuration; run it with --module {config.module}")
    return config

"""`spec-parity`: run the parity matrix, list cases and oracles, regenerate goldens, measure budgets."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import platform
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from . import cli_args, exchange, goldens, harness, ports, report, report_schema, runner
from .goldens import atomic_write


class BadInput(Exception):
    """A command-line input the run cannot use: one line naming it and the fix, exit 2."""


def _bad_input_errors() -> tuple[type[Exception], ...]:
    """What main() reports as bad input: the refusals of our loaders and readers. Only modules
    already imported are looked at (one that was not imported raised nothing)."""
    refusals = {"spec_parity.port.checkpoint": "CheckpointError", "spec_parity.port.ab": "PromptsError", "spec_parity.port.assistant": "DrafterError",
                "spec_parity.port.dspark": "DSparkError", "spec_parity.port.dflash": "DFlashError", "spec_parity.port.heads": "HeadError",
                "spec_parity.port.calibration": "ThresholdError", "spec_parity.port.targets": "TargetError",
                "spec_parity.bench.combine": "CombineError", "spec_parity.matrix": "MatrixError", "spec_parity.fuzz": "FuzzError", "spec_parity.bench.loops": "OptionError"}
    return (BadInput, *(getattr(sys.modules[m], n) for m, n in refusals.items() if m in sys.modules))


def _preflight(args, drafters: tuple[str, ...] = ()) -> None:
    """Checks every checkpoint directory the command names and --out before the first case runs
    (a bad --out was found only after the last case)."""
    from spec_parity.port import checkpoint

    if getattr(args, "target", None):
        checkpoint.check_dir(args.target, "--target", checkpoint.TARGETS)
    for opt in drafters:
        if getattr(args, opt, None):
            checkpoint.check_dir(getattr(args, opt), f"--{opt}",
                                 tuple(f for f in checkpoint.REQUIRED if f not in checkpoint.TARGETS))
    if getattr(args, "out", None):
        try:
            report.check_writable(Path(args.out))
        except OSError as e:
            raise BadInput(f"--out {args.out}: cannot be written ({e.strerror or e}); "
                           "give a folder you can write (it is created if missing)") from e


def _select(args, selection: ports.Selection = ports.OURS_ONLY) -> list:
    modules = [args.module] if getattr(args, "module", None) else list(harness.PAIRS)
    cases = harness.all_cases(modules, selection)
    if getattr(args, "target", None):
        from . import real

        try:
            cases = real.cases(args.target, getattr(args, "drafter", None), cases)
            real.check_pair(args.target, getattr(args, "drafter", None))
        except real.RealError as e:
            raise BadInput(str(e)) from e
        runnable = [c for c in cases if c.tier == "L3" or harness.pair(c.module).oracle_status(harness.oracle_name(c)) is None]
        for c in cases:
            if c not in runnable:
                print(f"skipped {c.id}: {harness.pair(c.module).oracle_status(harness.oracle_name(c))}", file=sys.stderr)
        cases = runnable
    elif getattr(args, "drafter", None):
        raise BadInput("--drafter DIR needs --target DIR (the target it drafts for)")
    if getattr(args, "case", None):
        cases = [c for c in cases if args.case in (c.name, c.golden_name)]
        if not cases and any(c.control and c.name == args.case for m in modules for c in harness.pair(m).cases()):
            raise BadInput(f"--case {args.case!r}: a negative control, which plants its bug in our own port, so it "
                           "runs only where our port answers; drop --port/--port-cmd, or name the case it controls")
        if not cases:
            raise _no_case(args.case)
    return cases


def _no_case(name: str) -> BadInput:
    return BadInput(f"--case {name!r}: no case of that name; `spec-parity list` shows them")


def _modules(args) -> tuple[list[str], str]:
    """The modules whose cases --module and --case select, whoever answers them, and the options
    that chose them (for a refusal's message)."""
    modules = [args.module] if args.module else list(harness.PAIRS)
    if args.case:
        modules = [m for m in modules if any(args.case in (c.name, c.golden_name) for c in harness.pair(m).cases())]
        if not modules:
            raise _no_case(args.case)
    by = " ".join(f"--{k} {v}" for k, v in (("module", args.module), ("case", args.case)) if v)
    return modules, by


def _header() -> str:
    import mlx.core as mx

    return (f"machine {goldens.machine_key()} ({platform.processor() or platform.machine()}), "
            f"python {platform.python_version()}, mlx {mx.__version__}")


def _ports(args, modules: list[str], selected_by: str) -> ports.Selection:
    """--port MODULE=SPEC and --port-cmd CMD: who answers the cases of `modules` (spec_parity.ports),
    refused before any case runs where a port the user named would not answer."""
    for opt, val in (("--timeout", f"{args.timeout:g}" if args.timeout is not None else None),
                     ("--port-id", args.port_id)):
        if val is not None and not args.port_cmd:
            raise BadInput(f"{opt} {val}: applies to --port-cmd only (an in-process --port runs in this process); "
                           f"give --port-cmd CMD or drop {opt}")
    try:
        ports.check(args.port, bool(args.port_cmd), modules, selected_by)
        cmd = exchange.command_port(args.port_cmd, exchange.TIMEOUT_S if args.timeout is None else args.timeout,
                                    args.port_id) if args.port_cmd else None
        return ports.configure(args.port, cmd, modules, selected_by)
    except ports.PortError as e:
        raise BadInput(str(e)) from e


def _answered(args, cases: list) -> None:
    """Every --port module still has a case once --target has narrowed the selection."""
    try:
        ports.check(args.port, False, {c.module for c in cases}, f"--target {args.target}")
    except ports.PortError as e:
        raise BadInput(str(e)) from e


def _error(case, e: Exception, debug: bool, port: ports.Port):
    """A case that could not run: ERROR with its reason, where in the port's code it was raised,
    and the traceback (report.json; printed under --debug)."""
    trace = "".join(traceback.format_exception(e))
    if debug:
        print(f"{case.id}: ERROR\n{trace}", file=sys.stderr)
    at = "" if isinstance(e, exchange.ExchangeError) else ports.where(port, e)
    reason = f"{type(e).__name__}: {e}" + (f" [at {at}]" if at else "")
    return harness.Result(case.module, case.name, "-", case.tier, verdict="ERROR", reason=reason, trace=trace)


def _prepare_run(args) -> tuple[ports.Selection, list]:
    """The run's ports and cases, as the parent and each worker (runner.py) build them."""
    selection = _ports(args, *_modules(args))
    cases = _select(args, selection)
    if args.target:
        _answered(args, cases)
    return selection, cases


def _run_one(args, selection: ports.Selection, case):
    try:
        return harness.evaluate(case, args.source, selection)
    except Exception as e:  # a case that cannot run is a failure with its reason, not a crash
        return _failed(args, selection, case, e)


def _failed(args, selection: ports.Selection, case, e: Exception):
    return _error(case, e, args.debug, selection.port(case.module))


def _worker(args):
    """A worker's runner of a case by its index in the selection, built as the parent builds it."""
    selection, cases = _prepare_run(args)
    return lambda i: _run_one(args, selection, cases[i])


def cmd_run(args) -> int:
    _preflight(args, ("drafter",))
    selection, cases = _prepare_run(args)
    t0, started = time.time(), datetime.datetime.now(datetime.timezone.utc)
    with report.Progress(len(cases)) as bar:
        results = runner.run(cases, functools.partial(_run_one, args, selection),
                             runner.workers(args.jobs, bool(args.target)), bar,
                             functools.partial(_worker, args), functools.partial(_failed, args, selection),
                             harness.affinity)
    rows = [(r, c.expect) for r, c in zip(results, cases)]
    header = f"{_header()}; ports: {selection.describe()}; {len(cases)} cases in {time.time() - t0:.1f} s"
    print(report.table(rows))
    out = Path(args.out)
    require = (args.require,) if args.require else ()
    report.write(out, rows, header, report_schema.run_info(args.argv, started, time.time() - t0, require),
                 report_schema.port_entries(selection, [c.module for c in cases]))
    print(runner.summary(rows, require, out, selection))
    return runner.exit_status(rows, require, selection)


def cmd_export(args) -> int:
    """Each case as a folder for a port in any language (spec_parity.exchange): the checkpoints,
    the inputs as safetensors, and in request.json the arrays to return with their shapes. A real
    checkpoint (--target, --drafter) has no goldens: its reference runs live."""
    _preflight(args, ("drafter",))
    args.source = args.source or ("live" if args.target else "golden")
    out = Path(args.out)
    cases = [c for c in _select(args) if not c.control]
    with report.Progress(len(cases)) as bar:
        for case in cases:
            bar.start(case.id)
            ref, _, _ = harness.reference(case, args.source)
            expected = harness.port_run(case, ref)
            folder = out / case.module / re.sub(r"[^\w.+-]+", "-", case.name).strip("-")
            exchange.write_case(harness.request(case, ref), folder, expected)
            bar.done(case.id, "written")
    print(f"{len(cases)} case folders in {out}/ (answer one with `CMD {{case}} {{out}}`, see docs/protocol.md)")
    return 0


def cmd_fuzz(args) -> int:
    """Draw configurations of one module, or run one again (spec_parity.fuzz.command)."""
    from . import fuzz

    fuzz.check_args(args)
    _preflight(args)
    return fuzz.command(args, _fuzz_ports(args), functools.partial(_fuzz_worker, args))


def _fuzz_ports(args) -> ports.Selection:
    return _ports(args, [args.module], f"--module {args.module}")


def _fuzz_worker(args):
    """A --jobs worker's runner of one draw, its ports built as the parent builds them."""
    from . import fuzz

    return functools.partial(fuzz.run_stream, args, _fuzz_ports(args))


def cmd_protocol(args) -> int:
    print(exchange.markdown())
    return 0


def cmd_list(args) -> int:
    for module in harness.PAIRS:
        p = harness.pair(module)
        print(f"{module}:")
        for name in sorted({harness.oracle_name(c) for c in p.cases()}):
            status = p.oracle_status(name)
            print(f"  oracle {name}: " + ("available here" if status is None else f"NOT available: {status}"))
        for c in p.cases():
            where = goldens.locate(c)
            golden = f"golden {where[0].relative_to(goldens.root())}" if where else "no golden"
            ctl = f"  [control: {c.control['what']}]" if c.control else ""
            print(f"  {c.id:44s} {c.tier}  {c.kind} seed={c.seed} {json.dumps(c.overrides)}  {golden}{ctl}")
    return 0


def cmd_regen(args) -> int:
    """Every golden the selection names, from its live reference; refused before the first one is
    written when a reference it needs cannot run here."""
    seen, cases = set(), []
    for case in _select(args):
        if not case.control and case.golden_name not in seen:
            seen.add(case.golden_name)
            cases.append(case)
    for case in cases:
        status = None if case.tier == "L3" and not harness.runs_live(case) else \
            harness.pair(case.module).oracle_status(harness.oracle_name(case))
        if status is not None:
            raise BadInput(f"{case.id}: its golden comes from {harness.oracle_name(case)}, which cannot run here "
                           f"({status}); no golden was written")
    for case in cases:
        print(f"{case.id}: {harness.regen(case)}")
    return 0


def cmd_measure(args) -> int:
    """Max |Δ| per quantity over seeds 0..N-1 of every non-control case: the numbers behind budgets.py.
    With --fuzz N, over N configurations drawn from the module's fuzz space instead."""
    if args.fuzz is not None:
        return _measure_fuzzed(args)
    for opt in ("seed", "reference"):
        if getattr(args, opt) is not None:
            raise BadInput(f"--{opt} {getattr(args, opt)}: applies to --fuzz N only; add --fuzz N or drop --{opt}")
    args.seeds = 5 if args.seeds is None else args.seeds
    _preflight(args, ("drafter",))
    worst: dict[str, float] = {}
    for case in _select(args):
        if case.control:
            continue
        for seed in range(args.seeds):
            for key, val in harness.measure(dataclasses.replace(case, seed=seed)).items():
                worst[key] = max(worst.get(key, 0.0), val)
    for k, v in sorted(worst.items()):
        print(f"{k:20s} {v:.2e}")
    return 0


def _measure_fuzzed(args) -> int:
    """`measure --fuzz N`: the budgets held to configurations no case uses. Exit 1 where a max |Δ|
    exceeds its budget's atol, a configuration raised an error in our port, or none was measured."""
    from . import fuzz

    if args.fuzz < 1:
        raise BadInput(f"--fuzz {args.fuzz}: draw at least 1 configuration")
    if not args.module or args.module not in fuzz.modules():
        raise BadInput(f"--fuzz needs --module with a fuzz space (--module {args.module or 'missing'}): one of "
                       f"{', '.join(fuzz.modules())}; measure any other module over seeds with --seeds N")
    for opt in ("case", "target", "drafter", "seeds"):
        if getattr(args, opt) is not None:
            raise BadInput(f"--{opt} {getattr(args, opt)}: --fuzz draws its own configurations; drop --{opt}")
    run = fuzz.measure(args.module, args.fuzz, args.seed or 0, args.reference)
    if not run.outcomes:
        raise BadInput(f"--module {args.module}" + (f" --reference {args.reference}" if args.reference else "")
                       + ": no L2 configuration to draw (an L1 reference is held bit-exact, no budget); "
                       "name an L2 reference or drop --reference")
    print(fuzz.measure_table(run))
    over, n = run.over(), run.counts()
    for q, dtype, v, atol, config in over:
        print(f"over budget: {q} ({dtype}) max |Δ| {v:.2e} > atol {atol:g} on {config.name}")
    if not n["measured"]:
        print("nothing measured: every configuration was skipped")
    return 1 if over or n["error"] or not n["measured"] else 0


def cmd_ab(args) -> int:
    """Paired drafter A/B through the serve loop at T=0: prints the report (JSON with --json).
    Exit 0 on PASS, 1 on FAIL."""
    from spec_parity.port import ab, checkpoint

    _preflight(args, ("a", "b"))
    if args.json:
        try:
            report.check_writable(Path(args.json).resolve().parent)
        except OSError as e:
            raise BadInput(f"--json {args.json}: its folder cannot be written ({e.strerror or e}); "
                           "give a path you can write") from e
    cfg = checkpoint.read_config(Path(args.target))
    prompts = ab.read_prompts(args.prompts, (cfg.get("text_config") or cfg).get("vocab_size"))
    a_results, b_results = ab.run_ab(args.target, args.a, args.b, prompts, gamma=args.gamma,
                                     max_tokens=args.max_tokens)
    verdict = ab.paired_verdict(a_results, b_results, max_drop_pts=args.max_drop_pts)
    text, doc = ab.render_report(Path(args.a).name, Path(args.b).name, verdict)
    print(f"{_header()}; target {Path(args.target).name}, {len(prompts)} prompts, "
          f"gamma {args.gamma or 'per drafter'}, max {args.max_tokens} tokens, T=0")
    print(text)
    if args.json:
        doc = {**doc, "target": str(args.target), "drafters": {"a": str(args.a), "b": str(args.b)},
               "gamma": args.gamma, "max_tokens": args.max_tokens,
               "prompts": {"a": [r.to_json() for r in a_results], "b": [r.to_json() for r in b_results]}}
        atomic_write(Path(args.json), (json.dumps(doc, indent=2) + "\n").encode())
        print(f"JSON report in {args.json}")
    return 0 if verdict.passed else 1


def cmd_bench(args) -> int:
    """Speed of the drafters side by side with the peers, against the bandwidth floor; figures are
    reported, never asserted. Writes OUT/bench.json, bench.md, bench.png (--serve: OUT/serve.json,
    serve.md, spec_parity/bench/loops.py). --out is checked before anything runs: a run that cannot
    be written is refused at once, not after its minutes of measuring."""
    _preflight(args)
    if args.serve:
        from .bench import loops

        return loops.main(args)
    import mlx.core as mx

    from . import bench
    from .bench import report as bench_report

    try:
        opts = cli_args.bench_options(args, mx.default_device().type == mx.DeviceType.gpu)
    except ValueError as e:
        raise BadInput(str(e)) from e
    try:
        doc = bench.run(opts, progress=lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True),
                        keep=lambda d: bench_report.keep(d, Path(args.out)))
    except ValueError as e:
        raise BadInput(str(e)) from e
    chart = {"auto": None, "matplotlib": True, "numpy": False}[args.chart]
    paths = bench_report.write(doc, Path(args.out), chart)
    print(bench_report.markdown(doc))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def cmd_combine(args) -> int:
    """One table from two or more bench runs (serve.json or bench.json): each run's figure, the
    median of the runs, and ratios given as a range where they moved more than their spread."""
    from .bench import combine

    _preflight(args)
    kind, runs = combine.load(args.runs)
    doc = combine.combine(kind, runs)
    print(combine.markdown(doc))
    if args.out:
        print("wrote " + ", ".join(str(p) for p in combine.write(doc, Path(args.out))))
    return 0


def cmd_bisect(args) -> int:
    """The first commit of a port's history that breaks one case (git bisect run). Exit 0 when
    one is named, 2 on bad input."""
    from . import bisect

    return bisect.bisect(args.repo, args.good, args.bad, args.case, args.port, args.pythonpath,
                         port_cmd=args.port_cmd, timeout=args.timeout)


def cmd_diff(args) -> int:
    """The verdict changes between two runs (spec_parity.diff): exit 1 on a regression."""
    from . import diff

    try:
        return diff.main(args.a, args.b)
    except diff.DiffError as e:
        raise BadInput(str(e)) from e


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM (a cancelled job) leaves through Python's cleanup as Ctrl-C does: a --port-cmd's
    process group is killed and its case folder removed. Main thread only (where signals land)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def cmd_matrix(args) -> int:
    """The support matrix from saved reports and/or ports run here; into --doc between its markers."""
    from . import matrix

    if not args.report and not args.port:
        raise matrix.MatrixError("nothing to tabulate: give --report DIR (a `spec-parity run --out` folder) "
                                 "or --port MODULE=SPEC")
    doc = Path(args.doc) if args.doc else None
    if doc is not None:
        if not doc.is_file():
            raise matrix.MatrixError(f"{doc}: no such file; --doc names a markdown file holding the matrix markers")
        try:
            matrix.into(doc.read_text(), {"tree": "-", "machine": "-", "rows": []})
        except matrix.MatrixError as e:
            raise matrix.MatrixError(f"{doc}: {e}") from e
    data = matrix.make(matrix.load([Path(p) for p in args.report or ()]) + matrix.run_ports(args.port or []),
                       ran_here=not args.report)
    if doc is None:
        print(matrix.render(data))
        return 0
    tmp = doc.with_name(f".{doc.name}.tmp")
    try:
        tmp.write_text(matrix.into(doc.read_text(), data))
        tmp.replace(doc)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"matrix of {len(data['rows'])} port x module rows written into {doc}")
    return 0


COMMANDS = (   # name ("GROUP NAME": a subcommand of GROUP), help, its arguments (cli_args), what runs it
    ("run", "run the parity matrix; non-zero exit on any unexpected verdict", cli_args.run, cmd_run),
    ("export", "write each case as a folder for an out-of-process port (--port-cmd)", cli_args.export, cmd_export),
    ("protocol", "print the port protocol (docs/protocol.md)", cli_args.none, cmd_protocol),
    ("list", "cases, goldens, and which oracles run here", cli_args.none, cmd_list),
    ("fixtures regen", "regenerate goldens from the live references (this machine's key only)", cli_args.regen,
     cmd_regen),
    ("measure", "measure cross-framework errors behind budgets.py", cli_args.measure, cmd_measure),
    ("ab", "paired drafter A/B through the serve loop at T=0 (exit 1 on FAIL); each arm any drafter family: "
     "assistant, DSpark, DFlash, DSpark-on-DFlash", cli_args.ab, cmd_ab),
    ("bench", "speed: our drafters vs the peers vs the bandwidth floor (JSON, Markdown, PNG)", cli_args.bench,
     cmd_bench),
    ("combine", "one table from two or more bench runs: each run's figure, the median of the runs, ratios as a "
     "range where they moved more than their spread", cli_args.combine, cmd_combine),
    ("bisect", "the first commit of a port's git history that breaks one case", cli_args.bisect, cmd_bisect),
    ("fuzz", "configurations no case uses: draw, run against the live reference, shrink a failure", cli_args.fuzz,
     cmd_fuzz),
    ("matrix", "the support matrix: ports x modules -> verdict counts and coverage", cli_args.matrix, cmd_matrix),
    ("diff", "verdict changes between two runs' report.json; exit 1 on a regression", cli_args.diff, cmd_diff),
)
GROUPS = {"fixtures": "goldens"}


def main(argv=None) -> int:
    ap = cli_args.parser(__doc__, COMMANDS, GROUPS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    try:
        with _sigterm_exits():
            return args.fn(args)
    except Exception as e:
        if args.debug or not isinstance(e, _bad_input_errors()):
            raise
        print(f"spec-parity {args.cmd}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The command line's arguments: one function per subcommand that adds its options to its parser,
parser() that builds the whole command line from spec_parity.cli's table of subcommands, and
bench_options(), the bench's Options as its arguments resolve."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence

from . import compare, exchange, harness, runner

DEBUG = dict(action="store_true", help="on bad input, the traceback instead of the one-line message "
             "(default: off, the one line and exit 2); `run`: also each ERROR case's traceback (report.json "
             "holds it either way)")

_PORT_OPTIONS = {   # who answers the cases: `run` and `fuzz` take the same
    "--port": dict(action="append", metavar="MODULE=SPEC",
                   help="run MODULE's cases on another port: SPEC is pkg.module:make_port or a name registered "
                        "in the spec_parity.ports entry points (repeatable: one per module, each a "
                        "module the run selects; default: our own ports)"),
    "--port-cmd": dict(metavar="CMD", help='a port in any language: run CMD per case, e.g. '
                       '"./my-port {case} {out}" (the file protocol, docs/protocol.md); it answers every module the '
                       'run selects, so it does not combine with --port (default: none)'),
    "--timeout": dict(type=float, metavar="S", help="--port-cmd: seconds a case may take before its "
                      f"process group is killed and the case reads ERROR (default: {exchange.TIMEOUT_S:g})"),
    "--port-id": dict(metavar="NAME", help="--port-cmd: the port's name in the report (default: "
                      "port-cmd; its identity also hashes every argument of CMD that is a file)"),
}


def parser(description: str, commands: Sequence[tuple[str, str, Callable, Callable]],
           groups: Mapping[str, str]) -> argparse.ArgumentParser:
    """A subparser per row of `commands` (name, help, its arguments, what runs it); a name "GROUP
    NAME" is a subcommand of GROUP, whose own help `groups` gives."""
    ap = argparse.ArgumentParser(prog="spec-parity", description=description)
    ap.add_argument("--debug", **DEBUG)
    sub = ap.add_subparsers(dest="cmd", required=True)
    nested: dict[str, argparse._SubParsersAction] = {}
    for name, help_text, arguments, fn in commands:
        group, _, name = name.rpartition(" ")
        if group and group not in nested:
            nested[group] = sub.add_parser(group, help=groups[group]).add_subparsers(dest=f"{group}_cmd", required=True)
        p = (nested[group] if group else sub).add_parser(name, help=help_text)
        arguments(p)
        p.set_defaults(fn=fn)
    return ap


def debug(p: argparse.ArgumentParser) -> None:
    """--debug after the subcommand too (it keeps the one given before it when left out)."""
    p.add_argument("--debug", default=argparse.SUPPRESS, **DEBUG)


def none(p: argparse.ArgumentParser) -> None:
    """A subcommand with no options of its own."""


def run(p: argparse.ArgumentParser) -> None:
    """`spec-parity run`: which cases, against what, on whose port, and what a pass must have checked."""
    p.description = ("Run the parity matrix: each case's port against its reference at its tier. Exit 0 "
                     "when every verdict is as expected (controls must FAIL) and every check ran, 4 when as "
                     "expected but a plug-in port's pass left checks unrun (PASS-PARTIAL; see --require), 1 "
                     "otherwise (or when a plug-in port answered no case), 2 on bad input (a one-line message "
                     "naming it and the fix).")
    p.add_argument("--module", choices=harness.PAIRS,
                   help="only this module's cases (default: every module)")
    p.add_argument("--case", help="only the case of this name, or the cases sharing this golden "
                   "(default: every case; `spec-parity list` names them)")
    p.add_argument("--out", default="parity-report",
                   help="folder for report.md, report.html, report.json, layers-MODULE.png; created if missing, checked "
                   "writable before the first case, earlier report files replaced (default: parity-report)")
    p.add_argument("--source", choices=("auto", "live", "golden"), default="auto",
                   help="reference outputs: live oracle, stored goldens, or live where available "
                   "(default: auto)")
    p.add_argument("--target", help="a real target checkpoint directory: the cases that apply to it (and to "
                   "--drafter), live references only (default: none, the built-in tiny checkpoints)")
    p.add_argument("--drafter", help="a real drafter checkpoint directory: its family (assistant, DSpark, DFlash, "
                   "DSpark-on-DFlash) is read off its config.json (default: none, the target's own cases)")
    for opt in ("--port", "--port-cmd", "--timeout", "--port-id"):
        p.add_argument(opt, **_PORT_OPTIONS[opt])
    p.add_argument("--jobs", type=_jobs, default=runner.AUTO,
                   help="worker processes the cases are spread over, a case and its controls in one (default: "
                   "auto, one a core, or one with --target; 1: every case in this process)")
    p.add_argument("--require", choices=("outputs", "internals"),
                   help="what a pass must have checked. A PASS-PARTIAL (a port that passed every check it "
                   "exposed arrays for, but left optional quantities out, so some checks did not run) is "
                   f"counted apart and the run exits {compare.PARTIAL_EXIT} (not green) by default; outputs: it "
                   "counts as a pass, exit 0; internals: it is an unexpected verdict, exit 1")
    debug(p)


def export(p: argparse.ArgumentParser) -> None:
    """`spec-parity export`: the cases written as folders for an out-of-process port."""
    p.add_argument("--module", choices=harness.PAIRS)
    p.add_argument("--case")
    p.add_argument("--source", choices=("auto", "live", "golden"),
                   help="the reference arrays fed to the port (default: golden; live with --target)")
    p.add_argument("--target", help="a real target checkpoint directory: its cases, as `run --target` selects them "
                   "(default: none, the built-in tiny checkpoints)")
    p.add_argument("--drafter", help="with --target: a real drafter checkpoint directory (default: none)")
    p.add_argument("--out", required=True, help="directory: OUT/<module>/<case>/")


def fuzz(p: argparse.ArgumentParser) -> None:
    """`spec-parity fuzz`: the module, how many configurations, the seed, and whose port."""
    from .fuzz import SHRINK_S

    p.description = ("Draw configurations no built-in case uses from a module's config space (hypothesis), run "
                     "the port against the live reference at the pair's tier, and shrink the first failure to a "
                     "minimal configuration, written as a case folder with the command that reproduces it. "
                     "Configurations a reference refuses are counted apart. Exit 0: no failure; 1: a failure "
                     "(written under --out); 2: bad input.")
    p.add_argument("--module", required=True, help="the module whose config space is drawn")
    p.add_argument("--examples", type=int, default=50, help="configurations to draw (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed: a run reproduces (default: 0)")
    p.add_argument("--reference", help="only this reference (default: every reference of the module that runs here)")
    p.add_argument("--config", metavar="FILE", help="run one configuration again: a fuzz-config.json a failure "
                   "wrote (default: draw)")
    p.add_argument("--jobs", type=int, default=1, help="independent draws sharing --examples, each fuzzed and shrunk "
                   "in its own worker process: the first draws --seed, so 1 draws what the seed always drew "
                   "(default: 1)")
    p.add_argument("--shrink-s", type=float, default=SHRINK_S, metavar="S",
                   help=f"seconds shrinking may take; then the smallest failure so far is kept (default: {SHRINK_S:g})")
    p.add_argument("--out", default="fuzz-report", help="folder for the shrunk failure's case folder and "
                   "fuzz.json (default: fuzz-report)")
    p.add_argument("--plant", metavar="MODULE:KEY", help="a negative control (spec_parity/controls) planted in our "
                   "port for the whole run: the fuzzer's own check that it finds a bug (default: none)")
    for opt in ("--port", "--port-cmd", "--timeout", "--port-id"):
        p.add_argument(opt, **_PORT_OPTIONS[opt])
    debug(p)


def regen(p: argparse.ArgumentParser) -> None:
    """`spec-parity fixtures regen`: the goldens of the selected cases."""
    p.add_argument("--module")
    p.add_argument("--case")


def measure(p: argparse.ArgumentParser) -> None:
    """`spec-parity measure`: the cases whose errors are measured over seeds, or --fuzz N drawn
    configurations."""
    p.description = ("Max |Δ| per budget quantity of our port against the live references: over seeds of the "
                     "built-in cases, or (--fuzz N) over N configurations drawn from the module's fuzz space, "
                     "each quantity beside its budget (exit 1 where one exceeds it). 2 on bad input.")
    p.add_argument("--module")
    p.add_argument("--case")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 of every non-control case (default: 5)")
    p.add_argument("--fuzz", type=int, metavar="N", help="measure N configurations drawn from the module's fuzz "
                   "space instead (`spec-parity fuzz`'s spaces; default: off)")
    p.add_argument("--seed", type=int, help="--fuzz: the draw's seed, the same configurations every time (default: 0)")
    p.add_argument("--reference", help="--fuzz: only this reference (default: every reference of the module that "
                   "runs here; only L2 configurations are drawn, an L1 one is held bit-exact)")
    p.add_argument("--target", help="a real target checkpoint directory: measure the cases that apply to it, "
                   "as `run --target` (the seed then moves the prompt only)")
    p.add_argument("--drafter", help="a real drafter checkpoint directory, as `run --drafter`")


def ab(p: argparse.ArgumentParser) -> None:
    """`spec-parity ab`: the two drafters, their prompts, and the acceptance drop that still passes."""
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--a", required=True, help="drafter A checkpoint directory (the baseline)")
    p.add_argument("--b", required=True, help="drafter B checkpoint directory (the candidate)")
    p.add_argument("--prompts", required=True,
                   help="one prompt per line as whitespace-separated token ids (# comments, blank lines skipped)")
    p.add_argument("--gamma", type=int, help="draft tokens per round (default: each block drafter's trained "
                   "block, 4 for the assistant)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-drop-pts", type=float, default=3,
                   help="largest acceptance drop of B vs A, absolute points, that still passes")
    p.add_argument("--json", help="also write the report (with per-prompt results) to this JSON file")
    debug(p)


def bench(p: argparse.ArgumentParser) -> None:
    """`spec-parity bench`: the sides, shapes and counts of a speed run (and `--serve`'s)."""
    p.add_argument("--shapes", choices=("tiny", "real"), default="tiny",
                   help="tiny: the factory's checkpoints; real: the real shapes of docs/references.md, random weights in memory")
    p.add_argument("--sources", default=",".join(("assistant", "dspark", "dflash")),
                   help="comma-separated draft sources (assistant, dspark, dflash)")
    p.add_argument("--peers", default="auto", help="auto (every other side of a source), none, or a comma list "
                   "of sides: our port's other paths (port-plain, port-sdpa, port-kernel, ...) and the peers "
                   "(optiq, zlab-mlx, dspark-mlx, ...); docs/bench.md says what each is, and a wrong name is "
                   "answered with the whole list")
    p.add_argument("--case", help="only these cases (comma-separated names, see bench.md)")
    p.add_argument("--warmup", type=int, help="untimed runs first (default 3 tiny, 10 real)")
    p.add_argument("--iters", type=int, help="timed runs (default 15 tiny, 40 real)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weights and activations (default float32 tiny, bfloat16 real)")
    p.add_argument("--ctx", type=int, help="context length: donor K/V / context rows (default 24 tiny, 2048 real)")
    p.add_argument("--scale", type=int, default=1,
                   help="real only: divide widths, vocabulary, windows and context by N (to run the path on a CPU)")
    p.add_argument("--target-layers", type=int,
                   help="depth of the real shapes' stand-in target (default: Qwen3-4B 36, Gemma-4 6)")
    p.add_argument("--gamma", type=int, default=4, help="assistant: chained draft steps per call and per round")
    p.add_argument("--max-tokens", type=int, help="serve loop: tokens per request (default 16 tiny, 32 real)")
    p.add_argument("--serve-runs", type=int, default=3, help="serve loop: timed requests (after one warm-up)")
    p.add_argument("--bw-mib", type=int, help="bandwidth buffer in MiB (default 1024 on a GPU, 256 on CPU)")
    p.add_argument("--torch-device", choices=("auto", "cuda", "cpu", "none"), default="auto",
                   help="torch references: auto = on CUDA if torch sees one, else skipped with the reason")
    p.add_argument("--chart", choices=("auto", "matplotlib", "numpy"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", action="store_true",
                   help="also record every GPU kernel of each side's step (CUPTI through torch.profiler; CUDA only)")
    p.add_argument("--serve", action="store_true",
                   help="decode tokens/s of our serve loop vs each peer's own loop and plain decode, fresh requests "
                   "(writes serve.json, serve.md; docs/bench.md)")
    p.add_argument("--prompt-len", type=int, default=2048, help="--serve: prompt tokens of a request (default 2048)")
    p.add_argument("--new-tokens", type=int, default=128, help="--serve: tokens decoded per request (default 128)")
    p.add_argument("--runs", type=int, default=3, help="--serve: timed requests per side, each fresh (default 3)")
    p.add_argument("--agree-frac", type=float, default=0.8,
                   help="--serve: share of the tokens the agreeing drafters propose right (default 0.8)")
    p.add_argument("--conditions", default="random,agreeing",
                   help="--serve: random (random drafters, tau ~ 1), agreeing (controlled tau, tiny float32), "
                   "agreeing-real (DFlash, the assistant and DSpark at real widths, tau set by --tau)")
    p.add_argument("--tau", default="2,4,max", help="--serve agreeing-real: tau per case, 1..max or max, each family's own: DFlash 16, "
                   "DSpark 8, the assistant --gamma + 1 (default 2,4,max)")
    p.add_argument("--out", required=True, help="directory for bench.json, bench.md, bench.png")


def combine(p: argparse.ArgumentParser) -> None:
    """`spec-parity combine`: the runs to combine."""
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a run's serve.json or bench.json, or the --out folder holding it (two or more, one tree)")
    p.add_argument("--out", help="folder for combined.json and combined.md (default: print the table only)")
    debug(p)


def bisect(p: argparse.ArgumentParser) -> None:
    """`spec-parity bisect`: the port's repository, the revisions and the case."""
    p.add_argument("--repo", required=True, help="the port's git repository (its work tree and index are not touched)")
    p.add_argument("--good", required=True, help="a revision where the case's verdict is as expected")
    p.add_argument("--bad", required=True, help="a later revision where it is not")
    p.add_argument("--case", required=True, help="the case (see `spec-parity list`), judged against its golden")
    p.add_argument("--port", action="append", help="passed verbatim to `spec-parity run --port` (repeatable)")
    p.add_argument("--port-cmd", metavar="CMD", help="passed to `spec-parity run --port-cmd`, run in each "
                   "revision's checkout (relative paths are the repository's)")
    p.add_argument("--timeout", type=float, metavar="S", help="passed to `spec-parity run --timeout` "
                   f"(default: {exchange.TIMEOUT_S:g})")
    p.add_argument("--pythonpath", help="the repository's folder that goes first on PYTHONPATH (default: its root)")


def matrix(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", action="append", metavar="DIR", help="a `spec-parity run --out` folder or its "
                   "report.json (repeatable)")
    p.add_argument("--port", action="append", metavar="MODULE=SPEC", help="run this port over MODULE's golden "
                   "cases first (repeatable)")
    p.add_argument("--doc", help="write the table into this markdown file between its <!-- matrix:begin --> and "
                   "<!-- matrix:end --> lines (default: print it)")


def diff(p: argparse.ArgumentParser) -> None:
    """`spec-parity diff`: the two runs."""
    p.description = ("The verdict changes between two runs, case by case: regressions, fixed, changed, new, "
                     "removed. Exit 1 on a regression (a case as expected in A and not in B), 0 otherwise, 2 on "
                     "a path holding no report.json of the schema this version reads (docs/report-schema.md).")
    p.add_argument("a", metavar="A", help="the baseline: a `spec-parity run --out` folder or its report.json")
    p.add_argument("b", metavar="B", help="the candidate, likewise")
    debug(p)


def bench_options(args: argparse.Namespace, gpu: bool):
    """`bench`'s Options from its arguments: the defaults that follow --shapes and the device
    (`gpu`) filled in, the comma lists checked; ValueError (bad input) for what it cannot run."""
    from .bench import Options, runner, shapes

    real = args.shapes == "real"
    if args.scale < 1 or (args.scale > 1 and not real):
        raise ValueError("--scale N (N >= 1) shrinks the real shapes (widths, vocabulary, windows, context); "
                         "it applies to --shapes real only")
    peers = None if args.peers == "auto" else [] if args.peers == "none" else _csv(args.peers, runner.OTHERS, "peers")
    opts = Options(
        shapes=args.shapes, sources=tuple(_csv(args.sources, shapes.SOURCES, "sources")), peers=peers,
        warmup=args.warmup if args.warmup is not None else (10 if real else 3),
        iters=args.iters if args.iters is not None else (40 if real else 15),
        dtype=args.dtype or ("bfloat16" if real else "float32"), ctx=args.ctx, scale=args.scale,
        target_layers=args.target_layers, gamma=args.gamma,
        max_tokens=args.max_tokens or (32 if real else 16), serve_runs=args.serve_runs,
        bw_bytes=(args.bw_mib or (1024 if gpu else 256)) << 20, torch_device=args.torch_device,
        cases=[c for c in (args.case or "").split(",") if c] or None, seed=args.seed, kernels=args.kernels,
        argv=list(args.argv))
    if opts.iters < 1 or opts.warmup < 0 or opts.serve_runs < 1:
        raise ValueError("--iters and --serve-runs must be >= 1 and --warmup >= 0")
    return opts


def _csv(text: str, known, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise ValueError(f"--{what} {text!r}: unknown {bad or 'empty list'}; known: {', '.join(known)}")
    return items


def _jobs(value: str) -> int | str:
    try:
        return runner.jobs(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from e

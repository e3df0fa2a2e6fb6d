"""Running a selection of cases, in this process or spread over worker processes (`--jobs`), and
what the run comes to (its closing lines and exit status).

A case and its negative controls read one reference run (spec_parity/shared.py keys it by the
manifest they share), so they go to one worker together, as do the cases a pair says share a
port run (Pair.affinity); the groups go out largest first (the sampled cases: a thousand
requests a side), each worker taking the next group as it finishes one. Workers are spawned (a forked MLX or torch process may hang on its threads) and build their
own selection from the command line, as the parent did. The results come back in the
selection's order, whatever order they finished in.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
from collections.abc import Callable

from . import compare, report_schema

AUTO = "auto"


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def jobs(value: str) -> int | str:
    """--jobs checked: a positive count, or "auto" (`workers`)."""
    if value == AUTO:
        return AUTO
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--jobs {value}: expected a positive number of worker processes or {AUTO!r}")
    return n


def workers(n_jobs: int | str, real: bool) -> int:
    """"auto": one worker a core on the built-in tiny checkpoints, one on a real checkpoint (each
    worker would hold its own copy of the model)."""
    return n_jobs if n_jobs != AUTO else 1 if real else cores()


def groups(cases: list, affinity: Callable) -> list[list[int]]:
    """Indices of the cases of one `affinity(case)` (a case and its controls, which share a reference
    run: Pair.affinity), the sampled groups first, then in selection order."""
    by: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        by.setdefault((c.module, affinity(c)), []).append(i)
    return sorted(by.values(), key=lambda g: (cases[g[0]].params.KIND != "sampled", g[0]))


# A worker's function of one item, built once per process by `_start` from the picklable `prepare`
# the parent hands down (the parent's own is not sent: a plug-in port's loaded modules need not pickle).
_WORKER: dict = {}


def _start(prepare: Callable) -> None:
    _WORKER["fn"] = prepare()


def _run_group(items: list) -> list[tuple[object, float]]:
    out = []
    for item in items:
        t0 = time.time()
        out.append((_WORKER["fn"](item), time.time() - t0))
    return out


def spread(item_groups: list[list], prepare: Callable, n_jobs: int):
    """Each group's items through `prepare()`'s function in spawned workers, a group in one worker,
    the groups in the order given; yields (group, [(result, seconds)], None) as each finishes, or
    (group, None, error) for the groups left unfinished when a worker died (the pool dies with it)."""
    with cf.ProcessPoolExecutor(n_jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                                initargs=(prepare,)) as pool:
        pending = {pool.submit(_run_group, g): g for g in item_groups}
        for future in cf.as_completed(pending):
            try:
                yield pending[future], future.result(), None
            except Exception as e:
                yield pending[future], None, e


def run(cases: list, run_one: Callable, n_jobs: int, bar, prepare: Callable, failed: Callable,
        affinity: Callable) -> list:
    """Each case's result, in order. `run_one(case)` -> Result (a case that raises is its own
    ERROR there); `prepare()` -> a worker's run_one of a case's index, built in the worker;
    `failed(case, error)` -> the Result of a case that did not finish because a worker died;
    `affinity(case)`: the cases that go to one worker together (`groups`)."""
    gs = groups(cases, affinity)
    if n_jobs <= 1 or len(gs) <= 1:
        results = []
        for case in cases:
            bar.start(case.id)
            results.append(run_one(case))
            bar.done(case.id, results[-1].shown_verdict)
        return results
    results: list = [None] * len(cases)
    bar.start(f"{min(n_jobs, len(gs))} workers")
    for group, done, error in spread(gs, prepare, min(n_jobs, len(gs))):
        if error is not None:
            error = RuntimeError(f"a worker process died before this case finished ({type(error).__name__}); "
                                 "--jobs 1 runs every case in one process and names the one that kills it")
            done = [(failed(cases[i], error), 0.0) for i in group]
        for i, (result, seconds) in zip(group, done):
            results[i] = result
            bar.done(cases[i].id, result.shown_verdict, seconds)
    return results


def unexpected(rows: list, require: tuple[str, ...]) -> list:
    """Results whose verdict is not the case's expected one (a DELTA or a decline is counted apart)."""
    return [r for r, e in rows if r.verdict not in ("DELTA", "DECLINED") and not compare.as_expected(r.verdict, e, require)]


def silent_ports(rows: list, selection) -> list[str]:
    """The plug-in ports `selection` chose that answered none of the run's cases (each declined, or
    none of their modules' cases selected): a run that checked nothing of the user's port."""
    theirs = sorted({selection.port(m).identity for m in selection.theirs()})
    answered = {r.metrics.get("port", {}).get("identity") for r, _ in rows if r.verdict != "DECLINED"}
    return [p for p in theirs if p not in answered]


def summary(rows: list, require: tuple[str, ...], out, selection) -> str:
    """The run's closing lines: verdicts as expected, the ones counted apart, every unexpected
    one's message, and a line per plug-in port that checked nothing."""
    bad = unexpected(rows, require)
    seen = {id(r) for r in bad}
    apart = {v: [r for r, _ in rows if r.verdict == v and id(r) not in seen] for v in (compare.PARTIAL, "DELTA", "DECLINED")}
    tally = report_schema.tally([{"category": report_schema.category(r.verdict, e, require)} for r, e in rows])
    lines = [f"\n{tally}; reports in {out}/"]
    lines += [r.message() for r in bad + apart["DELTA"] + apart["DECLINED"]]
    lines += [f"[{r.verdict}] {r.module}/{r.case}: {r.reason}" for r in apart[compare.PARTIAL]]
    lines += [f"port {p} checked nothing: it answered none of the {len(rows)} cases run (each declined, or none "
              f"of its module's cases selected); not a pass" for p in silent_ports(rows, selection)]
    return "\n".join(lines)


def exit_status(rows: list, require: tuple[str, ...], selection) -> int:
    """1 on any unexpected verdict, or when a plug-in port checked nothing; compare.PARTIAL_EXIT when a
    pass left checks unrun and the run does not accept it; else 0."""
    if unexpected(rows, require) or silent_ports(rows, selection):
        return 1
    partial = any(r.verdict == compare.PARTIAL for r, _ in rows)
    return compare.PARTIAL_EXIT if partial and "outputs" not in require else 0

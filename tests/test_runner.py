"""spec_parity/runner.py: cases spread over worker processes, a case with its controls, the
results in the selection's order; a worker that dies leaves errors, not lost cases."""

import json
from types import SimpleNamespace

import pytest
import runner_workers

from spec_parity import cli, harness, runner


class Bar:
    def __init__(self):
        self.done_ids = []

    def start(self, label):
        pass

    def done(self, label, verdict, seconds=None):
        self.done_ids.append(label)


def test_a_case_and_its_controls_are_one_group_and_the_sampled_go_first():
    cases = harness.all_cases(["assistant", "dspark"])
    gs = runner.groups(cases, harness.affinity)
    assert sorted(i for g in gs for i in g) == list(range(len(cases)))
    where = {i: n for n, g in enumerate(gs) for i in g}
    names = {(c.module, c.name): i for i, c in enumerate(cases)}
    for i, c in enumerate(cases):
        if c.control:
            assert where[i] == where[names[(c.module, c.control["base"])]], c.id
    kinds = [cases[g[0]].params.KIND for g in gs]
    assert kinds[:2] == ["sampled", "sampled"] and "sampled" not in kinds[2:]


def test_a_dflash_torch_twin_goes_with_its_mlx_case():
    """The z-lab MLX and torch twins of a Qwen3 loop share one port run in a process
    (drafters/dflash/adapter.py run_loop): one group, so one worker runs it once."""
    cases = harness.all_cases(["dflash"])
    where = {c.name: n for n, g in enumerate(runner.groups(cases, harness.affinity)) for i in g for c in [cases[i]]}
    twins = [c.name for c in cases if c.name.endswith("-torch")]
    assert "loop-agree-qwen3-bs16-torch" in twins
    for name in twins:
        assert where[name] == where[name.removesuffix("-torch")], name
    assert where["loop-qwen3"] != where["loop-gemma4"]


def test_a_worker_that_dies_is_an_error_not_a_lost_case():
    bar = Bar()
    failed = {}
    results = runner.run(runner_workers.CASES, runner_workers.run_one, 2, bar, runner_workers.prepare,
                         lambda case, e: failed.setdefault(case.name, str(e)) and
                         SimpleNamespace(shown_verdict="ERROR", name=case.name), runner_workers.affinity)
    assert [r.name for r in results] == [c.name for c in runner_workers.CASES]
    assert "dies" in failed and "--jobs 1" in failed["dies"]
    ran = {r.name: r.pid for r in results if getattr(r, "pid", None)}
    assert set(ran) | set(failed) == {c.name for c in runner_workers.CASES}
    assert "a" not in ran or ran["a"] == ran["a-control"]      # a case and its control: one worker
    assert sorted(bar.done_ids) == sorted(c.id for c in runner_workers.CASES)


@pytest.mark.slow
def test_spread_over_workers_the_report_is_the_one_process_report(tmp_path):
    reports = {}
    for jobs in ("1", "2"):
        assert cli.main(["run", "--module", "targets", "--jobs", jobs, "--out", str(tmp_path / jobs)]) == 0
        rows = json.loads((tmp_path / jobs / "report.json").read_text())["results"]
        reports[jobs] = [(r["case"], r["verdict"], r["checks_run"], r["metrics"].get("logits")) for r in rows]
    assert reports["1"] == reports["2"]


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_bad_jobs_value_exits_2(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--jobs", value])
    assert e.value.code == 2
    assert "--jobs: expected a positive number of worker processes or 'auto'" in capsys.readouterr().err

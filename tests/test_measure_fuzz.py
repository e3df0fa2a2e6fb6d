"""`spec-parity measure --fuzz`: a fixed-seed sample of each affordable family's config space held
to budgets.py through the measurement `measure` takes over seeds (harness.measure); the check must
be able to fail: a bug planted in our port from outside it, and a budget table scaled down, are
both flagged. Misuse is one line and exit 2."""

import pytest

from spec_parity import budgets, cli, controls, fuzz

# (module, reference, configurations): a few seconds each on a 2-core machine.
SAMPLES = [("assistant", "transformers", 24), ("targets", "transformers", 12)]


@pytest.mark.oracle
@pytest.mark.parametrize("module, reference, n", SAMPLES, ids=[m for m, _, _ in SAMPLES])
def test_a_fuzzed_sample_holds_to_the_budgets(live_oracle, module, reference, n):
    live_oracle(module, reference)
    run = fuzz.measure(module, n, seed=0, reference=reference)
    table = fuzz.measure_table(run)
    assert run.counts()["measured"] >= n // 2 and not run.counts()["error"], table
    assert run.over() == [], table

    def scaled(*key):      # the comparison itself can fail: the same measurements, a table at a thousandth
        return budgets.Budget(0.0, budgets.budget_for(*key).atol / 1000)

    assert {q for q, *_ in run.over(scaled)} == {q for q, *_ in run.rows()}, table


# A bug planted in our port for the whole sample (spec_parity/drafters/*/controls.py): some quantity
# must go over its budget.
PLANTED = [("assistant", "transformers", "scale"), ("targets", "transformers", "rope-L1")]


@pytest.mark.oracle
@pytest.mark.parametrize("module, reference, key", PLANTED, ids=[f"{m}-{k}" for m, _, k in PLANTED])
def test_a_planted_bug_goes_over_a_budget(live_oracle, module, reference, key):
    live_oracle(module, reference)
    with controls.planted(module, key):
        run = fuzz.measure(module, 4, seed=0, reference=reference)
    assert run.over(), fuzz.measure_table(run)


@pytest.mark.oracle
def test_the_command_prints_each_quantity_beside_its_budget(live_oracle, capsys):
    live_oracle("targets")
    assert cli.main(["measure", "--module", "targets", "--fuzz", "2", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "targets: 2 configurations drawn (seed 0" in out and "max/atol" in out
    assert f"{budgets.budget_for('targets', 'logits').atol:8.0e}" in out


def test_a_seed_draws_the_same_configurations():
    first = fuzz.draw("targets", 5, 3, ("transformers",))
    assert [c.to_json() for c in first] == [c.to_json() for c in fuzz.draw("targets", 5, 3, ("transformers",))]
    assert len({c.to_json() for c in first}) == 5
    assert [c.to_json() for c in first] != [c.to_json() for c in fuzz.draw("targets", 5, 4, ("transformers",))]


@pytest.mark.parametrize("argv, message", [
    (["--module", "targets", "--fuzz", "0"], "--fuzz 0: draw at least 1 configuration"),
    (["--fuzz", "3"], "--fuzz needs --module with a fuzz space (--module missing)"),
    (["--module", "targets", "--fuzz", "3", "--case", "qwen3"], "--case qwen3: --fuzz draws its own configurations"),
    (["--module", "targets", "--fuzz", "3", "--seeds", "5"], "--seeds 5: --fuzz draws its own configurations"),
    (["--module", "targets", "--seed", "1"], "--seed 1: applies to --fuzz N only"),
    (["--module", "targets", "--fuzz", "3", "--reference", "optiq"], "reference 'optiq' is not fuzzed"),
])
def test_misuse_is_one_line_and_exit_2(capsys, argv, message):
    assert cli.main(["measure", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.oracle
def test_a_reference_held_bit_exact_has_nothing_to_measure(live_oracle, capsys):
    live_oracle("assistant", "optiq")
    assert cli.main(["measure", "--module", "assistant", "--fuzz", "2", "--reference", "optiq"]) == 2
    assert "--reference optiq: no L2 configuration to draw" in capsys.readouterr().err

"""The differential fuzzer (spec_parity/fuzz.py): a fixed-seed sample of each family's config space
holds against the live references; bugs planted where no built-in case looks pass the matrix and
are found by a small fuzz run, shrunk to the configuration that shows them; misuse is one line and
exit 2."""

import json
from dataclasses import replace

import pytest

from spec_parity import cli, controls, fuzz, harness

# (module, reference, examples): a fixed-seed sample per family, every example through the harness
# at the pair's tier. The counts keep each family's sample near a minute on a 2-core machine.
SAMPLES = [("dflash", "zlab-mlx", 12), ("assistant", "optiq", 10), ("assistant", "transformers", 8),
           ("targets", "transformers", 8), ("dspark", "deepspec", 12)]


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("module, reference, examples", SAMPLES, ids=[f"{m}-{r}" for m, r, _ in SAMPLES])
def test_a_fixed_seed_sample_of_each_family_holds(live_oracle, module, reference, examples):
    live_oracle(module, reference)
    run = fuzz.fuzz(module, examples, seed=0, reference=reference, shrink_s=60)
    assert run.failure is None, fuzz.summary(run)
    assert run.counts()["passed"] >= examples // 2, fuzz.summary(run)


# Planted bugs no built-in case shows (spec_parity/controls): (module, control, reference, the key
# of the shrunk configuration that must carry the trigger, its value, examples).
OFF_THE_PATH = [
    ("dflash", "rope_theta_fixed", "zlab-mlx", ("drafter", "rope_theta"), 10000.0, 40),
    ("dflash", "window_within_block", "zlab-mlx", None, None, 60),
    ("assistant", "fp16_norms", "optiq", ("drafter", "dtype"), "float16", 40),
]


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("module, key, reference, trigger, value, examples", OFF_THE_PATH,
                         ids=[f"{m}-{k}" for m, k, *_ in OFF_THE_PATH])
def test_the_fuzzer_finds_a_bug_the_matrix_misses(live_oracle, module, key, reference, trigger, value, examples):
    live_oracle(module, reference)
    with controls.planted(module, key):
        missed = [harness.evaluate(c, "golden") for c in harness.all_cases([module]) if not c.control
                  and c.tier != "L3" and c.params.KIND != "sampled"]
        assert all(r.verdict == "PASS" for r in missed), [(r.case, r.verdict) for r in missed if r.verdict != "PASS"]
        run = fuzz.fuzz(module, examples, seed=0, reference=reference, shrink_s=120)
    assert run.failure is not None, fuzz.summary(run)
    config = json.loads(run.failure.config.to_json())
    if trigger:
        assert config[trigger[0]][trigger[1]] == value, fuzz.summary(run)
    # the control's own negative control: the shrunk configuration passes on the port as it is
    assert fuzz.evaluate(run.failure.config).end == "passed"


@pytest.mark.oracle
def test_a_failure_is_written_as_a_case_folder_that_reproduces(live_oracle, tmp_path, capsys):
    """`--config` runs the written configuration again: it fails under the plant, passes without."""
    live_oracle("dflash")
    config = fuzz.Config("dflash", "mod-qwen3", "qwen3-target", {}, {"rope_theta": 10000.0})
    path = tmp_path / "fuzz-config.json"
    path.write_text(config.to_json())
    argv = ["fuzz", "--module", "dflash", "--config", str(path), "--out", str(tmp_path / "out")]
    assert cli.main(argv + ["--plant", "dflash:rope_theta_fixed"]) == 1
    out = capsys.readouterr().out
    folder = tmp_path / "out" / "dflash" / config.name
    assert f"reproduce: spec-parity fuzz --module dflash --plant dflash:rope_theta_fixed --config {folder}" in out
    assert (folder / "request.json").is_file() and (folder / "fuzz-config.json").read_text().strip() == config.to_json()
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "out" / "fuzz.json").read_text())
    assert report["counts"] == {"passed": 1} and report["failure"] is None


@pytest.mark.oracle
@pytest.mark.slow
def test_draws_spread_over_workers_find_what_one_draw_finds(live_oracle, tmp_path, capsys):
    """--jobs 2: the first of two draws is --seed's own (10 of the 20 examples), which finds the
    planted bug in one process (OFF_THE_PATH), so the spread run finds and shrinks it too."""
    live_oracle("dflash", "zlab-mlx")
    argv = ["fuzz", "--module", "dflash", "--reference", "zlab-mlx", "--examples", "20", "--seed", "0", "--jobs", "2",
            "--plant", "dflash:rope_theta_fixed", "--shrink-s", "60", "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    assert "2 draws: seeds 0, 1" in capsys.readouterr().out
    report = json.loads((tmp_path / "fuzz.json").read_text())
    assert report["streams"] == [{"seed": 0, "examples": 10}, {"seed": 1, "examples": 10}]
    assert report["failure"]["drafter"]["rope_theta"] == 10000.0


def test_draws_share_the_examples_and_the_first_is_the_seeds_own():
    assert fuzz.streams(7, 50, 1) == [(7, 50)]
    assert fuzz.streams(7, 7, 3) == [(7, 3), (7000022, 2), (7000023, 2)]
    assert fuzz.streams(0, 2, 8) == [(0, 1), (1, 1)]


@pytest.mark.parametrize("argv, message", [
    (["--module", "nope"], "--module nope: no config space to fuzz; one of"),
    (["--module", "dflash", "--examples", "0"], "--examples 0: draw at least 1"),
    (["--module", "dflash", "--jobs", "0"], "--jobs 0: at least 1 worker"),
    (["--module", "dflash", "--plant", "dflash:nope"], "--plant dflash:nope: no control 'nope'"),
    (["--module", "dflash", "--config", "/nonexistent/fuzz-config.json"], "--config /nonexistent/fuzz-config.json: "),
])
def test_misuse_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert cli.main(["fuzz", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_config_file_of_another_module_or_no_config_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    other = tmp_path / "other.json"
    other.write_text(fuzz.Config("targets", "qwen3", "qwen3-target").to_json())
    for path, message in ((bad, "not a fuzz configuration"), (other, "a targets configuration; run it with --module targets")):
        assert cli.main(["fuzz", "--module", "dflash", "--config", str(path), "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err


def test_shrinking_ends_at_the_built_in_values():
    """Every choice lists the built-in case's value first: the simplest draw of each family is its
    built-in base configuration (what a shrunk failure keeps where a key does not matter)."""
    from hypothesis import find

    from spec_parity.drafters.dflash.fuzz import FAMILY

    simplest = find(FAMILY.strategy("dflash", ("zlab-mlx",)), lambda c: True)
    assert simplest.base == "mod-qwen3" and simplest.seed == 0
    assert {k: simplest.drafter[k] for k in ("num_draft_layers", "head_dim", "block_size", "rope_theta")} == {
        "num_draft_layers": 2, "head_dim": 16, "block_size": 8, "rope_theta": 1000000.0}
    assert fuzz.case(simplest).params.drafter[2]["target_layer_ids"] == [1, 2, 3]


def test_dflash_draws_half_precision_against_z_lab_mlx_alone():
    """Both references run at the drawn dtype; half precision is drawn against z-lab MLX only,
    where the target is the same framework's (docs/fuzz.md), and reaches the case's dtype."""
    drawn = fuzz.draw("dflash", 60, 0, ("zlab-mlx", "zlab-torch"))
    dtypes = {ref: {fuzz.case(c).dtype for c in drawn if c.base.endswith("-torch") == (ref == "zlab-torch")}
              for ref in ("zlab-mlx", "zlab-torch")}
    assert dtypes == {"zlab-mlx": {"float32", "bfloat16", "float16"}, "zlab-torch": {"float32"}}, dtypes
    assert all(fuzz.case(c).dtype == c.drafter.get("dtype", "float32") for c in drawn)


def test_dsparks_simplest_draw_builds_its_built_in_module_case():
    """DSpark draws the target the drafter copies: its simplest draw is mod-gemma4's very target and
    drafter, byte for byte."""
    from hypothesis import find

    from spec_parity.checkpoints import checkpoint_hash
    from spec_parity.drafters.dspark.fuzz import FAMILY

    simplest = find(FAMILY.strategy("dspark", ("deepspec",)), lambda c: True)
    built_in = next(c for c in harness.pair("dspark").cases() if c.name == "mod-gemma4")
    drawn = fuzz.case(simplest)
    assert simplest.base == built_in.name and drawn.params == replace(built_in.params, drafter=drawn.params.drafter)
    assert checkpoint_hash(drawn.checkpoint_dir()) == checkpoint_hash(built_in.checkpoint_dir())
    assert checkpoint_hash(drawn.drafter_dir()) == checkpoint_hash(built_in.drafter_dir())


def test_the_reproducing_command_names_the_port_it_ran_on():
    from argparse import Namespace

    args = Namespace(module="dflash", plant=None, port=["dflash=mypkg.adapter:make_port"], port_cmd=None,
                     timeout=None, port_id=None)
    assert fuzz.reproduce(args, "out/f c.json") == ("spec-parity fuzz --module dflash --port "
                                                    "dflash=mypkg.adapter:make_port --config 'out/f c.json'")
    args = Namespace(module="dflash", plant=None, port=None, port_cmd="./my-port {case} {out}", timeout=60.0,
                     port_id="mine")
    assert fuzz.reproduce(args, "f.json") == ("spec-parity fuzz --module dflash --port-cmd './my-port {case} {out}' "
                                              "--timeout 60.0 --port-id mine --config f.json")

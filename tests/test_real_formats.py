"""Real checkpoints as they ship, through the CLI: weights stored in bfloat16 or float16, split in
shards with their index (targets written by transformers' save_pretrained(max_shard_size=...),
drafters by tests/shipped.py in the same layout), and a vocabulary smaller than the pair's prompt
bound. Each case runs at float32 whatever the stored dtype (every loader casts the weights,
exactly) and its name says so; each is held to its reference, and a planted bug on the same
weights is still caught."""

import json
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from shipped import reshipped

from spec_parity import case as case_mod
from spec_parity import checkpoints, cli, harness, real
from spec_parity.port import checkpoint

PAIRS = {  # family -> (target kind, target overrides, drafter kind, drafter overrides)
    "dflash": ("qwen3-target", {}, "dflash-drafter", {}),
    "dspark": ("gemma4-target", {}, "dspark-drafter", {}),
    "assistant": ("gemma4-target", {}, "gemma4-assistant", {"use_ordered_embeddings": False}),
    "dflash-extension": ("qwen3-target", {}, "dflash-drafter",
                         {"dspark_extras": {"markov_rank": 8, "markov_head_type": "vanilla", "confidence": True}}),
}
VOCAB96 = ("qwen3-target", {"vocab_size": 96}, "dflash-drafter",
           {"mask_token_id": 95, "target_overrides": {"vocab_size": 96}})


def saved_by_transformers(src, dst, dtype: str, max_shard_size: str | None = None):
    """The target as transformers' save_pretrained writes it at `dtype` (shards past max_shard_size)."""
    import torch

    from spec_parity.oracles import targets as hf

    model = hf.load(src).to(getattr(torch, dtype))
    model.save_pretrained(dst, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return dst


def shipped_pair(tmp_path, family: str, dtype: str, shards: int):
    """The family's factory pair at `dtype`: the target through save_pretrained (in shards when
    `shards` > 1), the drafter in `shards` files."""
    tk, tov, dk, dov = PAIRS[family]
    target = saved_by_transformers(checkpoints.build(tk, 0, tov), tmp_path / "target", dtype,
                                   "200KB" if shards > 1 else None)
    drafter = reshipped(checkpoints.build(dk, 0, dov), tmp_path / "drafter", dtype, shards)
    return target, drafter


def run_cli(tmp_path, *args) -> tuple[int, list[dict]]:
    out = tmp_path / "report"
    rc = cli.main(["run", *map(str, args), "--out", str(out)])
    return rc, json.loads((out / "report.json").read_text())["results"]


def test_stored_dtype_shards_and_index(tmp_path):
    """What the loaders are told a checkpoint is: its stored dtype (off the safetensors headers),
    its files (the index and every shard), its tensors cast exactly to the run's dtype."""
    import mlx.core as mx

    src = checkpoints.build("dflash-drafter")
    assert checkpoint.stored_dtype(src) == "float32"
    assert checkpoint.files(src) == [src / "config.json", src / "model.safetensors"]
    bf16 = reshipped(src, tmp_path / "bf16", "bfloat16", 3)
    assert checkpoint.stored_dtype(bf16) == "bfloat16"
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert [f.name for f in checkpoint.files(bf16)] == [
        "config.json", "model.safetensors.index.json",
        *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))]
    assert checkpoint.check_dir(bf16, "--drafter") == "dflash"
    stored, run = checkpoint.read_tensors(bf16), checkpoint.read_tensors(bf16, mx.float32)
    assert set(stored) == set(checkpoint.read_tensors(src))
    for k, v in stored.items():
        assert v.dtype == mx.bfloat16 and run[k].dtype == mx.float32
        assert np.array_equal(np.array(v.astype(mx.float32)), np.array(run[k]))
    assert checkpoint.stored_dtype(reshipped(src, tmp_path / "fp16", "float16")) == "float16"


def test_a_shard_the_index_names_missing_is_refused(tmp_path, capsys):
    """A download that lost a shard: one line naming the index and the shard, exit 2, before any
    case runs (the loaders would read the other shards and fail inside)."""
    target = reshipped(checkpoints.build("qwen3-target"), tmp_path / "target", "bfloat16", 2)
    (target / "model-00002-of-00002.safetensors").unlink()
    assert cli.main(["run", "--target", str(target), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors.index.json: names shard(s) ['model-00002-of-00002.safetensors']" in err[0]
    assert not (tmp_path / "r" / "report.json").exists()


def test_a_case_names_the_dtype_it_runs_at(tmp_path):
    """Weights stored in bf16 / fp16 run at the case's float32 and the name says so; float32
    weights name nothing."""
    t, d = checkpoints.build("qwen3-target"), checkpoints.build("dflash-drafter")
    plain = real.cases(t, d, harness.all_cases(["dflash"]))
    assert plain and all("weights" not in c.name and c.dtype == "float32" for c in plain)
    bf16 = reshipped(d, tmp_path / "bf16", "bfloat16")
    fp16 = reshipped(t, tmp_path / "fp16", "float16")
    for c in real.cases(t, bf16, harness.all_cases(["dflash"])):
        assert c.name.endswith("(target float32, drafter bfloat16, run at float32)") and c.dtype == "float32"
    for c in real.cases(fp16, None, harness.all_cases(["targets"])):
        assert c.name.endswith("(weights float16, run at float32)")


def test_prompt_ids_stay_in_the_pairs_vocabularies(tmp_path):
    """A real case draws its prompt below the pair's bound and below the target's and the
    drafter's vocabularies: ids past a vocabulary are no token of the checkpoint."""
    t, d = (checkpoints.build(k, 0, o) for k, o in ((VOCAB96[0], VOCAB96[1]), (VOCAB96[2], VOCAB96[3])))
    for c in real.cases(t, d, harness.all_cases(["dflash"])):
        assert harness.prompt(c).max() < 96
    small = reshipped(checkpoints.build("dflash-drafter"), tmp_path / "drafter", "float32")
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 40}))
    base = next(c for c in harness.all_cases(["dflash"]) if c.name == "loop-qwen3")
    assert harness.prompt(base).max() >= 40       # the pair's bound (120) alone would pass ids >= 40
    on_path = real.cases(checkpoints.build("qwen3-target"), small, [base])[0]
    assert harness.prompt(on_path).max() < 40


@pytest.mark.oracle
def test_a_bf16_sharded_pair_through_the_cli(tmp_path, live_oracle):
    """`spec-parity run --target T --drafter D` on a Qwen3 target saved by transformers in bf16
    shards and a DFlash drafter in bf16 shards: every case that runs here passes, at float32."""
    live_oracle("dflash")
    target, drafter = shipped_pair(tmp_path, "dflash", "bfloat16", 2)
    assert len(list(target.glob("model-*-of-*.safetensors"))) > 1
    rc, results = run_cli(tmp_path, "--target", target, "--drafter", drafter)
    assert rc == 0 and results
    for r in results:
        assert r["verdict"] == "PASS", r
        assert r["case"].endswith("(weights bfloat16, run at float32)")


@pytest.mark.oracle
def test_a_planted_bug_on_bf16_weights_is_caught(tmp_path, live_oracle):
    """The comparison on bf16 weights can fail: our port scoring with the drafter's own lm head
    (a built-in control, planted around our run) FAILs against z-lab MLX on the same pair."""
    live_oracle("dflash")
    target = reshipped(checkpoints.build("qwen3-target"), tmp_path / "target", "bfloat16", 2)
    drafter = reshipped(checkpoints.build("dflash-drafter"), tmp_path / "drafter", "bfloat16", 2)
    control = next(c for c in harness.all_cases(["dflash"]) if c.name == "mod-qwen3-control-own_head")
    base = real.cases(target, drafter, [next(c for c in harness.all_cases(["dflash"]) if c.name == "mod-qwen3")])[0]
    assert harness.evaluate(base, "live").ok
    planted = harness.evaluate(replace(base, control=control.control), "live")
    assert planted.verdict == "FAIL", planted.message()


@pytest.mark.oracle
def test_a_vocabulary_of_96_passes_its_loop(live_oracle):
    """A pair whose vocabulary (96) is under the pair's prompt bound (120): the serve-loop case
    passes; drawn up to the bound instead (planted from outside), it is not lossless."""
    live_oracle("dflash")
    t, d = (checkpoints.build(k, 0, o) for k, o in ((VOCAB96[0], VOCAB96[1]), (VOCAB96[2], VOCAB96[3])))
    loop = next(c for c in real.cases(t, d, harness.all_cases(["dflash"])) if c.params.KIND == "loop")
    assert harness.evaluate(loop, "live").ok
    with mock.patch.object(case_mod, "vocab_size", lambda path: 10 ** 6):
        assert harness.prompt(loop).max() >= 96
        r = harness.evaluate(loop, "live")
    assert r.verdict == "FAIL" and "not lossless" in r.reason, r.message()


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("family,dtype,shards", [("dflash", "float16", 1), ("dspark", "bfloat16", 2),
                                                 ("assistant", "bfloat16", 2), ("dflash-extension", "float16", 2),
                                                 ("targets", "float16", 2)])
def test_every_family_as_shipped(tmp_path, live_oracle, family, dtype, shards):
    """Each drafter family (and a target alone) in bf16 or fp16, one file or shards, through
    `spec-parity run`: every case that runs here passes and names its dtype."""
    live_oracle("targets" if family == "targets" else family.split("-")[0])
    target, drafter = shipped_pair(tmp_path, "dspark" if family == "targets" else family, dtype, shards)
    rc, results = run_cli(tmp_path, "--target", target, *(() if family == "targets" else ("--drafter", drafter)))
    assert rc == 0 and results
    for r in results:
        assert r["verdict"] == "PASS", r
        assert r["case"].endswith(f"(weights {dtype}, run at float32)")


def test_ab_on_bf16_and_sharded_drafters(tmp_path, capsys):
    """`spec-parity ab` loads a bf16 target in shards and bf16 / fp16 sharded drafters as stored
    (it compares our own loop with itself: no reference, the stored dtype runs)."""
    target = reshipped(checkpoints.build("qwen3-target"), tmp_path / "target", "bfloat16", 2)
    a = reshipped(checkpoints.build("dflash-drafter"), tmp_path / "a", "bfloat16", 2)
    b = reshipped(checkpoints.build("dflash-drafter", 1), tmp_path / "b", "float16", 3)
    (tmp_path / "prompts.txt").write_text("5 6 7 8 9 10\n11 12 13 14\n")
    rc = cli.main(["ab", "--target", str(target), "--a", str(a), "--b", str(b), "--prompts",
                   str(tmp_path / "prompts.txt"), "--max-tokens", "12", "--json", str(tmp_path / "ab.json")])
    assert rc in (0, 1), capsys.readouterr()       # the verdict (speed, acceptance), not an error
    doc = json.loads((tmp_path / "ab.json").read_text())
    assert [p["generated_tokens"] for arm in "ab" for p in doc["prompts"][arm]] == [12] * 4


@pytest.mark.oracle
def test_measure_on_a_real_target(tmp_path, live_oracle, capsys):
    """`spec-parity measure --target T` gives the max |Δ| behind budgets.py on weights as shipped
    (fp16 here, run at float32), each within the float32 budget it is held to."""
    from spec_parity import budgets

    live_oracle("targets")
    target = reshipped(checkpoints.build("qwen3-target"), tmp_path / "target", "float16", 2)
    assert cli.main(["measure", "--target", str(target), "--seeds", "1"]) == 0
    worst = dict(line.split() for line in capsys.readouterr().out.strip().splitlines())
    assert {"logits", "hidden", "stream_logits"} <= set(worst)
    for q, v in worst.items():
        assert float(v) <= budgets.budget_for("targets", q).atol, (q, v)
    assert cli.main(["measure", "--drafter", str(checkpoints.build("dflash-drafter"))]) == 2
    assert capsys.readouterr().err.strip() == "spec-parity measure: error: --drafter DIR needs --target DIR (the target it drafts for)"


@pytest.mark.oracle
def test_export_writes_a_bf16_sharded_pair_as_case_folders(tmp_path, live_oracle):
    """`spec-parity export --target T --drafter D`: each case of the pair as a folder (its
    reference live, the shards copied as they lie), which our own port answers through the file
    protocol with the arrays request.json names."""
    from safetensors.numpy import load_file

    from spec_parity import exchange

    live_oracle("dflash")
    target, drafter = shipped_pair(tmp_path, "dflash", "bfloat16", 2)
    out = tmp_path / "cases"
    assert cli.main(["export", "--target", str(target), "--drafter", str(drafter), "--module", "dflash",
                     "--out", str(out)]) == 0
    folders = sorted(p.parent for p in out.glob("dflash/*/request.json"))
    assert folders and all(" " not in f.name for f in folders)
    case = folders[0]
    assert sorted(p.name for p in (case / "drafter").glob("*.safetensors")) == sorted(
        p.name for p in drafter.glob("*.safetensors"))
    assert exchange.main([str(case), str(tmp_path / "answer")]) == 0
    answer = load_file(str(tmp_path / "answer" / "outputs.safetensors"))
    expected = json.loads((case / "request.json").read_text())["expected"]
    assert {k: (list(v.shape), str(v.dtype)) for k, v in answer.items()} == {
        k: (e["shape"], e["dtype"]) for k, e in expected.items()}

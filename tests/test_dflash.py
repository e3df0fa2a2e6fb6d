"""DFlash drafter: port/dflash.py vs z-lab dflash 0.1.0: `dflash.model_mlx` (module cases L1, loops
L2) and `dflash.model` (torch, transformers 5.15 in its own environment; `-torch` cases, L2).

The cases themselves (golden and, with the reference installed, live; each planted bug must fail)
run in tests/test_parity.py. Here: the two reference deltas (z-lab MLX's sliding window after a
one-row update on a full ring; z-lab torch's raw block embedding), shown on the goldens of both
references, and the port's default window against a from-scratch time-ordered recompute."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import checkpoints, controls, goldens, harness, shared
from spec_parity.drafters.dflash import adapter, pair
from spec_parity.port import dflash, serve, targets
from spec_parity.port.sources.dflash import DflashProvider, DflashSource

CASES = pair.PAIR.cases()


def _case(name):
    return next(c for c in CASES if c.name == name)


def _with_window(case, window):
    from dataclasses import replace

    return replace(case, params=replace(case.params, window=window))


def _on_golden(case, **params):
    """`case` run with other port options, compared with the golden of `case` as it is."""
    from dataclasses import replace

    from spec_parity.compare import Result

    ref, _ = goldens.load(case)
    variant = replace(case, params=replace(case.params, **params))
    result = Result(case.module, case.name, "golden", case.tier)
    harness.judge(variant, harness.port_run(variant, ref), ref, result)
    return result


@pytest.mark.golden
@pytest.mark.parametrize("name", ["mod-gemma4", "mod-qwen3-swa"])
def test_window_delta_vs_zlab_mlx(name):
    """The port's default sliding window ("positional") is z-lab MLX's, bit for bit, until a round
    whose context update was ONE row on a full ring (here round 2, after the forced empty commit
    of round 1): from there z-lab MLX masks by ring index a buffer that is not in time order."""
    case = _case(name)
    ref, _ = goldens.load(case)
    port = adapter.run_modules(harness.request(_with_window(case, "positional"), ref))
    same = [np.array_equal(port[f"logits.{r}"], ref[f"logits.{r}"]) for r in range(len(case.params.accepts))]
    assert case.params.accepts[:2] == (3, 0) and case.params.prompt_len > 9
    assert same[:2] == [True, True] and not same[2], same


@pytest.mark.golden
@pytest.mark.parametrize("name", harness.slow_except(["mod-gemma4-torch", "mod-qwen3-swa-torch"], "mod-qwen3-swa-torch"))
def test_window_conventions_vs_zlab_torch(name):
    """z-lab torch keeps its sliding context in time order: the port's default window matches it
    (the case itself), z-lab MLX's convention departs from it on round 2, as from our recompute."""
    case = _case(name)
    assert harness.evaluate(case, "golden").ok
    result = _on_golden(case, window="zlab-mlx")
    assert not result.ok and result.metrics["rounds"]["first_differing_round"] == 2, result.message()


@pytest.mark.golden
@pytest.mark.parametrize("base", ["mod-qwen3-swa", "mod-qwen3-swa-torch"])
def test_a_window_one_row_short_fails_on_the_attended_positions(base):
    """The planted window_one_short control: every sliding layer's stored window, compared as
    attended (z-lab MLX's ring replayed, z-lab torch's rows in time order), names the lost row."""
    result = harness.evaluate(_case(f"{base}-control-window_one_short"), "golden")
    for i in (0, 1):
        m = result.metrics[f"ctx_k.{i}"]
        assert m["port_positions"] == list(range(22, 30)) and m["ref_positions"] == list(range(21, 30)), m


@pytest.mark.golden
def test_ring_replay_is_the_ports_own_ring():
    """The golden's ring positions, replayed from its taps, are those of the port's own cache
    (which it returns as ctx_pos) on the same schedule: the replay describes mlx-lm's ring."""
    case = _case("mod-qwen3-swa")
    ref, _ = goldens.load(case)
    port = harness.port_run(case, ref)
    sliding, W = pair._sliding(case)
    for i in (0, 1):
        known = pair._stored_positions(case, ref, f"ctx_k.{i}", sliding[i], W)
        assert known == tuple(port[f"ctx_pos.{i}"].tolist()) and known != tuple(sorted(known)), known


@pytest.mark.golden
def test_embed_convention_vs_zlab_torch():
    """z-lab torch embeds the block with the raw embedding rows; with z-lab MLX's sqrt(H)-scaled
    embedding the very first block already differs on a Gemma-4 target (and not on Qwen3)."""
    scaled = _on_golden(_case("mod-gemma4-torch"), embed="scaled")
    assert not scaled.ok and not scaled.metrics["hidden.0"]["ok"], scaled.message()
    assert _on_golden(_case("mod-qwen3-torch"), embed="scaled").ok


def _fresh_logits(m, target, rows, anchor, n):
    """The block from fresh caches fed every context row at once (time order, positions 0..)."""
    return m.block(target, anchor, n, rows, m.make_caches()).logits


@pytest.mark.parametrize("variant", harness.slow_except(["gemma4", "qwen3-swa", "qwen3"], "qwen3-swa"))
def test_positional_window_is_a_time_ordered_recompute(variant):
    """Each round of the cached source (default window) equals the drafter recomputed from scratch
    on the whole committed context, so only the window's own semantics decide what a block row sees;
    z-lab MLX's convention departs from that recompute on the first one-row update of a full ring."""
    case = _case(f"mod-{variant}")
    target = targets.load(case.checkpoint_dir())
    results = {}
    for window in ("positional", "zlab-mlx"):
        m = dflash.load(case.drafter_dir(), window)
        caches = targets.make_caches(target)
        src = DflashSource(m, serve.TargetView(target, caches))
        p = harness.prompt(case)
        tr = targets.forward(target, mx.array(p), caches=caches)
        taps = [tr.hidden[i + 1] for i in src.tap_layers]
        src.prefill(p[0].tolist(), taps)
        rows = [mx.concatenate(taps, axis=-1)]
        anchor, bs, gaps = int(mx.argmax(tr.logits[0, -1]).item()), m.args.block_size, []
        for a in case.params.accepts:
            tokens = src.draft([anchor], bs - 1, None)
            fresh = _fresh_logits(m, target, mx.concatenate(rows, axis=1), anchor, bs - 1)
            gaps.append(float(mx.abs(src.last_block.logits - fresh).max().item()))
            v = targets.forward(target, mx.array([[anchor] + tokens]), caches=caches)
            a = min(a, bs - 1)
            anchor = int(mx.argmax(v.logits[0, a]).item())
            serve.trim_caches(caches, bs - 1 - a)
            vt = [v.hidden[i + 1] for i in src.tap_layers]
            src.commit(bs - 1, a, vt)
            rows.append(mx.concatenate(vt, axis=-1)[:, : a + 1])
        results[window] = gaps
    assert max(results["positional"]) < 1e-4, results
    if variant == "qwen3":
        assert max(results["zlab-mlx"]) < 1e-4, results  # no sliding layer: the conventions coincide
    else:
        assert max(results["zlab-mlx"][:2]) < 1e-4 and results["zlab-mlx"][2] > 1e-2, results


@pytest.mark.parametrize("variant", harness.slow_except(["gemma4", "qwen3-swa", "qwen3-bs16"], "gemma4"))
@pytest.mark.parametrize("window", harness.slow_except(dflash.WINDOWS, "positional"))
def test_serve_loop_is_lossless(variant, window):
    """T=0 through the serve loop equals the target's greedy stream, whichever window convention
    and whether or not the last block is shrunk to the tokens left (z-lab's max_tokens rule)."""
    case = _case(f"loop-{variant}")
    target = targets.load(case.checkpoint_dir())
    p = harness.prompt(case)
    plain, _ = shared.greedy(case.checkpoint_dir(), p, 30, set())
    for max_tokens in (None, 30):
        prov = DflashProvider(case.drafter_dir(), window, max_tokens=max_tokens)
        tokens, stats = serve.generate(target, p[0].tolist(), 30, prov,
                                       serve.ServeOptions(gamma=prov.trained_gamma, eos=set()))
        assert tokens == plain
        last = stats.trace[-1][0]
        left = 30 - sum(e for _, _, e in stats.trace[:-1]) - 1
        assert last == (min(prov.trained_gamma, left) if max_tokens else prov.trained_gamma)


def _drafter(ov=None):
    return checkpoints.build("dflash-drafter", 0, ov or {})


def _qwen3(ov=None):
    return targets.load(checkpoints.build("qwen3-target", 0, ov or {}))


def test_wrong_depth_target_is_refused_by_name():
    m = dflash.load(_drafter())
    with pytest.raises(dflash.DFlashError, match=r"config.json: num_target_layers 6 != num_hidden_layers 4"):
        dflash.check_pairing(m, _qwen3({"num_hidden_layers": 4}))


def test_wrong_width_target_is_refused_by_name():
    m = dflash.load(_drafter())
    with pytest.raises(dflash.DFlashError, match="hidden_size 64 != hidden_size 32"):
        dflash.check_pairing(m, _qwen3({"hidden_size": 32}))


def test_wrong_vocab_target_is_refused_by_name():
    m = dflash.load(_drafter())
    with pytest.raises(dflash.DFlashError, match="vocab_size 128 != vocab_size 256"):
        dflash.check_pairing(m, _qwen3({"vocab_size": 256}))


def test_final_layer_tap_is_refused(tmp_path):
    src = _drafter()
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 2, 5]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dflash.DFlashError, match=r"\[5\] outside \[0, 4\].*z-lab MLX accepts it"):
        dflash.check_pairing(dflash.load(tmp_path), _qwen3())


def test_not_a_dflash_checkpoint_is_named():
    with pytest.raises(dflash.DFlashError, match="not a z-lab DFlash drafter"):
        dflash.load(checkpoints.build("qwen3-target", 0, {}))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("dflash_config"), "needs dflash_config"),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel .* is not ported"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 2, sliding_window=None), "need a sliding_window"),
])
def test_bad_config_is_named(tmp_path, edit, message):
    src = _drafter()
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dflash.DFlashError, match=message):
        dflash.load(tmp_path)


def test_unknown_window_is_refused():
    with pytest.raises(dflash.DFlashError, match="window 'hf'"):
        dflash.load(_drafter(), window="hf")


def test_factory_writes_zlab_format():
    cfg = json.loads((_drafter(pair.VARIANTS["gemma4"]) / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 2, 3], "mask_token_id": 127, "block_size": 8,
                                    "input_embedding_scale": 1.25, "output_multiplier": 0.75,
                                    "final_logit_softcapping": 30.0}
    from safetensors.numpy import load_file

    names = set(load_file(str(_drafter() / "model.safetensors")))
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    with pytest.raises(ValueError, match="strictly increasing"):
        checkpoints.build("dflash-drafter", 0, {"target_layer_ids": [2, 1]})


def test_zero_draft_rounds_keep_the_context():
    """A round that drafts nothing (gamma 0) still queues its verify row: the next draft sees it."""
    case = _case("loop-qwen3")
    target = targets.load(case.checkpoint_dir())
    prov = DflashProvider(case.drafter_dir())
    p = harness.prompt(case)[0].tolist()
    tokens, stats = serve.generate(target, p, 10, prov, serve.ServeOptions(gamma=0, eos=set()))
    plain, _ = shared.greedy(target.path, p, 10, set())
    assert tokens == plain and stats.drafted == 0


@pytest.mark.slow
def test_qwen3_loop_twins_share_a_run_that_is_each_twins_own():
    """The z-lab MLX and torch twins of a Qwen3 loop share one serve-loop run (drafters/dflash/adapter.py
    `run_loop`): it is, bit for bit, the torch twin's own embed="raw" run. On Gemma-4 (embed scale
    sqrt(H)) the twins' runs differ, and they are not shared."""
    mlx_case, torch_case = _case("loop-qwen3"), _case("loop-qwen3-torch")
    run = adapter.run_loop(harness.request(mlx_case, {}))
    own = adapter.loop_uncached(harness.request(torch_case, {}))
    assert set(own) == set(run)
    assert all(own[k].dtype == run[k].dtype and np.array_equal(own[k], run[k]) for k in own)
    assert all(adapter.run_loop(harness.request(torch_case, {}))[k] is v for k, v in run.items())
    g, gt = adapter.run_loop(harness.request(_case("loop-gemma4"), {})), adapter.run_loop(harness.request(_case("loop-gemma4-torch"), {}))
    assert not np.array_equal(g["stream.draft_logits"], gt["stream.draft_logits"])
    assert not any(gt[k] is v for k, v in g.items())


def test_a_target_side_bug_is_not_blamed_on_a_drafter_layer():
    """The own-error run drafts from the reference's prefill taps: a bug in the target (RoPE in its
    layer 1) moves the taps and every free-running drafter layer, and no drafter layer's own error."""
    case = next(c for c in harness.all_cases(["dflash"]) if c.name == "mod-qwen3")
    with controls.planted("targets", "rope-L1", case):
        result = harness.evaluate(case, "golden")
    layers = result.metrics["layers"]
    assert result.verdict == "FAIL" and layers["first_free_running_failure"] is not None, result.message()
    assert layers["first_divergent_layer"] is None, result.message()

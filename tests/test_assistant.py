"""Gemma-4 assistant drafter: port/assistant.py vs optiq (L1) and transformers (L2).

The cases themselves (golden and live; each planted bug must fail) run in tests/test_parity.py.
"""

import mlx.core as mx
import pytest

from spec_parity import checkpoints, shared
from spec_parity.port import assistant, targets


def _load(kind, overrides=None):
    return checkpoints.build(kind, 0, overrides or {})


def test_head_is_chosen_by_tensor_presence():
    assert assistant.load(_load("gemma4-assistant")).head == "centroid"
    assert assistant.load(_load("gemma4-assistant", {"use_ordered_embeddings": False})).head == "tied"


def test_untied_centroid_head_scores_its_candidates_on_the_convention_rows():
    """An untied centroid assistant loads (its lm_head.weight has a place); which rows score the
    candidates is the reference's convention: optiq's embedding, transformers' lm_head."""
    path = _load("gemma4-assistant", {"tie_word_embeddings": False})
    optiq, hf = (assistant.load(path, head_rows=rows) for rows in assistant.HEAD_ROWS)
    assert optiq.head == hf.head == "centroid"
    assert mx.array_equal(optiq.candidate_rows(), optiq.model.embed_tokens.weight)
    assert mx.array_equal(hf.candidate_rows(), hf.lm_head.weight)
    assert not mx.array_equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    with pytest.raises(assistant.DrafterError, match="head_rows 'rows'"):
        assistant.load(path, head_rows="rows")


@pytest.mark.oracle
@pytest.mark.slow
def test_untied_centroid_pair_runs_through_the_cli(tmp_path, live_oracle):
    """`spec-parity run --target G --drafter A` on the factory's untied centroid pair: every case
    as expected; with the candidates scored on the embedding (planted), the transformers step
    case fails and the run exits 1."""
    import json

    from spec_parity import cli, controls

    live_oracle("assistant")
    live_oracle("assistant", "transformers")
    argv = ["run", "--target", str(_load("gemma4-target")),
            "--drafter", str(_load("gemma4-assistant", {"tie_word_embeddings": False}))]
    assert cli.main([*argv, "--out", str(tmp_path / "ok")]) == 0
    results = json.loads((tmp_path / "ok" / "report.json").read_text())["results"]
    assert [r["verdict"] for r in results] == ["PASS"] * 3, results
    with controls.planted("assistant", "head_rows"):
        assert cli.main([*argv, "--out", str(tmp_path / "bug")]) == 1
    results = json.loads((tmp_path / "bug" / "report.json").read_text())["results"]
    assert [(r["oracle"].split()[0], r["verdict"]) for r in results] == [
        ("optiq", "PASS"), ("transformers", "FAIL"), ("optiq", "PASS")], results


def test_non_gemma4_target_is_refused_by_name():
    drafter = assistant.load(_load("gemma4-assistant"))
    with pytest.raises(assistant.DrafterError, match="needs a Gemma-4 target"):
        assistant.check_pairing(drafter, targets.load(_load("qwen3-target")))


def test_backbone_mismatch_is_refused_by_name():
    drafter = assistant.load(_load("gemma4-assistant", {"backbone_hidden_size": 32}))
    with pytest.raises(assistant.DrafterError, match=r"assistant-s0-\w+/config.json: backbone_hidden_size 32 != hidden_size 64 of .*; pair"):
        assistant.check_pairing(drafter, targets.load(_load("gemma4-target")))



def test_unsupported_head_is_named(tmp_path):
    import json
    import shutil

    src = _load("gemma4-assistant", {"use_ordered_embeddings": False})
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(assistant.DrafterError, match="unsupported head"):
        assistant.load(tmp_path)


def test_sliding_view_conventions():
    k = mx.arange(20)[None, None, :, None]
    assert assistant.sliding_view(k, k, 8, "optiq")[0].shape[2] == 7
    assert assistant.sliding_view(k, k, 8, "hf")[0].shape[2] == 9
    assert assistant.sliding_view(k, k, 8, "optiq")[0][0, 0, 0, 0].item() == 13


def test_plain_serve_loop_is_greedy_decoding():
    from spec_parity.port import serve

    target = targets.load(_load("gemma4-target"))
    prompt = list(range(3, 15))
    tokens, stats = serve.generate(target, prompt, 20, None, serve.ServeOptions(eos=set()))
    plain, _ = shared.greedy(target.path, prompt, 20, set())
    assert tokens == plain and stats.target_calls == 20 and stats.drafted == 0


def test_trimmed_rotating_cache_continues_like_a_fresh_one():
    """Verify 4 past the window, trim the 2 rejected, feed one more: the same logits as a cache
    that only ever saw the committed tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    from spec_parity.port import serve

    target = targets.load(_load("gemma4-target"))
    seq = list(range(3, 23))
    a = make_prompt_cache(target.model)
    targets.forward(target, mx.array([seq[:12]]), caches=a)
    targets.forward(target, mx.array([seq[12:15] + [99]]), caches=a)
    serve.trim_caches(a, 2)
    b = make_prompt_cache(target.model)
    targets.forward(target, mx.array([seq[:14]]), caches=b)
    for tok in ([seq[14]], [seq[15], seq[16]], [seq[17]]):
        la = targets.forward(target, mx.array([tok]), caches=a).logits
        lb = targets.forward(target, mx.array([tok]), caches=b).logits
        assert float(mx.abs(la - lb).max()) < 1e-4
    assert a[0].offset == b[0].offset


def test_stats_tau_and_acceptance():
    from spec_parity.port.serve import Stats

    s = Stats(drafted=8, accepted=3, trace=[(4, 1, 2), (4, 2, 3)])
    assert s.acceptance == 3 / 8 and s.tau == 2.5


def test_untrimmed_cache_is_caught_by_the_same_check():
    from mlx_lm.models.cache import make_prompt_cache

    target = targets.load(_load("gemma4-target"))
    seq = list(range(3, 23))
    a = make_prompt_cache(target.model)
    targets.forward(target, mx.array([seq[:12]]), caches=a)
    targets.forward(target, mx.array([seq[12:15] + [99]]), caches=a)
    b = make_prompt_cache(target.model)
    targets.forward(target, mx.array([seq[:14]]), caches=b)
    la = targets.forward(target, mx.array([[seq[14]]]), caches=a).logits
    lb = targets.forward(target, mx.array([[seq[14]]]), caches=b).logits
    assert float(mx.abs(la - lb).max()) > 1e-2

"""spec_parity.shared: a computation read by several tests is the port's own, bit for bit, whoever
asks first, and a changed checkpoint or argument is never served a stale entry."""

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import checkpoints, ports, shared
from spec_parity.port import targets


def test_shared_greedy_is_the_ports_greedy(tmp_path):
    src = checkpoints.build("gemma4-target", 0, {})
    prompt = list(range(3, 15))
    direct, direct_logits = targets.greedy(targets.load(src), mx.array([prompt]), 12, set())
    for eos in (set(), {direct[5]}):
        tokens, logits = shared.greedy(src, np.array([prompt], np.int32), 12, eos)
        again, again_logits = shared.greedy(src, prompt, 12, eos)
        want, want_logits = targets.greedy(targets.load(src), mx.array([prompt]), 12, eos)
        assert tokens == again == want and again_logits is logits
        assert np.array_equal(np.array(logits), np.array(want_logits))
    tokens.append(-1)
    assert shared.greedy(src, prompt, 12, set())[0] == direct   # callers get their own list
    # a rewritten checkpoint (same path, other bytes) is a new key
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    assert shared.greedy(ck, prompt, 12, set())[0] == direct
    other = checkpoints.build("gemma4-target", 1, {})
    shutil.copy(other / "model.safetensors", ck / "model.safetensors")
    os.utime(ck / "model.safetensors", ns=(1, 1))
    fresh, _ = targets.greedy(targets.load(ck), mx.array([prompt]), 12, set())
    assert fresh != direct and shared.greedy(ck, prompt, 12, set())[0] == fresh


def test_a_stored_result_cannot_be_changed_by_a_reader():
    calls = []
    key = ("test", "frozen")
    out = shared.once(key, lambda: calls.append(1) or {"a": np.zeros(3)})
    out["b"] = np.ones(1)                                      # the reader's own dict
    try:
        out["a"][0] = 1.0
    except ValueError:
        pass
    else:
        raise AssertionError("a stored array was writable")
    again = shared.once(key, lambda: calls.append(1) or {})
    assert calls == [1] and set(again) == {"a"} and not again["a"].any()


@pytest.mark.slow
def test_port_runs_are_shared_only_for_the_same_case_and_reference_bytes(monkeypatch):
    from spec_parity import goldens, harness
    from spec_parity.drafters.targets import pair

    case = next(c for c in pair.PAIR.cases() if not c.control)
    control = next(c for c in pair.PAIR.cases() if c.control and c.control["base"] == case.name)
    ref, _ = goldens.load(case)
    monkeypatch.setattr(shared, "_STORE", {})   # an empty store, whatever ran before in this process
    runs = []
    real = ports.ours().runs["targets"]
    monkeypatch.setitem(ports.ours().runs, "targets", lambda req: runs.append(req.case) or real(req))
    first = harness.port_run(case, ref)
    again = harness.port_run(case, {k: v.copy() for k, v in ref.items()})    # same bytes: one run
    assert runs == [case.name] and all(again[k] is v for k, v in first.items())
    harness.port_run(control, ref)                                          # a control is its own case
    other = dict(ref, **{"hidden.0": ref["hidden.0"] + np.float32(1e-3)})
    harness.port_run(case, other)                                           # other bytes: run again
    assert runs == [case.name, control.name, case.name]
    assert harness.check(case, harness.evaluate(case, "golden")) is None
    assert runs == [case.name, control.name, case.name]
    # another port (another identity) on the same case and bytes runs on its own, never shares ours
    other_port = ports.Port("other", "1", {"targets": lambda req: runs.append("other") or real(req)}, (__file__,))
    theirs = harness.port_run(case, ref, other_port)
    assert runs[-1] == "other" and not any(theirs[k] is v for k, v in first.items())


def _kept_once(tmp_path, monkeypatch, n: int):
    """One shared.greedy of the qwen3 target with the memo under tmp_path, then an emptied store
    (what a second process sees): (checkpoint, prompt, tokens, logits, the memo file)."""
    src = checkpoints.build("qwen3-target", 0, {})
    prompt = list(range(3, 15))
    monkeypatch.setattr(shared, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(shared, "_STORE", {})
    tokens, logits = shared.greedy(src, prompt, n, set())
    (memo,) = (tmp_path / "greedy").iterdir()
    monkeypatch.setattr(shared, "_STORE", {})
    return src, prompt, tokens, logits, memo


def test_greedy_kept_on_disk_is_read_back_only_under_its_own_key(tmp_path, monkeypatch):
    """The disk memo of shared.greedy: a second process (here: an emptied store) reads the same
    tokens and logit bits without decoding; another prompt, length, EOS set, checkpoint byte or
    decoding code is another file."""
    src, prompt, tokens, logits, memo = _kept_once(tmp_path, monkeypatch, 12)

    def no_decoding(*args, **kwargs):
        raise AssertionError("a kept stream was decoded again")

    monkeypatch.setattr(targets, "greedy", no_decoding)
    again, again_logits = shared.greedy(src, prompt, 12, set())
    assert again == tokens and again_logits.dtype == logits.dtype
    assert np.array(again_logits).tobytes() == np.array(logits).tobytes()

    key = shared._memo(src, prompt, 12, frozenset())
    assert key == memo
    others = {shared._memo(src, prompt[1:], 12, frozenset()), shared._memo(src, prompt, 11, frozenset()),
              shared._memo(src, prompt, 12, frozenset({5})), shared._memo(src, prompt, 12, None)}
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    raw = bytearray((ck / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (ck / "model.safetensors").write_bytes(bytes(raw))
    others.add(shared._memo(ck, prompt, 12, frozenset()))
    monkeypatch.setattr(shared, "_code_digest", lambda: "another port/targets.py")
    others.add(shared._memo(src, prompt, 12, frozenset()))
    assert len(others) == 6 and key not in others


def test_an_unreadable_kept_stream_is_decoded_and_written_anew(tmp_path, monkeypatch):
    """A memo file that is not a whole npz (a truncated copy, another format) is not an error: the
    stream is decoded again and the file replaced."""
    src, prompt, tokens, _, memo = _kept_once(tmp_path, monkeypatch, 8)
    whole = memo.read_bytes()
    memo.write_bytes(whole[: len(whole) // 2])
    assert shared.greedy(src, prompt, 8, set())[0] == tokens
    assert shared._read_memo(memo)[0] == tokens    # whole again (npz bytes carry a timestamp)

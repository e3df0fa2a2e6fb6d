"""spec_parity.shared: a computation read by several tests is the port's own, bit for bit, whoever
asks first, and a changed checkpoint or argument is never served a stale entry."""

import os
import shutil

import mlx.core as mx
import numpy as np

from port import targets
from spec_parity import checkpoints, shared


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

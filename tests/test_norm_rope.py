"""port/fast/norm_rope.py: a Qwen3 layer's Q and K norms and RoPE as one CUDA kernel, against
mlx-lm's own modules (verify.mlx_lm_qk, in fp32) on MLX CUDA, over head_dims 64 and 128, GQA,
offsets 0 and inside a long context, a linear-scaled RoPE; and the kernel verify that uses it,
against the fp32 verify, within the tier the kernel verify holds without it; the bucketed DFlash
and fused DSpark blocks that use it, against their fp32 blocks, as close as with mlx-lm's ops. Planted bugs, edited
into the kernel's source from here, must fail the same comparisons. On the CPU: which attentions
it refuses, and (with nvcc) that its source compiles for sm_90a and sm_75."""

import mlx.core as mx
import numpy as np
import pytest
import test_bucketed as tb
import test_bucketed_verify as tbv
import test_kernels
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from port import serve, targets
from port.fast import dflash as fast_dflash
from port.fast import dspark as fast_dspark
from port.fast import kernels, norm_rope
from port.fast import verify as fast_verify
from port.sources.dspark import DeepspecSource
from spec_parity import budgets, checkpoints, compare

CUDA = pytest.mark.skipif(not kernels.available(), reason="the kernel runs on MLX CUDA only")

# (Hq, Hkv, D, L, offset, rope_scaling)
SHAPES = [
    (32, 8, 128, 16, 2041, None),       # Qwen3-4B's verify
    (16, 8, 128, 1, 0, None),           # one row at the start
    (8, 2, 64, 7, 300, {"type": "linear", "factor": 2.0}),
]

# bf16: the kernel rounds once (after the rotation), mlx-lm's modules twice: no further from fp32
# than theirs, with a margin for where the two roundings happen to land closer.
BF16_FACTOR = 1.25

PLANTED = {
    "rotation": [("a * c - b * s", "a * c + b * s")],           # the first half rotated the wrong way
    "position": [("valid[0] + i)", "valid[0] + i + 1)")],       # every row one position late
    "weights": [("isq ? qw[j] : kw[j]", "qw[j]")],              # K normed with Q's weight
    "mean": [("ss / D + __int_as_float(EPS)", "ss / (D / 2) + __int_as_float(EPS)")],  # the mean square over half
}


def _attention(hq, hkv, d, scaling, seed=0):
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=hq, rms_norm_eps=1e-6, vocab_size=32, num_key_value_heads=hkv,
                           max_position_embeddings=4096, rope_theta=1e6, head_dim=d, tie_word_embeddings=True,
                           rope_scaling=scaling)
    a = qwen3.Attention(args)
    rng = np.random.default_rng(seed)
    a.q_norm.weight = mx.array(rng.uniform(0.5, 1.5, d).astype(np.float32))
    a.k_norm.weight = mx.array(rng.uniform(0.5, 1.5, d).astype(np.float32))
    return a


def _outside(shape, dtype) -> list:
    """The kernel against mlx-lm's modules on the same inputs, in fp32 (the inputs' rounded
    values): fp32, within the fp32 budget; bf16, no further from them than mlx-lm's own bf16
    modules (which round between the norm and the rotation) by BF16_FACTOR."""
    hq, hkv, d, L, offset, scaling = shape
    a = _attention(hq, hkv, d, scaling)
    a.set_dtype(dtype)
    rng = np.random.default_rng(1)
    qp, kp = (mx.array(rng.standard_normal((1, L, h * d)).astype(np.float32)).astype(dtype) for h in (hq, hkv))
    at = mx.array(offset, mx.int32)
    got = norm_rope.qk(a, qp, kp, at, kernels.device_valid(at))
    theirs = fast_verify.mlx_lm_qk(a, qp, kp, at, None)
    a.set_dtype(mx.float32)
    ref = fast_verify.mlx_lm_qk(a, qp.astype(mx.float32), kp.astype(mx.float32), at, None)
    bad = []
    for name, g, th, r in zip("qk", got, theirs, ref):
        if dtype == mx.float32:
            m = compare.tensor_metrics(g, r, budgets.DTYPE_DEFAULTS["float32"])
            bad += [] if m["ok"] else [(shape, name, m.get("max_abs"), m.get("error"))]
            continue
        ours, allowed = (mx.abs(x.astype(mx.float32) - r).max().item() for x in (g, th))
        bad += [] if np.isfinite(ours) and ours <= BF16_FACTOR * allowed else [(shape, name, ours, allowed)]
    return bad


@CUDA
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_norm_rope_is_mlx_lms_norms_and_rope(dtype):
    assert not [b for shape in SHAPES for b in _outside(shape, dtype)]


@pytest.fixture
def planted(monkeypatch):
    def plant(bug):
        for old, new in PLANTED[bug]:
            assert old in norm_rope.SOURCE, old
            monkeypatch.setattr(norm_rope, "SOURCE", norm_rope.SOURCE.replace(old, new))
        norm_rope._kernel.cache_clear()
    yield plant
    monkeypatch.undo()
    norm_rope._kernel.cache_clear()


@CUDA
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_norm_rope_bugs_fail(bug, planted):
    planted(bug)
    assert [b for shape in SHAPES for b in _outside(shape, mx.float32)], f"planted {bug!r} passed"


def _target(dtype=None):
    """The factory's Qwen3 target with head_dim 64 (the kernel's smallest), at `dtype`."""
    return targets.load(checkpoints.build("qwen3-target", 0, {"head_dim": 64}), dtype=dtype)


@CUDA
@pytest.mark.parametrize("bug", [None, "position"])
def test_kernel_verify_with_it_holds_its_tier(bug, planted, monkeypatch):
    """The kernel verify with the fused Q and K (the default where both run) is no further from the
    fp32 verify than the bf16 compiled verify by tests/test_bucketed_verify.py's KERNEL_BF16_FACTOR;
    a planted bug must leave that tier."""
    ref = tbv._verifies(_target(), "sdpa")
    allowed = tbv.KERNEL_BF16_FACTOR * tbv._distance(tbv._verifies(_target(mx.bfloat16), "sdpa"), ref)
    target = _target(mx.bfloat16)
    assert norm_rope.unsupported(target.model.model.layers[0].self_attn) is None
    if bug:
        planted(bug)
    distance = tbv._distance(tbv._verifies(target, "kernel"), ref)
    assert (distance <= allowed) == (bug is None), (bug, distance, allowed)


def _dflash_blocks(dtype, kv_bucket, attention="auto") -> tuple[list, object]:
    """Six rounds of the DFlash drafter with head_dim 64 (tests/test_bucketed.py's FEEDS, the
    context 5 -> 20 rows), drafter and target at `dtype`: each block's hidden and logits, as fp32;
    and the drafter."""
    path = checkpoints.build("dflash-drafter", 0, {"head_dim": 64})
    m = fast_dflash.load(path, kv_bucket=kv_bucket, bucket_attention=attention)
    target = targets.load(checkpoints.build("qwen3-target", 0, {}), dtype=dtype)
    if dtype is not None:
        m.set_dtype(dtype)
    rows, caches, out = tb._taps("qwen3-target", path), m.make_caches(), []
    for r, (lo, hi) in enumerate(tb.FEEDS):
        b = m.block(target, 7 + r, m.args.block_size - 1, rows[:, lo:hi].astype(dtype or mx.float32), caches)
        out.append([b.hidden.astype(mx.float32), b.logits.astype(mx.float32)])
    return out, m


def _dspark_blocks(dtype, kv_bucket, attention="auto") -> tuple[list, object]:
    """The same for the Qwen3 DSpark drafter (Fused where bucketed): hidden and base logits (not
    its Markov rows: they follow the block's own tokens, and one token apart between bf16 and fp32
    moves every row after it by the logits' size)."""
    path = checkpoints.build("dspark-drafter", 0, {**tb.DSPARK_VARIANTS["qwen3"], "target_overrides": {"head_dim": 64}})
    m = fast_dspark.load(path, True, kv_bucket, attention)
    if dtype is not None:
        m.set_dtype(dtype)
    target = tb._target("qwen3-target")
    rows = tb._taps("qwen3-target", path).astype(dtype or mx.float32)
    src, out = DeepspecSource(m, serve.TargetView(target, make_prompt_cache(target.model))), []
    for r, (lo, hi) in enumerate(tb.FEEDS):
        src.pending = rows[:, lo:hi]
        b = src._block([7 + r], None)
        out.append([x.astype(mx.float32) for x in (b.hidden, b.base_logits)])
    return out, m


BLOCKS = {"dflash": _dflash_blocks, "dspark": _dspark_blocks}


@CUDA
@pytest.mark.parametrize("bug", [None, "position", "rotation"])
@pytest.mark.parametrize("source", sorted(BLOCKS))
def test_bucketed_block_with_it_holds_its_tier(source, bug, planted, monkeypatch):
    """The bucketed DFlash block and the fused DSpark one in bf16 (kernel attention, the serve
    default there) with the fused Q and K are no further from the fp32 compiled block than the
    same block with norm_rope refused (mlx-lm's ops), by BF16_FACTOR; a planted bug must leave
    that tier."""
    blocks = BLOCKS[source]
    ref, m = blocks(None, None)
    assert norm_rope.unsupported(m.layers[0].self_attn) is None
    with monkeypatch.context() as refused:
        refused.setattr(norm_rope, "unsupported", lambda attn: "refused")
        unfused, _ = blocks(mx.bfloat16, tb.BUCKET, "kernel")
    if bug:
        planted(bug)
    allowed = BF16_FACTOR * tbv._distance(unfused, ref)
    distance = tbv._distance(blocks(mx.bfloat16, tb.BUCKET, "kernel")[0], ref)
    assert np.isfinite(distance) and (distance <= allowed) == (bug is None), (bug, distance, allowed)


def _stand_in(late: int, calls: list):
    """norm_rope.qk as the attention's own modules (`late`: positions that many late), called as
    the kernel is: projected rows, positions from the device copy of the offset."""
    def qk(attn, qp, kp, offset, valid):
        calls.append(qp.shape)
        d = attn.q_norm.weight.shape[0]
        at = valid[0] + late

        def heads(x, norm):
            return norm(x.reshape(1, x.shape[-2], -1, d)).transpose(0, 2, 1, 3)
        return attn.rope(heads(qp, attn.q_norm), offset=at), attn.rope(heads(kp, attn.k_norm), offset=at)
    return qk


@pytest.mark.parametrize("late", [0, 1])
@pytest.mark.parametrize("source", sorted(BLOCKS))
def test_the_bucketed_blocks_take_it_where_it_runs(source, late, monkeypatch):
    """Any backend, the kernel replaced by a stand-in of mlx-lm's ops: where norm_rope runs, the
    bucketed DFlash and fused DSpark blocks take their Q and K from it (every layer, every trace)
    and are the blocks without it (bit for bit on the CPU; on MLX CUDA, where the compiled graphs
    differ, within tests/test_bucketed.py's TIER); control: a stand-in one position late is not."""
    without, _ = BLOCKS[source](None, tb.BUCKET, "sdpa")
    calls: list = []
    monkeypatch.setattr(norm_rope, "unsupported", lambda attn: None)
    monkeypatch.setattr(norm_rope, "qk", _stand_in(late, calls))
    got, m = BLOCKS[source](None, tb.BUCKET, "sdpa")
    assert len(calls) == len(m.layers) * m._bucketed.traces > 0, calls
    outside = tb._outside_tier(got, without)
    assert bool(outside) == bool(late), outside
    if mx.default_device() == mx.cpu and not late:
        assert tbv._distance(got, without) == 0


def test_refusals(monkeypatch):
    """Off MLX CUDA, and there: a scaled RoPE that is not nn.RoPE (Llama 3's), a traditional one,
    norms of two eps, a head_dim not a multiple of 64. Control: the plain Qwen3 attention is taken."""
    if not kernels.available():
        assert "CUDA" in norm_rope.unsupported(_attention(4, 2, 64, None))
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert norm_rope.unsupported(_attention(4, 2, 64, None)) is None
    assert norm_rope.unsupported(_attention(4, 2, 64, {"type": "linear", "factor": 2.0})) is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 1024}
    assert "nn.RoPE" in norm_rope.unsupported(_attention(4, 2, 64, llama3))
    a = _attention(4, 2, 64, None)
    a.rope.traditional = True
    assert "nn.RoPE" in norm_rope.unsupported(a)
    a = _attention(4, 2, 64, None)
    a.k_norm.eps = 1e-5
    assert "eps" in norm_rope.unsupported(a)
    assert "multiple of 64" in norm_rope.unsupported(_attention(4, 2, 96, None))


def _translation_unit(source: str) -> str:
    t = test_kernels.CTYPES["bf16"]
    inputs = [("qp", t, 3), ("kp", t, 3), ("qw", t, 1), ("kw", t, 1), ("valid", "int32_t", 1)]
    template = [("T", t), ("HQ", 32), ("HKV", 8), ("L", 16), ("D", 128), ("EPS", kernels.scale_bits(1e-6)),
                ("SCALE", kernels.scale_bits(1.0)), ("LOG2BASE", kernels.scale_bits(19.93))]
    return test_kernels.STUB + test_kernels._kernel("norm_rope", source, inputs, [("q", t), ("k", t)], template)


@pytest.mark.slow
@pytest.mark.skipif(test_kernels.NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_75"])
def test_norm_rope_source_compiles(arch, tmp_path):
    """Its CUDA source compiles wherever nvcc is installed (no tensor cores: MLX CUDA's oldest
    target too). Control: a statement's semicolon dropped fails."""
    done = test_kernels._compiles(_translation_unit(norm_rope.SOURCE), tmp_path, arch)
    assert done.returncode == 0, done.stderr[-2000:]
    broken = norm_rope.SOURCE.replace("ss += y[e] * y[e];", "ss += y[e] * y[e]")
    assert test_kernels._compiles(_translation_unit(broken), tmp_path, arch).returncode != 0

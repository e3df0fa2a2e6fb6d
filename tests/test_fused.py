"""DSpark's fused path (port/fast/dspark.py Fused, the provider's default): the bucketed block on
stacked projections (port/fast/fusion.py); and DFlash's bucketed block on transposed weight views
(fusion.Transposed), held the same way. Held to the unfused bucketed block (and through it to
the plain forward) bit for bit on the CPU backend, where MLX's batched matmul gives each stacked
part the bits of its own product (measured over every variant here); on another backend within
the fp32 budget with the same greedy tokens (the H200's tier: docs/benchmarks.md). A planted fault
in the stacks (two parts swapped, from outside the port) must fail the same comparison."""

import mlx.core as mx
import pytest
from test_bucketed import BUCKET, _bits_same, _dflash_rounds, _dspark_rounds, _within_tier
from test_speed import DSPARK_VARIANTS

from spec_parity import checkpoints
from spec_parity.port.fast import dspark as fast_dspark
from spec_parity.port.fast import fusion

ON_CPU = mx.default_device().type == mx.DeviceType.cpu


def _held(fused, unfused) -> tuple[bool, object]:
    """The tier: bit for bit on the CPU backend, else within fp32 with the same tokens."""
    if ON_CPU:
        return _bits_same(fused, unfused), "bits differ"
    return _within_tier(fused, unfused)


@pytest.mark.parametrize("variant", DSPARK_VARIANTS)
def test_fused_block_holds_the_unfused_one(variant):
    """Six rounds over buffers of 8, 16, 24 context rows: the fused block is the unfused one (its
    tier), traced once per buffer length like it."""
    unfused, _ = _dspark_rounds(variant, BUCKET, model=_load(variant, fused=False))
    m = _load(variant)
    fused, _ = _dspark_rounds(variant, BUCKET, model=m)
    assert type(m) is fast_dspark.Fused
    ok, bad = _held(fused, unfused)
    assert ok, bad
    assert m._bucketed.traces == 3


@pytest.mark.parametrize("swap", ["gate_up0", "ctx_k", "kv1"])
def test_swapped_stack_parts_fail_the_comparison(swap, monkeypatch):
    """Negative control: one stack built with two of its parts in the wrong order (layer 0's gate
    and up; layers 0 and 1 of the context K; layer 1's block K and V) is caught."""
    unfused, _ = _dspark_rounds("qwen3", BUCKET, model=_load("qwen3", fused=False))
    add = fusion.Stacks.add

    def swapped(self, name, owners, adopt=False):
        if name == swap:
            owners = [owners[1], owners[0], *owners[2:]]
        return add(self, name, owners, adopt)

    monkeypatch.setattr(fusion.Stacks, "add", swapped)
    planted, _ = _dspark_rounds("qwen3", BUCKET, model=_load("qwen3"))
    assert not _held(planted, unfused)[0]


def test_a_weight_replaced_after_load_is_seen():
    """The stacks are rebuilt when a weight they were built from is replaced: the fused block
    then equals the unfused one with the same replacement, and differs from before it."""
    def grow(model):
        mlp = model.layers[1].mlp
        mlp.up_proj.weight = mlp.up_proj.weight * 1.5
        attn = model.layers[0].self_attn
        attn.k_proj.weight = attn.k_proj.weight * 0.5

    fused, unfused = _load("qwen3"), _load("qwen3", fused=False)
    before, _ = _dspark_rounds("qwen3", BUCKET, model=_load("qwen3"))
    for model in (fused, unfused):
        grow(model)
    after_fused, _ = _dspark_rounds("qwen3", BUCKET, model=fused)
    after_unfused, _ = _dspark_rounds("qwen3", BUCKET, model=unfused)
    assert _held(after_fused, after_unfused)[0]
    assert not _held(after_fused, before)[0]


def test_adopted_weights_stay_the_loaded_ones():
    """Adopting (the module's weights become views of their stacks) changes no weight, and a
    stack is not rebuilt while nothing changed."""
    m, loaded = _load("qwen3"), _load("qwen3", fused=False)
    stacks = m.weights()
    for i, (layer, ref) in enumerate(zip(m.layers, loaded.layers)):
        mlp = layer.mlp
        assert mx.array_equal(mlp.gate_proj.weight, ref.mlp.gate_proj.weight)
        assert mx.array_equal(stacks[f"gate_up{i}"][1], ref.mlp.up_proj.weight)
        assert mx.array_equal(stacks["ctx_k"][i], ref.self_attn.k_proj.weight)
    assert m.weights()["gate_up0"] is stacks["gate_up0"]   # not rebuilt while nothing changed


def _load(variant: str, fused: bool = True):
    return fast_dspark.load(checkpoints.build("dspark-drafter", 0, DSPARK_VARIANTS[variant]), kv_bucket=BUCKET,
                            fused=fused)


def _dflash_after_growth(kv_bucket):
    """DFlash rounds after layer 0's up and layer 1's K projection are replaced (after a first
    pass of rounds, so a view taken before the change would be stale)."""
    _, m = _dflash_rounds("qwen3", kv_bucket)
    m.layers[0].mlp.up_proj.weight = m.layers[0].mlp.up_proj.weight * 1.5
    m.layers[1].self_attn.k_proj.weight = m.layers[1].self_attn.k_proj.weight * 0.5
    return _dflash_rounds("qwen3", kv_bucket, model=m)[0]


def test_dflash_transposed_views_follow_a_replaced_weight(monkeypatch):
    """The bucketed block's transposed views are rebuilt when a weight is replaced: it holds the
    plain block with the same replacement (its tier). Negative control, planted from outside the
    port: views never rebuilt after the first (stale weights) fail the same comparison."""
    plain = _dflash_after_growth(None)
    assert _held(_dflash_after_growth(BUCKET), plain)[0]
    current = fusion.Transposed.current

    def stale(self):
        return self.views if self.views is not None else current(self)

    monkeypatch.setattr(fusion.Transposed, "current", stale)
    assert not _held(_dflash_after_growth(BUCKET), plain)[0]

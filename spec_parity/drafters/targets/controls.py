"""Negative controls of the target forward (port/targets.py): one layer's RoPE base scaled. Parity
must fail and name that layer as the first divergent one."""

from __future__ import annotations

from ...controls import control

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.targets:load",
)

ROPE_LAYERS = (1, 3)   # the layers the targets pair perturbs (Qwen3: 1, Gemma-4: 3)
ROPE_BASE_SCALE = 1.001


def scale_rope_base(target, layer: int, factor: float) -> None:
    """Rebuild one layer's RoPE of a loaded target with its base x factor."""
    from mlx_lm.models.rope_utils import initialize_rope

    attn = target.model.model.layers[layer].self_attn
    c = target.config
    if target.family == "gemma4":
        params = dict(c["rope_parameters"][c["layer_types"][layer]])
        params["rope_theta"] = params["rope_theta"] * factor
        attn.rope = initialize_rope(dims=attn.head_dim, traditional=False, base=params["rope_theta"],
                                    scaling_config=params, max_position_embeddings=c["max_position_embeddings"])
    else:
        attn.rope = initialize_rope(dims=c["head_dim"], traditional=False, base=c["rope_theta"] * factor,
                                    scaling_config=None, max_position_embeddings=c["max_position_embeddings"])


def _rope_base(layer: int):
    def swaps(case):
        from spec_parity.port import targets

        load = targets.load

        def perturbed(*args, **kwargs):
            target = load(*args, **kwargs)
            scale_rope_base(target, layer, ROPE_BASE_SCALE)
            return target

        return {(targets, "load"): perturbed}
    return swaps


for _layer in ROPE_LAYERS:
    control("targets", f"rope-L{_layer}", f"RoPE base x{ROPE_BASE_SCALE} in layer {_layer}")(_rope_base(_layer))

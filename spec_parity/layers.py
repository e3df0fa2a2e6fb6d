"""First divergent layer: which layer's OWN error first exceeds its budget.

Free-running per-layer errors accumulate drift from every earlier layer; the teacher-forced errors
(each port layer fed the reference's input to that layer) are each layer's own. A planted bug in
layer i shows as the first teacher-forced failure at i, even when drift makes later free-running
layers fail too.
"""

from __future__ import annotations

from .budgets import budget_for
from .compare import bit_exact, tensor_metrics


def localize(free, own, ref, module: str, dtype: str = "float32", tier: str = "L2",
             quantity: str = "hidden") -> dict:
    """free/own: per-layer port outputs (free-running / teacher-forced); ref: reference outputs.

    At L2 free-running outputs are held to the module's `quantity` budget, own errors to the
    tighter `quantity`_own one (measured on own errors, which carry no inherited drift); at L1
    both are bit-exact."""
    budget, free_budget = budget_for(module, quantity + "_own", dtype), budget_for(module, quantity, dtype)
    if tier == "L1":
        free_m = [bit_exact(p, r) for p, r in zip(free, ref)]
        own_m = [bit_exact(p, r) for p, r in zip(own, ref)]
    else:
        free_m = [tensor_metrics(p, r, free_budget, dtype) for p, r in zip(free, ref)]
        own_m = [tensor_metrics(p, r, budget, dtype) for p, r in zip(own, ref)]
    first_own = next((i for i, m in enumerate(own_m) if not m["ok"]), None)
    first_free = next((i for i, m in enumerate(free_m) if not m["ok"]), None)
    return {
        "ok": first_own is None and first_free is None,
        "first_divergent_layer": first_own,
        "first_free_running_failure": first_free,
        "free_max_abs": [m.get("max_abs", 0.0) for m in free_m],
        "own_max_abs": [m.get("max_abs", 0.0) for m in own_m],
        "budget": "bit-exactness" if tier == "L1" else budget.describe(),
        "own_budget_atol": budget.atol,
        "free_budget_atol": free_budget.atol,
    }


def quantities(port: dict, ref: dict) -> dict[str, float]:
    """Max |Δ| of the drafter layers (free-running `layer`, teacher-forced `layer_own`) where the
    port returned them: what `spec-parity measure` aggregates into the layer budgets."""
    import numpy as np

    out = {}
    for q, prefix in (("layer", "layer."), ("layer_own", "own.")):
        gaps = [float(np.max(np.abs(port[prefix + k[6:]].astype(np.float64) - ref[k])))
                for k in ref if k.startswith("layer.") and prefix + k[6:] in port]
        if gaps:
            out[q] = max(gaps)
    return out

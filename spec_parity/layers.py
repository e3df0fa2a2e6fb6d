"""First divergent layer: which layer's OWN error first exceeds its budget.

Free-running per-layer errors accumulate drift from every earlier layer; the teacher-forced errors
(each port layer fed the reference's input to that layer) are each layer's own. A planted bug in
layer i shows as the first teacher-forced failure at i, even when drift makes later free-running
layers fail too.
"""

from __future__ import annotations

from .budgets import budget_for
from .compare import tensor_metrics


def localize(free, own, ref, module: str, dtype: str = "float32") -> dict:
    """free/own: per-layer port outputs (free-running / teacher-forced); ref: reference outputs.

    Free-running outputs are held to the module's "hidden" budget, own errors to the tighter
    "hidden_own" one (measured on own errors, which carry no inherited drift)."""
    budget, free_budget = budget_for(module, "hidden_own", dtype), budget_for(module, "hidden", dtype)
    free_m = [tensor_metrics(p, r, free_budget, dtype) for p, r in zip(free, ref)]
    own_m = [tensor_metrics(p, r, budget, dtype) for p, r in zip(own, ref)]
    first_own = next((i for i, m in enumerate(own_m) if not m["ok"]), None)
    first_free = next((i for i, m in enumerate(free_m) if not m["ok"]), None)
    return {
        "ok": first_own is None and first_free is None,
        "first_divergent_layer": first_own,
        "first_free_running_failure": first_free,
        "free_max_abs": [m["max_abs"] for m in free_m],
        "own_max_abs": [m["max_abs"] for m in own_m],
        "budget": budget.describe(),
        "own_budget_atol": budget.atol,
        "free_budget_atol": free_budget.atol,
    }

"""layers-MODULE.png (matplotlib): one figure per module, one panel per case that records
per-layer errors. Per layer the free-running max|Δ| (blue) and the layer's own, teacher-forced
max|Δ| (orange) on a log scale (a zero error shows no bar), the first divergent layer's bar red
and labelled. An L2/L3 panel
draws its two budgets as dashed lines; an L1 panel's budget is bit-exactness, so it draws none
and its legend says so. Every panel has its own legend; the case's name and verdict are its title.
"""

from __future__ import annotations

import io
import re

import numpy as np

FLOOR = 1e-9  # a zero error is drawn at the floor (a log axis has no 0)
FREE, OWN, FIRST = "#3a5fcd", "#f28e2b", "#d62728"


def chart_name(module: str) -> str:
    return f"layers-{re.sub(r'[^A-Za-z0-9_.-]+', '-', module)}.png"


def layer_chart(panels: list[tuple[str, str, dict]], title: str = "") -> bytes:
    """A PNG's bytes: a panel per (case name, tier, layer localization), two columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    panel_w, panel_h, gap_w, gap_h = 6.4, 3.3, 0.9, 0.95    # inches; a gap holds titles and labels
    width, height = panel_w * cols, panel_h * rows + 0.6
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(width, height))
    # Fixed margins (a constrained layout measured every label: 4 of a module's 10 s); subplots_adjust
    # takes the gaps as fractions of an axis's own width and height.
    fig.subplots_adjust(left=0.7 / width, right=1 - 0.2 / width, top=1 - gap_h / height, bottom=0.45 / height,
                        hspace=gap_h / (panel_h - gap_h), wspace=gap_w / (panel_w - gap_w))
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, tier, lay) in zip(axes.flat, panels):
        _panel(ax, name, tier, lay)
    fig.suptitle(f"{title}: per-layer error, port vs reference (log scale; a zero error shows no bar)"
                 if title else "Per-layer error, port vs reference", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _panel(ax, name: str, tier: str, lay: dict) -> None:
    free, own = (np.asarray(lay[k], float) for k in ("free_max_abs", "own_max_abs"))
    bit_exact = tier == "L1"
    budgets = [] if bit_exact else [lay["free_budget_atol"], lay["own_budget_atol"]]
    finite = np.concatenate([free, own, budgets, [FLOOR]])
    top = float(np.max(finite[np.isfinite(finite)]))
    bad = ~np.isfinite(own) | ~np.isfinite(free)
    identical = bool(np.all(free == 0) and np.all(own == 0))
    free, own = (np.maximum(np.where(np.isfinite(v), v, top * 10), FLOOR) for v in (free, own))
    x = np.arange(len(free))
    for i in np.flatnonzero(bad):
        ax.text(i, FLOOR * 3, "NaN/Inf", ha="center", va="bottom", rotation=90, fontsize=8, color="black")
    first = lay["first_divergent_layer"]
    ax.bar(x - 0.2, free, 0.4, color=FREE)
    ax.bar(x + 0.2, own, 0.4, color=[FIRST if i == first else OWN for i in x])
    for color, label in ((FREE, "free-running max|Δ|"), (OWN, "own (teacher-forced) max|Δ|")) + (
            ((FIRST, "first divergent layer (own)"),) if first is not None else ()):
        ax.bar([0], [0], 0, color=color, label=label)  # the legend's key: one color per meaning
    if bit_exact:
        ax.plot([], [], ls="none", label="L1 budget: bit-exact (any visible bar fails)")
    else:
        ax.axhline(lay["free_budget_atol"], color="#1f2a6e", ls="--", lw=1.2,
                   label=f"free-running budget (atol {lay['free_budget_atol']:.0e})")
        ax.axhline(lay["own_budget_atol"], color="#d62728", ls="--", lw=1.2,
                   label=f"own budget (atol {lay['own_budget_atol']:.0e})")
    if first is not None:
        ax.annotate(f"first divergent layer {first}", (first + 0.2, own[first]), xytext=(0, 16),
                    textcoords="offset points", ha="center", fontsize=8, color="#d62728",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},
                    arrowprops={"arrowstyle": "->", "color": "#d62728"})
    verdict = "all layers within budget" if lay.get("ok") else (
        f"first divergent layer {first}" if first is not None else "free-running drift over budget")
    ax.set_title(f"{name} ({tier})\n{verdict}", fontsize=8.5, loc="left")
    ax.set_yscale("log")
    ax.set_ylim(FLOOR, top * 1e6)  # a zero error, drawn at the floor, shows no bar
    if identical:
        ax.text(0.5, 0.3, "every layer identical (max|Δ| = 0)", transform=ax.transAxes, ha="center",
                fontsize=9, color="#555555")
    decades = np.arange(np.log10(FLOOR), np.log10(top * 1e6) + 1, 2)
    ax.set_yticks(10.0 ** decades, [f"$10^{{{d:.0f}}}$" for d in decades])   # fixed: no locator per draw
    ax.minorticks_off()
    ax.set_xticks(x)
    ax.set_xlabel("layer", fontsize=8)
    ax.set_ylabel("max |port − reference|", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(loc="upper left", ncol=2, fontsize=6.5, frameon=True, framealpha=0.85)

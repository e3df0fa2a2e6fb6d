"""Reports of a matrix run: a table on stdout, report.md, report.json, layers.png, and the
progress of the run on stderr.

layers.png (matplotlib): one panel per case that records per-layer errors, in the order of
report.md's layer table; per layer the free-running max|Δ| (blue) and the layer's own,
teacher-forced max|Δ| (orange) on a log scale, the two budgets as dashed lines, the first
divergent layer's bar red and labelled. Every file is written atomically, and a report file the
new run does not write (a layers.png from an earlier run) is removed: the folder never mixes runs.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from .compare import Result
from .goldens import atomic_write

REPORT_FILES = ("report.json", "report.md", "layers.png")


class Progress:
    """A rich progress bar when stderr is a terminal; otherwise one plain line per finished case
    (`[3/49] PASS targets/qwen3 (1.2 s)`), which logs and CI read."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream, self.done_n = total, stream or sys.stderr, 0
        self.bar = None
        self.t0 = time.time()

    def __enter__(self) -> Progress:
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=Console(file=self.stream), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("starting", total=self.total)
        return self

    def start(self, label: str) -> None:
        self.t0 = time.time()
        if self.bar is not None:
            self.bar.update(self.task, description=label)

    def done(self, label: str, verdict: str) -> None:
        self.done_n += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1)
        else:
            self.stream.write(f"[{self.done_n}/{self.total}] {verdict} {label} ({time.time() - self.t0:.1f} s)\n")
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def check_writable(out_dir: Path) -> None:
    """Refuse an --out that cannot hold the report before any case runs (it was found only after
    the last one). Creates the folder; raises OSError with the reason."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError("a file, not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=out_dir)
    os.close(fd)
    os.unlink(probe)


def table(rows: list[tuple[Result, str]]) -> str:
    head = ("module", "case", "oracle", "tier", "verdict", "expected", "checks run", "worst max|Δ|")
    body = []
    for r, expect in rows:
        worst = max((m.get("max_abs", 0.0) for m in r.metrics.values()
                     if isinstance(m, dict) and isinstance(m.get("max_abs"), float)), default=0.0)
        body.append((r.module, r.case, r.oracle, r.tier, r.shown_verdict, expect, r.checks_run, f"{worst:.2e}"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def _layers(r: Result) -> dict | None:
    """The result's layer localization, None where the port exposed no per-layer outputs."""
    lay = r.metrics.get("layers")
    return lay if lay and lay.get("exposed", True) else None


def markdown(rows: list[tuple[Result, str]], header: str = "") -> str:
    out = ["# spec-parity report", "", header, "",
           "| module | case | oracle | tier | verdict | checks run | worst max abs | reason |",
           "|---|---|---|---|---|---|---|---|"]
    out += [r.markdown_row() for r, _ in rows]
    out += ["", "## Per-layer error (free-running / own teacher-forced max abs)", ""]
    for r, _ in rows:
        lay = _layers(r)
        if not lay:
            continue
        free = ", ".join(f"{x:.1e}" for x in lay["free_max_abs"])
        own = ", ".join(f"{x:.1e}" for x in lay["own_max_abs"])
        first = lay["first_divergent_layer"]
        out.append(f"- **{r.module}/{r.case}**: first divergent layer "
                   f"{'none (every own error within budget)' if first is None else first}; "
                   f"free [{free}]; own [{own}]; budget {lay['budget']}")
    out += ["", "## Details", ""]
    for r, _ in rows:
        out += ["```", r.message(), "```"]
    return "\n".join(out) + "\n"


def write(out_dir: Path, rows: list[tuple[Result, str]], header: str) -> list[Path]:
    """report.json, report.md and (when a case records layers) layers.png, each atomically; the
    report files this run does not write are removed. Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "report.json": (json.dumps({"header": header, "results": [{**r.to_json(), "expected": e} for r, e in rows]},
                                   indent=2) + "\n").encode(),
        "report.md": markdown(rows, header).encode(),
    }
    panels = [(f"{r.module}/{r.case}", _layers(r)) for r, _ in rows if _layers(r)]
    if panels:
        files["layers.png"] = layer_chart(panels)
    for name, data in files.items():
        atomic_write(out_dir / name, data)
    for name in set(REPORT_FILES) - set(files):
        (out_dir / name).unlink(missing_ok=True)
    return [out_dir / n for n in files]


def layer_chart(panels: list[tuple[str, dict]]) -> bytes:
    """layers.png's bytes: see the module docstring."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-9  # a zero error is drawn at the floor (a log axis has no 0)
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    height = 2.8 * rows + 0.9  # the panels, then the title and the legend
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(6.2 * cols, height))
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, lay) in zip(axes.flat, panels):
        free, own = (np.asarray(lay[k], float) for k in ("free_max_abs", "own_max_abs"))
        finite = np.concatenate([free, own, [lay["free_budget_atol"], lay["own_budget_atol"]]])
        top = float(np.max(finite[np.isfinite(finite)]))
        bad = ~np.isfinite(own) | ~np.isfinite(free)
        free, own = (np.maximum(np.where(np.isfinite(v), v, top * 10), floor) for v in (free, own))
        x = np.arange(len(free))
        for i in np.flatnonzero(bad):
            ax.text(i, floor * 3, "NaN/Inf", ha="center", va="bottom", rotation=90, fontsize=8, color="black")
        first = lay["first_divergent_layer"]
        ax.bar(x - 0.2, free, 0.4, color="#3a5fcd", label="free-running max|Δ|")
        ax.bar(x + 0.2, own, 0.4, color=["#d62728" if i == first else "#f28e2b" for i in x],
               label="own (teacher-forced) max|Δ|")
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
        ax.set_title(f"{name}: {verdict}", fontsize=9, loc="left")
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, top * 300)
        ax.set_xticks(x)
        ax.set_xlabel("layer", fontsize=8)
        ax.set_ylabel("max |port − reference|", fontsize=8)
        ax.tick_params(labelsize=7)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Per-layer error, port vs reference (log scale; a zero is drawn at 1e-9)", fontsize=10)
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1 - 0.05 / height))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_png(path: Path, rgb: np.ndarray) -> None:
    """An RGB array as a PNG with numpy and zlib only: the bench's chart where matplotlib is not wanted."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)

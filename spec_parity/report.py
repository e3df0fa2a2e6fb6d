"""Reports of a matrix run: a table on stdout, report.json (spec_parity.report_schema), report.md
and report.html (spec_parity.report_render), layers-MODULE.png (spec_parity.report_plot), and
the progress of the run on stderr. Every file is written atomically, and a report file the new
run does not write (a layers chart from an earlier run) is removed: the folder never mixes runs.
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

from . import report_plot, report_render, report_schema
from .compare import Result
from .goldens import atomic_write

REPORT_FILES = ("report.json", "report.md", "report.html", "layers.png")


class Progress:
    """A rich progress bar when stderr is a terminal: the running case, its elapsed time, the cases
    done and the run's time; otherwise one plain line per finished case
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

            self.bar = Bar(TextColumn("{task.description}"), _case_elapsed_column(), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=Console(file=self.stream), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("starting", total=self.total, since=self.t0)
        return self

    def start(self, label: str) -> None:
        self.t0 = time.time()
        if self.bar is not None:
            self.bar.update(self.task, description=label, since=self.t0)

    def done(self, label: str, verdict: str, seconds: float | None = None) -> None:
        """A finished case; `seconds`: its own time where it ran elsewhere (a worker)."""
        self.done_n += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1)
        else:
            took = time.time() - self.t0 if seconds is None else seconds
            self.stream.write(f"[{self.done_n}/{self.total}] {verdict} {label} ({took:.1f} s)\n")
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _case_elapsed_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class CaseElapsed(ProgressColumn):
        """The running case's seconds so far (the bar's own clock is the run's)."""

        def render(self, task) -> Text:
            return Text(f"{time.time() - task.fields.get('since', time.time()):6.1f} s", style="cyan")

    return CaseElapsed()


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
    return lay if lay and lay.get("exposed", True) and "own_max_abs" in lay else None


def charts(rows: list[tuple[Result, str]]) -> dict[str, bytes]:
    """layers-MODULE.png per module whose cases record layers (spec_parity.report_plot)."""
    by_module: dict[str, list] = {}
    for r, _ in rows:
        if _layers(r):
            by_module.setdefault(r.module, []).append((r.case, r.tier, _layers(r)))
    return {report_plot.chart_name(m): report_plot.layer_chart(p, m) for m, p in by_module.items()}


def markdown(rows: list[tuple[Result, str]], header: str = "", doc: dict | None = None,
             charts: tuple[str, ...] = ()) -> str:
    """report.md of `rows`: the summary first (spec_parity.report_render)."""
    doc = doc or report_schema.document(rows, header)
    return report_render.markdown(report_render.blocks(doc, _messages(rows), list(charts)))


def _messages(rows: list[tuple[Result, str]]) -> dict[str, str]:
    return {f"{r.module}/{r.case}": r.message() for r, _ in rows}


def write(out_dir: Path, rows: list[tuple[Result, str]], header: str, run: dict | None = None,
          ports: list[dict] | None = None) -> list[Path]:
    """report.json (validated against its schema), report.md, report.html and a layers-MODULE.png
    per module that records layers, each atomically; the report files this run does not write are
    removed. `run` and `ports`: report_schema.run_info() and port_entries(). Returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = report_schema.document(rows, header, run, ports)
    report_schema.validate(doc)
    files = charts(rows)
    bl = report_render.blocks(doc, _messages(rows), sorted(files))
    files.update({"report.json": (json.dumps(doc, indent=2) + "\n").encode(),
                  "report.md": report_render.markdown(bl).encode(),
                  "report.html": report_render.html_page(bl).encode()})
    for name, data in files.items():
        atomic_write(out_dir / name, data)
    stale = {p.name for p in out_dir.glob("layers*.png")} | set(REPORT_FILES)
    for name in stale - set(files):
        (out_dir / name).unlink(missing_ok=True)
    return [out_dir / n for n in files]


def write_png(path: Path, rgb: np.ndarray) -> None:
    """An RGB array as a PNG with numpy and zlib only: the bench's chart where matplotlib is not wanted."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)

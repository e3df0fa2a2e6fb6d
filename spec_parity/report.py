"""Reports of a matrix run: a table on stdout, report.md, report.json, layers.png.

The PNG is drawn with numpy and zlib only (no plotting dependency): one panel per case with
per-layer errors on a log scale from 1e-8 (bottom) to 1e-2 (top); for each layer a blue bar (free-
running error) and an orange bar (the layer's own, teacher-forced error); the dark blue line is the
free-running budget, the red line the own-error budget. A failing layer's own bar is drawn red. Panels are in the order of report.md's layer table.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

from .compare import Result


def progress(i: int, n: int, label: str, stream=sys.stderr) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    stream.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:50]:<50}")
    if i == n:
        stream.write("\n")
    stream.flush()


def table(rows: list[tuple[Result, str]]) -> str:
    head = ("module", "case", "oracle", "tier", "verdict", "expected", "worst max|Δ|")
    body = []
    for r, expect in rows:
        worst = max((m.get("max_abs", 0.0) for m in r.metrics.values()
                     if isinstance(m, dict) and isinstance(m.get("max_abs"), float)), default=0.0)
        body.append((r.module, r.case, r.oracle, r.tier, r.verdict, expect, f"{worst:.2e}"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def markdown(rows: list[tuple[Result, str]], header: str = "") -> str:
    out = ["# spec-parity report", "", header, "",
           "| module | case | oracle | tier | verdict | worst max abs | reason |",
           "|---|---|---|---|---|---|---|"]
    out += [r.markdown_row() for r, _ in rows]
    out += ["", "## Per-layer error (free-running / own teacher-forced max abs)", ""]
    for r, _ in rows:
        lay = r.metrics.get("layers")
        if not lay:
            continue
        free = ", ".join(f"{x:.1e}" for x in lay["free_max_abs"])
        own = ", ".join(f"{x:.1e}" for x in lay["own_max_abs"])
        out.append(f"- **{r.module}/{r.case}**: first divergent layer {lay['first_divergent_layer']}; "
                   f"free [{free}]; own [{own}]; budget {lay['budget']}")
    out += ["", "## Details", ""]
    for r, _ in rows:
        out += ["```", r.message(), "```"]
    return "\n".join(out) + "\n"


def write(out_dir: Path, rows: list[tuple[Result, str]], header: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(
        {"header": header, "results": [{**r.to_json(), "expected": e} for r, e in rows]}, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(rows, header))
    panels = [r.metrics["layers"] for r, _ in rows if "layers" in r.metrics]
    if panels:
        write_png(out_dir / "layers.png", layer_chart(panels))


def layer_chart(panels: list[dict], h: int = 120, bar: int = 8) -> np.ndarray:
    lo, hi = -8.0, -2.0
    width = max(len(p["free_max_abs"]) for p in panels) * (2 * bar + 6) + 10
    img = np.full((len(panels) * (h + 10), width, 3), 255, np.uint8)

    def y_of(v: float) -> int:
        t = (np.log10(max(v, 1e-12)) - lo) / (hi - lo)
        return int(round((1 - min(max(t, 0.0), 1.0)) * (h - 1)))

    for row, lay in enumerate(panels):
        top = row * (h + 10)
        img[top + h, :] = 0
        for i, (free, own) in enumerate(zip(lay["free_max_abs"], lay["own_max_abs"])):
            x = 10 + i * (2 * bar + 6)
            img[top + y_of(free):top + h, x:x + bar] = (60, 90, 200)
            colour = (220, 30, 30) if i == lay["first_divergent_layer"] else (240, 140, 30)
            img[top + y_of(own):top + h, x + bar:x + 2 * bar] = colour
        img[top + y_of(lay["free_budget_atol"]), :] = (20, 30, 110)
        img[top + y_of(lay["own_budget_atol"]), :] = (220, 30, 30)
    return img


def write_png(path: Path, rgb: np.ndarray) -> None:
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    path.write_bytes(png)

"""The bench's outputs: bench.json (every figure, the command, the machine), bench.md (tables) and
bench.png (ms per draft step per side, with the floor): matplotlib if importable, else drawn with
numpy and written by spec_parity.report.write_png."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..goldens import atomic_write
from .port_sides import verify_words

MIB = 1 << 20


def _ms(s) -> str:
    if s is None:
        return "–"
    v = s * 1e3
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×" if v < 10 else f"{v:.0f}×"


def _num(v, fmt="{:.0f}") -> str:
    return "–" if v is None else fmt.format(v)


def _mib(mem: dict | None) -> str:
    """Peak MiB and, in brackets, its rise over what was active before (the step's own memory)."""
    if not mem:
        return "–"
    rise = (mem["peak_bytes"] - mem["active_before_bytes"]) / MIB
    return f"{mem['peak_bytes'] / MIB:.0f} (+{rise:.1f})"


def _gbs(b: float) -> str:
    return f"{b / 1e9:.1f} GB/s"


def header(doc: dict) -> str:
    m, v = doc["machine"], doc["versions"]
    dev = m["mlx_default_device"]
    info = m.get("mlx_device_info") or {}
    name = info.get("device_name") or info.get("architecture") or ""
    o = doc["options"]
    bw = doc["bandwidth"]
    load = f", load average {m['loadavg'][0]:.1f} on {m['cpu_count']} CPUs" if m.get("loadavg") else ""
    return (f"`{doc['command']}`\n\n"
            f"project {_identity(doc)}; MLX {v.get('mlx', '?')} on {dev} ({name}){_mlx_env(m)}{load}; python {m['python']}; "
            f"shapes {o['shapes']}{' /' + str(o['scale']) if o['scale'] > 1 else ''}, {o['dtype']}, "
            f"{o['warmup']} warm-up + {o['iters']} timed runs; torch sides: {doc['torch_sides']}; "
            f"whole run {doc['wall_s']:.0f} s.\n\n"
            f"Bandwidth measured in this run ({bw['bytes'] / MIB:.0f} MiB buffer): copy {_gbs(bw['copy_bytes_per_s'])} "
            f"({bw['copy']}), read {_gbs(bw['read_bytes_per_s'])} ({bw['read']}). Floor = bytes a step must read / "
            "copy bandwidth." + _launch(doc.get("launch")))


def _launch(launch: dict | None) -> str:
    if not launch:
        return ""
    custom = (f"; {launch['custom_kernel_s'] * 1e6:.2f} µs per custom CUDA kernel (build "
              f"{launch['custom_kernel_build_s'] * 1e6:.2f})" if "custom_kernel_s" in launch
              else f"; custom kernel {launch['custom_kernel']}")
    return (f" Launch cost measured in this run ({launch['chain']}): {launch['primitive_s'] * 1e6:.2f} µs per MLX "
            f"primitive (Python graph build {launch['primitive_build_s'] * 1e6:.2f}){custom}. Launch floor = "
            "launches per step × the primitive's cost.")


def step_table(doc: dict) -> list[str]:
    out = ["| case | side | ms / call | p10–p90 | CPU ms / call | graph build ms / call | ms / step | × best peer | "
           "port's speed-up over it | × floor | floor ms / step | host syncs / call | graph ops / call | peak MiB (+ rise) | "
           "first draft = port's | cold ms / call |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cases"]:
        if c.get("status") != "ok":
            out.append(f"| {c['case']} | – | failed: {c.get('reason', '')} ||||||||||||")
            continue
        n = c["steps_per_call"]
        floor_step = c["floor"]["copy_floor_s"] / n
        for s in c["sides"]:
            if s.get("status") != "ok":
                continue
            w = s["wall_s"]
            name = f"**{s['side']}**" if s["side"] == "port" else s["side"]
            if s["side"] == c.get("best_peer"):
                name += " (best peer)"
            out.append(f"| {c['case']} | {name} | {_ms(w['median'])} | {_ms(w['p10'])}–{_ms(w['p90'])} | "
                       f"{_ms(s['cpu_s']['median'])} | {_ms(s['graph_build_s']['median']) if 'graph_build_s' in s else '–'} | "
                       f"{_ms(s['per_step_s'])} | {_x(s.get('x_best_peer'))} | {_x(s.get('port_speedup'))} | {_x(s['x_floor'])} | "
                       f"{_ms(floor_step)} | "
                       f"{_num(s.get('host_syncs'))} | {_num(s.get('graph_ops'))} | {_mib(s.get('memory'))} | "
                       f"{'yes' if s.get('agrees_with_port') else 'NO ' + s.get('agreement', '')} | "
                       f"{_ms(s['cold_wall_s']['median']) if 'cold_wall_s' in s else '–'} |")
    return out


def _cold_round(sv: dict) -> str:
    c = sv.get("cold")
    if not c or not c.get("round_median_s"):
        return "– | –"
    r = c["round_median_s"]
    return f"{_ms(r['round_s'])} ({_ms(r['draft_s'])} / {_ms(r['verify_s'])}) | {c['decode_tokens_per_s']:.1f}"


def _serve_rows(doc: dict):
    """(row name, serve-loop figures) per case: the port's loop on each path the run has, the
    default first, each named with its verify (kv_bucket or mlx-lm's caches; compiled or plain)."""
    for c in doc["cases"]:
        for key in sorted((k for k in c if k == "serve" or k.startswith("serve_")), key=lambda k: k != "serve"):
            sv = c[key]
            yield f"{c['case']} ({sv.get('path', 'port')}, {verify_words(sv.get('kv_bucket'), sv.get('verify'))})", sv


def serve_table(doc: dict) -> list[str]:
    out = ["| case | γ | round ms | draft | verify | accept+trim | host syncs / round | largest host read / round | "
           "graph ops / round | decode tok/s | loop tok/s (with prefill) | τ | peak MiB (+ rise) | "
           "cold round ms (draft / verify) | cold decode tok/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, sv in _serve_rows(doc):
        if "round_median_s" not in sv:
            out.append(f"| {name} | – | failed: {sv.get('reason', '')} |||||||||||")
            continue
        r = sv["round_median_s"]
        out.append(f"| {name} | {sv['gamma']} | {_ms(r.get('round_s'))} | {_ms(r.get('draft_s'))} | "
                   f"{_ms(r.get('verify_s'))} | {_ms(r.get('accept_trim_s'))} | {sv['host_syncs_per_round']:.1f} | "
                   f"{_bytes(sv.get('host_read_max_bytes_per_round'))} | {sv['graph_ops_per_round']:.0f} | {sv['decode_tokens_per_s']['median']:.1f} | "
                   f"{sv['loop_tokens_per_s']['median']:.1f} | {sv['tau']:.2f} | {_mib(sv.get('memory'))} | "
                   f"{_cold_round(sv)} |")
    return out


def _bytes(n) -> str:
    return "–" if n is None else f"{n} B"


def kernel_tables(doc: dict) -> list[str]:
    """`--kernels`: per side, launches and device time per step against its wall time and the floor."""
    rows = [(c, s) for c in doc["cases"] for s in c.get("sides", []) if s.get("kernels")]
    if not rows:
        return []
    out = ["", "## GPU kernels per step (`--kernels`)", "",
           "CUPTI records of 10 synchronized calls (torch.profiler; MLX's kernels included), per step. busy = "
           "the union of kernel intervals (the device's own time); wall = the timed loop's median; the rest of "
           "the wall is the host building, dispatching and launching. Under the profiler each launch costs more "
           "host time, so its window is not the wall.", "",
           "| case | side | launches | Σ kernel ms | busy ms | wall ms | busy / floor | launch floor ms | top classes (ms) |",
           "|---|---|---|---|---|---|---|---|---|"]
    per_launch = (doc.get("launch") or {}).get("primitive_s")
    for c, s in rows:
        k, steps = s["kernels"], c.get("steps_per_call", 1)
        if k.get("status") != "ok":
            out.append(f"| {c['case']} | {s['side']} | {k.get('reason', '')} | | | | | | |")
            continue
        floor_ms = c["floor"]["copy_floor_s"] / steps * 1e3
        classes = ", ".join(f"{x['class']} {x['us_per_call'] / steps / 1e3:.3f}" for x in k["classes"][:4])
        out.append(f"| {c['case']} | {s['side']} | {k['launches_per_call'] / steps:.0f} | "
                   f"{k['kernel_us_per_call'] / steps / 1e3:.3f} | {k['busy_us_per_call'] / steps / 1e3:.3f} | "
                   f"{s['per_step_s'] * 1e3:.3f} | {k['busy_us_per_call'] / steps / 1e3 / floor_ms:.2f}x | "
                   f"{_ms(k['launches_per_call'] / steps * per_launch) if per_launch else '–'} | {classes} |")
    return out


def markdown(doc: dict) -> str:
    out = ["# spec-parity bench", "", header(doc), "",
           "## One draft call per side (a, c, e, f)", "",
           "A call is one draft step chain for the assistant (γ chained steps, as its loop drafts them; "
           "ms / step = ms / call ÷ γ) and one draft block for DSpark / DFlash (after one committed context "
           "row). Host syncs and graph ops are counted (MLX sides), see bench.json `what`. Block sources at real "
           "shapes: the timed calls run at context lengths the side has already seen (an untimed pre-pass), "
           "since MLX CUDA plans a multi-row-query attention once per key length and the first side to reach a "
           "length would otherwise pay for all; `cold ms / call` is the same call at lengths no side has seen "
           "(what a serving loop, whose context grows every round, pays).", ""]
    out += step_table(doc)
    out += ["", "## Our serve loop, spec_parity.port.serve.generate (b, c, d)", "",
            "Greedy, random-weight drafters (acceptance is what random weights give: see τ; most rounds are "
            "correction rounds), a fixed random prompt of ctx tokens, EOS off. Round phases are medians over the rounds after the first (which "
            "projects the prompt's context); verify = the target forward, accept+trim = from its end to the next "
            "draft (acceptance, cache trim, the source's commit). The timed requests repeat one warm-up request's "
            "context lengths; `cold` is one request of another prompt length (every length new).", ""]
    out += serve_table(doc)
    out += kernel_tables(doc)
    skipped = [(c["case"], s) for c in doc["cases"] for s in c.get("sides", []) if s.get("status") != "ok"]
    if skipped:
        out += ["", "## Sides that did not run here", "", "| case | side | why |", "|---|---|---|"]
        out += [f"| {case} | {s['side']} | {s.get('reason', '').replace('|', '/')} |" for case, s in skipped]
    out += ["", "## Bytes model of the floor", "", "| case | per | MiB | parts (MiB) |", "|---|---|---|---|"]
    for c in doc["cases"]:
        f = c.get("floor")
        if f:
            parts = ", ".join(f"{k} {v / MIB:.2f}" for k, v in f["parts"].items())
            out.append(f"| {c['case']} | {f['per']} | {f['total'] / MIB:.2f} | {parts} |")
    notes = [(c["case"], n) for c in doc["cases"] for n in c.get("notes", [])]
    if notes:
        out += ["", "## Shapes", ""] + [f"- {c['case']}: {c['shape']}" for c in doc["cases"]]
        out += [f"- {case}: {n}" for case, n in notes]
    return "\n".join(out) + "\n"


def _bars(doc: dict) -> list[tuple[str, list[tuple[str, float]], float]]:
    """Per case: (name, [(side, ms per step)], floor ms per step)."""
    rows = []
    for c in doc["cases"]:
        if c.get("status") != "ok":
            continue
        sides = [(s["side"], s["per_step_s"] * 1e3) for s in c["sides"] if s.get("status") == "ok"]
        if sides:
            rows.append((c["case"], sides, c["floor"]["copy_floor_s"] / c["steps_per_call"] * 1e3))
    return rows


def chart_matplotlib(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = _bars(doc)
    vals = [v for _, s, f in rows for v in [f] + [x for _, x in s]] or [1.0]
    ratios = [len(s) + 0.6 for _, s, _ in rows] or [1]
    fig, axes = plt.subplots(len(rows) or 1, 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": ratios},
                             figsize=(8, 1.0 + 0.42 * sum(ratios)))
    for ax, (case, sides, floor) in zip(axes[:, 0], rows):
        names = [n for n, _ in sides]
        vals_ = [v for _, v in sides]
        ax.barh(names, vals_, left=min(vals) / 2, color=["#3a5fcd" if n == "port" else "#999999" for n in names])
        for i, v in enumerate(vals_):
            ax.text(v, i, f" {v:.3g} ms ({v / floor:.1f}x floor)", va="center", fontsize=7)
        ax.axvline(floor, color="#d62728", lw=1.5)
        ax.set_title(f"{case}   (floor {floor:.3g} ms, red)", fontsize=9, loc="left")
        ax.invert_yaxis()
        ax.tick_params(labelsize=8)
    ax = axes[-1, 0]
    ax.set_xscale("log")
    ax.set_xlim(min(vals) / 2, max(vals) * 6)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("ms per draft step (log scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_numpy(doc: dict, path: Path) -> None:
    """No plotting library: one panel per case, one bar per side (port blue, peers grey) on a log
    scale spanning every figure and floor, the floor a red line."""
    from ..report import write_png

    rows = _bars(doc) or [("none", [("none", 1.0)], 1.0)]
    vals = [v for _, s, f in rows for v in [f] + [x for _, x in s]]
    lo, hi = np.log10(min(vals)) - 0.2, np.log10(max(vals)) + 0.2
    width, bar, gap = 600, 12, 4
    heights = [len(s) * (bar + gap) + 16 for _, s, _ in rows]
    img = np.full((sum(heights), width, 3), 255, np.uint8)

    def x_of(v):
        return int(round((np.log10(v) - lo) / (hi - lo) * (width - 20))) + 10

    top = 0
    for (_, sides, floor), h in zip(rows, heights):
        for i, (name, v) in enumerate(sides):
            y = top + 8 + i * (bar + gap)
            img[y:y + bar, 10:x_of(v)] = (58, 95, 205) if name == "port" else (150, 150, 150)
        img[top:top + h - 4, x_of(floor)] = (214, 39, 40)
        img[top + h - 2, :] = 0
        top += h
    write_png(path, img)


def write(doc: dict, out: Path, matplotlib: bool | None = None) -> list[Path]:
    """bench.json, bench.md and bench.png in `out`, each written atomically. matplotlib None: use
    it if importable."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md", out / "bench.png"]
    if matplotlib is None:
        try:
            import matplotlib as _  # noqa: F401

            matplotlib = True
        except ImportError:
            matplotlib = False
    doc["chart"] = "matplotlib" if matplotlib else "numpy"
    keep(doc, out)
    atomic_write(paths[1], markdown(doc).encode())
    fd, tmp = tempfile.mkstemp(prefix=".bench.", suffix=".png", dir=out)
    os.close(fd)
    try:
        (chart_matplotlib if matplotlib else chart_numpy)(doc, Path(tmp))
        os.replace(tmp, paths[2])
    finally:
        Path(tmp).unlink(missing_ok=True)
    return paths


def keep(doc: dict, out: Path) -> Path:
    """bench.json alone: after each case of a run, and with bench.md and bench.png at its end."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "bench.json", (json.dumps(doc, indent=1, default=str) + "\n").encode())
    return out / "bench.json"


def _identity(doc: dict) -> str:
    """The project's commit (and how it is known) and its source digest, for a report's header."""
    p = doc.get("project") or {}
    commit = (p.get("commit") or "unknown")[:12] + ("+dirty" if p.get("dirty") else "")
    return f"{commit} ({p.get('from', 'unknown')}; source sha256 {str(p.get('source_sha256', '?'))[:12]})"


def _mlx_env(machine: dict) -> str:
    """The run's MLX_* settings (machine.mlx_env) as ", KEY=value" each, for a report's header."""
    return "".join(f", {k}={v}" for k, v in (machine.get("mlx_env") or {}).items())

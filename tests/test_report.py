"""Reports a person can read: layers.png drawn with matplotlib, no stale file beside a new report,
shapes in words, no sentinel-sized max|Δ|, no None, `run --help` with every default, progress."""

from __future__ import annotations

import contextlib
import io
import re
import time

import numpy as np
import pytest

from spec_parity import cli, report, report_plot
from spec_parity.budgets import DTYPE_DEFAULTS
from spec_parity.compare import (
    Result,
    bit_exact,
    check_tensor,
    stream_metrics,
    tensor_metrics,
    trace_metrics,
)

FP32 = DTYPE_DEFAULTS["float32"]


def _layers(first=None, own_bad=None) -> dict:
    own = [2e-6, 3e-6, 4e-6, 2e-6]
    if own_bad is not None:
        own[own_bad] = 5e-4
    return {"ok": first is None, "first_divergent_layer": first, "first_free_running_failure": None,
            "free_max_abs": [2e-6, 8e-6, 2e-5, 0.0], "own_max_abs": own, "budget": "rtol=1.3e-06, atol=3e-05",
            "own_budget_atol": 3e-5, "free_budget_atol": 5e-4}


def _row(name: str, layers: dict | None = None, verdict: str = "PASS") -> tuple[Result, str]:
    r = Result("targets", name, "transformers (golden)", "L2", verdict=verdict)
    if layers:
        r.metrics["layers"] = layers
    return r, "PASS"


@pytest.mark.slow
def test_layers_png_is_a_matplotlib_chart_with_the_divergent_layer_red(tmp_path):
    import matplotlib.image as mpimg

    written = report.write(tmp_path, [_row("qwen3", _layers()), _row("qwen3-control", _layers(2, 2), "FAIL")], "h")
    assert tmp_path / "layers-targets.png" in written
    img = mpimg.imread(tmp_path / "layers-targets.png")
    h, w = img.shape[:2]
    assert w >= 600 and h >= 250, (w, h)  # the numpy drawing was 142 px wide, no text
    red = (img[..., 0] > 0.8) & (img[..., 1] < 0.25) & (img[..., 2] < 0.25)
    assert red.sum() > 200  # the first divergent layer's bar
    plain = report_plot.layer_chart([("a", "L2", _layers())])
    assert plain[:8] == b"\x89PNG\r\n\x1a\n"
    clean = mpimg.imread(io.BytesIO(plain))
    assert ((clean[..., 0] > 0.8) & (clean[..., 1] < 0.25) & (clean[..., 2] < 0.25)).sum() < red.sum() / 4


@pytest.mark.slow
def test_a_non_finite_layer_is_drawn():
    lay = _layers(1, 1)
    lay["own_max_abs"][1] = float("inf")
    assert report_plot.layer_chart([("nan", "L2", lay)])[:4] == b"\x89PNG"


def test_no_stale_report_file_and_no_temp_left(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "layers.png").write_bytes(b"an earlier version's single chart")
    report.write(tmp_path, [_row("qwen3", _layers())], "first")
    assert (tmp_path / "layers-targets.png").exists() and not (tmp_path / "layers.png").exists()
    report.write(tmp_path, [_row("assistant-step")], "second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "report.html", "report.json", "report.md"]
    assert "second" in (tmp_path / "report.md").read_text()


def test_shape_mismatch_says_shape_a_vs_b():
    for tier in ("L1", "L2"):
        r = Result("m", "c", "o", tier)
        check_tensor(r, "logits", np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32), "m", "logits")
        assert "logits: shape [2, 3] vs [2, 4]" in r.reason and "None" not in r.message(), r.message()


def test_masked_logits_leave_max_abs_but_a_one_sided_mask_fails():
    ref = np.array([1.0, -1e30, 2.0, -1e30], np.float32)
    port = ref.copy()
    port[0] += 0.5
    for m in (bit_exact(port, ref), tensor_metrics(port, ref, FP32)):
        assert not m["ok"] and m["max_abs"] == pytest.approx(0.5)
    one_sided = ref.copy()
    one_sided[2] = -1e30  # the port masks a logit the reference scores: a failure, never hidden
    for m in (bit_exact(one_sided, ref), tensor_metrics(one_sided, ref, FP32)):
        assert not m["ok"] and m["masked_mismatch"] == 1 and m["max_abs"] < 1e29
    assert tensor_metrics(ref.copy(), ref, FP32)["ok"]


def test_no_none_in_messages():
    s = stream_metrics([1, 2, 3], [1, 2], np.zeros((2, 4)))
    assert s["first_divergence"] == 2 and "port_token" not in s  # checks.py words it by the lengths
    t = trace_metrics([(2, 1, 2)], [(2, 1, 2), (2, 2, 3)])
    assert t["port_round"] == "end of trace"
    r = Result("m", "c", "o", "L2")
    r.metrics.update(tokens=s, same=stream_metrics([1, 2], [1, 2], np.zeros((2, 4))), trace=t)
    assert "None" not in r.message() and "first_divergence=none" in r.message()
    assert "None" not in report.markdown([_row("qwen3", _layers())])


@pytest.mark.golden
def test_run_report_on_a_centroid_control(tmp_path):
    """A centroid head's control, from the command line: the report shows no 1e30 sentinel, no
    None, and the stale layers.png of an earlier run is gone."""
    (tmp_path / "layers.png").write_bytes(b"stale")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main(["run", "--module", "assistant", "--case", "step-gemma4-centroid-optiq-control-scale",
                       "--source", "golden", "--out", str(tmp_path)])
    assert rc == 0
    md = (tmp_path / "report.md").read_text()
    assert "| FAIL |" in md and "e+30" not in md and "None" not in md
    assert not (tmp_path / "layers.png").exists()  # the stale file of an earlier run is gone
    for png in tmp_path.glob("layers-*.png"):    # the case's own drafter layers, or none
        assert png.read_bytes().startswith(b"\x89PNG")
    assert err.getvalue().splitlines()[-1].startswith("[1/1] FAIL assistant/step-gemma4-centroid-optiq-control-scale")


def test_python_dash_m_runs_the_command():
    """`python -m spec_parity` is the `spec-parity` script, where none is on PATH."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "spec_parity", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("usage: spec-parity"), run.stderr
    run = subprocess.run([sys.executable, "-m", "spec_parity", "no-such-command"], capture_output=True, text=True)
    assert run.returncode == 2 and "invalid choice: 'no-such-command'" in run.stderr, run.stderr


def test_run_help_documents_every_option_and_its_default():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = out.getvalue()
    blocks = re.split(r"\n(?=  -)", text.split("options:", 1)[1])
    opts = {re.match(r"\s*(-[-\w]+)", b).group(1): " ".join(b.split()) for b in blocks if b.strip()}
    assert {"--module", "--case", "--out", "--source", "--target", "--drafter", "--debug"} <= set(opts)
    for opt, help_text in opts.items():
        if opt not in ("-h", "--help"):
            assert "default" in help_text, f"run --help: {opt} names no default: {help_text}"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_off_a_terminal_and_a_bar_on_one():
    plain = io.StringIO()
    with report.Progress(2, plain) as bar:
        for name, verdict in (("targets/qwen3", "PASS"), ("targets/gemma4", "FAIL non-finite")):
            bar.start(name)
            bar.done(name, verdict)
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/2] PASS targets/qwen3 (")
    assert lines[1].startswith("[2/2] FAIL non-finite targets/gemma4")
    tty = _Tty()
    with report.Progress(2, tty) as bar:
        bar.start("targets/qwen3")
        time.sleep(1.3)                 # a long case: its clock runs while it runs
        bar.done("targets/qwen3", "PASS")
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty.getvalue())
    assert "1/2" in shown and "[1/2] PASS" not in shown
    ticks = [float(t) for t in re.findall(r"targets/qwen3\s+(\d+\.\d) s", shown)]
    assert ticks and max(ticks) >= 1.0, shown


@pytest.mark.parametrize("tier, dashed", [("L1", 0), ("L2", 2)])
def test_each_panel_has_its_tiers_budget_and_a_legend(tier, dashed):
    """An L1 panel's budget is bit-exactness: no tolerance line; an L2 panel draws both budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    report_plot._panel(ax, "qwen3", tier, _layers())
    lines = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    assert len(lines) == dashed and any("free-running max" in t for t in labels)
    assert any("bit-exact" in t for t in labels) == (tier == "L1")
    assert ax.get_title(loc="left").startswith(f"qwen3 ({tier})")

"""tools/figures.py: each set's bench twice, each run its own process, then combine on the runs
that wrote their JSON; the benches themselves are not run here (tests/test_combine.py holds combine).
tools/serve_kernels.py: a round is two request lengths' kernel profiles, their difference over
their rounds' (the prefill and what every request pays once cancel); its profiles need CUDA, so
the arithmetic is held on summaries made up to a known round. tools/serve_memory.py: each request's
peak is its own (MLX's peak reset before it), held on requests that allocate known sizes."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(tool: str = "figures"):
    """tools/<tool>.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"{tool}_tool", ROOT / "tools" / f"{tool}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def figures(monkeypatch):
    mod = load()
    calls, failing = [], set()

    def call(cmd):
        calls.append(cmd[3:])   # after `python -m spec_parity.cli`
        out = Path(cmd[cmd.index("--out") + 1])
        if cmd[3] == "bench" and out.name not in failing:
            out.mkdir(parents=True)
            (out / ("serve.json" if "--serve" in cmd else "bench.json")).write_text("{}")
        return 1 if out.name in failing else 0

    monkeypatch.setattr(mod.subprocess, "call", call)
    mod.calls, mod.failing = calls, failing
    return mod


def test_every_set_runs_twice_then_combines(figures, tmp_path):
    assert figures.main([str(tmp_path), "--only", "serve-dflash,step", "--shapes", "tiny"]) == 0
    benches = [c for c in figures.calls if c[0] == "bench"]
    combines = [c for c in figures.calls if c[0] == "combine"]
    assert [Path(c[c.index("--out") + 1]).name for c in benches] == [
        "serve-dflash-run1", "serve-dflash-run2", "step-run1", "step-run2"]
    assert all(c[1:3] == ["--shapes", "tiny"] for c in benches)
    assert all("--serve" in c for c in benches[:2]) and not any("--serve" in c for c in benches[2:])
    assert [c[1:3] for c in combines] == [[str(tmp_path / "serve-dflash-run1"), str(tmp_path / "serve-dflash-run2")],
                                          [str(tmp_path / "step-run1"), str(tmp_path / "step-run2")]]
    assert [c[-1] for c in combines] == [str(tmp_path / "serve-dflash"), str(tmp_path / "step")]


def test_a_failed_run_is_named_and_its_set_not_combined(figures, tmp_path, capsys):
    figures.failing.add("step-run2")
    assert figures.main([str(tmp_path), "--only", "step"]) == 1
    assert not [c for c in figures.calls if c[0] == "combine"]
    assert "failed: " + str(tmp_path / "step-run2") in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [(["--runs", "1"], "two runs or more"),
                                        (["--only", "step,serves"], "serves: not a set")])
def test_bad_options_are_refused(figures, tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        figures.main([str(tmp_path), *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err and not figures.calls


def test_the_sets_name_only_known_sides():
    """A misspelt side would only show on the device, as a refused run: every --peers name of every
    set is one the bench knows."""
    from spec_parity.bench import loop_sides, runner

    for name, args in load().SETS.items():
        known = set(loop_sides.SIDES) if "--serve" in args else set(runner.OTHERS)
        peers = args[args.index("--peers") + 1].split(",")
        assert set(peers) <= known, (name, set(peers) - known)


def summary(rounds: int, once: float = 5000.0) -> dict:
    """A request of `rounds` rounds of 100 launches / 700 us busy each (attention 20 of them, 300 us),
    after a prefill of 40 launches and `once` us."""
    return {"status": "ok", "launches_per_call": 40 + 100 * rounds, "kernel_us_per_call": once + 900 * rounds,
            "busy_us_per_call": once + 700 * rounds, "window_us_per_call": 2 * once + 2000 * rounds,
            "classes": [{"class": "attention", "launches_per_call": 20 * rounds, "us_per_call": 300 * rounds},
                        {"class": "matmul", "launches_per_call": 40 + 80 * rounds, "us_per_call": once + 600 * rounds}]}


def test_a_round_is_the_difference_over_the_rounds():
    line = load("serve_kernels").per_round((summary(15), 15.0), (summary(31), 31.0))
    assert "100 launches, kernels 900 us, busy 700 us, window 2000 us" in line
    assert "attention 20x 300us, matmul 80x 600us" in line


def test_a_per_request_division_would_be_caught():
    """Control: the long request alone over its rounds (the prefill counted in) is not the round."""
    s = summary(31)
    assert f"{s['launches_per_call'] / 31:.0f} launches" not in load("serve_kernels").per_round((summary(15), 15.0), (s, 31.0))


def allocating(generate_mib: dict):
    """A generate that holds `generate_mib[n]` MiB for a moment, as a request of n tokens."""
    def generate(prompt, n):
        mx.eval(mx.zeros((generate_mib[n] * 2**18,), mx.float32))
    return generate


def test_each_requests_peak_is_its_own():
    big, small = load("serve_memory").request_peaks(allocating({1: 64, 2: 16}), [([], 1), ([], 2)])
    for (before, peak), mib in ((big, 64), (small, 16)):
        assert mib * 2**20 <= peak - before < (mib + 8) * 2**20


def test_a_peak_not_reset_would_be_caught(monkeypatch):
    """Control: without the reset the small request reads the big one's peak."""
    mod = load("serve_memory")
    monkeypatch.setattr(mod.mx, "reset_peak_memory", lambda: None)
    _, (before, peak) = mod.request_peaks(allocating({1: 64, 2: 16}), [([], 1), ([], 2)])
    assert not peak - before < 24 * 2**20

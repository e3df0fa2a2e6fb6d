"""`spec-parity bench`: the command runs and writes its three files; the counters count (a planted
extra host sync / graph op must show); a peer that cannot be imported is a reason, not a crash.
Speed figures are reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from spec_parity import bench, cli, controls, harness
from spec_parity.bench import port_sides, report, runner, serve, shapes, sides, timing
from spec_parity.port.fast import kernels

ROOT = Path(__file__).resolve().parent.parent


# ---- the counters ---------------------------------------------------------------------------------

def _syncing(extra: bool):
    def fn(x):
        y = mx.exp(x)
        n = int(y.sum().item() > 0)
        if extra:  # planted: one more host round trip
            n += int(y.max().item() > 0)
        return y.tolist(), n
    return fn


def test_host_syncs_counts_every_kind_of_wait_and_a_planted_one():
    x = mx.ones((4,))
    mx.eval(x)
    real = (mx.array.item, mx.eval, np.array)
    with bench.HostSyncs() as base:
        _syncing(False)(x)
    with bench.HostSyncs() as planted:
        _syncing(True)(x)
    assert base.syncs == 2 and base.calls == {"item": 1, "tolist": 1}
    assert planted.syncs == base.syncs + 1
    with bench.HostSyncs() as h:
        int(x[0])
        float(x[1])
        bool(x[2] > 0)
        np.array(x + 1)
        mx.eval(x * 2)
        mx.async_eval(x * 3)
    assert h.calls == {"__int__": 1, "__float__": 1, "__bool__": 1, "numpy": 1, "eval": 1, "async_eval": 1}
    assert h.syncs == 5  # async_eval does not wait
    assert (mx.array.item, mx.eval, np.array) == real  # restored on exit
    with bench.HostSyncs() as after:
        pass
    x.item() if x.size == 1 else x.tolist()
    assert after.syncs == 0


def test_graph_ops_count_pending_primitives_once_and_a_planted_op():
    x = mx.ones((4,))
    mx.eval(x)
    with bench.HostSyncs(ops=True) as one:
        mx.eval(mx.exp(x))
    with bench.HostSyncs(ops=True) as two:
        mx.eval(mx.exp(mx.exp(x)))  # planted: one more op
    assert (one.ops, two.ops) == (1, 2) and dict(two.kinds) == {"Exp": 2}
    with bench.HostSyncs(ops=True) as h:
        y = mx.exp(x)
        mx.async_eval(y)         # scheduled here: counted once
        (mx.log(y)).tolist()     # only the Log is new
    assert h.ops == 2 and dict(h.kinds) == {"Exp": 1, "Log": 1}
    with bench.HostSyncs(ops=True) as done:
        x.tolist()               # already evaluated: nothing to run
    assert done.ops == 0 and done.syncs == 1


def test_count_step_sees_a_planted_op_and_a_planted_sync():
    x = mx.ones((8,))
    mx.eval(x)
    base = bench.count_step(sides.Stepper(lambda: mx.exp(x)))
    op = bench.count_step(sides.Stepper(lambda: mx.exp(x) * x))
    sync = bench.count_step(sides.Stepper(lambda: [mx.exp(x), mx.exp(x).sum().item()]))
    assert base["graph_ops"] == 1 and base["host_syncs"] == 1   # the caller's eval of the output
    assert op["graph_ops"] == base["graph_ops"] + 1
    assert sync["host_syncs"] == base["host_syncs"] + 1


# ---- the pieces -------------------------------------------------------------------------------------

def test_serve_weights_hands_out_the_same_arrays_and_restores_mx_load(tmp_path):
    case = next(c for c in shapes.tiny_cases(dtype="bfloat16") if c.name == "dflash-qwen3")
    ckpt = shapes.build(case, tmp_path)
    real_load = mx.load
    served = ckpt.weights("drafter")
    with shapes.serve_weights(ckpt):
        got = mx.load(str(ckpt.drafter_dir / "model.safetensors"))
    assert mx.load is real_load
    assert set(got) == set(served) and all(got[k] is served[k] for k in served)
    assert all(v.dtype == mx.bfloat16 for v in served.values())


def test_real_shapes_build_in_memory_at_the_references_floor_bytes(tmp_path):
    """At full size (nothing evaluated: the draws are lazy) the bytes model gives the real
    shapes' floors (docs/references.md, "Real shapes"): 12B tied 0.24 ms, E4B centroid 0.0095 ms,
    DFlash 0.52 ms at 3.6 TB/s."""
    floors = {}
    for case in shapes.real_cases(dtype="bfloat16"):
        ckpt = shapes.build(case, tmp_path)
        assert (ckpt.drafter_dir / "model.safetensors").stat().st_size < 1024  # config only on disk
        floors[case.name] = shapes.step_bytes(ckpt)["total"] / 3.6e12 * 1e3
    assert floors["assistant-12b-tied"] == pytest.approx(0.24, rel=0.05)
    assert floors["assistant-e4b-centroid"] == pytest.approx(0.0095, rel=0.1)
    assert floors["dflash-qwen3-4b"] == pytest.approx(0.52, rel=0.05)


def test_centroid_floor_reads_only_the_selected_rows(tmp_path):
    cases = {c.name: c for c in shapes.tiny_cases()}
    for name, full in (("assistant-tied", True), ("assistant-centroid", False)):
        ckpt = shapes.build(cases[name], tmp_path)
        all_weights = sum(v.nbytes for v in ckpt.weights("drafter").values())
        counted = shapes.step_bytes(ckpt)["parts"]["drafter weights"]
        assert (counted == all_weights) is full


def test_a_peer_that_cannot_be_imported_is_a_reason(monkeypatch):
    for name in [m for m in sys.modules if m == "optiq" or m.startswith("optiq.")] + ["optiq"]:
        monkeypatch.setitem(sys.modules, name, None)
    out, stepper = runner.build_side(bench.SIDES["optiq"], prep=None, opts=bench.Options())
    assert stepper is None
    assert out["status"] == "not run" and "optiq" in out["reason"] and "install: pip install" in out["reason"]


def test_sides_are_timed_in_rotation_and_a_failing_side_stops_alone():
    """Every side runs once per round, round r starting at side r mod n (the order recorded by the
    steps themselves); a side that raises mid-loop is failed with its error, the others finish."""
    from spec_parity.bench.sides import Stepper
    from spec_parity.bench.timing import time_sides

    calls: list[str] = []

    def step(name, fail_at=None):
        def run():
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} broke")
            return mx.array([1])
        return Stepper(run, tokens=lambda out: out.tolist())

    outs = time_sides([step("a"), step("b"), step("c", fail_at=5)], warmup=1, iters=4)
    timed = calls[6:]   # after each side's first + 1 warm-up run, in order
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b"], timed
    assert [o["wall_s"]["n"] for o in outs[:2]] == [4, 4] and outs[0]["timing"] == "3 sides in rotation"
    assert "wall_s" not in outs[2] and "c broke" in str(outs[2]["error"])


def test_bench_imports_without_the_peers_or_torch():
    blocked = ["torch", "transformers", "optiq", "dflash", "dspark_mlx", "dflash_mlx", "scipy", "matplotlib"]
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
            + "from spec_parity import bench, cli\n"
            + "from spec_parity import third_party\n"
            + "from spec_parity.bench import counters, peers, port_sides, report, runner, serve, shapes, sides, timing\n"
            + "print(sides.torch_device('auto')[0])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None"


@pytest.mark.parametrize("argv, message", [
    (["--sources", "assistant,nope"], "unknown ['nope']"),
    (["--peers", "optiq,nobody"], "unknown ['nobody']"),
    (["--scale", "4"], "--shapes real only"),
])
def test_bad_arguments_name_the_problem(argv, message, tmp_path, capsys):
    assert cli.main(["bench", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("spec-parity bench: error: ") and len(err.splitlines()) == 1


# ---- the command --------------------------------------------------------------------------------

def _run(tmp_path, *argv) -> dict:
    out = tmp_path / "out"
    assert cli.main(["bench", "--warmup", "1", "--iters", "2", "--serve-runs", "1", "--max-tokens", "4",
                     "--bw-mib", "8", "--out", str(out), *argv]) == 0
    assert {p.name for p in out.iterdir()} >= {"bench.json", "bench.md", "bench.png"}
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "| case | side | ms / call |" in md and "| case | γ | round ms |" in md
    return json.loads((out / "bench.json").read_text())


@pytest.mark.slow
def test_bench_tiny_writes_every_figure(tmp_path):
    doc = _run(tmp_path, "--sources", "dflash", "--peers", "zlab-mlx", "--chart", "numpy")
    assert "bench" in doc["command"] and doc["machine"]["mlx_default_device"] and doc["versions"]["mlx"]
    assert doc["bandwidth"]["copy_bytes_per_s"] > 0 and doc["bandwidth"]["read_bytes_per_s"] > 0
    assert 0 < doc["launch"]["primitive_build_s"] < doc["launch"]["primitive_s"]
    assert "custom_kernel_s" in doc["launch"] or doc["launch"]["custom_kernel"].startswith("not run")
    (case,) = doc["cases"]
    assert case["case"] == "dflash-qwen3" and case["status"] == "ok"
    assert case["floor"]["total"] > 0 and case["floor"]["copy_floor_s"] > 0
    sides = {s["side"]: s for s in case["sides"]}
    port = sides["port"]
    assert port["status"] == "ok"
    assert set(port["wall_s"]) >= {"median", "p10", "p90"} and port["wall_s"]["n"] == 2
    assert 0 < port["graph_build_s"]["median"] <= port["wall_s"]["median"]  # the graph, then its eval
    assert port["host_syncs"] >= 1 and port["graph_ops"] > 0 and port["memory"]["peak_bytes"] > 0
    assert port["x_floor"] > 0 and port["agrees_with_port"]
    assert port["host_buffers"] == 0
    if sides["zlab-mlx"]["status"] == "ok":  # z-lab installed: same weights, same first block
        assert sides["zlab-mlx"]["agrees_with_port"] and port["x_best_peer"] > 0
        z = sides["zlab-mlx"]
        assert z["port_speedup"] == z["wall_s"]["median"] / port["wall_s"]["median"]
        assert "host_buffers" not in sides["zlab-mlx"]  # HostBuffers watches the port's modules only
    else:
        assert sides["zlab-mlx"]["reason"]
    serve = case["serve"]
    assert set(serve["round_median_s"]) >= {"draft_s", "verify_s", "accept_trim_s"}
    assert serve["host_syncs_per_round"] >= 1 and serve["graph_ops_per_round"] > 0
    assert serve["host_read_max_bytes_per_round"] <= 8 and serve["host_syncs_at_end"] == 1
    assert serve["decode_tokens_per_s"]["median"] > 0


@pytest.mark.slow
def test_serve_loop_counts_a_planted_sync_per_round(tmp_path):
    """The per-round counters must move when a source makes one more host round trip per draft,
    one that reads its drafts (4 bytes each: over the 8-byte scalars a round reads)."""
    case = next(c for c in shapes.tiny_cases() if c.name == "dflash-qwen3")
    ckpt = shapes.build(case, tmp_path)
    prep = runner.prepare(ckpt, (None, "off"), 0)
    prompt = runner.prompt(ckpt, 0)

    class Planted(port_sides.PortProvider):
        def open(self, view):
            src = super().open(view)
            for name in ("draft_device", "draft_pipelined"):   # the loop's T=0 paths: drafts on the device
                setattr(src, name, self.extra(getattr(src, name)))
            return src

        @staticmethod
        def extra(draft):
            def drafted(*args):
                out = draft(*args)
                out.tolist()   # planted
                return out

            return drafted

    base = serve.serve_loop(ckpt, prep.target, prompt, 6, 1)
    planted = serve.serve_loop(ckpt, prep.target, prompt, 6, 1, provider=Planted(ckpt))
    assert planted["host_syncs_per_round"] == base["host_syncs_per_round"] + 1
    assert base["host_read_max_bytes_per_round"] <= 8 < planted["host_read_max_bytes_per_round"]
    assert planted["graph_ops_per_round"] > base["graph_ops_per_round"]


@pytest.mark.slow
def test_bench_real_path_runs_scaled_down(tmp_path):
    doc = _run(tmp_path, "--shapes", "real", "--scale", "64", "--sources", "dflash", "--peers", "none",
               "--target-layers", "8")
    (case,) = doc["cases"]
    assert case["case"] == "dflash-qwen3-4b" and case["status"] == "ok"
    assert case["drafter_config"]["num_hidden_layers"] == 5 and case["drafter_config"]["block_size"] == 16
    assert [s["side"] for s in case["sides"]] == ["port"] and case["sides"][0]["status"] == "ok"


@pytest.mark.slow
def test_bench_serve_section_runs_the_port_plain_loop(tmp_path):
    """The serve section's default row is the bucketed drafter and verify (kv_bucket=BUCKET, the
    verify compiled); with port-plain among the sides a second row runs mlx-lm's caches (op by
    op), on the Qwen3 and the Gemma-4 target alike."""
    doc = _run(tmp_path, "--sources", "dspark", "--peers", "port-plain")
    cases = {c["case"]: c for c in doc["cases"]}
    assert set(cases) == {"dspark-qwen3", "dspark-gemma4"}
    md = (tmp_path / "out" / "bench.md").read_text()
    for name, c in cases.items():
        assert c["serve"]["kv_bucket"] == port_sides.BUCKET and c["serve_plain"]["kv_bucket"] is None
        assert c["serve_plain"]["decode_tokens_per_s"]["median"] > 0
        assert c["serve"]["verify"] == "compiled" and c["serve_plain"]["verify"] == "plain"
        assert f"| {name} (port, verify kv_bucket=256, compiled) |" in md
        assert f"| {name} (port-plain, verify mlx-lm caches, plain) |" in md


def test_kernel_busy_time_counts_overlap_once_and_gaps_not_at_all():
    """busy = the union of kernel intervals: two overlapping kernels count once, a gap between
    kernels is not GPU time. Control: a plain sum of durations over-counts the overlap."""
    kernels = [("gemv_a", 0.0, 10.0), ("sdpa_b", 5.0, 12.0), ("rms_norm", 20.0, 21.0)]
    k = timing.kernel_summary(kernels, steps=1, window_us=30.0)
    assert k["busy_us_per_call"] == 13.0 and k["kernel_us_per_call"] == 18.0 and k["launches_per_call"] == 3
    assert sum(b - a for _, a, b in kernels) != k["busy_us_per_call"]
    assert {c["class"]: c["us_per_call"] for c in k["classes"]} == {"matmul": 10.0, "attention": 7.0, "norm": 1.0}
    assert timing.kernel_summary(kernels * 2, steps=2, window_us=60.0)["launches_per_call"] == 3


def test_ratios_to_the_best_peer_the_floor_and_the_port():
    """Per side: / the fastest peer (our opt-in paths are never a peer), / the floor, and the port's
    speed-up over it (its time / the port's). A 1 ms port against peers at 3 and 2 ms: the port is
    3x and 2x faster, 0.5x the best peer; the bucketed path at 0.5 ms is not the best peer."""
    def side(name, ms):
        return {"side": name, "status": "ok", "wall_s": {"median": ms / 1e3}, "first_tokens": [1, 2]}
    case = {"steps_per_call": 1, "floor": {"copy_floor_s": 0.25e-3},
            "sides": [side("port", 1.0), side("port-bucketed", 0.5), side("optiq", 3.0), side("hf-torch", 2.0)]}
    runner._ratios(case)
    got = {s["side"]: (s["port_speedup"], s["x_best_peer"], s["x_floor"]) for s in case["sides"]}
    assert case["best_peer"] == "hf-torch"
    assert got == {"port": (1.0, 0.5, 4.0), "port-bucketed": (0.5, 0.25, 2.0), "optiq": (3.0, 1.5, 12.0),
                   "hf-torch": (2.0, 1.0, 8.0)}, got


def test_launch_floor_is_the_steps_launches_times_the_measured_launch_cost():
    """The kernel table's launch floor: launches per step x the run's per-primitive cost (400
    launches per call of 4 steps at 5 us: 0.5 ms). A run without the launch figure says so ('–')."""
    side = {"side": "port", "per_step_s": 1e-3, "kernels": {"status": "ok", "launches_per_call": 400,
                                                           "kernel_us_per_call": 100.0, "busy_us_per_call": 80.0,
                                                           "classes": []}}
    doc = {"launch": {"primitive_s": 5e-6}, "cases": [{"case": "c", "steps_per_call": 4,
                                                      "floor": {"copy_floor_s": 1e-4}, "sides": [side]}]}
    row = report.kernel_tables(doc)[-1].split(" | ")
    assert row[2:4] == ["100", "0.025"] and row[7] == "0.5", row
    del doc["launch"]
    assert report.kernel_tables(doc)[-1].split(" | ")[7] == "–"


def test_kernel_classes_of_names_an_h200_run_recorded():
    """Kernel names as CUPTI recorded them on an H200: cuBLASLt's Hopper GEMMs are `nvjet_*`,
    cuDNN's attention contains "wgmma" (not a GEMM here). Control: a name no class names stays
    "other"."""
    names = {"nvjet_sm90_tst_128x16_64x11_4x1_v_bz_TNT": "matmul",
             "void mlx::core::cu::gemv_single<__nv_bfloat16, 8, 4>(__nv_bfloat16 const*)": "matmul",
             "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128": "attention",
             "void mlx::core::cu::gather<__nv_bfloat16, int, 1, 2, int>(__nv_bfloat16 const*)": "copy / gather / concat",
             "void mlx::core::cu::rope<__nv_bfloat16, false, true>(__nv_bfloat16 const*)": "rope",
             "void mlx::core::cu::kernel_launcher_of_something_new()": "other"}
    assert {n: timing.kernel_class(n) for n in names} == names


@pytest.mark.slow
def test_bench_kernels_on_cpu_says_why_not(tmp_path):
    doc = _run(tmp_path, "--sources", "dflash", "--peers", "none", "--kernels")
    (port,) = doc["cases"][0]["sides"]
    assert port["kernels"]["status"] == "not run" and "CUDA" in port["kernels"]["reason"]
    assert "GPU kernels per step" in (tmp_path / "out" / "bench.md").read_text()


def test_port_blocks_index_without_gathers(tmp_path):
    """MLX makes a lone integer index (`logits[0]`) a Gather; on MLX CUDA one over a block's logits
    costs 22-257 us of device time (H200), a slice (`logits[0, ...]`) is free. The DFlash block's
    one Gather is its embedding lookup. Control: a planted `[0]` on the logits adds one."""
    case = next(c for c in shapes.tiny_cases() if c.name == "dflash-qwen3")
    prep = runner.prepare(shapes.build(case, tmp_path), (None, "off"), 0)
    assert bench.count_step(port_sides.port_side(prep))["op_kinds"].get("Gather") == 1
    with controls.planted("bench", "logits_gather"):
        assert bench.count_step(port_sides.port_side(prep))["op_kinds"].get("Gather") == 2


def _host_buffers(prep, side) -> int:
    return bench.count_step(side(prep), runs=1)["host_buffers"]


@pytest.mark.parametrize("name", harness.slow_except([c.name for c in shapes.tiny_cases()], "dflash-qwen3",
                                                     "dspark-qwen3"))
def test_port_steps_build_no_host_filled_buffers(name, tmp_path):
    """A draft step / block (plain and bucketed) builds no array from host data over 8 bytes: on MLX
    CUDA the GPU page-faults on such a buffer (H200: a block's embedding Gather 100-280 us instead
    of 3). Control (blocks): the ids built as one host list, as they were, must count."""
    case = next(c for c in shapes.tiny_cases() if c.name == name)
    prep = runner.prepare(shapes.build(case, tmp_path), (None, "off"), 0)
    for side in port_sides.SIDES:
        if case.module in side.sources and (side.name != "port-kernel" or kernels.available()):
            assert _host_buffers(prep, side.build) == 0, side.name
    if case.module == "assistant":
        return
    with controls.planted("bench", "host_filled_block_ids"):
        assert _host_buffers(prep, port_sides.port_side) == 1


def test_port_side_notes_name_the_attention_it_resolved(tmp_path):
    """A reader of bench.md sees which attention the default block ran (the bench's weights are
    bf16: the kernels on MLX CUDA, mx.fast's elsewhere); an explicit path says what it asked for."""
    case = next(c for c in shapes.tiny_cases() if c.name == "dflash-qwen3")
    prep = runner.prepare(shapes.build(case, tmp_path), (None, "off"), 0)
    assert port_sides.port_side(prep).notes[-1] == f"attention={'kernel' if kernels.available() else 'sdpa'}"
    assert port_sides.port_side(prep, "sdpa").notes[-1] == "attention=sdpa"


def test_project_identity_from_a_copy_inside_another_repository(tmp_path, monkeypatch):
    """A copy of the project without .git, inside some other repository, records no commit of that
    other repository (the defect: bench.json read the enclosing one's), the commit the copier
    states (over a stale .git too), and the same source digest as the checkout it was copied
    from. Control: inside its own repository, nothing stated, the commit is git's."""
    import shutil
    import subprocess

    outer = tmp_path / "outer"
    copy = outer / "copy"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "other"], check=True)
    for d in runner.SOURCE_DIRS:
        shutil.copytree(runner.ROOT / d, copy / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(runner.ROOT / "pyproject.toml", copy / "pyproject.toml")
    monkeypatch.delenv("SPEC_PARITY_COMMIT", raising=False)
    got = runner.project(copy)
    assert got["commit"] is None and got["from"] == "unknown"
    assert got["source_sha256"] == runner.source_sha256(runner.ROOT)
    assert runner.project(outer)["from"] == "git"
    monkeypatch.setenv("SPEC_PARITY_COMMIT", "abc123")
    assert runner.project(copy)["commit"] == "abc123"
    stated = runner.project(outer)   # a stale .git: the stated commit, git's view beside it
    assert stated["commit"] == "abc123" and stated["git"]["commit"] != "abc123"
    (copy / "port" / "serve.py").write_text("changed")
    assert runner.source_sha256(copy) != runner.source_sha256(runner.ROOT)


def test_the_mlx_environment_is_recorded_and_shown(monkeypatch):
    """A backend setting that moves the figures (MLX_USE_CUDA_GRAPHS) is in bench.json's machine
    facts and in the report's header; an unset one is absent."""
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    monkeypatch.delenv("MLX_MAX_OPS_PER_BUFFER", raising=False)
    env = runner.machine()["mlx_env"]
    assert env["MLX_USE_CUDA_GRAPHS"] == "0" and "MLX_MAX_OPS_PER_BUFFER" not in env
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
    assert "MLX_USE_CUDA_GRAPHS" not in runner.machine()["mlx_env"]


def test_a_run_stopped_midway_keeps_its_finished_cases(tmp_path, monkeypatch):
    """The bench writes bench.json after each case: a run that stops in its second case (planted
    from outside: run_case raises there) leaves the first on disk, marked incomplete."""
    calls = []

    def run_case(case, *args):
        calls.append(case.name)
        if len(calls) == 2:
            raise RuntimeError("stopped in the second case")
        return {"case": case.name, "status": "ok", "sides": []}

    monkeypatch.setattr(runner, "run_case", run_case)
    monkeypatch.setattr(runner, "launch_cost", lambda: {})
    with pytest.raises(RuntimeError, match="second case"):
        cli.main(["bench", "--sources", "dspark,dflash", "--bw-mib", "8", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [c["case"] for c in doc["cases"]] == calls[:1] and doc["complete"] is False and doc["cases_planned"] >= 2
    assert not (tmp_path / "bench.md").exists()

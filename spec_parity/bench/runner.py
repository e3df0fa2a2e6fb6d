"""The bench's run: its options, each case (`run_case`) and its sides (`run_sides`), the
ratios between the sides, and the facts about the run that bench.json records (`run`)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..case import Case
from . import peers, port_sides, shapes
from .counters import HostSyncs, count_step
from .serve import serve_loop
from .shapes import SOURCES, Checkpoints
from .sides import Prep, Side, Skip, Stepper, torch_device
from .timing import COLD_SPACING, bandwidth, cold, kernel_profile, launch_cost, pre_pass, time_sides

PACKAGES = ("mlx", "mlx-cuda-13", "mlx-cuda", "mlx-metal", "mlx-cpu", "mlx-lm", "numpy", "safetensors", "torch",
            "transformers", "huggingface_hub", "mlx-optiq", "dflash", "dspark-mlx", "dflash-mlx", "scipy")

# Every side, in the tables' order: our port, our opt-in paths, the peers.
SIDES: dict[str, Side] = {s.name: s for s in (*port_sides.SIDES, *peers.SIDES)}
OTHERS = [name for name in SIDES if name != "port"]   # what --peers selects from


def others_for(source: str, wanted: list[str] | None) -> list[Side]:
    """The other sides of a source (our opt-in paths first, then the peers): all of them (wanted
    None), or those of `wanted` that serve it."""
    return [SIDES[n] for n in OTHERS if source in SIDES[n].sources and (wanted is None or n in wanted)]


# ---- one case ------------------------------------------------------------------------------------

@dataclass
class Options:
    shapes: str = "tiny"
    sources: tuple[str, ...] = SOURCES
    peers: list[str] | None = None      # None: all that serve the source
    warmup: int = 3
    iters: int = 15
    dtype: str = "float32"
    ctx: int | None = None
    scale: int = 1
    target_layers: int | None = None
    gamma: int = 4
    max_tokens: int = 16
    serve_runs: int = 3
    bw_bytes: int = 256 << 20
    torch_device: str = "auto"
    cases: list[str] | None = None      # case names (default: every case of the sources)
    seed: int = 0
    kernels: bool = False               # also record each side's GPU kernels per step (kernel_profile)
    argv: list[str] = field(default_factory=list)


def prompt(ckpt: Checkpoints, seed: int) -> list[int]:
    """A random context of ctx tokens (3..vocab-1) in the case's target vocabulary."""
    vocab, n = ckpt.target_config["vocab_size"], ckpt.case.shapes.ctx
    rng = np.random.default_rng([seed, n])
    return [int(t) for t in rng.integers(3, vocab, size=n)]


def prepare(ckpt: Checkpoints, torch: tuple[str | None, str], seed: int) -> Prep:
    """The state every side starts from: the target loaded once, the random context prefilled."""
    return port_sides.prepare(ckpt, torch, prompt(ckpt, seed))


def _reason(e: BaseException, hint: str = "") -> str:
    """One line: the exception and where it was raised (a deliberate Skip: its message only;
    a missing module: what to install)."""
    if isinstance(e, Skip):
        return str(e)
    if isinstance(e, ImportError) and hint:
        return f"{type(e).__name__}: {e}; install: {hint}"[:400]
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{where}"[:400]


def shape_passes(prep: Prep, opts: Options) -> bool:
    """Whether a block source's context length matters to the timing: on MLX CUDA an attention
    with a multi-row query builds its kernel plan once per key length (measured: ~60 ms of host
    time per new length on the H200, MLX 0.32.4), so the first side to reach a length would pay
    what every later side gets for free. Real shapes only; the tiny CPU cases have no such cost."""
    return opts.shapes == "real" and prep.source != "assistant" and prep.taps is not None


def _can_build(side: Side, prep: Prep) -> None:
    """A torch side without a torch device is skipped; a side's modules import, or its reason
    says what to install."""
    if side.framework == "torch" and prep.torch_device is None:
        raise Skip(prep.torch_reason)
    for module in side.needs:
        importlib.import_module(module)


def build_side(side: Side, prep: Prep, opts: Options, index: int = 0) -> tuple[dict, Stepper | None]:
    """Build one side for the timed loop; any failure is the side's reason (no stepper). Block
    sources at real shapes: first `cold` (own never-seen lengths), then a pre-pass over the timed
    lengths on a side built for it, then the side for the timed loop, built fresh."""
    t0 = time.perf_counter()
    cold_out = {}
    try:
        _can_build(side, prep)
        if side.framework == "mlx" and shape_passes(prep, opts):
            cold_out = cold(side, prep, index)
            stepper = side.build(prep)
            pre_pass(stepper, opts.warmup, opts.iters)
            del stepper
            gc.collect()
        stepper = side.build(prep)
        if stepper.framework != side.framework:
            raise RuntimeError(f"side {side.name!r} runs on {stepper.framework}, its Side says {side.framework}")
    except Exception as e:
        return {"side": side.name, "status": "not run", "reason": _reason(e, side.install)}, None
    return {"side": side.name, "status": "ok", "framework": stepper.framework, "notes": stepper.notes,
            "build_s": time.perf_counter() - t0, **cold_out}, stepper


def finish_side(out: dict, stepper: Stepper, timed: dict, opts: Options, peer: bool) -> None:
    """A built side's timed loop result (`time_sides`), then its counts and kernels (run_sides
    releases the stepper after)."""
    try:
        if "error" in timed:
            raise timed.pop("error")
        out.update(timed)
        if stepper.framework == "mlx":
            out.update(count_step(stepper, port=not peer))
        else:
            out["count_note"] = "host syncs / graph ops are counted on MLX sides only"
        if opts.kernels:
            out["kernels"] = kernel_profile(stepper)
    except Exception as e:
        out.update(status="failed", reason=_reason(e))


def run_sides(sides: list[Side], prep: Prep, opts: Options) -> list[dict]:
    """Every side built (side i's cold range its own), timed together in rotation (`time_sides`),
    then counted one by one; the results in the sides' order."""
    built = [build_side(side, prep, opts, i) for i, side in enumerate(sides)]
    outs = [out for out, _ in built]
    ready = [(side, out, stepper) for side, (out, stepper) in zip(sides, built) if stepper is not None]
    del built
    timed = time_sides([stepper for _, _, stepper in ready], opts.warmup, opts.iters)
    for (side, out, stepper), t in zip(ready, timed):
        finish_side(out, stepper, t, opts, side.peer)
    torch_cuda = any(s.framework == "torch" and s.device.startswith("cuda") for _, _, s in ready)
    del ready
    gc.collect()
    if torch_cuda:  # hand the torch sides' cached blocks back before the serve loops
        import torch

        torch.cuda.empty_cache()
    return outs


def run_case(case: Case, opts: Options, torch: tuple[str | None, str], bw: dict, root: Path) -> dict:
    t0 = time.perf_counter()
    ckpt = shapes.build(case, root)
    s = case.shapes
    out = {"case": case.name, "source": case.module, "shape": s.label, "ctx": s.ctx, "gamma": s.gamma,
           "notes": list(s.notes), "dtype": case.dtype, "drafter_config": ckpt.drafter_config}
    try:
        prep = prepare(ckpt, torch, opts.seed)
    except Exception as e:
        out.update(status="failed", reason=_reason(e))
        return out
    floor = shapes.step_bytes(ckpt)
    per_call = 1 if case.module != "assistant" else s.gamma
    floor["bytes_per_call"] = floor["total"] * per_call
    floor["copy_floor_s"] = floor["bytes_per_call"] / bw["copy_bytes_per_s"]
    floor["read_floor_s"] = floor["bytes_per_call"] / bw["read_bytes_per_s"]
    out["floor"] = floor
    out["steps_per_call"] = per_call
    others = others_for(case.module, opts.peers)
    out["sides"] = run_sides([SIDES["port"], *others], prep, opts)
    _ratios(out)
    # The serve loop on the default path, and on each other path of ours the run selected.
    paths = [""] + [p for p in port_sides.PATHS if p and SIDES[port_sides.path_name(p)] in others]
    for path in paths:
        key = "serve_" + path if path else "serve"
        try:
            out[key] = serve_loop(ckpt, prep.target, prompt(ckpt, opts.seed), opts.max_tokens, opts.serve_runs,
                                  port_sides.PortProvider(ckpt, path),
                                  cold=opts.shapes == "real" and s.ctx > COLD_SPACING * 16)
            out[key]["path"] = port_sides.path_name(path)
        except Exception as e:
            out[key] = {"status": "failed", "reason": _reason(e), "path": port_sides.path_name(path)}
    out["status"] = "ok"
    out["wall_s"] = time.perf_counter() - t0
    del prep, ckpt
    gc.collect()
    mx.clear_cache()
    return out


def _ratios(case: dict) -> None:
    """Each side's time / the best peer's and / the floor, and / the port's (the port's speed-up over
    that side: the "≥ 3× every peer" figure); whether its first draft equals the port's (same
    weights, same inputs: a side that disagrees is not computing the same drafter)."""
    ran = [s for s in case["sides"] if s.get("status") == "ok"]
    port = next((s for s in ran if s["side"] == "port"), None)
    for s in ran:
        if port is not None:
            a, b = s["first_tokens"], port["first_tokens"]
            s["agrees_with_port"] = a == b
            s["agreement"] = f"{sum(x == y for x, y in zip(a, b))}/{max(len(a), len(b))}"
    peers = [s for s in ran if SIDES[s["side"]].peer]
    best = min(peers, key=lambda s: s["wall_s"]["median"], default=None)
    case["best_peer"] = best["side"] if best else None
    for s in ran:
        t = s["wall_s"]["median"]
        s["per_step_s"] = t / case["steps_per_call"]
        s["x_floor"] = t / case["floor"]["copy_floor_s"]
        s["x_best_peer"] = t / best["wall_s"]["median"] if best else None
        s["port_speedup"] = t / port["wall_s"]["median"] if port else None
        if best and "graph_ops" in s and "graph_ops" in best and best["graph_ops"]:
            s["ops_x_best_peer"] = s["graph_ops"] / best["graph_ops"]


# ---- facts about the run -------------------------------------------------------------------------

def machine() -> dict:
    info = {}
    with contextlib.suppress(Exception):
        info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in mx.device_info().items()}
    facts = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
             "python": platform.python_version(), "cpu_count": os.cpu_count(), "mlx_default_device": str(mx.default_device()),
             "mlx_device_info": info, "mlx_env": mlx_env()}
    with contextlib.suppress(OSError):
        facts["loadavg"] = os.getloadavg()
    return facts


def mlx_env() -> dict:
    """The MLX_* environment the run saw: backend settings that move the figures (on MLX CUDA,
    MLX_USE_CUDA_GRAPHS=0 or MLX_MAX_OPS_PER_BUFFER=10 move a DFlash block: docs/benchmarks.md,
    "Where a block's time goes")."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}


def versions() -> dict:
    out = {}
    for p in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[p] = metadata.version(p)
    return out


ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("port", "spec_parity", "oracles")


def source_sha256(root: Path = ROOT) -> str:
    """sha256 over the project's code as files (path and bytes of every .py under SOURCE_DIRS, and
    pyproject.toml): the same in a clone at a commit and in a copy of it without .git, so a run
    from a copy can be matched to its commit."""
    h = hashlib.sha256()
    files = [root / "pyproject.toml"] + sorted(f for d in SOURCE_DIRS for f in (root / d).rglob("*.py"))
    for f in files:
        if f.is_file():
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def project(root: Path = ROOT) -> dict:
    """The project's own identity: the commit its copier states in SPEC_PARITY_COMMIT (a device run
    over a copy of the working tree may carry a stale .git, or sit inside another repository), else
    git's HEAD and dirtiness only when `root` is the top of its own repository, else none; git's
    view beside a stated commit; always the source digest, which matches a run to its commit."""
    out = {"commit": None, "dirty": None, "from": "unknown", "source_sha256": source_sha256(root)}
    seen = _own_git(root)
    if os.environ.get("SPEC_PARITY_COMMIT"):
        out.update({"commit": os.environ["SPEC_PARITY_COMMIT"], "from": "SPEC_PARITY_COMMIT (stated, not checked)",
                    "git": seen})
    elif seen:
        out.update(seen, **{"from": "git"})
    return out


def _own_git(root: Path) -> dict | None:
    """HEAD and dirtiness of the repository whose top is `root`, or None."""
    with contextlib.suppress(Exception):
        def git(*args):
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)

        top = git("rev-parse", "--show-toplevel")
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve():
            return {"commit": git("rev-parse", "HEAD").stdout.strip(),
                    "dirty": bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())}
    return None


def run(opts: Options, progress=None, keep=None) -> dict:
    """The whole bench; returns the results document (bench.json's content). `keep(doc)` gets the
    document after each case but the last (`complete` false): a run stopped midway keeps those."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    torch = torch_device(opts.torch_device)
    cases = (shapes.tiny_cases(opts.ctx, opts.gamma, opts.dtype) if opts.shapes == "tiny"
             else shapes.real_cases(opts.ctx, opts.scale, opts.target_layers, opts.gamma, opts.dtype))
    cases = [c for c in cases if c.module in opts.sources and (not opts.cases or c.name in opts.cases)]
    if opts.cases and not cases:
        raise ValueError(f"no case named {opts.cases} among the {opts.shapes} shapes of {list(opts.sources)}")
    say(f"bandwidth ({opts.bw_bytes >> 20} MiB)")
    bw = bandwidth(opts.bw_bytes)
    say("launch cost")
    launch = launch_cost()
    results = []
    cmd = shlex.join([sys.executable, "-m", "spec_parity.cli", *opts.argv])
    process = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    head = {"command": cmd, "process": process, "cwd": os.getcwd(), "argv": opts.argv,
            "options": {k: v for k, v in vars(opts).items() if k != "argv"}, "project": project(), "machine": machine(),
            "versions": versions(), "torch_sides": torch[0] or torch[1], "bandwidth": bw, "launch": launch}

    def doc() -> dict:
        return {**head, "cases": results, "complete": len(results) == len(cases), "cases_planned": len(cases),
                "wall_s": time.perf_counter() - t0, "what": WHAT}

    with tempfile.TemporaryDirectory(prefix="spec-parity-bench-") as tmp:
        for case in cases:
            say(f"case {case.name}")
            results.append(run_case(case, opts, torch, bw, Path(tmp)))
            if keep is not None and len(results) < len(cases):
                keep(doc())
    return doc()


WHAT = {"a": "one draft call: assistant = gamma chained steps, blocks = one block after one committed row; "
             "per_step_s = a / steps_per_call",
        "c": HostSyncs.__doc__.split("\n\n")[0], "f": "primitives evaluated per step (graph nodes)",
        "floor": shapes.step_bytes.__doc__.split("\n")[0] + " / copy bandwidth",
        "launch": "wall per op of a chain of dependent tiny ops: the least one launch costs"}

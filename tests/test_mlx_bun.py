"""mlx-bun's shim (examples/mlx_bun) stays runnable: examples/mlx_bun/setup.sh builds bun and
libmlxc from the mlx-bun and mlx-c trees MLX_BUN_SRC and MLX_C_SRC name, and a few cases run
through `--port-cmd`, held to the verdicts docs/third-party.md records (read from that file, so
the doc and the test cannot drift apart). The control: the same case on a copy of the tree with
the fixes the doc proposes applied must PASS, so the recorded FAIL is the two findings, not a
shim that cannot pass.

Skips with one line where a tool (npm, cmake, a C++ compiler) or a tree is missing; `tox -e
mlx-bun` takes the trees from shared/references beside the checkout where they lie.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spec_parity import exchange, harness, ports

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "third-party.md"
SECTION = "mlx-bun c2e1d46"
SETUP = ROOT / "examples" / "mlx_bun" / "setup.sh"
SHIM = ROOT / "examples" / "mlx_bun" / "port.ts"
CASES = [("assistant", "step-gemma4-tied-transformers"), ("assistant", "step-gemma4-centroid-untied-transformers"),
         ("assistant", "loop-random-centroid-g2"), ("assistant", "sampled-agreeing-T3.0"),
         ("targets", "qwen3"), ("dflash", "mod-qwen3")]
# The fixes docs/third-party.md proposes, as (file, line as shipped, line fixed).
FIXES = [("src/spec/drafter.ts", "ops.sdpa(q, k, v, Math.pow(blk.headDim, -0.5),", "ops.sdpa(q, k, v, 1.0,"),
         ("src/spec/drafter.ts", "ops.rope(q, blk.headDim, blk.ropeBase, position, blk.ropeFreqs)",
          "ops.rope(q, blk.headDim, blk.ropeBase, position + 1, blk.ropeFreqs)"),
         ("src/spec/drafter.ts", "Math.max(0, position - this.slidingWindow + 1)",
          "Math.max(0, position - this.slidingWindow + 2)")]


def missing() -> str | None:
    """Why the shim cannot be built here, or None."""
    for tool, hint in (("npm", "install Node.js"), ("cmake", "install cmake")):
        if not shutil.which(tool):
            return f"{tool} not found ({hint}): mlx-bun's shim not built"
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler: mlx-bun's shim not built"
    for var in ("MLX_BUN_SRC", "MLX_C_SRC"):
        if not os.environ.get(var) or not Path(os.environ[var]).is_dir():
            return f"{var} names no tree ({os.environ.get(var) or 'unset'}): mlx-bun's shim not built"
    return None


if why := missing():     # one line for the module, not one per test
    pytest.skip(why, allow_module_level=True)


@pytest.fixture(scope="module")
def built() -> dict[str, str]:
    """setup.sh's exports (it is idempotent: a second run reuses the first one's build)."""
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    return dict(re.findall(r"^export (\w+)=(.*)$", proc.stdout, re.M))


def recorded(case: str) -> tuple[str, str, str]:
    """(verdict, first failing check or decline reason, layer) of `case` in the doc's section."""
    text = DOC.read_text().split(f"## {SECTION}", 1)[1].split("\n## ", 1)[0]
    m = re.search(rf"^\| {re.escape(case)} \| [^|]+ \| [^|]+ \| (PASS|FAIL|DELTA|DECLINED) \| ([^|]*) \| ([^|]*) \|",
                  text, re.M)
    assert m, f"{DOC}: no row for {case} under '## {SECTION}'"
    return m.group(1), m.group(2).strip().strip("`"), m.group(3).strip()


def evaluate(module: str, case: str, env: dict):
    """The case through the shim, with `env` in the command (a port's runs are kept per command)."""
    assigned = " ".join(f"{k}={v}" for k, v in env.items() if k != "BUN")
    port = exchange.command_port(f"env {assigned} {env['BUN']} run {SHIM} {{case}} {{out}}")
    c = {c.name: c for c in harness.pair(module).cases()}[case]
    return harness.evaluate(c, "golden", ports.Selection({module: port}))


@pytest.mark.parametrize("module,case", CASES, ids=[c for _, c in CASES])
def test_shim_gives_the_recorded_verdict(module, case, built):
    verdict, first, layer = recorded(case)
    result = evaluate(module, case, built)
    if verdict == "DECLINED":
        assert result.verdict == "DECLINED" and first in result.reason, result.message()
        return
    assert result.verdict == verdict, f"{case}: {result.message()}"
    failed = [k for k, v in result.metrics.items() if isinstance(v, dict) and v.get("ok") is False]
    assert (failed[0] if failed else "") == first, f"{case}: first failing check {failed[:3]}, doc says {first!r}"
    localized = result.metrics.get("layers", {}).get("first_divergent_layer")
    assert str("-" if localized is None else localized) == layer, (case, result.metrics.get("layers"))


def test_the_proposed_fixes_pass(built, tmp_path, monkeypatch):
    """The control: the findings are mlx-bun's, fixed there the shim passes."""
    tree = tmp_path / "mlx-bun"
    shutil.copytree(built["MLX_BUN_DIR"], tree)
    for rel, shipped, fixed in FIXES:
        path = tree / rel
        text = path.read_text()
        assert text.count(shipped) == 1, f"{rel}: {shipped!r} is not in the built tree"
        path.write_text(text.replace(shipped, fixed))
    result = evaluate("assistant", "step-gemma4-tied-transformers", {**built, "MLX_BUN_DIR": str(tree)})
    assert result.verdict == "PASS", result.message()


def test_misuse_is_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_BUN_SRC", "MLX_C_SRC")}
    for args, says in (([], "no mlx-bun tree"), ([str(tmp_path)] * 2, "is not an mlx-bun tree")):
        proc = subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_shim_misuse_is_one_line_and_exit_2(built, tmp_path):
    env = {**os.environ, "MLX_BUN_LIBMLXC": built["MLX_BUN_LIBMLXC"]}
    env.pop("MLX_BUN_DIR", None)
    (tmp_path / "request.json").write_text('{"module": "assistant", "kind": "step"}')
    (tmp_path / "inputs.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    for args, says in (([], "usage:"), ([str(tmp_path / "nope"), str(tmp_path)], "must be a case folder"),
                       ([str(tmp_path), str(tmp_path / "out")], "MLX_BUN_DIR does not name")):
        proc = subprocess.run([built["BUN"], "run", str(SHIM), *args], capture_output=True, text=True, env=env)
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr

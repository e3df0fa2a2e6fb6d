"""Every speed figure of docs/benchmarks.md in one command, on the machine it runs on (MLX CUDA
or Metal; `--shapes tiny` on a CPU to try it): each bench runs twice, each run in its own process,
then `spec-parity combine` makes one table of each pair. A figure is never one run's, and runs made
apart (another day, another host) combine the same way: `spec-parity combine A B C`.

    python3 tools/figures.py OUT [--only serve-dflash,step,...] [--runs 2] [--shapes real|tiny]

OUT/<set>-run<i>/ holds each run (serve.json or bench.json), OUT/<set>/combined.md the table.
State the tree with SPEC_PARITY_COMMIT where the copy that runs has no .git (docs/bench.md).
A set whose peers are not installed still runs: those sides say why in the table.
"""

import argparse
import subprocess
import sys
from pathlib import Path

# The sets, as docs/benchmarks.md reports them: the serving conditions against every peer's own
# loop (with our loop's earlier paths beside the default, for the before/after), and the step.
SETS = {
    "serve-dflash": ["--serve", "--sources", "dflash", "--runs", "2", "--new-tokens", "64",
                     "--peers", "port-sequential,port-plain-verify,port-compiled-verify,port-again,zlab-mlx,dflash-mlx"],
    "serve-dspark": ["--serve", "--sources", "dspark", "--runs", "2", "--new-tokens", "64",
                     "--peers", "port-sequential,port-plain-verify,port-compiled-verify,port-again,dspark-mlx,deepspec-torch"],
    "serve-assistant": ["--serve", "--sources", "assistant", "--runs", "2", "--new-tokens", "64",
                        "--peers", "optiq"],
    "step": ["--sources", "dflash,dspark", "--peers", "port-sdpa,zlab-mlx,dspark-mlx"],
    "step-assistant": ["--sources", "assistant", "--peers", "optiq"],
}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "spec_parity.cli", *args]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--only", help=f"comma-separated sets (default all: {', '.join(SETS)})")
    p.add_argument("--runs", type=int, default=2, help="runs of each set, each its own process (>= 2)")
    p.add_argument("--shapes", choices=("real", "tiny"), default="real")
    a = p.parse_args(argv)
    names = a.only.split(",") if a.only else list(SETS)
    unknown = [n for n in names if n not in SETS]
    if unknown:
        p.error(f"--only {','.join(unknown)}: not a set; the sets are {', '.join(SETS)}")
    if a.runs < 2:
        p.error(f"--runs {a.runs}: a figure needs two runs or more")
    failed = []
    for name in names:
        runs = [a.out / f"{name}-run{i}" for i in range(1, a.runs + 1)]
        for run in runs:
            print(f"== {run}", flush=True)
            if subprocess.call(cli("bench", "--shapes", a.shapes, *SETS[name], "--out", str(run))):
                failed.append(str(run))
        done = [r for r in runs if any(r.glob("*.json"))]
        if len(done) >= 2 and subprocess.call(cli("combine", *map(str, done), "--out", str(a.out / name))):
            failed.append(f"combine {name}")
    if failed:
        print(f"figures: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

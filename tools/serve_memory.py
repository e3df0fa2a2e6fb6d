"""Peak memory of a request, per side of `bench --serve` (spec_parity/bench/loop_sides.py), each side
built in turn in one process as the serve bench builds them, every side served the same prompt
lengths: MLX's active memory before the request, its peak during it, the rise: whether a side's
higher peak in a serving table is its own or its build order's (on MLX CUDA the side built first
in a process peaked lower, whichever it was).

    python3 tools/serve_memory.py [--source dflash|dspark] [--sides port,port-compiled-verify,port-again] [--shapes tiny]
"""

import argparse
import gc
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from spec_parity.bench import loop_sides, loops, shapes

NEW_TOKENS = (1, 2, 64)   # the prefill and a round; the prefill and 63 rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=("dflash", "dspark"), default="dflash")
    p.add_argument("--sides", default=f"port,{loop_sides.COMPILED_VERIFY},{loop_sides.AGAIN}")
    p.add_argument("--shapes", choices=("real", "tiny"), default="real", help="tiny: a CPU runs it")
    args = p.parse_args()
    opts, case, sides, env = loops.our_sides(args.source, args.shapes, args.sides.split(","))
    unit, label = (2**30, "GiB") if args.shapes == "real" else (2**20, "MiB")
    with tempfile.TemporaryDirectory() as root:
        ckpt = shapes.build(case, Path(root))
        seq = [int(t) for t in np.random.default_rng(0).integers(3, ckpt.target_config["vocab_size"], size=opts.prompt_len + 512)]
        lengths = [opts.prompt_len + 97 * i for i in range(len(NEW_TOKENS) + 1)]
        print(f"{case.name} ({case.shapes.label}), prompts of {lengths} tokens (the first a warm-up), {label}")
        for side in sides:
            loop = side.build(ckpt, env)
            peaks = request_peaks(loop.generate, [(seq[:n], k) for n, k in zip(lengths, (16,) + NEW_TOKENS)])[1:]
            print(f"{side.name}: " + "; ".join(f"{k} new: before {b / unit:.2f}, peak {pk / unit:.2f} (+{(pk - b) / unit:.2f})"
                                              for k, (b, pk) in zip(NEW_TOKENS, peaks)))
            del loop


def request_peaks(generate, requests: list) -> list[tuple[int, int]]:
    """(active bytes before, peak bytes during) of each generate(prompt, n) in `requests`, MLX's
    cache emptied and its peak reset before each."""
    out = []
    for prompt, n in requests:
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        generate(prompt, n)
        out.append((before, mx.get_peak_memory()))
    return out


if __name__ == "__main__":
    main()

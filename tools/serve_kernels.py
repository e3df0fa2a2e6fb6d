"""Where a whole request's time goes in serving conditions, for our loop's sides of `bench --serve`
(spec_parity/bench/loop_sides.py): per request, the wall time, and the GPU's kernels (CUPTI
through torch.profiler, timing.kernel_profile): launches, summed kernel time, busy time (their
union) against the profiled window, by class. Each request is fresh, at a prompt length no other
request has used (as the serve bench's): whether a round is bound by the GPU or by the host. MLX
CUDA with a CUDA torch only.

    python3 tools/serve_kernels.py [--source dflash|dspark] [--sides port,port-compiled-verify] [--shapes tiny]
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np

from spec_parity.bench import loop_sides, loops, shapes, timing
from spec_parity.bench.sides import Stepper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=("dflash", "dspark"), default="dflash")
    p.add_argument("--sides", default=f"port,{loop_sides.COMPILED_VERIFY}")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=3, help="timed requests per side, then as many profiled")
    p.add_argument("--shapes", choices=("real", "tiny"), default="real", help="tiny: a CPU runs it (no profile)")
    args = p.parse_args()
    opts, case, sides, env = loops.our_sides(args.source, args.shapes, args.sides.split(","))
    with tempfile.TemporaryDirectory() as root:
        ckpt = shapes.build(case, Path(root))
        vocab = ckpt.target_config["vocab_size"]
        seq = [int(t) for t in np.random.default_rng(0).integers(3, vocab, size=opts.prompt_len + 4096)]
        length = iter(range(opts.prompt_len, opts.prompt_len + 4096, args.new_tokens + 32))
        print(f"{case.name} ({case.shapes.label}), {args.new_tokens} new tokens a request, prompts from "
              f"{opts.prompt_len} tokens, each at a new length")
        for side in sides:
            loop = side.build(ckpt, env)
            loop.generate(seq[: next(length)], args.new_tokens)   # warm-up: kernels compiled, traces made
            rates = []
            for _ in range(args.requests):
                run = loop.generate(seq[: next(length)], args.new_tokens)
                rates.append((len(run.tokens) - run.n_first) / (run.t_end - run.t_first))
            print(f"{side.name}: decode {np.median(rates):.1f} tok/s [{min(rates):.1f}-{max(rates):.1f}]; {loop.notes}")
            short, long = (profiled(loop, seq, length, n, args.requests) for n in (args.new_tokens, 2 * args.new_tokens))
            if short[0]["status"] != "ok":
                print(f"  not profiled: {short[0]['reason']}")
                continue
            print("  " + per_round(short, long))
            del loop


def profiled(loop, seq, length, n: int, requests: int) -> tuple[dict, float]:
    """timing.kernel_profile over `requests` fresh requests of n tokens, and their mean rounds."""
    rounds = []

    def request():
        run = loop.generate(seq[: next(length)], n)
        rounds.append(run.rounds)
        return run.tokens

    s = timing.kernel_profile(Stepper(step=request), steps=requests)
    return s, float(np.mean(rounds[1:] or [0]))   # kernel_profile's first call is its warm-up


def per_round(short: tuple[dict, float], long: tuple[dict, float]) -> str:
    """A round's GPU work: the two request lengths' difference over their rounds' (the prefill and
    the first round cancel)."""
    (a, ra), (b, rb) = short, long
    r = rb - ra

    def d(key):
        return (b[key] - a[key]) / r

    classes = {c["class"]: c for c in a["classes"]}
    parts = ", ".join(f"{c['class']} {(c['launches_per_call'] - classes.get(c['class'], {}).get('launches_per_call', 0)) / r:.0f}x "
                      f"{(c['us_per_call'] - classes.get(c['class'], {}).get('us_per_call', 0)) / r:.0f}us"
                      for c in b["classes"])
    return (f"a round ({ra:.0f} and {rb:.0f} rounds a request): {d('launches_per_call'):.0f} launches, kernels "
            f"{d('kernel_us_per_call'):.0f} us, busy {d('busy_us_per_call'):.0f} us, window {d('window_us_per_call'):.0f} us"
            f" | {parts}")


if __name__ == "__main__":
    main()

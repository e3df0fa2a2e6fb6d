"""How far each fast path of the serve loop lands from the op-by-op path it replaces, on the
device this runs on: the compiled verify against the plain verify (tests/test_bucketed_verify.py's
loops) and the pipelined loop against the sequential one (tests/test_pipelined.py's requests), per
tensor of a round the largest |Δ| and the largest |ref|, and whether the tokens are equal. Zero
everywhere on the CPU; on MLX CUDA it is what budgets ("serve", "mlx_cuda") was set from
(docs/benchmarks.md, session 19).

    PYTHONPATH=$PWD:$PWD/tests python3 tools/fast_path_tiers.py
"""

import numpy as np
import test_bucketed_verify as verify_tests
import test_pipelined as pipelined_tests


def worst(fast, plain) -> dict:
    """Per tensor index of a round, (largest |Δ|, largest |ref|) over the rounds."""
    out = {}
    for f, p in zip(fast, plain):
        for i, (a, b) in enumerate(zip(f, p)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            out[i] = max(out.get(i, (0.0, 0.0)), (float(np.abs(a - b).max()), float(np.abs(b).max())))
    return {i: f"{d:.3g} (|ref| {m:.3g})" for i, (d, m) in out.items()}


def main() -> None:
    for name in ["dspark", "gemma4", "assistant-tied", "dflash"]:
        p_tokens, _, plain = verify_tests._loop(name, verify_tests.BUCKET, verify="plain")
        tokens, _, fast = verify_tests._loop(name, verify_tests.BUCKET)
        print(f"compiled verify {name}: tokens equal {tokens == p_tokens}, {len(fast)} forwards,",
              worst(fast, plain), flush=True)
    for name in ["dspark-dflash-variant", "dspark", "dflash"]:
        for max_tokens, eos in pipelined_tests._ends(name):
            seq = pipelined_tests._run(name, max_tokens, eos, "off")
            pipe = pipelined_tests._run(name, max_tokens, eos, "on")
            print(f"pipelined {name} max_tokens={max_tokens} eos={sorted(eos)}: tokens equal {seq[0] == pipe[0]},",
                  worst(pipe[2][: len(seq[2])], seq[2]), flush=True)


if __name__ == "__main__":
    main()

"""How far each fast path of the serve loop lands from the op-by-op path it replaces, on the
device this runs on: the compiled verify against the plain verify (tests/test_bucketed_verify.py's
loops) and the pipelined loop against the sequential one (tests/test_pipelined.py's requests), per
tensor of a round the largest |Δ| and the largest |ref|, and whether the tokens are equal. Zero
everywhere on the CPU; on MLX CUDA it is what budgets ("serve", "mlx_cuda") was set from.
`--controls`: how far the planted controls that those tests hold move the same tensors (the budget
must stay far below the smallest).

    PYTHONPATH=$PWD:$PWD/tests python3 tools/fast_path_tiers.py [--controls]
"""

import sys

import numpy as np
import test_bucketed as bucketed_tests
import test_bucketed_verify as verify_tests
import test_pipelined as pipelined_tests

from spec_parity import controls


def deltas(fast, plain) -> dict:
    """Per tensor index of a round, the largest |Δ| over the rounds and the largest |ref| of the
    round it is in (the magnitude that |Δ| is set against)."""
    out = {}
    for f, p in zip(fast, plain):
        for i, (a, b) in enumerate(zip(f, p)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            out[i] = max(out.get(i, (0.0, 0.0)), (float(np.abs(a - b).max()), float(np.abs(b).max())))
    return out


def worst(fast, plain) -> dict:
    return {i: f"{d:.3g} (|ref| {m:.3g})" for i, (d, m) in deltas(fast, plain).items()}


def largest(fast, plain) -> float:
    return max(d for d, _ in deltas(fast, plain).values())


def planted_reach() -> None:
    """Per planted control of tests/test_bucketed_verify.py and tests/test_bucketed.py, the largest
    |Δ| it causes against the unplanted path."""
    reach = []
    for bug, names in verify_tests.CONTROLS.items():
        for name in names:
            plain = (verify_tests._default(name) if bug != "compiled_verify_write_off_by_one"
                     else verify_tests._loop(name, verify_tests.BUCKET, verify="plain"))[2]
            with controls.planted("serve", bug):
                planted = verify_tests._loop(name, verify_tests.BUCKET)[2]
            reach.append((bug, name, largest(planted[: len(plain)], plain[: len(planted)])))
    for source, variant, attention in bucketed_tests.MASK_CONTROLS:
        plain, _ = bucketed_tests.ROUNDS[source](variant, None)
        with controls.planted(source, "bucket_mask_off_by_one"):
            planted, _ = bucketed_tests.ROUNDS[source](variant, bucketed_tests.BUCKET, attention=attention)
        reach.append(("bucket_mask_off_by_one", f"{source}-{variant}-{attention}",
                      largest([t for t, _ in planted], [t for t, _ in plain])))
    for bug in bucketed_tests.ASSISTANT_CONTROLS.values():
        with controls.planted("assistant", bug):
            _, _, _, fast, plain = bucketed_tests._assistant_loop("assistant-tied")
        reach.append((bug, "assistant-tied", largest([t for t, _ in fast], [t for t, _ in plain])))
    for bug, name, d in reach:
        print(f"planted {bug} on {name}: largest |Δ| {d:.3g}")
    print(f"smallest reach of a control: {min(d for *_, d in reach):.3g}")


def main() -> None:
    if "--controls" in sys.argv[1:]:
        planted_reach()
        return
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

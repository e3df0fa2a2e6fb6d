"""Paired drafter A/B: same target, same prompts, T=0, drafter A vs drafter B.

The statistics and the verdict wording are those of mlx-bun 0.0.11 `dspark/ab-stats.ts`. Prompts
are the pairing unit: per-prompt deltas cancel prompt difficulty and machine-load drift between
the arms. The gate: B may lose at most `max_drop_pts` absolute points of acceptance AND must be
strictly faster in wall clock.

`run_ab` runs both arms through the one serve loop (`spec_parity.port.serve.generate`), prompt by prompt,
alternating which arm goes first; at T=0 both arms must emit the target's own greedy stream, so
a stream mismatch is an error (a broken loop or drafter), not a result.

Prompts file (`read_prompts`, `spec-parity ab --prompts`): one prompt per line, written as
whitespace-separated integer token ids of the target's vocabulary; blank lines and lines starting
with `#` are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path


@dataclass
class AbPromptResult:
    """One prompt x one drafter arm."""

    prompt: str
    generated_tokens: int
    drafted: int
    accepted: int
    target_calls: int
    wall_ms: float
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class AbArmSummary:
    """Aggregates over one arm's prompt set."""

    n_prompts: int
    generated_tokens: int
    acceptance: float  # accepted / drafted over the whole set
    tau: float  # committed tokens per target forward
    tok_per_sec: float  # generated tokens per wall second over the whole set
    acceptance_by_pos: list[float]  # acceptance at each draft position 0..gamma-1

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class AbVerdict:
    a: AbArmSummary
    b: AbArmSummary
    acceptance_delta_pts: float  # B - A, absolute points (-2.1 = B accepts 2.1 points less)
    speed_ratio: float  # B / A wall-clock throughput (> 1 = B faster); 0 if A has no throughput
    paired_acceptance_holds: int  # prompts where B's acceptance >= A's - max_drop_pts
    max_drop_pts: float
    passed: bool
    verdict: str

    def to_json(self) -> dict:
        return {"a": self.a.to_json(), "b": self.b.to_json(),
                "acceptance_delta_pts": self.acceptance_delta_pts, "speed_ratio": self.speed_ratio,
                "paired_acceptance_holds": self.paired_acceptance_holds,
                "max_drop_pts": self.max_drop_pts, "pass": self.passed, "verdict": self.verdict}


def summarize_arm(results: Sequence[AbPromptResult]) -> AbArmSummary:
    generated = sum(r.generated_tokens for r in results)
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    calls = sum(r.target_calls for r in results)
    wall_ms = sum(r.wall_ms for r in results)
    gamma = max([0] + [len(r.drafted_by_pos) for r in results])
    by_pos = []
    for i in range(gamma):
        d = sum(r.drafted_by_pos[i] if i < len(r.drafted_by_pos) else 0 for r in results)
        a = sum(r.accepted_by_pos[i] if i < len(r.accepted_by_pos) else 0 for r in results)
        by_pos.append(a / d if d > 0 else 0.0)
    return AbArmSummary(
        n_prompts=len(results),
        generated_tokens=generated,
        acceptance=accepted / drafted if drafted > 0 else 0.0,
        tau=generated / calls if calls > 0 else 0.0,
        tok_per_sec=generated / wall_ms * 1000 if wall_ms > 0 else 0.0,
        acceptance_by_pos=by_pos,
    )


def to_fixed(x: float, digits: int) -> str:
    """JavaScript's Number.prototype.toFixed: the exact binary value rounded half away from zero
    (Python's format rounds half to even), and -0 prints as 0."""
    if x == 0:
        x = 0.0
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def paired_verdict(a_results: Sequence[AbPromptResult], b_results: Sequence[AbPromptResult],
                   max_drop_pts: float = 3) -> AbVerdict:
    """PASS iff B's acceptance is at most `max_drop_pts` points below A's AND B is strictly faster
    in wall clock. The arms must hold the same prompts, in the same order."""
    if len(a_results) != len(b_results):
        raise ValueError(f"paired_verdict: arm sizes differ ({len(a_results)} vs {len(b_results)})")
    a, b = summarize_arm(a_results), summarize_arm(b_results)
    delta = (b.acceptance - a.acceptance) * 100
    ratio = b.tok_per_sec / a.tok_per_sec if a.tok_per_sec > 0 else 0.0
    holds = 0
    for ra, rb in zip(a_results, b_results):
        acc_a = ra.accepted / ra.drafted if ra.drafted > 0 else 0.0
        acc_b = rb.accepted / rb.drafted if rb.drafted > 0 else 0.0
        if acc_b >= acc_a - max_drop_pts / 100:
            holds += 1
    acceptance_ok = delta >= -max_drop_pts
    speed_ok = ratio > 1
    passed = acceptance_ok and speed_ok
    return AbVerdict(a, b, delta, ratio, holds, max_drop_pts, passed,
                     verdict_text(delta, ratio, max_drop_pts, acceptance_ok, passed))


def verdict_text(delta: float, ratio: float, max_drop_pts: float, acceptance_ok: bool, passed: bool) -> str:
    """The seed's three verdicts, saying truthfully whether B's acceptance rose or dropped."""
    limit, d = _js_number(max_drop_pts), to_fixed(abs(delta), 1)
    moved = "rose" if d != "0.0" and delta > 0 else "dropped" if d != "0.0" else "unchanged at"
    if passed:
        return f"PASS — acceptance {moved} {d} pts (within {limit}), wall-clock ×{to_fixed(ratio, 2)}"
    if not acceptance_ok:
        return f"FAIL — acceptance dropped {d} pts (limit {limit}); B does not preserve A's acceptance"
    return (f"FAIL — acceptance {moved} {d} pts (within {limit}) but wall-clock did not improve "
            f"(×{to_fixed(ratio, 2)})")


def _js_number(x: float) -> str:
    """A number as a JS template literal prints it (3, not 3.0)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def render_report(label_a: str, label_b: str, v: AbVerdict) -> tuple[str, dict]:
    """The two-arm report: the seed's text, and the same content as a JSON-able dict."""

    def pct(x: float) -> str:
        return f"{to_fixed(x * 100, 1)}%"

    def row(label: str, s: AbArmSummary) -> str:
        return (f"  {label.ljust(28)} acceptance {pct(s.acceptance).rjust(6)}  τ {to_fixed(s.tau, 2)}  "
                f"{to_fixed(s.tok_per_sec, 1)} tok/s  ({s.generated_tokens} tok over {s.n_prompts} prompts)")

    def pos_row(label: str, s: AbArmSummary) -> str:
        return f"  {label.ljust(28)} by-pos [{' '.join(pct(x) for x in s.acceptance_by_pos)}]"

    text = "\n".join([
        row(f"A: {label_a}", v.a),
        row(f"B: {label_b}", v.b),
        pos_row(f"A: {label_a}", v.a),
        pos_row(f"B: {label_b}", v.b),
        f"  paired: B holds A's acceptance on {v.paired_acceptance_holds}/{v.a.n_prompts} prompts",
        f"  {v.verdict}",
    ])
    return text, {"labels": {"a": label_a, "b": label_b}, **v.to_json()}


# ------------------------------------------------------------------------------------------------
# Running the arms


class PromptsError(ValueError):
    """A prompts file that cannot be read as token ids: the message names the file, line and fix."""


def read_prompts(path: str | Path, vocab_size: int | None = None) -> list[list[int]]:
    """Prompts file: one prompt per line as whitespace-separated token ids in 0..vocab_size-1;
    blank lines and `#` comments skipped."""
    path = Path(path)
    fix = "write one prompt per line as whitespace-separated token ids"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PromptsError(f"--prompts {path}: cannot be read ({e.strerror or e}); give a prompts file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptsError(f"{path}: binary, not UTF-8 text (byte {e.start}); {fix}") from None
    if "\x00" in text:
        raise PromptsError(f"{path}: binary, not text (a NUL byte at {text.index(chr(0))}); {fix}")
    prompts = []
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            ids = [int(tok) for tok in line.split()]
        except ValueError:
            raise PromptsError(f"{path}:{n}: a prompt is whitespace-separated integer token ids; {fix}") from None
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            bound = f"0..{vocab_size - 1}" if vocab_size is not None else "0 and up"
            raise PromptsError(f"{path}:{n}: token ids {bad[:8]} outside the vocabulary {bound}; "
                               "use the target tokenizer's ids")
        prompts.append(ids)
    if not prompts:
        raise PromptsError(f"{path}: no prompts; {fix}")
    return prompts


def _result(prompt: list[int], stats) -> AbPromptResult:
    return AbPromptResult(
        prompt=" ".join(map(str, prompt)),
        generated_tokens=stats.emitted,  # every token the target committed (EOS included)
        drafted=stats.drafted,
        accepted=stats.accepted,
        target_calls=stats.target_calls,
        wall_ms=stats.elapsed_s * 1000,
        drafted_by_pos=list(stats.drafted_by_position),
        accepted_by_pos=list(stats.accepted_by_position),
    )


def provider_for(path: str | Path):
    """The serve-loop provider of any drafter family, from its config.json: the assistant,
    DSpark, DFlash, or DFlash with the DSpark extras on (its thresholds resolved as the provider
    resolves them: env, then calibration.json)."""
    from . import checkpoint

    kind = checkpoint.drafter_kind(checkpoint.read_config(Path(path)))
    if kind == "assistant":
        from .sources.assistant import AssistantProvider

        return AssistantProvider(path)
    if kind == "dspark":
        from .sources.dspark import DeepspecProvider

        return DeepspecProvider(path)
    if kind in ("dflash", "dflash-extension"):
        from .sources.dflash import DflashProvider

        return DflashProvider(path, extras=kind == "dflash-extension")
    raise checkpoint.CheckpointError(f"{Path(path) / 'config.json'}: not a drafter the A/B takes (a Gemma-4 "
                                     "assistant, DSpark, DFlash or DSpark-on-DFlash checkpoint)")


def run_ab(target_dir: str | Path, drafter_a: str | Path, drafter_b: str | Path,
           prompts: Sequence[Sequence[int]], gamma: int | None = None, max_tokens: int = 32,
           warmup: bool = True, provider_factory=None) -> tuple[list[AbPromptResult], list[AbPromptResult]]:
    """Both arms over the prompts at T=0 (greedy), prompt by prompt: A then B on even prompts, B
    then A on odd ones, so load drift and cache warmth do not favour one arm. With `warmup`, each
    arm first runs the first prompt once untimed (MLX's first calls pay one-off costs). Returns
    (A's per-prompt results, B's), in prompt order. Raises if the arms' streams differ (T=0 must
    emit the target's greedy stream whatever the drafter). `gamma` None: each arm's trained
    block (block drafters), 4 for the assistant."""
    from . import serve, targets

    factory = provider_factory or provider_for
    target = targets.load(target_dir)
    providers = {"a": factory(drafter_a), "b": factory(drafter_b)}
    gammas = {arm: gamma or getattr(p, "trained_gamma", None) or 4 for arm, p in providers.items()}
    prompts = [list(map(int, p)) for p in prompts]
    try:
        if warmup and prompts:
            for arm in ("a", "b"):
                serve.generate(target, prompts[0], max_tokens, providers[arm],
                               serve.ServeOptions(gamma=gammas[arm]))
        results: dict[str, list[AbPromptResult]] = {"a": [], "b": []}
        for i, prompt in enumerate(prompts):
            streams = {}
            for arm in (("a", "b") if i % 2 == 0 else ("b", "a")):
                tokens, stats = serve.generate(target, prompt, max_tokens, providers[arm],
                                               serve.ServeOptions(gamma=gammas[arm]))
                streams[arm] = tokens
                results[arm].append(_result(prompt, stats))
            if streams["a"] != streams["b"]:
                raise RuntimeError(f"prompt {i}: the arms emitted different streams at T=0 "
                                   f"(A {streams['a'][:8]}..., B {streams['b'][:8]}...): a drafter or "
                                   "the loop is not lossless; timings would be meaningless")
        return results["a"], results["b"]
    finally:
        for p in providers.values():
            p.dispose()

"""`spec-parity bench --serve`: decode tokens/s of our serve loop in serving conditions, side by
side with each peer's own generation loop and the target's plain decode, on the same weights.

Per case (a draft source at a condition) every side (spec_parity/bench/loop_sides.py) gets:
  * two passes over the sides, the second in reverse order (A B C, then C B A), each building the
    side anew and giving it half of its timed requests, so that a drift of the machine over the
    case weighs on every side alike; per pass:
  * one untimed request on the check prompt (`--prompt-len` tokens): its warm-up, and its stream
    against the plain decode's stream on the same prompt (T=0 is lossless: any difference is a bug
    or a knife-edge tie, named with its first divergent position; every pass's is compared);
  * `--runs` timed requests in all (half per pass), each a FRESH request at a prompt length no
    other request of this case has used (so every round of every request is at a context length no
    side has seen: serving conditions, where MLX CUDA plans a multi-row attention once per key
    length). The lengths are interleaved across sides, and reversed on odd runs, so every side's
    mean length is the same;
  * decode tokens/s per request = the tokens after the first group the host sees / the time from
    that group to the last token (the prefill is not decode); median and p10-p90 over the runs;
  * tau = decode tokens / verify rounds (mean tokens committed per round: accepted + 1),
    acceptance = accepted / drafted where the side reports both; peak memory over the timed runs;
  * the round split (draft / verify / accept+trim) where the side exposes it: ours from one more
    observed request in the second pass (spec_parity/bench/serve.py's serve_loop instrumentation),
    dflash-mlx's from its own cycle events.
Conditions: `random` (the bench's cases, random drafters: tau ~ 1) and `agreeing` (the factory's
agreeing kinds, spec_parity/checkpoints/agreeing.py: the target's greedy stream walks a known
permutation and the drafter proposes it on a share `--agree-frac` of the tokens, the same weights
for every side, so every side's tau is set by the weights, not by its loop). The agreeing kinds
need hidden >= vocab (DFlash) and exact float32 margins, so they are built at the factory's own
shapes in float32 whatever `--shapes` says; the report states each case's shapes. `agreeing-real`
(spec_parity/bench/agreeing_real.py): DFlash on a Qwen3-8B shaped target, the Gemma-4 12B
assistant on its Gemma-4 target and DSpark on the Qwen3-4B shaped target of the bench's real DSpark
case, at real widths in the run's dtype, the stream confined to tokens each on a coordinate of its
own, tau set exactly per case and family (`--tau`; `max`: each family's own).
Figures are reported, never asserted.
"""

from __future__ import annotations

import contextlib
import gc
import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from ..case import Case
from ..goldens import atomic_write
from . import agreeing_real, loop_sides, shapes
from .loop_sides import Loop
from .report import _identity, _mlx_env
from .runner import _can_build, _reason, machine, project, versions
from .shapes import SOURCES
from .sides import Side, torch_device
from .timing import _memory, summary

CONDITIONS = ("random", "agreeing", "agreeing-real")
# The bench's case per source (spec_parity/bench/shapes.py) for the random condition.
RANDOM_CASES = {"tiny": {"assistant": "assistant-tied", "dspark": "dspark-qwen3", "dflash": "dflash-qwen3"},
                "real": {"assistant": "assistant-12b-tied", "dspark": "dspark-qwen3-4b", "dflash": "dflash-qwen3-4b"}}
AGREE_DFLASH = {"hidden_size": 256, "vocab_size": 256}   # hidden >= vocab: the slot maps are exact


@dataclass
class Options:
    shapes: str = "tiny"
    sources: tuple[str, ...] = SOURCES
    sides: list[str] | None = None        # None: every side of a source
    conditions: tuple[str, ...] = CONDITIONS[:2]
    prompt_len: int = 2048
    new_tokens: int = 128
    runs: int = 3
    agree_frac: float = 0.8
    taus: str = "2,4,max"                 # agreeing-real: tau per case (max: the family's, parse_taus)
    dtype: str = "float32"
    scale: int = 1
    target_layers: int | None = None
    gamma: int = 4
    torch_device: str = "auto"
    seed: int = 0
    argv: list[str] = field(default_factory=list)


def agreeing_cases(agree_frac: float, gamma: int, ctx: int) -> list[Case]:
    """The agreeing pair of each source at the factory's shapes (the pairs' own agreeing loops:
    spec_parity/drafters/*/pair.py), all on agreeing targets, float32; DFlash at block 16 like the real case."""
    f = {"agree_frac": agree_frac}
    shape = "factory agreeing shapes (vocab {v}, hidden {h}), float32"
    rows = [
        ("assistant-agreeing", "assistant", shape.format(v=128, h=64) + ", tied head",
         ("gemma4-assistant-agreeing", {"use_ordered_embeddings": False, **f}), ("gemma4-target-agreeing", {}), gamma),
        ("dspark-agreeing", "dspark", shape.format(v=128, h=64) + ", block 7",
         ("dspark-drafter-agreeing", {"target_kind": "qwen3-target-agreeing", **f}), ("qwen3-target-agreeing", {}), 7),
        ("dflash-agreeing", "dflash", shape.format(v=256, h=256) + ", block 16",
         ("dflash-drafter-agreeing", {"target_overrides": AGREE_DFLASH, "block_size": 16, "num_attention_heads": 16,
                                      **f}), ("qwen3-target-agreeing", AGREE_DFLASH), 15),
    ]
    return [shapes.bench_case("tiny", name, src, label, d, t, ctx, g, "float32") for name, src, label, d, t, g in rows]


def cases(opts: Options) -> list[tuple[str, Case]]:
    """(condition, case) per source and condition."""
    out = []
    if "random" in opts.conditions:
        every = (shapes.tiny_cases(opts.prompt_len, opts.gamma, opts.dtype) if opts.shapes == "tiny"
                 else shapes.real_cases(opts.prompt_len, opts.scale, opts.target_layers, opts.gamma, opts.dtype))
        names = RANDOM_CASES[opts.shapes]
        out += [("random", c) for c in every if c.module in opts.sources and c.name == names[c.module]]
    if "agreeing" in opts.conditions:
        out += [("agreeing", c) for c in agreeing_cases(opts.agree_frac, opts.gamma, opts.prompt_len)
                if c.module in opts.sources]
    if "agreeing-real" in opts.conditions:
        for src in (s for s in SOURCES if s in opts.sources and s in agreeing_real.FAMILIES):
            taus = agreeing_real.parse_taus(opts.taus, agreeing_real.tau_max(src, opts.gamma), _tau_why(src))
            out += [("agreeing-real", c) for c in agreeing_real.cases(src, taus, opts.shapes, opts.prompt_len,
                                                                      opts.dtype, opts.gamma, opts.target_layers)]
    return out


def _tau_why(source: str) -> str:
    return " (the assistant's tau max is --gamma + 1)" if source == "assistant" else f" ({source})"


def our_sides(source: str, shape: str, names: list[str]) -> tuple[Options, Case, list[Side], SimpleNamespace]:
    """What a tool that runs some of our loop sides outside `bench` builds (tools/serve_kernels.py,
    tools/serve_memory.py): the options and case of `source`'s random condition at `shape` ("real":
    bf16, "tiny": fp32), the sides named in their order, and an env with no torch side."""
    opts = Options(shapes=shape, sources=(source,), conditions=("random",),
                   dtype="bfloat16" if shape == "real" else "float32")
    case = cases(opts)[0][1]
    sides = sorted((s for s in loop_sides.sides_for(case.module, names) if s.name in names), key=lambda s: names.index(s.name))
    return opts, case, sides, SimpleNamespace(torch_device=None, torch_reason="not used")


# ---- one side ------------------------------------------------------------------------------------

def stream_check(tokens: list[int], reference: list[int] | None) -> dict:
    """The side's stream on the check prompt against the plain decode's."""
    if reference is None:
        return {"lossless": None, "note": "no plain decode stream to compare with"}
    n = min(len(tokens), len(reference))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if first is None and len(tokens) != len(reference):
        first = n
    return {"lossless": first is None, "first_divergence": first, "compared": len(reference)}


def _medians(rounds: list[dict]) -> dict:
    steady = rounds[1:] or rounds
    return {k: float(np.median([r[k] for r in steady])) for k in steady[0]} if steady else {}


def requests(loop: Loop, prompts: list[list[int]], check: list[int], split_prompt: list[int], n: int,
             split: bool = True) -> dict:
    """One pass on a built side, raw: the check request, the timed requests (one per prompt), and
    with `split` the round split (the side's own per-round events need no request of their own)."""
    first = loop.generate(check, n)
    mem = _memory(loop)
    if mem:
        mem[0]()
    runs = [loop.generate(p, n) for p in prompts]
    out = {"check_tokens": first.tokens, "runs": runs, "prompt_lens": [len(p) for p in prompts]}
    if mem:
        out["peak_bytes"] = int(mem[2]())
    if loop.split is not None:
        if split:
            out["split"] = loop.split(split_prompt, n)
            out["split_from"] = "one more observed request (spec_parity/bench/serve.py serve_loop instrumentation)"
    elif runs and all(r.split for r in runs):
        out["split"] = [x for r in runs for x in r.split]
        out["split_from"] = "the side's own per-round events"
    return out


def figures(passes: list[dict], reference: list[int] | None) -> dict:
    """A side's figures over its passes' raw requests (`requests`): tok/s per request pooled, tau,
    acceptance, the largest peak, the round split, and each pass's check stream against the
    plain decode's (lossless only if every pass is)."""
    runs = [r for p in passes for r in p["runs"]]
    out = {"check_tokens": passes[0]["check_tokens"]}
    peaks = [p["peak_bytes"] for p in passes if "peak_bytes" in p]
    if peaks:
        out["peak_bytes"] = max(peaks)
    rates = [r.decode_tokens / r.decode_s for r in runs if r.decode_s > 0]
    rounds = sum(r.rounds for r in runs)
    out.update(decode_tokens_per_s=summary(rates) if rates else None, samples_tokens_per_s=rates,
               prompt_lens=[n for p in passes for n in p["prompt_lens"]], decode_tokens=[r.decode_tokens for r in runs],
               rounds=[r.rounds for r in runs], tau=sum(r.decode_tokens for r in runs) / rounds if rounds else None)
    drafted = [r.drafted for r in runs]
    if all(d is not None for d in drafted) and sum(drafted):
        out["acceptance"] = sum(r.accepted for r in runs) / sum(drafted)
    split = [x for p in passes for x in p.get("split", [])]
    if split:
        out["round_split_s"] = _medians(split)
        out["round_split_from"] = next(p["split_from"] for p in passes if "split_from" in p)
    checks = [stream_check(p["check_tokens"], reference) for p in passes]
    out["stream"] = next((c for c in checks if c["lossless"] is False), checks[0])
    return out


def _release(torch_cuda: bool) -> None:
    """Hand a side's memory back before the next side (a failed side's too)."""
    with contextlib.suppress(Exception):
        gc.collect()
        mx.clear_cache()
        if torch_cuda:
            import torch

            torch.cuda.empty_cache()


def run_pass(side: Side, ckpt, env, prompts, check, split_prompt, n, split: bool = True) -> dict:
    """Build one side, run one pass of its requests (`requests`), let it go; any failure (an
    import, a loader, a CUDA error) is the pass's recorded reason, never the run's end."""
    t0 = time.perf_counter()
    try:
        _can_build(side, env)
        loop = side.build(ckpt, env)
    except Exception as e:
        _release(side.framework == "torch")
        return {"side": side.name, "status": "not run", "reason": _reason(e, side.install)}
    out = {"side": side.name, "status": "ok", "framework": loop.framework, "device": loop.device or str(mx.default_device()),
           "notes": loop.notes, "build_s": time.perf_counter() - t0}
    try:
        out["raw"] = requests(loop, prompts, check, split_prompt, n, split)
    except Exception as e:
        out.update(status="failed", reason=_reason(e))
    torch_cuda = loop.framework == "torch" and loop.device.startswith("cuda")
    del loop
    _release(torch_cuda)
    return out


def side_result(passes: list[dict], reference: list[int] | None) -> dict:
    """One side's row from its passes: the first pass that did not run or failed, else the
    figures over all of them (the first pass's build time, device and notes)."""
    bad = next((p for p in passes if p["status"] != "ok"), None)
    if bad is not None:
        return {k: v for k, v in bad.items() if k != "raw"}
    head = {k: v for k, v in passes[0].items() if k != "raw"}
    return {**head, **figures([p["raw"] for p in passes], reference)}


# ---- one case ------------------------------------------------------------------------------------

def prompt_plan(opts: Options, n_sides: int, vocab: int, seed: int) -> tuple[list[int], list[int], list[list[list[int]]]]:
    """(check prompt, split prompt, per side its timed prompts): prefixes of one random sequence
    (ids >= 3: the specials stay out), each ending in the check prompt's last token (an agreeing
    target's stream depends on that token only: every request then walks the same stretch of its
    cycle, and tau is the same for every side); request (side i, run r) has its own length, and no
    two requests share a context length (stride > new tokens + a block)."""
    stride = opts.new_tokens + 32
    slots = (opts.runs + 1) * n_sides + 1
    rng = np.random.default_rng([seed, opts.prompt_len])
    seq = [int(t) for t in rng.integers(3, vocab, size=opts.prompt_len + slots * stride)]

    def at(slot: int) -> list[int]:
        return seq[: opts.prompt_len - 1 + slot * stride] + [seq[opts.prompt_len - 1]]

    per_side = [[at(1 + r * n_sides + (i if r % 2 == 0 else n_sides - 1 - i)) for r in range(opts.runs)]
                for i in range(n_sides)]
    return at(0), at(1 + opts.runs * n_sides), per_side


def run_case(condition: str, case: Case, opts: Options, env, root: Path, say) -> dict:
    t0 = time.perf_counter()
    s = case.shapes
    out = {"case": case.name, "condition": condition, "source": case.module, "shape": s.label, "dtype": case.dtype,
           "gamma": s.gamma, "notes": list(s.notes), "prompt_len": opts.prompt_len, "new_tokens": opts.new_tokens}
    sides = loop_sides.sides_for(case.module, opts.sides)
    try:
        ckpt = (agreeing_real.build if condition == "agreeing-real" else shapes.build)(case, root)
        vocab = ckpt.prompt_vocab or ckpt.target_config["vocab_size"]
        check, split_prompt, per_side = prompt_plan(opts, len(sides), vocab, opts.seed)
    except Exception as e:
        return {**out, "status": "failed", "reason": _reason(e)}
    # Two passes over the sides, the second in reverse order (A B C, then C B A), each side built
    # anew with half of its timed requests: a drift of the machine over the case then weighs on
    # every side alike, which one pass in sequence does not give.
    passes: list[list[dict]] = [[] for _ in sides]
    reference = None
    order = list(range(len(sides)))
    for p, pass_order in enumerate((order, order[::-1])):
        for i in pass_order:
            if passes[i] and passes[i][0]["status"] != "ok":
                continue
            say(f"{condition} {case.name}: {sides[i].name} (pass {p + 1})")
            passes[i].append(run_pass(sides[i], ckpt, env, per_side[i][p::2], check, split_prompt,
                                      opts.new_tokens, split=p == 1))
            if sides[i].name == "plain" and reference is None and passes[i][-1]["status"] == "ok":
                reference = passes[i][-1]["raw"]["check_tokens"]
    results = [side_result(ps, reference if side.name != "plain" else None) for side, ps in zip(sides, passes)]
    _ratios(results)
    del ckpt
    _release(False)
    return {**out, "status": "ok", "sides": results, "wall_s": time.perf_counter() - t0}


def _ratios(sides: list[dict]) -> None:
    """Each side's speed-up over the plain decode (median tok/s over median tok/s)."""
    plain = next((s for s in sides if s["side"] == "plain" and s.get("decode_tokens_per_s")), None)
    for s in sides:
        rate = s.get("decode_tokens_per_s")
        if plain and rate:
            s["x_plain"] = rate["median"] / plain["decode_tokens_per_s"]["median"]


def run(opts: Options, progress=None, keep=None) -> dict:
    """The whole --serve bench; returns serve.json's content. `keep(doc)` gets the document after
    each case but the last (`complete` false), so a run stopped midway keeps its finished cases."""
    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    torch_dev, torch_reason = torch_device(opts.torch_device)
    env = SimpleNamespace(torch_device=torch_dev, torch_reason=torch_reason)  # where the torch side runs, or why not
    planned, results = cases(opts), []
    head = {"command": shlex.join([sys.executable, "-m", "spec_parity.cli", *opts.argv]),
            "options": {k: v for k, v in vars(opts).items() if k != "argv"}, "project": project(),
            "machine": machine(), "versions": versions(), "torch_sides": torch_dev or torch_reason}

    def doc() -> dict:
        return {**head, "cases": results, "complete": len(results) == len(planned), "cases_planned": len(planned),
                "wall_s": time.perf_counter() - t0, "what": __doc__.split("\n\n")[1]}

    with tempfile.TemporaryDirectory(prefix="spec-parity-serve-") as tmp:
        for condition, case in planned:
            results.append(run_case(condition, case, opts, env, Path(tmp), say))
            if keep is not None and len(results) < len(planned):
                keep(doc())
    return doc()


# ---- the report ----------------------------------------------------------------------------------

def _ms(x) -> str:
    return f"{x * 1e3:.2f}" if x is not None else "-"


def _row(s: dict) -> str:
    if s.get("status") != "ok":
        return f"| {s['side']} | {s.get('status')} | - | - | - | - | - | - | - | - | {s.get('reason', '')} |"
    r = s.get("decode_tokens_per_s") or {}
    split = s.get("round_split_s") or {}
    split_txt = " / ".join(_ms(split.get(k)) for k in ("draft_s", "verify_s", "accept_trim_s")) if split else "-"
    stream = s.get("stream", {})
    ok = {True: "yes", False: f"no (at {stream.get('first_divergence')})", None: "ref"}[stream.get("lossless")]
    peak = f"{s['peak_bytes'] / 2**20:.0f}" if "peak_bytes" in s else "-"
    tau = f"{s['tau']:.2f}" if s.get("tau") else "-"
    acc = f"{s['acceptance']:.2f}" if "acceptance" in s else "-"
    x = f"{s['x_plain']:.2f}x" if "x_plain" in s else "-"
    return (f"| {s['side']} | ok | {r.get('median', 0):.1f} | {r.get('p10', 0):.1f}-{r.get('p90', 0):.1f} | {x} | {tau} "
            f"| {acc} | {split_txt} | {peak} | {ok} | {'; '.join(s.get('notes') or [])} |")


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = ["# spec-parity bench --serve", "",
             f"`{doc['command']}`", "",
             f"project {_identity(doc)}; {m['platform']}; mlx device {m['mlx_default_device']}{_mlx_env(m)}; "
             f"torch sides: {doc['torch_sides']}",
             "", "Decode tokens/s per fresh request (prompt lengths never repeated), median and p10-p90 over the "
             "runs; x plain = speed-up over the target's plain decode; tau = decode tokens / verify rounds; "
             "split = median ms per round draft / verify / accept+trim; peak = MiB over the timed runs "
             "(every loaded side's weights included); stream = the check request's stream equals plain decode's.", ""]
    for c in doc["cases"]:
        lines += [f"## {c['condition']}: {c['case']} ({c['source']})", "",
                  f"{c['shape']}; {c['dtype']}; prompt {c['prompt_len']}+, {c['new_tokens']} new tokens, "
                  f"gamma {c['gamma']}" + (f"; {'; '.join(c['notes'])}" if c.get("notes") else ""), ""]
        if c.get("status") != "ok":
            lines += [f"not run: {c.get('reason')}", ""]
            continue
        lines += ["| side | status | tok/s | p10-p90 | x plain | tau | acceptance | split ms (d / v / a+t) | peak MiB "
                  "| stream = plain | notes / reason |", "|" + "---|" * 11]
        lines += [_row(s) for s in c["sides"]] + [""]
    return "\n".join(lines)


def write(doc: dict, out: Path) -> list[Path]:
    md = out / "serve.md"
    js = keep(doc, out)
    atomic_write(md, (markdown(doc) + "\n").encode())
    return [js, md]


def keep(doc: dict, out: Path) -> Path:
    """serve.json alone: after each case of a run, and with serve.md at its end."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "serve.json", (json.dumps(doc, indent=2, default=str) + "\n").encode())
    return out / "serve.json"


class OptionError(ValueError):
    """A --serve option the bench cannot run with: one line naming it and the fix (exit 2)."""


def main(args) -> int:
    """`spec-parity bench --serve` (spec_parity/cli.py passes its parsed arguments)."""
    real = args.shapes == "real"
    if args.scale < 1 or (args.scale > 1 and not real):
        raise OptionError("--scale N (N >= 1) applies to --shapes real only")
    known = [n for n in loop_sides.SIDES if n != "plain"]
    sides = None if args.peers == "auto" else [] if args.peers == "none" else [x.strip() for x in args.peers.split(",")]
    if sides and set(sides) - set(known):
        raise OptionError(f"--peers {args.peers!r}: unknown {sorted(set(sides) - set(known))}; with --serve known: {', '.join(known)}")
    sources = tuple(x.strip() for x in args.sources.split(",") if x.strip())
    conditions = tuple(x.strip() for x in args.conditions.split(",") if x.strip())
    if set(sources) - set(SOURCES) or set(conditions) - set(CONDITIONS):
        raise OptionError(f"--sources from {SOURCES}, --conditions from {CONDITIONS}")
    taus = getattr(args, "tau", None) or "2,4,max"
    try:
        agreeing_real.parse_taus(taus, max(agreeing_real.BLOCK, args.gamma + 1))
        if "agreeing-real" in conditions:
            for src in set(sources) & set(agreeing_real.FAMILIES):
                agreeing_real.parse_taus(taus, agreeing_real.tau_max(src, args.gamma), _tau_why(src))
    except ValueError as e:
        raise OptionError(str(e)) from None
    opts = Options(shapes=args.shapes, sources=sources, sides=sides, conditions=conditions, prompt_len=args.prompt_len,
                   new_tokens=args.new_tokens, runs=args.runs, agree_frac=args.agree_frac, taus=taus,
                   dtype=args.dtype or ("bfloat16" if real else "float32"), scale=args.scale,
                   target_layers=args.target_layers, gamma=args.gamma, torch_device=args.torch_device, seed=args.seed,
                   argv=list(args.argv))
    low = [f"{name} {v}" for name, v, least in (("--runs", opts.runs, 2), ("--new-tokens", opts.new_tokens, 2),
                                                 ("--prompt-len", opts.prompt_len, 1)) if v < least]
    if low:
        raise OptionError(f"{', '.join(low)}: --serve needs --runs >= 2 (a median and a spread), --new-tokens >= 2 "
                          "and --prompt-len >= 1")
    doc = run(opts, progress=lambda msg: print(f"[serve] {msg}", file=sys.stderr, flush=True),
              keep=lambda d: keep(d, Path(args.out)))
    paths = write(doc, Path(args.out))
    print(markdown(doc))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0

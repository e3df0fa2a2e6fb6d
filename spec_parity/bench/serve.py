"""Our serve loop, spec_parity.port.serve.generate, wrapped (never forked): the round split into draft /
verify / accept+trim, host syncs and graph ops per round, decode tokens/s, and the same for a
request whose context lengths are all new (`cold`)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from . import port_sides
from .counters import HostSyncs
from .shapes import Checkpoints
from .timing import COLD_SPACING, summary


def _probe(provider, events: list, hook=None, split: bool = False):
    """`provider`, observed: each prefill / draft / commit of its sources timed into `events`;
    `hook` runs on the first draft (the end of the prefill). The loop's on-device drafts (it
    overlaps them with the verify) are the draft phase; in the split run they are evaluated
    inside it, so their work is counted in the draft, not the verify."""
    def around(name, src, args, call):
        kind = next((k for k in ("draft", "commit") if name.startswith(k)), name)   # draft_device, commit_pipelined
        if kind == "draft" and hook is not None and not any(e[0] == "draft" for e in events):
            hook()
        t0 = time.perf_counter()
        out = call()
        if name in ("draft_device", "draft_pipelined") and split:
            mx.eval(out)
        events.append((kind, t0, time.perf_counter()))
        return out
    return port_sides.observed(provider, around)


def _timed_forward(events: list):
    """Time the loop's target forwards, evaluating what the loop reads of them (so the verify's
    work is counted in the verify, not in the acceptance that first reads it)."""
    def timed(orig):
        def forward(*args, **kwargs):
            t0 = time.perf_counter()
            trace = orig(*args, **kwargs)
            mx.eval(trace.logits, trace.final, *trace.hidden)
            events.append(("forward", t0, time.perf_counter()))
            return trace
        return forward

    return port_sides.wrapped_forward(timed)


def _rounds(events: list, t_end: float) -> list[dict]:
    """Per round: draft, verify (the target forward), accept+trim (the verify's end to the next
    draft: acceptance, cache trim, the source's commit), from the timestamps."""
    drafts = [e for e in events if e[0] == "draft"]
    forwards = [e for e in events if e[0] == "forward"][1:]  # the first forward is the prefill
    commits = [e for e in events if e[0] == "commit"]
    out = []
    for i, (d, f) in enumerate(zip(drafts, forwards)):
        end = drafts[i + 1][1] if i + 1 < len(drafts) else t_end
        c = commits[i] if i < len(commits) else None
        out.append({"draft_s": d[2] - d[1], "verify_s": f[2] - f[1], "accept_trim_s": end - f[2],
                    "commit_s": (c[2] - c[1]) if c else 0.0, "round_s": end - d[1]})
    return out


def serve_loop(ckpt: Checkpoints, target, prompt: list[int], max_tokens: int, runs: int,
               provider=None, cold: bool = False) -> dict:
    """Our port in spec_parity.port.serve.generate on `prompt`: tokens/s (decode only: from the first draft on,
    and the loop's own figure with the prefill), the round split, host syncs and graph ops per round.
    `provider` (default: the port's drafter of the case on its default path) is what the loop
    drafts with; the verify follows it (its kv_bucket)."""
    provider = provider or port_sides.PortProvider(ckpt)
    gamma = ckpt.case.shapes.gamma

    def run(events, hook=None, split=False, ids=prompt):
        t0 = time.perf_counter()
        _, stats = port_sides.generate(target, ids, max_tokens, _probe(provider, events, hook, split), gamma)
        return stats, t0, time.perf_counter()

    def medians(rounds: list[dict]) -> dict:
        return {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]} if rounds else {}

    run([])  # warm-up
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    decode, looped, rounds_n = [], [], 0
    for _ in range(runs):
        events: list = []
        stats, _, t_end = run(events)
        first = next(e[1] for e in events if e[0] == "draft")
        decode.append((stats.emitted - 1) / (t_end - first))
        looped.append(stats.tokens_per_s)
        rounds_n = len(stats.trace)
    peak = mx.get_peak_memory()
    events = []
    with _timed_forward(events):
        _, _, t_end = run(events, split=True)
    split = _rounds(events, t_end)
    steady = split[1:] or split
    mark = {}
    with HostSyncs(ops=True) as hs, port_sides.wrapped_read_at_end(
            lambda read: lambda groups: (mark.setdefault("end", hs.snapshot()), read(groups))[1]):
        stats, _, _ = run([], hook=lambda: mark.setdefault("at", hs.snapshot()))
    (syncs0, ops0), (syncs1, ops1) = mark.get("at", (0, 0)), mark.get("end", hs.snapshot())
    n = max(len(stats.trace), 1)
    med = medians(steady)
    cold_out = {}
    if cold:
        # A prompt of another length: every context length of this request is new to the drafter's
        # and the target's attention (the warm runs above repeat one request's lengths).
        events = []
        short = prompt[: len(prompt) - COLD_SPACING * 8]
        with _timed_forward(events):
            cstats, _, t_end = run(events, split=True, ids=short)
        first = next(e[1] for e in events if e[0] == "draft")
        cold_out = {"cold": {"prompt_len": len(short), "decode_tokens_per_s": (cstats.emitted - 1) / (t_end - first),
                             "round_median_s": medians(_rounds(events, t_end)[1:])}}
    return {**cold_out, "kv_bucket": stats.kv_bucket, "verify": stats.verify, "pipeline": stats.pipeline, "gamma": gamma, "max_tokens": max_tokens, "prompt_len": len(prompt), "rounds": rounds_n,
            "tau": stats.tau, "acceptance": stats.acceptance,
            "decode_tokens_per_s": summary(decode), "loop_tokens_per_s": summary(looped),
            "round_median_s": med, "first_round_s": split[0] if split else {},
            "host_syncs_per_round": (syncs1 - syncs0) / n, "graph_ops_per_round": (ops1 - ops0) / n,
            "host_read_max_bytes_per_round": hs.largest_read(syncs0, syncs1), "host_syncs_at_end": hs.syncs - syncs1,
            "sync_calls": dict(hs.calls), "memory": {"active_before_bytes": int(active), "peak_bytes": int(peak)}}

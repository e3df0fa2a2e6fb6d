"""Pair: z-lab's DFlash drafter (port/dflash.py) against z-lab's `dflash` 0.1.0 (oracles/dflash.py):
its MLX model `dflash.model_mlx` at L1 and its torch model `dflash.model` at L2.

Module cases (L1, bit-exact): z-lab's own prefill (`_prefill_target`: the prompt less its last
token, then the last token, taps through its layer hooks) and eight draft rounds with forced
commits (`accepts`: long, partial and empty ones, so one-row context updates on a full sliding
ring happen). Compared per round: the taps entering the context, the drafter's final-normed block
hidden, its logits (target head x output_multiplier, softcap) and greedy block, the next anchor,
and at the end every layer's stored context K/V. Same framework, same ops: identical bytes.

Loop cases (L2): our serve loop with the DflashSource against z-lab's `stream_generate` (T=0):
token stream, per-round (drafted, accepted, emitted), the draft tokens, and the drafter's logits
per round along the shared path (our loop prefills the prompt in one forward where z-lab splits off
its last token, so on Gemma-4 those differ in the last bits), held within a measured budget;
lossless against the target's plain greedy stream, with the logits of every committed token.

Sliding layers run with window="zlab-mlx" against z-lab MLX; the port's default ("positional")
differs from it after a one-row context update on a full ring (port/dflash.py, tests/test_dflash.py).

The same module and loop cases run at L2 against z-lab's torch model (`-torch` cases; transformers
5.15 in its own environment, driven through oracles/dflash_torch_runner.py) with the port in z-lab
torch's conventions: window "positional", embed "raw" (no Gemma sqrt(H) on the block embedding),
and z-lab torch's one-forward prefill. Tokens must be equal (a knife-edge excused only as
compare.stream_metrics allows); tensors within the measured budgets.
"""

from __future__ import annotations

import numpy as np

from .. import controls, shared
from ..case import Case
from ..compare import Result, check_tensor, stream_metrics, trace_metrics

NAME = "dflash"
ORACLE = "zlab-mlx"
TORCH = "zlab-torch"

GEMMA4 = {"target_kind": "gemma4-target", "layer_types": ["sliding_attention", "full_attention"],
          "sliding_window": 10, "output_multiplier": 0.75, "input_embedding_scale": 1.25}
VARIANTS = {
    "qwen3": {},
    "qwen3-causal": {"is_causal": True},
    "qwen3-swa": {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 10},
    "qwen3-bs16": {"block_size": 16, "num_draft_layers": 3, "target_layer_ids": [1, 3]},
    "gemma4": GEMMA4,
    "gemma4-keqv": {**GEMMA4, "target_overrides": {"attention_k_eq_v": True, "num_global_key_value_heads": 1}},
}
ACCEPTS = [3, 0, 0, 7, 0, 1, 0, 2]      # forced commits per module round (clipped to bs-1)
ACCEPTS_BS16 = [3, 0, 0, 15, 0, 1, 0, 9]
LOOPS = [("qwen3", []), ("qwen3", [4]),  # token 4 is 13th in the seed-0 stream: the stop path runs
         ("qwen3-swa", []), ("qwen3-bs16", []), ("gemma4", []), ("gemma4-keqv", [])]
MAX_TOKENS = 40
# Agreeing loops (spec_parity.agreeing "dflash-drafter-agreeing" on an agreeing target): drafts
# follow h along the chain, so long, partial and empty accepts all occur (every length 0..bs-1
# within max_tokens). (name, target kind, target overrides, drafter overrides, max_tokens); the
# slot maps are exact for hidden_size >= vocab_size.
AGREE_128 = {"hidden_size": 128}
AGREE_256 = {"hidden_size": 256, "vocab_size": 256}
AGREEING = [
    ("agree-qwen3", "qwen3-target-agreeing", AGREE_128, {"agree_frac": 0.8}, 80),
    ("agree-gemma4", "gemma4-target-agreeing", AGREE_128,
     {"target_kind": "gemma4-target-agreeing", "agree_frac": 0.7}, 80),
    ("agree-qwen3-bs16", "qwen3-target-agreeing", AGREE_256,
     {"target_overrides": AGREE_256, "agree_frac": 0.9, "block_size": 16, "num_attention_heads": 16}, 260),
]
TORCH_MODULES = list(VARIANTS)
TORCH_LOOPS = ["qwen3", "qwen3-swa", "qwen3-bs16", "gemma4", "gemma4-keqv"]

# Planted bugs (spec_parity/controls/dflash.py) and the cases that must catch each.
CONTROLS = [
    ("own_head", "mod-qwen3"), ("own_head", "mod-gemma4"),
    ("ctx_input_layernorm", "mod-qwen3"), ("ctx_input_layernorm", "mod-gemma4"),
    ("block_position_shift", "mod-qwen3"), ("block_position_shift", "mod-gemma4"),
    ("rejected_rows", "mod-qwen3"), ("rejected_rows", "loop-qwen3"), ("rejected_rows", "loop-gemma4"),
    ("own_head", "mod-gemma4-torch"), ("ctx_input_layernorm", "mod-qwen3-torch"),
    ("block_position_shift", "mod-qwen3-swa-torch"), ("rejected_rows", "loop-qwen3-torch"),
]


def window(variant: str) -> str:
    return "zlab-mlx" if "sliding_attention" in (VARIANTS[variant].get("layer_types") or []) else "positional"


def _case(name: str, variant: str, params: dict, tier: str, oracle: str = ORACLE) -> Case:
    ov = VARIANTS[variant]
    conventions = ({"window": window(variant), "embed": "scaled", "prefill": "split"} if oracle == ORACLE
                   else {"window": "positional", "embed": "raw", "prefill": "whole"})
    return Case(NAME, name, tier, ov.get("target_kind", "qwen3-target"), 0, ov.get("target_overrides", {}),
                {**params, **conventions, "drafter": ["dflash-drafter", 0, ov]}, oracle=oracle)


def _module_params(variant: str) -> dict:
    return {"prompt_len": 12, "accepts": ACCEPTS_BS16 if "bs16" in variant else ACCEPTS}


def cases() -> list[Case]:
    out = [_case(f"mod-{v}", v, _module_params(v), "L1") for v in VARIANTS]
    out += [_case(f"loop-{v}" + ("-eos" if eos else ""), v,
                  {"loop": True, "prompt_len": 12, "max_tokens": MAX_TOKENS, "eos": eos}, "L2") for v, eos in LOOPS]
    out += [Case(NAME, f"loop-{name}", "L2", tk, 0, tov,
                 {"loop": True, "prompt_len": 12, "max_tokens": n, "eos": [], "window": "positional",
                  "embed": "scaled", "prefill": "split", "drafter": ["dflash-drafter-agreeing", 0, ov]}, oracle=ORACLE)
            for name, tk, tov, ov, n in AGREEING]
    # The Qwen3 agreeing loops against z-lab's torch loop too (Qwen3 has no embedding scale, so the
    # torch model's raw block embedding is the same construction).
    out += [Case(NAME, f"loop-{name}-torch", "L2", tk, 0, tov,
                 {"loop": True, "prompt_len": 12, "max_tokens": n, "eos": [], "window": "positional",
                  "embed": "raw", "prefill": "whole", "drafter": ["dflash-drafter-agreeing", 0, ov]}, oracle=TORCH)
            for name, tk, tov, ov, n in AGREEING if tk.startswith("qwen3")]
    out += [_case(f"mod-{v}-torch", v, _module_params(v), "L2", TORCH) for v in TORCH_MODULES]
    out += [_case(f"loop-{v}-torch", v, {"loop": True, "prompt_len": 12, "max_tokens": MAX_TOKENS, "eos": []}, "L2",
                  TORCH) for v in TORCH_LOOPS]
    by_name = {c.name: c for c in out}
    for bug, base in CONTROLS:
        b = by_name[base]
        out.append(Case(NAME, f"{base}-control-{bug}", b.tier, b.kind, b.seed, b.overrides, dict(b.params),
                        control=controls.case_control(NAME, bug, base), oracle=b.oracle))
    return out


def oracle_status(oracle: str = ORACLE) -> str | None:
    from oracles import dflash as o

    return o.torch_status() if oracle == TORCH else o.status()


def prompt(case: Case) -> np.ndarray:
    return np.random.default_rng([case.seed, 17]).integers(3, 120, (1, case.params["prompt_len"])).astype(np.int32)


def run_oracle(case: Case):
    from oracles import dflash as oracle

    t, d, p = case.checkpoint_dir(), case.drafter_dir(), prompt(case)
    if case.oracle == TORCH:
        arrays = (oracle.torch_loop(t, d, p, case.params["max_tokens"]) if case.params.get("loop")
                  else oracle.torch_modules(t, d, p, case.params["accepts"]))
        return arrays, {"reference": {"name": "z-lab dflash.model (torch)", "versions": oracle.torch_versions()}}
    if case.params.get("loop"):
        arrays = oracle.loop(t, d, p, case.params["max_tokens"], case.params["eos"])
    else:
        arrays = oracle.modules(t, d, p, case.params["accepts"])
    return arrays, {"reference": {"name": "z-lab dflash.model_mlx", "versions": oracle.versions()}}


def run_port(case: Case, ref: dict) -> dict:
    out = run_loop(case) if case.params.get("loop") else run_modules(case)
    out["meta.torch"] = np.array([case.oracle == TORCH])
    return out


def run_modules(case: Case) -> dict:
    """The module rounds through the DflashSource, prefilled as the reference does: z-lab MLX splits
    off the prompt's last token ("split"), z-lab torch runs it in one forward ("whole"). The stored
    context K/V are returned as the reference holds them: mlx-lm's buffers as they are ("split"),
    or in time order, sliding layers their newest W-1 rows (torch's DynamicSlidingWindowLayer)."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from port import dflash, serve, targets

    target = targets.load(case.checkpoint_dir())
    m = dflash.load(case.drafter_dir(), case.params["window"], case.params["embed"])
    caches = make_prompt_cache(target.model)
    src = dflash.DflashSource(m, serve.TargetView(target, caches))
    p = prompt(case)
    if case.params["prefill"] == "split":
        first = targets.forward(target, mx.array(p[:, :-1]), caches=caches)
        last = targets.forward(target, mx.array(p[:, -1:]), caches=caches)
        taps = [mx.concatenate([first.hidden[i + 1], last.hidden[i + 1]], axis=1) for i in src.tap_layers]
    else:
        last = targets.forward(target, mx.array(p), caches=caches)
        taps = [last.hidden[i + 1] for i in src.tap_layers]
    src.prefill(p[0].tolist(), taps)
    # z-lab MLX hands an all-sliding drafter only the newest W-1 prompt rows (so does the source);
    # z-lab torch projects them all and its sliding caches keep W-1.
    out = {"taps.0": src.pending[0] if case.params["prefill"] == "split" else mx.concatenate(taps, axis=-1)[0]}
    anchor = int(mx.argmax(last.logits[0, -1]).item())
    anchors, bs = [anchor], m.args.block_size
    for r, a in enumerate(case.params["accepts"]):
        tokens = src.draft([anchor], bs - 1, None)
        b = src.last_block
        out[f"hidden.{r}"], out[f"logits.{r}"], out[f"tokens.{r}"] = b.hidden, b.logits, mx.array(tokens, dtype=mx.int32)
        verify = targets.forward(target, mx.array([[anchor] + tokens]), caches=caches)
        a = min(a, bs - 1)
        anchor = int(mx.argmax(verify.logits[0, a]).item())
        anchors.append(anchor)
        serve.trim_caches(caches, bs - 1 - a)
        src.commit(bs - 1, a, [verify.hidden[i + 1] for i in src.tap_layers])
        out[f"taps.{r + 1}"] = src.pending[0]
    for i, c in enumerate(src.caches):
        if not isinstance(c, RotatingKVCache):
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        elif case.params["prefill"] == "split":
            k, v = c.keys, c.values
        else:
            n = min(c.max_size, c.offset)
            k, v = c._temporal_order(c.keys)[..., -n:, :], c._temporal_order(c.values)[..., -n:, :]
        out[f"ctx_k.{i}"], out[f"ctx_v.{i}"] = k[0], v[0]
    out["anchors"] = mx.array(anchors, dtype=mx.int32)
    return {k: np.array(v) for k, v in out.items()}


def _recording(provider, rows: list):
    """`provider`, observed: each round's draft logits appended to `rows` (changes nothing)."""
    from port import serve

    def around(name, src, args, call):
        tokens = call()
        if name.startswith("draft") and src.last_block is not None and len(tokens):
            rows.append(src.last_block.logits)
        return tokens
    return serve.Observed(provider, around)


def run_loop(case: Case) -> dict:
    """Our serve loop on the case, once per process for what it reads (spec_parity.shared): the
    checkpoints, the prompt, the length, EOS, window, planted bug and block embedding. On a target
    with no embed scale (Qwen3) embed "raw" and "scaled" are the same multiply (port/dflash.py
    `embed`), so the z-lab MLX and torch twins of a Qwen3 loop share one run. Arrays as
    harness.port_run hands them out: read-only, in a fresh dict."""
    from port import targets

    target = targets.load(case.checkpoint_dir())
    if case.path:                    # a real checkpoint runs every time (harness.port_run)
        return _loop(case, target)
    embed = case.params["embed"] if hasattr(target.model.model, "embed_scale") else "scaled"
    key = ("dflash-loop", shared.stamp(case.checkpoint_dir()), shared.stamp(case.drafter_dir()),
           prompt(case).tobytes(), case.params["max_tokens"], tuple(sorted(case.params["eos"])),
           case.params["window"], (case.control or {}).get("bug"), embed)
    return shared.once(key, lambda: _loop(case, target))


def _loop(case: Case, target) -> dict:
    import mlx.core as mx

    from port import dflash, serve

    n, eos = case.params["max_tokens"], set(case.params["eos"])
    rows: list = []
    provider = _recording(dflash.DflashProvider(case.drafter_dir(), case.params["window"], max_tokens=n,
                                                embed=case.params["embed"]), rows)
    p = prompt(case)
    tokens, stats = serve.generate(target, p[0].tolist(), n, provider, gamma=provider.trained_gamma, eos=eos,
                                   record=True)
    plain, plain_logits = shared.greedy(case.checkpoint_dir(), p, n, eos)
    V = target.config["vocab_size"]
    return {"stream.tokens": np.array(tokens, np.int32), "stream.stop": np.array([stats.stop == "eos"]),
            "stream.drafted": np.array([d for d, _, _ in stats.trace], np.int32),
            "stream.accepted": np.array([k for _, k, _ in stats.trace], np.int32),
            "stream.emitted": np.array([e for _, _, e in stats.trace], np.int32),
            "stream.proposals": np.array([t for q in stats.proposals for t in q], np.int32),
            "stream.draft_logits": np.array(mx.concatenate(rows, axis=0)) if rows
            else np.zeros((0, V), np.float32),
            "stream.logits": np.array(mx.stack(stats.logits)), "greedy.tokens": np.array(plain, np.int32),
            "greedy.logits": np.array(plain_logits), "tau": np.array([stats.tau])}


def _check(result: Result, name: str, port, ref, quantity: str) -> None:
    """check_tensor, with a missing tensor or a shape difference (a context that grew by other rows)
    named as such."""
    if port is None or np.shape(port) != np.shape(ref):
        what = "missing" if port is None else f"shape {list(np.shape(port))} != z-lab's {list(np.shape(ref))}"
        result.metrics[name] = {"ok": False, "error": what}
        result.fail(f"{name}: {what}")
        return
    check_tensor(result, name, port, ref, NAME, quantity)


def compare(case: Case, port: dict, ref: dict, result: Result) -> None:
    if case.params.get("loop"):
        return compare_loop(case, port, ref, result)
    rounds = len(case.params["accepts"])
    _check(result, "taps.0", port.get("taps.0"), ref["taps.0"], "taps")
    for r in range(rounds):  # in the order they are computed, so the reason names the first one off
        for key in ("hidden", "logits"):
            _check(result, f"{key}.{r}", port.get(f"{key}.{r}"), ref[f"{key}.{r}"], key)
        if case.tier == "L1":
            _check(result, f"tokens.{r}", port.get(f"tokens.{r}"), ref[f"tokens.{r}"], "tokens")
        else:
            t = stream_metrics(port[f"tokens.{r}"], ref[f"tokens.{r}"], ref[f"logits.{r}"])
            result.metrics[f"tokens.{r}"] = t
            if not t["ok"]:
                result.fail(f"tokens.{r}: draft {t['first_divergence']} differs (port {t.get('port_token')} vs "
                            f"z-lab {t.get('ref_token')}, reference margin {t.get('ref_margin', 0):.3g})")
        _check(result, f"taps.{r + 1}", port.get(f"taps.{r + 1}"), ref[f"taps.{r + 1}"], "taps")
    _check(result, "anchors", port.get("anchors"), ref["anchors"], "anchors")
    for key in sorted(k for k in ref if k.startswith("ctx_")):
        _check(result, key, port.get(key), ref[key], "context_kv")
    bad = [r for r in range(rounds) if not result.metrics[f"logits.{r}"]["ok"]]
    result.metrics["rounds"] = {"ok": not bad, "first_differing_round": bad[0] if bad else None, "rounds": rounds}


def compare_loop(case: Case, port: dict, ref: dict, result: Result) -> None:
    eos = set(case.params["eos"])
    ref_tokens = ref["stream.tokens"].tolist()
    if ref_tokens and ref_tokens[-1] in eos:  # z-lab emits the EOS; our loop ends on it without emitting it
        ref_tokens = ref_tokens[:-1]
    s = stream_metrics(port["stream.tokens"], ref_tokens, port["greedy.logits"])
    result.metrics["stream_vs_zlab"] = s
    if not s["ok"]:
        result.fail(f"token stream differs from z-lab's at {s['first_divergence']}")
    trace = trace_metrics(np.stack([port["stream.drafted"], port["stream.accepted"], port["stream.emitted"]], 1),
                          np.stack([ref["stream.drafted"], ref["stream.accepted"], ref["stream.emitted"]], 1))
    result.metrics["rounds_vs_zlab"] = trace
    if not trace["ok"]:
        result.fail(f"per-round (drafted, accepted, emitted) differs from z-lab's at round {trace['first_differing_round']} "
                    f"(port {trace.get('port_round')} vs z-lab {trace.get('ref_round')})")
    pp, rp = port["stream.proposals"].tolist(), ref["stream.proposals"].tolist()
    if pp != rp:
        first = next((i for i, (a, b) in enumerate(zip(pp, rp)) if a != b), min(len(pp), len(rp)))
        result.fail(f"draft tokens differ from z-lab's at draft {first}")
    result.metrics["proposals"] = {"ok": pp == rp, "drafts": [len(pp), len(rp)]}
    pl, rl = port["stream.draft_logits"], ref["stream.draft_logits"]
    m = min(len(pl), len(rl))
    check_tensor(result, "draft_logits_vs_zlab", pl[:m], rl[:m], NAME,
                 "loop_draft_logits_torch" if case.oracle == TORCH else "loop_draft_logits")
    acc = int(port["stream.accepted"].sum())
    result.metrics["acceptance"] = {"ok": True, "accepted": acc, "drafted": int(port["stream.drafted"].sum()),
                                    "tau": float(port["tau"][0])}
    n = len(port["stream.tokens"])
    g = stream_metrics(port["stream.tokens"], port["greedy.tokens"][:n], port["greedy.logits"])
    result.metrics["lossless_vs_greedy"] = g
    if not g["ok"]:
        result.fail(f"not lossless: diverges from the target's greedy stream at {g['first_divergence']}")
    k = min(len(port["stream.logits"]), len(port["greedy.logits"]))
    check_tensor(result, "path_logits_vs_greedy", port["stream.logits"][:k], port["greedy.logits"][:k], NAME,
                 "path_logits")


def quantities(port: dict, ref: dict) -> dict[str, float]:
    def gap(a, b):
        m = min(len(a), len(b))
        return float(np.abs(a[:m].astype(np.float64) - b[:m].astype(np.float64)).max()) if m else 0.0

    torch = bool(port.get("meta.torch", [False])[0])
    if "greedy.logits" in port:
        return {"path_logits": gap(port["stream.logits"], port["greedy.logits"]),
                "loop_draft_logits" + ("_torch" if torch else ""): gap(port["stream.draft_logits"],
                                                                        ref["stream.draft_logits"])}
    out: dict[str, float] = {}
    for key in ref:
        q = {"ctx_k": "context_kv", "ctx_v": "context_kv"}.get(key.split(".")[0], key.split(".")[0])
        if q in ("tokens", "anchors"):
            continue
        if key in port and port[key].shape == ref[key].shape:
            out[q] = max(out.get(q, 0.0), gap(port[key], ref[key]))
    return out

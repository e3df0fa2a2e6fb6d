"""The tiny Gemma-4 targets and sources the T > 0 tests share (a helper module: no tests here):
the setups (`setup_kinds`, `setup`), the target's exact distribution of its first tokens
(`target_exact`, `exact`), and N seeded requests through `spec_parity.port.serve.generate` tested against
it (`run_streams`, `e2e_tests`)."""

from __future__ import annotations

import functools
import time

import mlx.core as mx
import numpy as np

from spec_parity import checkpoints
from spec_parity.port import sampling, serve, targets
from spec_parity.port.sources.assistant import AssistantProvider
from spec_parity.port.sources.dflash import DflashProvider
from spec_parity.port.sources.dspark import DeepspecProvider

from stats import stat_tests

TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
GAMMA = 2
SOURCES = ("assistant", "dspark", "dflash", "dflash-extras")
DFLASH_MARKOV = {"markov_rank": 8, "markov_gain": 3.0}   # extension: a Markov bias of ~3 logits
DFLASH_THRESHOLDS = [0.5]                                 # extension: confidence pruning on


def setup_kinds(name: str) -> dict:
    """Tiny Gemma-4 targets with small vocabularies and their sources (factory overrides).

    The planted bias a test can see at a given N shrinks with its distributions' largest
    probability (see `stats.power`), so both targets sample at a temperature where no conditional is
    close to a point mass, and the prompt is the one whose first token is the flattest (the
    first token is one conditional; the later positions mix many).

    "agreeing": vocab 64, the agreeing pair (spec_parity/checkpoints/, agree_frac 0.8) at T = 4:
        the successor has p ~ 0.16-0.3, the drafters propose it (or a wrong token) with q from
        ~0.05 (assistant) to ~1 (DSpark), so every accepted length 0..gamma occurs and
        rejections with q != p are frequent. Prompt [3, 4, 17] (its first token: max p 0.16).
        First n = 3 tokens (the prefill's, then d1 / correction, d2 / correction).
    "random": vocab 16, random (context-sensitive) target and drafters, the target's softcap 4
        (its raw logits span tens: at softcap 30 a later conditional's max p averages ~0.7) at
        T = 2, a prompt of 10 tokens (past the sliding window of 8: rotating caches are trimmed
        after rejections), the flattest first token (max p 0.13) of 64 random prompts. First
        n = 4 tokens: the prefill's and a whole round at gamma 2 (d1, d2, bonus).
    DFlash on both (block gamma + 1, one layer); "dflash-extras" is the same drafter with the
    DSpark-on-DFlash extension (a random Markov head and confidence head, pruning at 0.5)."""
    if name == "agreeing":
        V, H = 64, 64
        t = {"vocab_size": V, "vocab_size_per_layer_input": V, "hidden_size": H, **TWO_LAYERS}
        return {"V": V, "n": 3, "prompt": [3, 4, 17], "sampler": sampling.Sampler(4.0),
                "target": ("gemma4-target-agreeing", t),
                "assistant": ("gemma4-assistant-agreeing", {"agree_frac": 0.8, "backbone_hidden_size": H,
                                                            "text_config": {"vocab_size": V, "hidden_size": 16,
                                                                            **TWO_LAYERS}}),
                "dspark": ("dspark-drafter-agreeing", {"agree_frac": 0.8, "target_overrides": t, "target_layer_ids": [0],
                                                      "num_draft_layers": 1, "block_size": 3}),
                "dflash": ("dflash-drafter-agreeing", {"target_kind": "gemma4-target-agreeing", "target_overrides": t,
                                                       "agree_frac": 0.8, "target_layer_ids": [0], "num_draft_layers": 1,
                                                       "block_size": GAMMA + 1, "num_attention_heads": 2})}
    V = 16
    t = {"vocab_size": V, "vocab_size_per_layer_input": V, "final_logit_softcapping": 4.0, **TWO_LAYERS}
    return {"V": V, "n": 4, "prompt": [13, 13, 4, 8, 11, 9, 11, 11, 11, 3], "sampler": sampling.Sampler(2.0),
            "target": ("gemma4-target", t),
            "assistant": ("gemma4-assistant", {"text_config": {"vocab_size": V, **TWO_LAYERS}}),
            "dspark": ("dspark-drafter", {"target_overrides": t, "target_layer_ids": [0], "num_draft_layers": 1,
                                          "block_size": 3}),
            "dflash": ("dflash-drafter", {"target_kind": "gemma4-target", "target_overrides": t, "target_layer_ids": [0],
                                          "num_draft_layers": 1, "block_size": GAMMA + 1, "mask_token_id": 0})}


@functools.cache
def setup(name: str):
    k = setup_kinds(name)
    build = lambda kind: checkpoints.build(k[kind][0], 0, k[kind][1])  # noqa: E731
    extras_dir = checkpoints.build(k["dflash"][0], 0, {**k["dflash"][1], "dspark_extras": DFLASH_MARKOV})
    target = targets.load(build("target"))
    providers = {"assistant": AssistantProvider(build("assistant")),
                 "dspark": DeepspecProvider(build("dspark")),
                 "dflash": DflashProvider(build("dflash")),
                 "dflash-extras": DflashProvider(extras_dir, extras=True, thresholds=DFLASH_THRESHOLDS)}
    return target, providers, k


def provider_for(setup_name: str, source: str | None):
    """The named source of a setup; "<source>-deterministic" hides its `draft_sampled`."""
    if source is None:
        return None
    prov = setup(setup_name)[1][source.removesuffix("-deterministic")]
    return Deterministic(prov) if source.endswith("-deterministic") else prov


class Deterministic:
    """A provider whose sources hide `draft_sampled` (like a source written before it): rejection
    mode then verifies its greedy drafts with q = the point mass."""

    def __init__(self, inner):
        self.inner, self.id, self.weights_bytes, self.trained_gamma = inner, inner.id, inner.weights_bytes, None

    def open(self, view):
        src = self.inner.open(view)

        class Source:
            tap_layers = src.tap_layers
            prefill, draft, commit, dispose = src.prefill, src.draft, src.commit, src.dispose

        return Source()

    def dispose(self):
        pass


def target_exact(target, prompt: list[int], n: int, sampler: sampling.Sampler,
                 processors=()) -> tuple[np.ndarray, list[np.ndarray]]:
    """Exact distribution [V**n] of the first n tokens the target samples after the prompt, and
    the conditionals it is built from (conds[j] [V**j, V]: token j after each prefix of j
    tokens, prefixes in `encode` order): an uncached batched forward (mlx-lm's own model call)
    over every prefix of n - 1 tokens gives every conditional (causal: position j of a row is
    the conditional after its first j tokens); each distinct context's row goes through the
    same processors and Sampler."""
    V = target.config["vocab_size"]
    prefixes = (np.stack(np.meshgrid(*[np.arange(V)] * (n - 1), indexing="ij"), -1).reshape(-1, n - 1)
                if n > 1 else np.zeros((1, 0), np.int64))
    ids = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
    chunks = []
    for c in range(0, len(ids), 2048):
        out = target.model(mx.array(ids[c:c + 2048], mx.int32))[:, len(prompt) - 1:, :].astype(mx.float32)
        mx.eval(out)
        chunks.append(out)
    logits = mx.concatenate(chunks, axis=0)        # [V**(n-1), n, V]
    joint, conds = None, []
    for j in range(n):
        step = V ** (n - 1 - j)                    # rows that share their first j prefix tokens
        sel = logits[::step, j, :]                 # [V**j, V]
        if processors:
            ctx = ids[::step, : len(prompt) + j]
            sel = mx.stack([sampling.process(processors, mx.array(c, mx.int32), sel[i]) for i, c in enumerate(ctx)])
        P = np.array(sampler.probs(sel), np.float64)
        conds.append(P)
        joint = P.reshape(-1) if joint is None else (joint[:, None] * P).reshape(-1)
    return joint, conds


BANNED = [5, 9, 12, 20, 31]
PROCESSORS = {"": (), "ban": (sampling.ban(BANNED),)}


@functools.cache
def exact(setup_name: str, processors: str = "") -> tuple[np.ndarray, list[np.ndarray]]:
    target, _, k = setup(setup_name)
    return target_exact(target, k["prompt"], k["n"], k["sampler"], PROCESSORS[processors])


def run_streams(setup_name: str, source: str | None, mode: str, N: int, seed0: int = 0, processors: str = "",
                **kw) -> tuple[np.ndarray, dict, float]:
    """N independent requests through serve.generate (seeds seed0..seed0+N-1): the first n
    tokens of each [N, n], the accepted-length histogram of their rounds, CPU seconds per request."""
    target, _, k = setup(setup_name)
    provider = provider_for(setup_name, source)
    n, sp = k["n"], k["sampler"]
    seqs = np.zeros((N, n), np.int64)
    hist: dict[int, int] = {}
    t0 = time.process_time()
    for i in range(N):
        s = sampling.Sampler(sp.temperature, sp.top_k, sp.top_p, seed0 + i)
        toks, stats = serve.generate(target, k["prompt"], n, provider,
                                     serve.ServeOptions(gamma=GAMMA, eos=set(), sampler=s, mode=mode,
                                                        processors=PROCESSORS[processors], **kw))
        seqs[i] = toks
        for _, a, _ in stats.trace:
            hist[a] = hist.get(a, 0) + 1
    return seqs, dict(sorted(hist.items())), (time.process_time() - t0) / N


def e2e_tests(setup_name, source, mode, N, seed0=0, processors="", **kw):
    seqs, hist, per = run_streams(setup_name, source, mode, N, seed0, processors, **kw)
    joint, conds = exact(setup_name, processors)
    res = stat_tests(seqs, joint, setup(setup_name)[2]["V"], conds, seed=seed0)
    label = (f"{setup_name}/{source or 'plain'}/{mode}{'/' + processors if processors else ''} accepted={hist} "
             f"{per * 1e3:.1f}ms CPU/request")
    return res, hist, label

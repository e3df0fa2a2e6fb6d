"""The one serve-loop runner of our ports: every draft source through spec_parity.port.serve.generate, its
arrays named as protocol */loop has them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from spec_parity.oracles.layers import to_numpy


def _recording(provider, blocks: list):
    """`provider`, observed: (block, tokens proposed) of each draft call that made a block, where
    the source keeps its last block (changes nothing)."""
    from spec_parity.port import serve

    def around(name, src, args, call):
        tokens = call()
        block = getattr(src, "last_block", None)
        if name.startswith("draft") and block is not None:
            blocks.append((block, len(tokens)))
        return tokens
    return serve.Observed(provider, around)


def _blocks(blocks: list, V: int) -> dict:
    """The drafter's logits of each round that proposed (every block row), and where the blocks
    carry them, the DSpark extras: base rows, confidences, block lengths and proposal lengths."""
    import mlx.core as mx

    proposed = [b for b, n in blocks if n]
    out = {"stream.draft_logits": to_numpy(mx.concatenate([b.logits for b in proposed], axis=0)) if proposed
           else np.zeros((0, V), np.float32)}
    if blocks and blocks[0][0].confidence is not None:
        out["ext.base_logits"] = to_numpy(mx.concatenate([b.base_logits for b, _ in blocks], axis=0))
        out["ext.logits"] = to_numpy(mx.concatenate([b.logits for b, _ in blocks], axis=0))
        out["ext.confidence"] = to_numpy(mx.concatenate([b.confidence for b, _ in blocks]))
        out["ext.block_len"] = np.array([b.confidence.shape[0] for b, _ in blocks], np.int32)
        out["ext.proposed"] = np.array([n for _, n in blocks], np.int32)
    return out


def run(target, prompt: np.ndarray, max_tokens: int, provider, gamma: int, eos: set[int],
        keep: int | None = None) -> dict:
    """Our loop on `prompt`; `keep` cuts the content to its first tokens (DeepSpec decodes while
    fewer than n + 1 are committed, then trims to n)."""
    import mlx.core as mx

    from spec_parity.port import serve

    blocks: list = []
    tokens, stats = serve.generate(target, prompt[0].tolist(), max_tokens, _recording(provider, blocks),
                                   serve.ServeOptions(gamma=gamma, eos=eos, record=True))
    out = {"stream.tokens": np.array(tokens[:keep], np.int32),
           "stream.drafted": np.array([d for d, _, _ in stats.trace], np.int32),
           "stream.accepted": np.array([k for _, k, _ in stats.trace], np.int32),
           "stream.emitted": np.array([e for _, _, e in stats.trace], np.int32),
           "stream.proposals": np.array([t for q in stats.proposals for t in q], np.int32),
           "stream.logits": to_numpy(mx.stack(stats.logits)), "tau": np.array([stats.tau])}
    if blocks or not stats.drafted:
        out.update(_blocks(blocks, target.config["vocab_size"]))
    return out


# Seeds a sampled case also runs through serve.generate, one by one, and holds the lockstep
# requests to (port/fast/seeded.py): any difference and every seed runs through serve.generate.
CROSS_CHECKED = 16


def seeded_requests(target, prompt: np.ndarray, max_tokens: int, provider, gamma: int, options: dict,
                    mode: str = "match") -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """A sampled case's requests: our loop at options["temperature"], EOS off, once per seed from
    options["seed0"] (options["runs"] of them); each request's tokens and trace (drafted, accepted,
    emitted). Where port/fast/seeded.py runs the requests in lockstep and its first CROSS_CHECKED
    equal serve.generate's, those; else serve.generate's for every seed."""
    from spec_parity.port import sampling, serve
    from spec_parity.port.fast import seeded

    seeds = list(range(options["seed0"], options["seed0"] + options["runs"]))
    sampler = sampling.Sampler(options["temperature"])

    def plain(seed):
        tokens, stats = serve.generate(target, prompt[0].tolist(), max_tokens, provider,
                                       serve.ServeOptions(gamma=gamma, eos=set(), mode=mode,
                                                          sampler=replace(sampler, seed=seed)))
        return tokens, stats.trace

    checked = [plain(s) for s in seeds[:CROSS_CHECKED]]
    try:
        fast = seeded.generate(target, prompt[0].tolist(), max_tokens, provider, gamma, sampler, seeds, mode=mode)
    except seeded.Unsupported:
        fast = None
    if fast is not None and fast[:CROSS_CHECKED] == checked:
        return fast
    return checked + [plain(s) for s in seeds[CROSS_CHECKED:]]


def first_round(tokens: list[int], trace: list[tuple[int, int, int]]) -> tuple[int, int, int | None]:
    """The first drafting round's (drafted, accepted, the token it ends with or None where the
    request stopped before it): the prefill's token is tokens[0]."""
    n, k, _ = trace[0]
    return n, k, tokens[1 + k] if 1 + k < len(tokens) else None

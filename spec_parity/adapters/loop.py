"""The one serve-loop runner of our ports: every draft source through port.serve.generate, its
arrays named as protocol */loop has them."""

from __future__ import annotations

import numpy as np


def _recording(provider, rows: list):
    """`provider`, observed: each round's draft logits appended to `rows`, where the source keeps
    its last block (changes nothing)."""
    from port import serve

    def around(name, src, args, call):
        tokens = call()
        block = getattr(src, "last_block", None)
        if name.startswith("draft") and block is not None and len(tokens):
            rows.append(block.logits)
        return tokens
    return serve.Observed(provider, around)


def run(target, prompt: np.ndarray, max_tokens: int, provider, gamma: int, eos: set[int],
        keep: int | None = None) -> dict:
    """Our loop on `prompt`; `keep` cuts the content to its first tokens (DeepSpec decodes while
    fewer than n + 1 are committed, then trims to n)."""
    import mlx.core as mx

    from port import serve

    rows: list = []
    tokens, stats = serve.generate(target, prompt[0].tolist(), max_tokens, _recording(provider, rows), gamma=gamma,
                                   eos=eos, record=True)
    V = target.config["vocab_size"]
    out = {"stream.tokens": np.array(tokens[:keep], np.int32),
           "stream.drafted": np.array([d for d, _, _ in stats.trace], np.int32),
           "stream.accepted": np.array([k for _, k, _ in stats.trace], np.int32),
           "stream.emitted": np.array([e for _, _, e in stats.trace], np.int32),
           "stream.proposals": np.array([t for q in stats.proposals for t in q], np.int32),
           "stream.logits": np.array(mx.stack(stats.logits)), "tau": np.array([stats.tau])}
    if rows:
        out["stream.draft_logits"] = np.array(mx.concatenate(rows, axis=0))
    elif not stats.drafted:
        out["stream.draft_logits"] = np.zeros((0, V), np.float32)
    return out

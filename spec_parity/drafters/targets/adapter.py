"""Our target port (mlx-lm's model classes, port/targets.py) behind protocol targets/forward."""

from __future__ import annotations

import numpy as np

from ...protocol import Request


def run(req: Request) -> dict:
    import mlx.core as mx

    from spec_parity.port import targets as port

    target = port.load(req.target, getattr(mx, req.dtype))
    ids = req.prompt
    trace = port.forward(target, mx.array(ids))
    L = target.num_layers
    own = port.forward(target, mx.array(ids),
                       layer_inputs=[mx.array(req.inputs[f"hidden.{i}"])[None] for i in range(L)])
    tokens, step_logits = port.greedy(target, mx.array(ids), req.options["new_tokens"])
    forced = np.concatenate([ids[0], req.inputs["stream.tokens"][:-1]])[None]
    tf_logits = port.forward(target, mx.array(forced)).logits[0, ids.shape[1] - 1:]
    out = {"logits": trace.logits[0], "final": trace.final[0], "stream.logits": step_logits,
           "tf.logits": tf_logits, "stream.tokens": mx.array(tokens, dtype=mx.int32)}
    for i, h in enumerate(trace.hidden):
        out[f"hidden.{i}"] = h[0]
    for i in range(L):
        out[f"own.{i + 1}"] = own.hidden[i + 1][0]
    for name, (k, v) in trace.donors.items():
        out[f"donor.{name}.k"], out[f"donor.{name}.v"] = k[0], v[0]
    return {k: np.array(v) for k, v in out.items()}

"""dspark-mlx 0.1.0 (PyPI, popfido) behind spec-parity's protocols dspark/modules and dspark/loop.

An example of checking a third-party port through the plug-in seam, never part of spec-parity:

    pip install --no-deps --target /tmp/peers dspark-mlx==0.1.0
    PYTHONPATH=$PWD:$PWD/examples:/tmp/peers python -m spec_parity.cli run --module dspark \\
        --port dspark=dspark_mlx_adapter:make_port --source golden

The drafter is dspark-mlx's own (`load_draft`: its arch registry, Qwen3 or Gemma4 backbone, its
Markov and confidence heads). The target is the host, which dspark-mlx leaves to its user
(`BaseModelAdapter`): on Qwen3 its own `hosts.MlxLmHostAdapter`; on Gemma-4 its host is
mlx-vlm's multimodal model, which does not load an mlx-lm `gemma4_text` checkpoint, so a small
`BaseModelAdapter` here runs spec-parity's mlx-lm target (spec_parity.port.targets, which the targets pair
holds to transformers) and hands dspark-mlx the tapped hiddens `hidden_states[l + 1]`. Loading and
the first draft, which the bench makes too, are written once, in spec_parity/third_party.py.

Module cases run the round the protocol defines (DeepSpec's first round): every prompt row's
taps into the context (`extend_context`), then `draft(anchor)` with the target's greedy next
token. Internals, and how they are read (keep these few lines in step with dspark-mlx):
- block hidden and pre-Markov logits: dspark-mlx computes them inside `draft()` and hands them
  to `recipe.draft_block_decode`; that function is wrapped, where the arch module imported it,
  to record its `logits` and `conf_hidden` arguments;
- per-layer context K/V: the drafter's private `_ctx_k` / `_ctx_v` lists;
- the projected context: `backbone.project_context(taps)`, recomputed (the drafter keeps only K/V);
- the proposal length at a threshold: `loop._confident_prefix_length`, the private function its
  loop gates with.
Config keys dspark-mlx has no field for (markov_head_type, confidence_head_alpha, ...) are left
unread, as dspark-mlx leaves them: the verdict shows what that does.

Loop cases run `generate_eager` (its DeepSpec-matched loop, T=0, the case's threshold). Each
round's accepted count comes from its TokenEvents (`n_accepted`, one group per round); the
drafts are recorded by wrapping the drafter instance's `draft` (its outputs unchanged) and cut
at the threshold as the loop cuts them. Its loop starts from the prompt's last token as anchor
(the target's first token is round 0's first draft), where DeepSpec starts from the prefill's
greedy token: the adapter says so (`stream.prefilled` 0: nothing committed before round 0), so the
drafts are paired with DeepSpec's on the same context and the schedule finding names the shift.
"""

from __future__ import annotations

import contextlib

import numpy as np

from spec_parity import ports, third_party


def make_port() -> ports.Port:
    import dspark_mlx

    return ports.Port("dspark-mlx", dspark_mlx.__version__, {"dspark": run},
                      (__file__, ports.package_dir("dspark_mlx")))


def run(req) -> dict:
    if req.kind not in ("modules", "loop"):
        raise ports.Declined(f"this adapter answers dspark/modules and dspark/loop; dspark/{req.kind} is not "
                             "written for dspark-mlx")
    return _loop(req) if req.kind == "loop" else _modules(req)


class _Host:
    """dspark-mlx's BaseModelAdapter over spec-parity's mlx-lm target (Gemma-4): one forward per
    call with the mlx-lm caches, taps = the outputs of `target_layer_ids`, rollback = trim."""

    def __init__(self, path, target_layer_ids, dtype):
        from spec_parity.port import targets

        self.target = targets.load(path, dtype)
        self.target_layer_ids = tuple(target_layer_ids)
        self.caches = targets.make_caches(self.target)

    def _run(self, ids):
        import mlx.core as mx

        from spec_parity.port import targets

        t = targets.forward(self.target, ids, caches=self.caches)
        return t.logits, mx.concatenate([t.hidden[i + 1] for i in self.target_layer_ids], axis=-1)

    def prefill(self, tokens):
        from dspark_mlx import StepOut

        logits, main = self._run(tokens)
        return StepOut(logits=logits[:, -1, :], main_hidden=main)

    def verify_forward(self, block_tokens):
        from dspark_mlx import BlockOut

        logits, main = self._run(block_tokens)
        return BlockOut(per_pos_logits=logits, per_pos_main_hidden=main, main_hidden_last=main[:, -1, :])

    def kv_snapshot(self):
        return self.caches[0].offset

    def kv_rollback(self, n_keep: int) -> None:
        from spec_parity.port import serve

        serve.trim_caches(self.caches, self.caches[0].offset - n_keep)


def _load(req):
    """The drafter and its host target at the request's dtype (a checkpoint stored in bf16 or fp16
    runs at the case's float32, as the reference does)."""
    import json

    import mlx.core as mx
    from dspark_mlx.hosts import MlxLmHostAdapter
    from mlx_lm.utils import load_model

    dtype = getattr(mx, req.dtype)
    drafter, config = third_party.dspark_mlx_draft(req.drafter)
    drafter.set_dtype(dtype)
    ids = config["target_layer_ids"]
    family = json.loads((req.target / "config.json").read_text()).get("model_type", "")
    if family.startswith("gemma"):
        return drafter, _Host(req.target, ids, dtype)
    target = load_model(req.target)[0]
    target.set_dtype(dtype)
    return drafter, MlxLmHostAdapter(target, ids)


@contextlib.contextmanager
def _recording_decode(drafter, seen: list):
    """Record draft_block_decode's (logits, conf_hidden) for the drafter's arch module."""
    import importlib

    arch = importlib.import_module(type(drafter).__module__)
    inner = arch.draft_block_decode

    def recording(logits, conf_hidden, *args, **kw):
        seen.append((logits, conf_hidden))
        return inner(logits, conf_hidden, *args, **kw)
    arch.draft_block_decode = recording
    try:
        yield
    finally:
        arch.draft_block_decode = inner


def _modules(req) -> dict:
    import mlx.core as mx
    from dspark_mlx.loop import _confident_prefix_length

    drafter, host = _load(req)
    step = host.prefill(mx.array(req.prompt.astype(np.int32)))
    anchor = int(mx.argmax(step.logits[0]).item())
    seen: list = []
    with _recording_decode(drafter, seen):
        ids, logits, confidence = third_party.dspark_mlx_first(drafter, step.main_hidden,
                                                               mx.array([anchor], dtype=mx.int32))
    base, hidden = seen[-1]
    tokens = np.array(ids[0, 1:]).astype(np.int32)
    out = {"anchor": np.array([anchor], np.int32), "taps": step.main_hidden[0],
           "context": drafter.backbone.project_context(step.main_hidden)[0], "block_hidden": hidden[0],
           "base_logits": base[0], "logits": logits[0], "tokens": tokens, "confidence": confidence[0]}
    for i, (k, v) in enumerate(zip(drafter._ctx_k, drafter._ctx_v)):
        out[f"context_k.{i}"], out[f"context_v.{i}"] = k[0], v[0]
    conf = np.array(confidence[0].astype(mx.float32))
    for t in req.options["thresholds"]:
        n = _confident_prefix_length(conf, drafter.block_size, t)
        out[f"prefix@{t}"] = np.array([n], np.int32)
        out[f"proposal@{t}"] = tokens[:n]
    return {k: np.array(v) for k, v in out.items()}


def _loop(req) -> dict:
    import mlx.core as mx
    from dspark_mlx import TokenEvent, generate_eager
    from dspark_mlx.loop import _confident_prefix_length

    drafter, host = _load(req)
    t = req.options["threshold"]
    drafts: list = []
    draft = drafter.draft

    def recording(anchor):
        out = draft(anchor)
        drafts.append(out)
        return out
    drafter.draft = recording

    events = [e for e in generate_eager(host, drafter, req.prompt[0].tolist(), req.options["max_new_tokens"],
                                        confidence_threshold=t) if isinstance(e, TokenEvent)]
    accepted, i = [], 0
    while i < len(events):                      # a round emits its n_accepted drafts + one token
        accepted.append(events[i].n_accepted)
        i += events[i].n_accepted + 1
    proposals, rows = [], []
    for ids, logits, conf in drafts:
        n = drafter.block_size
        if t > 0.0:
            n = _confident_prefix_length(np.array(conf[0].astype(mx.float32)), drafter.block_size, t)
        proposals.append(np.array(ids[0, 1:1 + n]))
        rows.append(np.array(logits[0, :n].astype(mx.float32)))
    accepted = np.array(accepted, np.int32)
    return {"stream.tokens": np.array([e.token for e in events], np.int32),
            "stream.drafted": np.array([len(p) for p in proposals], np.int32), "stream.accepted": accepted,
            "stream.emitted": accepted + 1, "stream.proposals": np.concatenate(proposals).astype(np.int32),
            "stream.draft_logits": np.concatenate(rows), "tau": np.array([float(np.mean(accepted + 1))]),
            "stream.prefilled": np.array([0], np.int32)}

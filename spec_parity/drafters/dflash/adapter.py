"""Our DFlash port (port/dflash.py) behind protocols dflash/modules and dflash/loop."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from spec_parity.oracles.layers import as_numpy, mlx_recorded, to_numpy

from ... import controls, shared
from ...adapters import loop
from ...checks import layer_feeds
from ...protocol import Request


def run(req: Request) -> dict:
    return {"loop": run_loop, "extension": run_extension}.get(req.kind, run_modules)(req)


def run_extension(req: Request) -> dict:
    """The DSpark-on-DFlash extension (extras on): the serve loop with pruning at the case's
    thresholds, and one with pruning off for the distribution shift (every block's base and
    extended rows)."""
    import mlx.core as mx

    from spec_parity.port import targets
    from spec_parity.port.sources.dflash import DflashProvider

    dt = getattr(mx, req.dtype)
    o, target = req.options, targets.load(req.target, dt)

    def source(thresholds):
        return DflashProvider(req.drafter, max_tokens=o["max_tokens"], extras=True, thresholds=thresholds, dtype=dt)

    pruned = source(o["thresholds"])
    out = loop.run(target, req.prompt, o["max_tokens"], pruned, pruned.trained_gamma, set())
    full = source([])
    unpruned = loop.run(target, req.prompt, o["max_tokens"], full, full.trained_gamma, set())
    out.update({"unpruned." + k[4:]: v for k, v in unpruned.items() if k in ("ext.base_logits", "ext.logits")})
    if "heads.hidden" in req.inputs:
        out.update(fed_heads(pruned.extension, req.inputs))
    return out


def fed_heads(extension, inputs: dict) -> dict:
    """The extension's heads, as the source calls them, fed the harness's rows (teacher-forced):
    per block the hidden and base rows and the anchor, each slot's token picked as the fed chain's
    (so every slot's previous token is the fed one). Rows [blocks, n, V], confidence [blocks, n]."""
    import mlx.core as mx

    rows, conf = [], []
    for h, base, anchor, tokens in zip(*(inputs[k] for k in ("heads.hidden", "heads.base_logits", "heads.anchor",
                                                              "heads.tokens"))):
        r, _, c = extension(mx.array(h), mx.array(base), mx.array([int(anchor)], mx.uint32),
                            functools.partial(_fed, iter(tokens.tolist())))
        rows.append(to_numpy(r))
        if c is not None:
            conf.append(to_numpy(c))
    return {"heads.logits": np.stack(rows), **({"heads.confidence": np.stack(conf)} if conf else {})}


def _fed(chain, row) -> int:
    """A pick that ignores the row: the fed chain's next token."""
    return next(chain)


def run_modules(req: Request) -> dict:
    """The module rounds through the DflashSource, prefilled as the reference does: z-lab MLX splits
    off the prompt's last token ("split"), z-lab torch runs it in one forward ("whole"). The stored
    context K/V are returned as the reference holds them: mlx-lm's buffers as they are ("split"),
    or in time order, sliding layers their newest W-1 rows (torch's DynamicSlidingWindowLayer),
    with each row's position (`ctx_pos.i`), so the harness compares them as attended.
    Each drafter layer's output in round 0 is recorded (`layer.i`); fed the reference's, a second
    prefill on the reference's taps and round 0 give each layer's own error (`own.i`)."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    from spec_parity.port import dflash, serve, targets

    o, dt = req.options, getattr(mx, req.dtype)
    target = targets.load(req.target, dt)
    m = dflash.load(req.drafter, o["window"], o["embed"], scales=o["scales"], dtype=dt)
    src, caches, out, anchor = _prefilled(req, target, m)
    anchors, bs, recorded = [anchor], m.args.block_size, {}
    for r, a in enumerate(o["accepts"]):
        with mlx_recorded(m.layers, recorded) if r == 0 else contextlib.nullcontext():
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
    feed = layer_feeds(req.inputs)
    if feed:
        own_src, _, _, first = _prefilled(req, target, m)
        if "taps.0" in req.inputs:   # the context from the reference's taps, as many rows as ours
            own_src.pending = mx.array(req.inputs["taps.0"]).astype(dt)[-own_src.pending.shape[1]:][None]
        with mlx_recorded(m.layers, recorded, "own", feed):
            own_src.draft([first], bs - 1, None)
    for i, c in enumerate(src.caches):
        if not isinstance(c, RotatingKVCache):
            k, v, pos = c.keys[..., : c.offset, :], c.values[..., : c.offset, :], np.arange(c.offset)
        elif o["prefill"] == "split":
            k, v, pos = c.keys, c.values, _ring_positions(c)
        else:
            n = min(c.max_size, c.offset)
            k, v = c._temporal_order(c.keys)[..., -n:, :], c._temporal_order(c.values)[..., -n:, :]
            pos = np.arange(c.offset - n, c.offset)
        out[f"ctx_k.{i}"], out[f"ctx_v.{i}"], out[f"ctx_pos.{i}"] = k[0], v[0], mx.array(pos, dtype=mx.int32)
    out["anchors"] = mx.array(anchors, dtype=mx.int32)
    return {**{k: to_numpy(v) for k, v in out.items()}, **as_numpy(recorded)}


def _ring_positions(c) -> np.ndarray:
    """The absolute position of each row of an mlx-lm RotatingKVCache's buffer as it lies (the
    cache's own time order of its row indices; rows never written: -1)."""
    import mlx.core as mx

    L = c.keys.shape[2]
    order = np.array(c._temporal_order(mx.arange(L).reshape(1, 1, L, 1))).ravel()
    pos = np.full(L, -1)
    pos[order] = c.offset - len(order) + np.arange(len(order))
    return pos


def _prefilled(req: Request, target, m):
    """A DflashSource prefilled on the prompt as the reference prefills: (source, target caches,
    {"taps.0"}, the first anchor)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from spec_parity.port import serve, targets
    from spec_parity.port.sources.dflash import DflashSource

    caches = make_prompt_cache(target.model)
    src = DflashSource(m, serve.TargetView(target, caches))
    p, split = req.prompt, req.options["prefill"] == "split"
    if split:
        first = targets.forward(target, mx.array(p[:, :-1]), caches=caches)
        last = targets.forward(target, mx.array(p[:, -1:]), caches=caches)
        taps = [mx.concatenate([first.hidden[i + 1], last.hidden[i + 1]], axis=1) for i in src.tap_layers]
    else:
        last = targets.forward(target, mx.array(p), caches=caches)
        taps = [last.hidden[i + 1] for i in src.tap_layers]
    src.prefill(p[0].tolist(), taps)
    # z-lab MLX hands an all-sliding drafter only the newest W-1 prompt rows (so does the source);
    # z-lab torch projects them all and its sliding caches keep W-1.
    out = {"taps.0": src.pending[0] if split else mx.concatenate(taps, axis=-1)[0]}
    return src, caches, out, int(mx.argmax(last.logits[0, -1]).item())


def run_loop(req: Request) -> dict:
    """Our serve loop, once per process for what it reads (spec_parity.shared): the checkpoints,
    the prompt, the length, EOS, window, the controls planted now and block embedding. On a target with no
    embed scale (Qwen3) embed "raw" and "scaled" are the same multiply (port/dflash.py `embed`), so
    the z-lab MLX and torch twins of a Qwen3 loop share one run."""
    import mlx.core as mx

    from spec_parity.port import targets

    o = req.options
    target = targets.load(req.target, getattr(mx, req.dtype))
    embed = o["embed"] if hasattr(target.model.model, "embed_scale") else "scaled"
    key = ("dflash-loop", shared.stamp(req.target), shared.stamp(req.drafter), req.dtype, req.prompt.tobytes(), o["max_tokens"],
           tuple(sorted(o["eos"])), o["window"], controls.active(), embed, _scales(req))
    return shared.once(key, lambda: loop_uncached(req, target))


def _scales(req: Request) -> tuple[float, float]:
    """The two scales the drafter runs with under the case's convention: the twins of a checkpoint
    that nests them (every factory one) read the same values, so they share one run."""
    import json

    from spec_parity.port import dflash

    cfg = json.loads((req.drafter / "config.json").read_text())
    a = dflash.ModelArgs.from_config(cfg, req.drafter, req.options["scales"])
    return a.input_embedding_scale, a.output_multiplier


def loop_uncached(req: Request, target=None) -> dict:
    import mlx.core as mx

    from spec_parity.port import targets
    from spec_parity.port.sources.dflash import DflashProvider

    o, dt = req.options, getattr(mx, req.dtype)
    provider = DflashProvider(req.drafter, o["window"], max_tokens=o["max_tokens"],
                              embed=o["embed"], scales=o["scales"], dtype=dt)
    return loop.run(target or targets.load(req.target, dt), req.prompt, o["max_tokens"], provider, provider.trained_gamma,
                    set(o["eos"]))

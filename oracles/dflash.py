"""Reference for the DFlash drafter: z-lab's `dflash` 0.1.0 (PyPI), its MLX model `dflash.model_mlx`.

Everything here imports and calls z-lab's own code on an mlx-lm target: `load_draft` (its
`snapshot_download` call is bypassed for a local directory, nothing else), `_patch_model` (its
layer hooks that collect the taps), `_prefill_target`, `DFlashDraftModel.bind / hidden_states /
compute_logits`, `make_prompt_cache`, `_trim_recent_cache`, and the decoding loop
`stream_generate` (T=0). The loop is observed, never changed: the drafter and the target are
wrapped by subclasses that record what z-lab's own calls return.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import numpy as np

from .layers import as_numpy, mlx_recorded, to_numpy

INSTALL = "pip install --no-deps dflash==0.1.0   (it imports huggingface_hub: pip install huggingface_hub)"


def status() -> str | None:
    missing = [m for m in ("dflash", "huggingface_hub") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} not installed: {INSTALL}"
    return None


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("dflash", "mlx", "mlx-lm")}


@contextlib.contextmanager
def _local_snapshot():
    """`load_draft` resolves its argument with huggingface_hub.snapshot_download; for a local
    directory that lookup is the identity."""
    from dflash import model_mlx as z

    saved = z.snapshot_download
    z.snapshot_download = lambda repo_id, **kw: str(repo_id)
    try:
        yield
    finally:
        z.snapshot_download = saved


def load_draft(drafter_dir: Path):
    """z-lab's MLX draft model from a checkpoint directory (`load_draft`, no hub lookup)."""
    from dflash import model_mlx as z

    with _local_snapshot():
        return z.load_draft(str(drafter_dir))


def bind(draft, target) -> list:
    """The draft model bound to the mlx-lm target (`bind`: its embedding and head); a fresh draft
    cache (`make_prompt_cache`)."""
    from mlx_lm.models.cache import make_prompt_cache

    draft.bind(target)
    return make_prompt_cache(draft)


def draft_block(draft, block, hidden, cache) -> tuple:
    """One draft block after the new context rows `hidden`: `hidden_states(block, hidden, cache,
    logits_start=1)` and `compute_logits`. (block hidden, logits)."""
    h = draft.hidden_states(block, hidden, cache, logits_start=1)
    return h, draft.compute_logits(h)


def _load(target_dir: Path, drafter_dir: Path, dtype: str = "float32"):
    """The mlx-lm target and z-lab's drafter cast to the case's dtype, whatever dtype the
    checkpoints are stored in (as transformers' `dtype=` loads them on the torch side)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    target, _ = load_model(Path(target_dir))
    draft = load_draft(drafter_dir)
    target.set_dtype(getattr(mx, dtype))
    draft.set_dtype(getattr(mx, dtype))
    return target, draft


class _Detokenizer:
    last_segment = ""

    def reset(self):
        pass

    def add_token(self, token):
        pass

    def finalize(self):
        pass


def _tokenizer(eos: set[int]):
    """mlx-lm's TokenizerWrapper around no tokenizer: the loop only reads eos_token_ids and a
    detokenizer (token-id prompts need no encoding)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tw = object.__new__(TokenizerWrapper)
    tw._tokenizer = None
    tw._detokenizer = _Detokenizer()
    tw._eos_token_ids = set(eos)
    return tw


def stream(target, draft, prompt: list[int], max_tokens: int, eos: set[int]):
    """z-lab's own T=0 loop, `stream_generate`, on token ids: its responses, as it yields them."""
    import mlx.core as mx
    from dflash import model_mlx as z

    return z.stream_generate(target, draft, _tokenizer(eos), mx.array(prompt), max_tokens=max_tokens,
                             temperature=0.0)


def modules(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, accepts: list[int],
            dtype: str = "float32") -> dict:
    """Draft rounds on z-lab's own pieces: `_prefill_target` (taps through its layer hooks), then per
    round the block [anchor, MASK x (bs-1)] through `hidden_states` + `compute_logits` with the
    draft cache, a verify of [anchor, drafts] through the hooked target, the target cache trimmed
    with `_trim_recent_cache`, and the next context = the verify's taps of the anchor + `a` drafts
    (a forced per round by `accepts`, so long and empty commits both occur; the next anchor is the
    target's greedy token after them)."""
    import mlx.core as mx
    from dflash import model_mlx as z
    from mlx_lm.models.cache import make_prompt_cache

    model, draft = _load(target_dir, drafter_dir, dtype)
    cfg = draft.config
    z._patch_model(model, cfg.target_layer_ids)
    cache, dcache = make_prompt_cache(model), bind(draft, model)
    limit = cfg.sliding_window - 1 if all(t == "sliding_attention" for t in cfg.layer_types) else None
    logits, hidden, hidden_offset = z._prefill_target(model, mx.array(prompt[0]), cache, limit, 2048)
    for c in dcache:
        c.offset = hidden_offset
    bs = int(cfg.block_size)
    out = {"taps.0": hidden[0]}
    anchor = int(mx.argmax(logits[0, -1]).item())
    anchors = [anchor]
    layers: dict = {}
    for r, a in enumerate(accepts):
        block = mx.array([[anchor] + [int(cfg.mask_token_id)] * (bs - 1)])
        with mlx_recorded(draft.layers, layers) if r == 0 else contextlib.nullcontext():
            h, dl = draft_block(draft, block, hidden, dcache)
        tokens = mx.argmax(dl, axis=-1)
        out[f"hidden.{r}"], out[f"logits.{r}"], out[f"tokens.{r}"] = h[0], dl[0], tokens[0].astype(mx.int32)
        vl = model(mx.concatenate([mx.array([[anchor]]), tokens], axis=1), cache)
        vh = mx.concatenate(model._hidden_states, axis=-1)
        a = min(a, bs - 1)
        anchor = int(mx.argmax(vl[0, a]).item())
        anchors.append(anchor)
        z._trim_recent_cache(cache, bs - 1 - a)
        hidden = vh[:, : a + 1, :]
        out[f"taps.{r + 1}"] = hidden[0]
    for i, c in enumerate(dcache):
        out[f"ctx_k.{i}"], out[f"ctx_v.{i}"] = c.keys[0, :, : _stored(c)], c.values[0, :, : _stored(c)]
    out["anchors"] = mx.array(anchors, dtype=mx.int32)
    return {**{k: to_numpy(v) for k, v in out.items()}, **as_numpy(layers)}


def ring_positions(start: int, sizes: list[int], window: int) -> tuple[int, ...]:
    """The absolute position of each row a sliding layer's `ctx_k`/`ctx_v` hold as `modules`
    stores them (mlx-lm's RotatingKVCache of W-1 rows, z-lab MLX's draft cache), replayed on that
    cache with the positions as the rows: `start` the first context row's position, `sizes` the
    rows entering it per round (taps.r; z-lab MLX keeps the newest W-1 of them, counting all)."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    c = RotatingKVCache(max_size=window - 1, keep=0)
    c.offset = start
    for n in sizes:
        c.offset += max(0, n - (window - 1))
        rows = mx.arange(c.offset, c.offset + min(n, window - 1), dtype=mx.float32).reshape(1, 1, -1, 1)
        c.update_and_fetch(rows, rows)
    return tuple(int(x) for x in np.array(c.keys[0, 0, : _stored(c), 0]))


def _stored(c) -> int:
    """Rows held by an mlx-lm cache's buffer (KVCache over-allocates in steps of 256)."""
    from mlx_lm.models.cache import RotatingKVCache

    return c.keys.shape[2] if isinstance(c, RotatingKVCache) else c.offset


def loop(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, max_tokens: int, eos: list[int],
         dtype: str = "float32") -> dict:
    """z-lab's own T=0 loop, `stream_generate`. Recorded per round: the drafter's logits (its
    `__call__`, rows 1..bs-1), its greedy block, the target's verify argmax, and the tokens each
    response emits; accepted = the longest prefix where the block equals the verify's argmax
    (z-lab's own rule)."""
    import mlx.core as mx

    model, draft = _load(target_dir, drafter_dir, dtype)
    drafts, verifies = [], []

    class RecordingDraft(type(draft)):
        def __call__(self, *args, **kw):
            out = super().__call__(*args, **kw)
            drafts.append(out)
            return out

    class RecordingTarget(type(model)):
        def __call__(self, inputs, *args, **kw):
            out = super().__call__(inputs, *args, **kw)
            verifies.append((inputs, out))
            return out

    draft.__class__ = RecordingDraft
    model.__class__ = RecordingTarget
    responses = list(stream(model, draft, prompt[0].tolist(), max_tokens, set(eos)))
    emitted = [r.tokens for r in responses if r.tokens]
    rounds = emitted[1:]
    checks = verifies[-len(drafts):] if drafts else []
    drafted, accepted, proposals, logits = [], [], [], []
    for d, (_, vl) in zip(drafts, checks):
        toks = mx.argmax(d, axis=-1)[0].tolist()
        target_toks = mx.argmax(vl, axis=-1)[0].tolist()
        k = next((i for i in range(len(toks)) if toks[i] != target_toks[i]), len(toks))
        drafted.append(len(toks))
        accepted.append(k)
        proposals += toks
        logits.append(d[0])
    V = int(model.args.vocab_size) if hasattr(model, "args") else 0
    return {"stream.tokens": np.array([t for e in emitted for t in e], np.int32),
            "stream.drafted": np.array(drafted, np.int32), "stream.accepted": np.array(accepted, np.int32),
            "stream.emitted": np.array([len(e) for e in rounds], np.int32),
            "stream.proposals": np.array(proposals, np.int32),
            "stream.draft_logits": to_numpy(mx.concatenate(logits, axis=0)) if logits else np.zeros((0, V), np.float32)}


# ---- z-lab torch (`dflash.model`), in its own environment ---------------------------------------

TORCH_ENV = "SPEC_PARITY_TF515_PYTHON"
TORCH_INSTALL = ("z-lab's torch model needs transformers 5.15: make a venv with `pip install torch==2.13.0 "
                 "transformers==5.15.0 numpy safetensors && pip install --no-deps dflash==0.1.0` and "
                 f"`export {TORCH_ENV}=/that/venv/bin/python` (or run `tox -e oracle-tf515`)")
RUNNER = Path(__file__).with_name("dflash_torch_runner.py")


def _probe(python: str) -> str | None:
    """None if `python` holds transformers 5.15.x and dflash, else why not. Reads the installed
    versions without importing transformers (an import costs a second of CPU per test process)."""
    import subprocess

    code = ("import importlib.metadata as m, importlib.util as u; v = m.version('transformers'); "
            "assert u.find_spec('dflash'), 'dflash missing'; print(v)")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if r.returncode != 0:
        return f"{python}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}"
    if not r.stdout.strip().startswith("5.15."):
        return f"{python} has transformers {r.stdout.strip()}"
    return None


_TORCH_PYTHON: list = []


def torch_python() -> tuple[str | None, str | None]:
    """(python, None) for the environment that runs z-lab's torch model, or (None, why not)."""
    import os
    import sys

    if not _TORCH_PYTHON:
        tried = [p for p in (os.environ.get(TORCH_ENV), sys.executable) if p]
        why = []
        for p in tried:
            w = _probe(p)
            if w is None:
                _TORCH_PYTHON.append((p, None))
                break
            why.append(w)
        else:
            _TORCH_PYTHON.append((None, f"{'; '.join(why)}: {TORCH_INSTALL}"))
    return _TORCH_PYTHON[0]


def torch_status() -> str | None:
    return torch_python()[1]


def _run_torch(request: dict) -> dict:
    import json
    import subprocess
    import tempfile

    python, why = torch_python()
    if python is None:
        raise RuntimeError(why)
    with tempfile.TemporaryDirectory(prefix="dflash-torch-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "out.npz"
        req.write_text(json.dumps(request))
        r = subprocess.run([python, "-I", str(RUNNER), str(req), str(out)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"z-lab torch runner failed ({python}):\n{r.stderr[-3000:]}")
        with np.load(out) as z:
            arrays = {k: z[k] for k in z.files}
    versions = json.loads(arrays.pop("__versions__").tobytes().decode())
    _VERSIONS.update(versions)
    return arrays


_VERSIONS: dict = {}


def torch_versions() -> dict[str, str]:
    if not _VERSIONS:
        _run_torch({"mode": "versions"})
    return dict(_VERSIONS)


def torch_modules(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, accepts: list[int],
                  dtype: str = "float32") -> dict:
    return _run_torch({"mode": "modules", "target": str(target_dir), "drafter": str(drafter_dir),
                       "prompt": [int(t) for t in prompt[0]], "accepts": list(accepts), "dtype": dtype})


def torch_save(drafter_dir: Path, out_dir: Path) -> Path:
    """The drafter as z-lab's torch `DFlashDraftModel.save_pretrained` writes it, in out_dir."""
    _run_torch({"mode": "save", "drafter": str(drafter_dir), "out": str(out_dir)})
    return Path(out_dir)


def torch_loop(target_dir: Path, drafter_dir: Path, prompt: np.ndarray, max_tokens: int,
               dtype: str = "float32") -> dict:
    return _run_torch({"mode": "loop", "target": str(target_dir), "drafter": str(drafter_dir),
                       "prompt": [int(t) for t in prompt[0]], "max_tokens": int(max_tokens), "dtype": dtype})

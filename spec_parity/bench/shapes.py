"""The cases `spec-parity bench` measures: a drafter and the target it borrows from, as the
harness's Case (spec_parity/case.py) with its `shapes`, built into checkpoint directories every
side reads with its own loader (`build` -> Checkpoints).

`tiny`: the factory's own tiny checkpoints (spec_parity/checkpoints/), read from disk.
`real`: the shapes of docs/references.md ("Real shapes") with RANDOM weights built in memory: the
same factory kinds (so the tensor names and the config are the checkpoint format the loaders
expect), with every draw taken from mx.random instead of numpy. Nothing large is written: the
directory holds the config.json and an empty model.safetensors, and while a side loads,
`serve_weights` makes `mx.load` of that file return the in-memory tensors. Every side (our port,
optiq, z-lab, the peer ports, the mlx-lm target) therefore loads through its own code path and gets
the SAME arrays (shared, not copied). The target is a stand-in of the real one: its real width,
vocabulary, head dims and donor K/V, at a depth given by `target_layers` (Qwen3-4B: its real 36;
Gemma-4: 6, the real depths are not in docs/references.md).

The bytes model of a step (what it must read, for the bandwidth floor) is `step_bytes`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

from .. import checkpoints
from ..case import Case, Shapes
from ..params import Bench

SOURCES = ("assistant", "dspark", "dflash")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class Checkpoints:
    """A built bench case: where its checkpoints are and the tensors `serve_weights` hands out."""

    case: Case
    drafter_dir: Path
    target_dir: Path
    tensors: dict[str, dict[str, mx.array]]   # realpath of a .safetensors -> its tensors
    prompt_vocab: int | None = None           # prompts drawn from ids below this (None: the vocabulary)

    @property
    def dtype(self) -> str:
        return self.case.dtype

    @property
    def source(self) -> str:
        return self.case.module

    @property
    def drafter_config(self) -> dict:
        return json.loads((self.drafter_dir / "config.json").read_text())

    @property
    def target_config(self) -> dict:
        return json.loads((self.target_dir / "config.json").read_text())

    def weights(self, which: str) -> dict[str, mx.array]:
        d = self.drafter_dir if which == "drafter" else self.target_dir
        return self.tensors[os.path.realpath(d / "model.safetensors")]


def bench_case(size: str, name: str, source: str, label: str, drafter: tuple[str, dict], target: tuple[str, dict],
               ctx: int, gamma: int, dtype: str, notes: tuple[str, ...] = ()) -> Case:
    """The harness's Case of one bench case: its target is the checkpoint (kind, overrides), its
    drafter params.drafter, as for the drafter pairs; the tier is the bench's (never asserted)."""
    return Case(source, name, "bench", target[0], 0, target[1], Bench(drafter=(drafter[0], 0, drafter[1])),
                dtype=dtype, shapes=Shapes(size, label, ctx, gamma, tuple(notes)))


# ---- the shapes ----------------------------------------------------------------------------

def tiny_cases(ctx: int | None = None, gamma: int = 4, dtype: str = "float32") -> list[Case]:
    """The factory's tiny checkpoints; the default context crosses the tiny sliding window (8)."""
    n = ctx or 24
    qwen = ("qwen3-target", {})
    gemma = ("gemma4-target", {})
    rows = [
        ("assistant-tied", "assistant", "tiny Gemma-4 assistant, tied head",
         ("gemma4-assistant", {"use_ordered_embeddings": False}), gemma, gamma),
        ("assistant-centroid", "assistant", "tiny Gemma-4 assistant, centroid head 8/top-2",
         ("gemma4-assistant", {}), gemma, gamma),
        ("dspark-qwen3", "dspark", "tiny DSpark on Qwen3, block 7",
         ("dspark-drafter", {"target_kind": "qwen3-target"}), qwen, 7),
        ("dspark-gemma4", "dspark", "tiny DSpark on Gemma-4, block 7", ("dspark-drafter", {}), gemma, 7),
        ("dflash-qwen3", "dflash", "tiny DFlash on Qwen3, block 16", ("dflash-drafter", {"block_size": 16}), qwen, 15),
    ]
    return [bench_case("tiny", name, src, label, d, t, n, g, dtype) for name, src, label, d, t, g in rows]


def _div(x: int, scale: int, mult: int = 8) -> int:
    """x / scale, a multiple of `mult` (at least `mult`): widths that stay kernel friendly."""
    return x if scale == 1 else max(mult, x // scale // mult * mult)


def spread_taps(num_target_layers: int, n: int) -> list[int]:
    """Tap layers spread over 1..L-3, z-lab's `build_target_layer_ids` rule (Qwen3-4B: [1, 9, 17, 25, 33])."""
    span = num_target_layers - 4
    if span < n - 1:
        raise ValueError(f"a {num_target_layers}-layer target cannot hold {n} distinct taps in 1..L-3: "
                         f"give --target-layers >= {n + 3}")
    return [round(1 + i * span / (n - 1)) for i in range(n)]


def _gemma_target(scale: int, layers: int, hidden: int, inter: int, heads: int, kv: int, global_kv: int | None,
                  k_eq_v: bool, window: int, vocab: int) -> dict:
    return {"hidden_size": _div(hidden, scale), "intermediate_size": _div(inter, scale),
            "num_hidden_layers": layers, "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
            "num_attention_heads": heads, "num_key_value_heads": kv, "num_global_key_value_heads": global_kv,
            "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": k_eq_v,
            "sliding_window": _div(window, scale), "vocab_size": _div(vocab, scale, 256),
            "vocab_size_per_layer_input": _div(vocab, scale, 256), "max_position_embeddings": 131072}


def _assistant_text(target: dict, hidden: int, inter: int, heads: int, scale: int) -> dict:
    return {"vocab_size": target["vocab_size"], "hidden_size": _div(hidden, scale),
            "intermediate_size": _div(inter, scale), "num_hidden_layers": 4,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "num_attention_heads": heads,
            "num_key_value_heads": target["num_key_value_heads"],
            "num_global_key_value_heads": target["num_global_key_value_heads"],
            "attention_k_eq_v": target["attention_k_eq_v"], "head_dim": 256, "global_head_dim": 512,
            "sliding_window": target["sliding_window"], "max_position_embeddings": 131072}


def real_cases(ctx: int | None = None, scale: int = 1, target_layers: int | None = None, gamma: int = 4,
               dtype: str = "bfloat16") -> list[Case]:
    """docs/references.md's shapes ("Real shapes"), random weights. `scale` divides every
    width, the vocabulary, the windows and the context (the code path at a size a CPU runs);
    head counts, head dims and draft depths stay real."""
    n = ctx or _div(2048, scale)
    g_layers = target_layers or 6
    q_layers = target_layers or max(8, 36 // scale)
    assumed = "assumed (not in docs/references.md)"
    # 12B: donor K/V sliding 8 x 256, full 1 x 512 (k_eq_v, 1 global KV head).
    t12 = _gemma_target(scale, g_layers, 3840, 15360, 16, 8, 1, True, 1024, 262144)
    a12 = {"model_type": "gemma4_unified_assistant", "backbone_hidden_size": t12["hidden_size"],
           "use_ordered_embeddings": False, "tie_word_embeddings": True,
           "text_config": _assistant_text(t12, 1024, 8192, 16, scale)}
    te4 = _gemma_target(scale, g_layers, 2560, 10240, 8, 2, None, False, 512, 262144)
    ae4 = {"model_type": "gemma4_assistant", "backbone_hidden_size": te4["hidden_size"],
           "use_ordered_embeddings": True, "num_centroids": te4["vocab_size"] // 128,  # 2048 x 128 tokens
           "centroid_intermediate_top_k": 32,
           "text_config": _assistant_text(te4, 256, 2048, 4, scale)}
    vocab_q = _div(151936, scale, 16)
    tq = {"hidden_size": _div(2560, scale), "intermediate_size": _div(9728, scale), "num_hidden_layers": q_layers,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": vocab_q,
          "tie_word_embeddings": True, "max_position_embeddings": 40960}
    mask = 151669 if scale == 1 else vocab_q - 1
    taps = spread_taps(q_layers, 5)
    dspark = {"target_kind": "qwen3-target", "target_overrides": tq, "target_layer_ids": taps,
              "num_draft_layers": 5, "block_size": 7, "mask_token_id": mask, "markov_rank": _div(256, scale),
              "confidence_head_alpha": 1.0, "confidence_head_with_markov": True}
    dflash = {"target_kind": "qwen3-target", "target_overrides": tq, "target_layer_ids": taps,
              "num_draft_layers": 5, "block_size": 16, "mask_token_id": mask, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": _div(9728, scale)}
    sc = f" /{scale}" if scale > 1 else ""
    rows = [
        ("assistant-12b-tied", "assistant",
         f"12B tied assistant (3840->1024, 4 layers, 16 heads, 256/512, vocab 262144){sc}",
         ("gemma4-assistant", a12), ("gemma4-target", t12), gamma,
         [f"assistant intermediate 8192, sliding window 1024, target intermediate 15360: {assumed}",
          f"stand-in target: {g_layers} layers"]),
        ("assistant-e4b-centroid", "assistant",
         f"E4B centroid assistant (2560->256, 2048 centroids, top-32){sc}",
         ("gemma4-assistant", ae4), ("gemma4-target", te4), gamma,
         [f"assistant intermediate 2048 (E2B's), sliding window 512, 4 heads: {assumed}",
          f"stand-in target: {g_layers} layers"]),
        ("dspark-qwen3-4b", "dspark",
         f"Qwen3-4B DSpark (2560, 5 layers, 32/8x128, inter 9728, vocab 151936, block 7, Markov 256){sc}",
         ("dspark-drafter", dspark), ("qwen3-target", tq), 7, [f"stand-in target: {q_layers} layers, taps {taps}"]),
        ("dflash-qwen3-4b", "dflash",
         f"Qwen3-4B DFlash (2560, 5 layers, 32/8x128, inter 9728, vocab 151936, block 16){sc}",
         ("dflash-drafter", dflash), ("qwen3-target", tq), 15, [f"stand-in target: {q_layers} layers, taps {taps}"]),
    ]
    return [bench_case("real", name, src, label, d, t, n, g, dtype, tuple(notes))
            for name, src, label, d, t, g, notes in rows]


# ---- building a case -------------------------------------------------------------------------

def _cast(tensors: dict, dtype: mx.Dtype) -> dict[str, mx.array]:
    out = {}
    for k, v in tensors.items():
        a = v if isinstance(v, mx.array) else mx.array(v)
        out[k] = a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) and a.dtype != dtype else a
    return out


class _MxDraw(checkpoints.Draw):
    """The factory's Draw with mx.random draws (lazy: an unused tensor is never computed)."""

    mx_dtype = mx.float32

    def _key(self, name: str):
        return mx.random.key(zlib.crc32(f"{self.seed}:{name}".encode()))

    def normal(self, name: str, shape: tuple, std: float) -> None:
        self.tensors[name] = mx.random.normal(tuple(shape), dtype=self.mx_dtype, scale=float(std), key=self._key(name))

    def scale(self, name: str, shape: tuple, lo: float = 0.5, hi: float = 1.5) -> None:
        self.tensors[name] = mx.random.uniform(lo, hi, tuple(shape), dtype=self.mx_dtype, key=self._key(name))


@contextlib.contextmanager
def _mx_draws(dtype: mx.Dtype):
    """The factory kinds draw through one Draw class: hand them the mx.random one meanwhile."""
    with checkpoints.drawing_with(type("_Draw", (_MxDraw,), {"mx_dtype": dtype})):
        yield


def _in_memory_dir(root: Path, name: str, config: dict) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({}, str(d / "model.safetensors"), metadata={"format": "pt"})  # empty: served by serve_weights
    return d


def real_block_case(name: str, ctx: int, scale: int = 1) -> Checkpoints:
    """The real-shape case named `name` (a case's name, or a block source: "dspark", "dflash") at
    context `ctx`, built under a fresh temporary directory: what a tool beside the bench measures
    (tools/verify_device_time.py, tools/block_host_time.py)."""
    case = next(c for c in real_cases(ctx=ctx, scale=scale) if name in (c.name, c.module))
    return build(case, Path(tempfile.mkdtemp()))


def build(case: Case, root: Path) -> Checkpoints:
    """tiny: the factory's directories, their tensors cast to the case's dtype; real: config-only
    directories under `root` and the random tensors in memory."""
    mdtype = DTYPES[case.dtype]
    drafter_kind, _, drafter_overrides = case.params.drafter
    kinds = ((drafter_kind, drafter_overrides), (case.kind, case.overrides))
    if case.shapes.size == "tiny":
        dirs = [checkpoints.build(kind, case.seed, copy.deepcopy(ov)) for kind, ov in kinds]
        tensors = {os.path.realpath(d / "model.safetensors"): _cast(mx.load(str(d / "model.safetensors")), mdtype)
                   for d in dirs}
        return Checkpoints(case, dirs[0], dirs[1], tensors)
    dirs, tensors = [], {}
    with _mx_draws(mdtype):
        for role, (kind, ov) in zip(("drafter", "target"), kinds):
            config, t = checkpoints.KINDS[kind](case.seed, copy.deepcopy(ov))
            d = _in_memory_dir(root, f"{case.name}-{role}", config)
            tensors[os.path.realpath(d / "model.safetensors")] = _cast(t, mdtype)
            dirs.append(d)
    return Checkpoints(case, dirs[0], dirs[1], tensors)


@contextlib.contextmanager
def serve_weights(ckpt: Checkpoints):
    """While loading: `mx.load` of one of the case's .safetensors returns its (shared) tensors."""
    real_load = mx.load

    def load(file, *args, **kwargs):
        got = ckpt.tensors.get(os.path.realpath(str(file)))
        if got is None or args or kwargs:
            return real_load(file, *args, **kwargs)
        return dict(got)

    mx.load = load
    try:
        yield
    finally:
        mx.load = real_load


# ---- the bytes a step must read ----------------------------------------------------------------

def _nbytes(shape, dtype: mx.Dtype) -> int:
    return int(np.prod(shape)) * dtype.size


def step_bytes(ckpt: Checkpoints) -> dict:
    """What one draft step (assistant) / one draft block must read at least: every weight it
    touches once (a gathered table: only the gathered rows; a centroid head: only the selected
    candidate rows, not the vocabulary), plus the context K/V it attends to, each once (a layer
    re-reading the same donor K/V may find it in cache). Returns the total and its parts."""
    s, w, t = ckpt.case.shapes, ckpt.weights("drafter"), ckpt.weights("target")
    dt = DTYPES[ckpt.dtype]
    cfg, tc = ckpt.drafter_config, ckpt.target_config
    parts: dict[str, int] = {}
    if ckpt.source == "assistant":
        tx = cfg["text_config"]
        rows = {}
        if cfg.get("use_ordered_embeddings"):
            per = tx["vocab_size"] // cfg["num_centroids"]
            rows = {"model.embed_tokens.weight": cfg["centroid_intermediate_top_k"] * per,
                    "masked_embedding.token_ordering": cfg["centroid_intermediate_top_k"] * per}
        parts["drafter weights"] = sum(
            (rows[k] * v.nbytes // v.shape[0]) if k in rows else v.nbytes for k, v in w.items())
        parts["target embedding row"] = tc["hidden_size"] * dt.size
        keqv = tc.get("attention_k_eq_v")
        full_kv = tc["num_global_key_value_heads"] if keqv and tc.get("num_global_key_value_heads") else tc["num_key_value_heads"]
        parts["donor K/V sliding"] = 2 * _nbytes((tc["num_key_value_heads"], min(s.ctx, tc["sliding_window"] - 1),
                                                  tc["head_dim"]), dt)
        parts["donor K/V full"] = 2 * _nbytes((full_kv, s.ctx, tc["global_head_dim"]), dt)
        return {"total": sum(parts.values()), "parts": parts, "per": "draft step"}
    block = cfg.get("block_size") or cfg["dflash_config"]["block_size"]
    if ckpt.source == "dspark":
        rows = {"embed_tokens.weight": block, "markov_head.markov_w1.weight": block}
        parts["drafter weights"] = sum((rows[k] * v.nbytes // v.shape[0]) if k in rows else v.nbytes
                                       for k, v in w.items())
        hd = cfg.get("global_head_dim") if cfg.get("model_type") == "gemma4_text" else cfg["head_dim"]
        kv = (cfg["num_global_key_value_heads"] if cfg.get("attention_k_eq_v") else cfg["num_key_value_heads"])
        layers = cfg["num_hidden_layers"]
    else:
        parts["drafter weights"] = sum(v.nbytes for v in w.values())
        head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
        parts["target head"] = head.nbytes
        parts["target embedding rows"] = block * tc["hidden_size"] * dt.size
        hd, kv, layers = cfg["head_dim"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    parts["context K/V"] = layers * 2 * _nbytes((kv, s.ctx, hd), dt)
    return {"total": sum(parts.values()), "parts": parts, "per": "draft block"}

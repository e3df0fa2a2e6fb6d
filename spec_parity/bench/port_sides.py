"""Our port in the bench: the target prefill every side starts from, the port's sides (the
default path and its other paths), its DraftProvider, and the seams of spec_parity.port.serve the
serve-loop figures observe. Every call the bench makes into port/ is here; port/ is imported
lazily (mlx-lm imports transformers, and the bench imports without it).
"""

from __future__ import annotations

import contextlib
from functools import partial

import mlx.core as mx

from .shapes import Checkpoints, serve_weights
from .sides import Prep, Side, Skip, Stepper

BUCKET = 256  # mlx-lm KVCache's own growth step (spec_parity.port.compiled.BUCKET; port/ is imported lazily)
# The port's modules whose host-filled buffers counters.HostBuffers counts (by name: not imported).
PORT_MODULES = ("spec_parity.port.assistant", "spec_parity.port.compiled", "spec_parity.port.dflash", "spec_parity.port.dspark", "spec_parity.port.heads", "spec_parity.port.sampling",
                "spec_parity.port.serve", "spec_parity.port.targets", "spec_parity.port.fast.assistant", "spec_parity.port.fast.dflash", "spec_parity.port.fast.dspark",
                "spec_parity.port.fast.verify", "spec_parity.port.sources.assistant", "spec_parity.port.sources.dflash", "spec_parity.port.sources.dspark")


def prepare(ckpt: Checkpoints, torch: tuple[str | None, str], prompt: list[int]) -> Prep:
    """Load the target once (spec_parity.port.targets.load, through `serve_weights`) and prefill `prompt`
    (the context): its caches hold the donor K/V, its hidden states give the taps."""
    from mlx_lm.models.cache import make_prompt_cache

    from spec_parity.port import targets

    target = load_target(ckpt)
    caches = make_prompt_cache(target.model)
    trace = targets.forward(target, mx.array([prompt]), caches=caches)
    cfg = ckpt.drafter_config
    taps = row = None
    if ckpt.source != "assistant":
        ids = cfg.get("target_layer_ids") or cfg["dflash_config"]["target_layer_ids"]
        taps = mx.concatenate([trace.hidden[i + 1] for i in ids], axis=-1)
        row = taps[:, -1 - ckpt.case.shapes.gamma:, :] + 0  # a verify's worth of tap rows (own buffer)
    anchor_hidden = trace.final[:, -1:, :]
    anchor = int(mx.argmax(targets.head(target, anchor_hidden)[0, 0]).item())
    mx.eval(anchor_hidden, taps if taps is not None else anchor_hidden, row if row is not None else anchor_hidden,
            [[c.keys, c.values] for c in caches if getattr(c, "keys", None) is not None])
    del trace
    return Prep(ckpt, target, caches, taps, row, anchor, anchor_hidden, torch[0], torch[1])


def load_target(ckpt: Checkpoints):
    """The case's target (spec_parity.port.targets.load through `serve_weights`), its weights evaluated."""
    from spec_parity.port import targets

    with serve_weights(ckpt):
        target = targets.load(ckpt.target_dir)
    mx.eval(target.model.parameters())
    return target


def donor_kv(prep: Prep) -> dict[str, tuple[mx.array, mx.array]]:
    """The donor K/V an assistant step attends to, the sliding one cut to the target's window
    (spec_parity.port.targets.donor_view, spec_parity.port.assistant.sliding_view)."""
    from spec_parity.port import assistant, targets

    donors = targets.donor_view(prep.target, prep.caches)
    window = prep.ckpt.target_config["sliding_window"]
    return {"sliding_attention": assistant.sliding_view(*donors["sliding_attention"], window),
            "full_attention": donors["full_attention"]}


# ---- the port's sides ----------------------------------------------------------------------------

# The port's paths by side suffix: its drafter loader's options (port/fast/). The serve loop's
# verify follows the drafter (spec_parity.port.serve.generate's kv_bucket="auto": the drafter's kv_bucket).
# "" is the providers' default (port/sources/): the bucketed block for DSpark (on stacked projections;
# "unfused": without them) and DFlash, the compiled step for the assistant.
PATHS = {
    "": {"assistant": {}, "dspark": {"kv_bucket": "auto"}, "dflash": {"kv_bucket": "auto"}},
    "plain": {"dspark": {"kv_bucket": None}, "dflash": {"kv_bucket": None}},
    "bucketed": {"assistant": {"bucketed": True}},
    "unfused": {"dspark": {"kv_bucket": BUCKET, "fused": False}},
    "eager": {"dspark": {"kv_bucket": BUCKET, "compiled": False}, "dflash": {"kv_bucket": BUCKET, "compiled": False}},
    "bucketed-2seg": {"dspark": {"kv_bucket": BUCKET, "bucket_attention": "two-segment"},
                      "dflash": {"kv_bucket": BUCKET, "bucket_attention": "two-segment"}},
    "exact": {"dflash": {"kv_bucket": BUCKET, "bucket_attention": "exact"}},
    "sdpa": {"dspark": {"kv_bucket": BUCKET, "bucket_attention": "sdpa"},
             "dflash": {"kv_bucket": BUCKET, "bucket_attention": "sdpa"}},
    "kernel": {"dspark": {"kv_bucket": BUCKET, "bucket_attention": "kernel"},
               "dflash": {"kv_bucket": BUCKET, "bucket_attention": "kernel"}},
}


def path_name(path: str) -> str:
    return "port-" + path if path else "port"


def port_side(prep: Prep, path: str = "") -> Stepper:
    """Our port on one of its PATHS through the serve loop's seam: the source's `draft_device` (what
    the loop drafts with: the tokens stay on the device until the verify; and `commit` of one row).
    No host read in the step, as in the peers' steps: on MLX CUDA a host read of more than 8 bytes
    costs the next step 0.1-0.56 ms of unified-memory faults (measured on an H200)."""
    from spec_parity.port import serve

    options = PATHS[path][prep.source]
    drafter = load_port_drafter(prep.ckpt, **options)
    src = _source_class(prep.ckpt)(drafter, serve.TargetView(prep.target, prep.caches))
    tok, hid, g = prep.anchor, prep.anchor_hidden, prep.gamma
    notes = [f"{k}={v}" for k, v in options.items()] + resolved(drafter)
    if prep.source == "assistant":
        return Stepper(lambda: src.draft_device([tok], g, hid), keep=src, tokens=_host_list, notes=notes)
    src.prefill(list(range(prep.ctx)), [prep.taps])
    mx.eval(src.draft_device([tok], g, hid))

    def step():
        src.commit(g, 0, [prep.row])
        return src.draft_device([tok], g, hid)

    return Stepper(step, keep=src, tokens=_host_list, notes=notes)


def _host_list(tokens: mx.array) -> list[int]:
    return tokens.tolist()


# Ours, never a peer: the default path first; the others are selected with the peers (--peers).
SIDES = tuple(Side(path_name(path), tuple(by_source), partial(port_side, path=path), peer=False)
              for path, by_source in PATHS.items())


class PortProvider:
    """A `DraftProvider` over the port's in-memory drafter on one of its PATHS (the providers
    themselves read paths only through the port's loaders, which `serve_weights` feeds)."""

    trained_gamma = None
    weights_bytes = 0

    def __init__(self, ckpt: Checkpoints, path: str = ""):
        self.ckpt, self.id = ckpt, ckpt.case.name
        self.drafter = load_port_drafter(ckpt, **PATHS[path][ckpt.source])
        self.kv_bucket = getattr(self.drafter, "kv_bucket", None)

    def open(self, view):
        return _source_class(self.ckpt)(self.drafter, view)

    def dispose(self) -> None:
        self.drafter = None


def _source_class(ckpt: Checkpoints):
    from spec_parity.port.sources import assistant, dflash, dspark

    return {"assistant": assistant.AssistantSource, "dspark": dspark.DeepspecSource,
            "dflash": dflash.DflashSource}[ckpt.source]


def load_port_drafter(ckpt: Checkpoints, **options):
    from spec_parity.port import compiled
    from spec_parity.port.fast import assistant, dflash, dspark

    if options.get("bucket_attention") in compiled.BUCKET_ATTENTIONS:
        compiled.check_attention(options["bucket_attention"], Skip)  # the port's own refusal, as a Skip
    mod = {"assistant": assistant, "dspark": dspark, "dflash": dflash}[ckpt.source]
    with serve_weights(ckpt):
        return mod.load(ckpt.drafter_dir, **options)


def resolved(drafter) -> list[str]:
    """What the drafter's options resolved to here: its bucketed block's attention (the default
    takes the kernels on MLX CUDA with bf16 weights, port/compiled.py resolve_attention)."""
    attention = getattr(drafter, "bucket_attention", None)
    return [f"attention={attention}"] if attention else []


# ---- spec_parity.port.serve's seams, for the serve-loop figures ---------------------------------------------

def generate(target, prompt: list[int], max_tokens: int, provider, gamma: int, verify: str = "auto",
             pipeline: str = "auto"):
    """spec_parity.port.serve.generate at T=0 with EOS off, its verify's caches as the provider's path wants and
    its forward and loop as `verify` and `pipeline` say: (tokens, stats)."""
    from spec_parity.port import serve

    return serve.generate(target, prompt, max_tokens, provider,
                          serve.ServeOptions(gamma=gamma, eos=set(), verify=verify, pipeline=pipeline))


def verify_note(target, provider, verify: str = "auto") -> str:
    """The verify a loop of ours runs, in words (verify_words), as spec_parity.port.serve.resolve_verify resolves it."""
    from spec_parity.port import serve

    return verify_words(provider.kv_bucket, serve.resolve_verify(verify, target, provider.kv_bucket))


def verify_words(kv_bucket: int | None, verify: str | None) -> str:
    """A verify in words: its caches (kv_bucket or mlx-lm's) and, where known, its forward."""
    caches = f"kv_bucket={kv_bucket}" if kv_bucket else "mlx-lm caches"
    return f"verify {caches}" + (f", {verify}" if verify else "")


def observed(provider, around):
    """spec_parity.port.serve.Observed: `around(name, src, args, call)` wraps each call of the provider's sources."""
    from spec_parity.port import serve

    return serve.Observed(provider, around)


@contextlib.contextmanager
def wrapped_forward(wrap):
    """The loop's target forward (spec_parity.port.serve.target_forward: the prefill and every verify) is
    `wrap(forward)` meanwhile."""
    from spec_parity.port import serve

    with _wrapped(serve, "target_forward", wrap):
        yield


@contextlib.contextmanager
def wrapped_read_at_end(wrap):
    """spec_parity.port.serve.read_at_end (the request's one read of its tokens) is `wrap(read_at_end)` meanwhile."""
    from spec_parity.port import serve

    with _wrapped(serve, "read_at_end", wrap):
        yield


@contextlib.contextmanager
def _wrapped(owner, name: str, wrap):
    orig = getattr(owner, name)
    setattr(owner, name, wrap(orig))
    try:
        yield
    finally:
        setattr(owner, name, orig)

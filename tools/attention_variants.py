"""The DFlash block's attention, five layers' worth, in the forms the port and z-lab MLX use, timed
on one device: where the bucketed block's extra evaluation time goes.

    python3 tools/attention_variants.py          # Qwen3-4B DFlash shapes, bf16 (on MLX CUDA)
    python3 tools/attention_variants.py tiny     # tiny shapes: that the script runs (CPU)

"exact": the keys at the context's exact length, no mask, already in place (the port's plain
path: one attention plan per length on MLX CUDA). "z-lab": the context's exact rows joined to the
block's K/V per layer (a copy), no mask. "joined": the bucketed "sdpa" design's, the whole context
buffer joined to the block's K/V (a copy per layer) with the padded rows masked (float or bool),
and the join without a mask (what the copies cost alone). "in place": the "in-place" design's,
the block's K/V written into the donated buffer after the valid rows, every row past them masked.
Each median [p10, p90] of 200 calls after 20."""

import sys
import time

import mlx.core as mx

HQ, HK, D, L, S, BUF = (32, 8, 128, 16, 2048, 2304) if sys.argv[1:] != ["tiny"] else (4, 2, 16, 4, 40, 64)
LAYERS, DT, SCALE = 5, mx.bfloat16, D ** -0.5


def rand(*shape):
    return mx.random.normal(shape).astype(DT)


# per layer its own query and block K/V (mx.compile would merge identical layers into one)
qs, bks, bvs = ([rand(1, h, L, D) for _ in range(LAYERS)] for h in (HQ, HK, HK))
buf_k, buf_v = rand(1, HK, BUF, D), rand(1, HK, BUF, D)
exact_k = [mx.concatenate([buf_k[:, :, :S], bk], axis=2) for bk in bks]
exact_v = [mx.concatenate([buf_v[:, :, :S], bv], axis=2) for bv in bvs]
valid = mx.array(S, mx.int32)
mx.eval(qs, bks, bvs, buf_k, buf_v, exact_k, exact_v)


def exact():
    return [mx.fast.scaled_dot_product_attention(qs[i], exact_k[i], exact_v[i], scale=SCALE) for i in range(LAYERS)]


def zlab():
    out = []
    for i in range(LAYERS):
        keys = mx.concatenate([buf_k[:, :, :S], bks[i]], axis=2)
        values = mx.concatenate([buf_v[:, :, :S], bvs[i]], axis=2)
        out.append(mx.fast.scaled_dot_product_attention(qs[i], keys, values, scale=SCALE))
    return out


def joined(mask: str):
    def run():
        out = []
        for i in range(LAYERS):
            keys, values = mx.concatenate([buf_k, bks[i]], axis=2), mx.concatenate([buf_v, bvs[i]], axis=2)
            seen = mx.concatenate([mx.broadcast_to(mx.arange(BUF) < valid, (L, BUF)), mx.ones((L, L), mx.bool_)], -1)
            m = None if mask == "none" else seen if mask == "bool" else mx.where(seen, mx.array(0, DT),
                                                                                     mx.array(-mx.inf, DT))
            out.append(mx.fast.scaled_dot_product_attention(qs[i], keys, values, scale=SCALE, mask=m))
        return out
    return run


def in_place_layers(ks, vs, at):
    out = []
    seen = mx.arange(BUF) < at + L
    mask = mx.broadcast_to(mx.where(seen, mx.array(0, DT), mx.array(-mx.inf, DT)), (L, BUF))
    for i in range(LAYERS):
        ks[i] = mx.slice_update(ks[i], bks[i], at.reshape(1), axes=(2,))
        vs[i] = mx.slice_update(vs[i], bvs[i], at.reshape(1), axes=(2,))
        out.append(mx.fast.scaled_dot_product_attention(qs[i], ks[i], vs[i], scale=SCALE, mask=mask))
    return out, ks, vs


def in_place(fn):
    """fn over one buffer per layer, handed over each call (nothing else holds them: donated)."""
    bufs = [[rand(1, HK, BUF, D) for _ in range(LAYERS)], [rand(1, HK, BUF, D) for _ in range(LAYERS)]]

    def run():
        ks, vs = bufs
        bufs.clear()
        out, ks, vs = fn(ks, vs, valid)
        bufs.extend([ks, vs])
        return out + ks + vs
    return run


# the block rows after the context in a buffer of BUF rows (mlx-lm's cache: the keys a view of it)
ctx_k = [mx.slice_update(buf_k, bk, mx.array([S]), axes=(2,)) for bk in bks]
ctx_v = [mx.slice_update(buf_v, bv, mx.array([S]), axes=(2,)) for bv in bvs]
mx.eval(ctx_k, ctx_v)


def heads(view: bool, n: int = S):
    """The block rows folded into the query heads ([1, HQ * L, 1, D]) over n context rows + the
    block: the buffer's view (cuDNN's decode plan, one per buffer length) or a contiguous copy
    made beforehand (MLX's vector kernel)."""
    ks = [k[:, :, :n + L] for k in ctx_k] if view else [mx.contiguous(k[:, :, :n + L]) for k in ctx_k]
    vs = [v[:, :, :n + L] for v in ctx_v] if view else [mx.contiguous(v[:, :, :n + L]) for v in ctx_v]
    mx.eval(ks, vs)

    def run():
        return [mx.fast.scaled_dot_product_attention(qs[i].reshape(1, HQ * L, 1, D), ks[i], vs[i], scale=SCALE)
                for i in range(LAYERS)]
    return run


def cold(name: str, make, n: int = 6) -> None:
    """The first call at n new context lengths (what a serving round pays), median."""
    ts = []
    for r in range(n):
        fn = make(S - 1 - r)
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    print(f"{name:28s} cold {sorted(ts)[n // 2] * 1e3:.3f} ms  [min {min(ts) * 1e3:.3f} max {max(ts) * 1e3:.3f}]")


def exact_at(n: int):
    ks = [mx.contiguous(k[:, :, :n + L]) for k in ctx_k]
    vs = [mx.contiguous(v[:, :, :n + L]) for v in ctx_v]
    mx.eval(ks, vs)
    return lambda: [mx.fast.scaled_dot_product_attention(qs[i], ks[i], vs[i], scale=SCALE) for i in range(LAYERS)]


def timed(name: str, fn, n: int = 200) -> None:
    for _ in range(20):
        mx.eval(fn())
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"{name:28s} {ts[n // 2] * 1e3:.3f} ms  [p10 {ts[n // 10] * 1e3:.3f} p90 {ts[9 * n // 10] * 1e3:.3f}]")


VARIANTS = [("exact, no mask", exact), ("joined, float mask", joined("float")), ("joined, bool mask", joined("bool")),
            ("joined, no mask", joined("none")), ("joined float, compiled", mx.compile(joined("float"))),
            ("joined bool, compiled", mx.compile(joined("bool"))), ("exact, compiled", mx.compile(exact)),
            ("z-lab, compiled", mx.compile(zlab)), ("in place, compiled", in_place(mx.compile(in_place_layers))),
            ("in place, uncompiled", in_place(in_place_layers)), ("rows as heads, buffer view", heads(True)),
            ("rows as heads, contiguous", heads(False))]
for name, fn in VARIANTS + [(name + " (again)", fn) for name, fn in VARIANTS[:2]]:
    timed(name, fn)
cold("exact (block query)", exact_at)
cold("rows as heads, buffer view", lambda n: heads(True, n))
cold("rows as heads, contiguous", lambda n: heads(False, n))

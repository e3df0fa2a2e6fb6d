"""Negative controls of the serve loop (port/serve.py), caught by the assistant pair's loop cases
against optiq's spec_generate and by the loop tests."""

from __future__ import annotations

from . import control

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.compiled:VerifyCache.mask", "spec_parity.port.compiled:written",
    "spec_parity.port.fast.verify:BufferView.update_and_fetch", "spec_parity.port.fast.verify:forward_at",
    "spec_parity.port.serve:_content", "spec_parity.port.serve:_kept", "spec_parity.port.serve:_verdict", "spec_parity.port.serve:trim_caches",
    "spec_parity.port.sources:PipelinedRows.commit_pipelined",
)


@control("serve", "trim", "trim one too few")
def _trim(case):
    from spec_parity.port import serve

    trim = serve.trim_caches
    return {(serve, "trim_caches"): lambda caches, n: trim(caches, n - 1)}


@control("serve", "eos", "EOS emitted as content")
def _eos(case):
    from spec_parity.port import serve

    return {(serve, "_content"): lambda committed, eos: committed}


@control("serve", "bonus", "bonus token dropped on a full accept")
def _bonus(case):
    """A full accept commits the n drafts only: the last draft becomes the pending token (the
    greedy verdict's last-token field too)."""
    import mlx.core as mx

    from spec_parity.port import serve

    kept, verdict, shift = serve._kept, serve._verdict, 2 * serve._BITS

    def dropped(n, k):
        return k if n and k == n else kept(n, k)

    def verdict_dropped(drafts, greedy, eos):
        v, n = verdict(drafts, greedy, eos), drafts.shape[0]
        if not n:
            return v
        k = v & serve._FIELD
        last = mx.take(greedy, k - (k == n).astype(k.dtype))
        return (v & ((1 << shift) - 1)) + (last.astype(mx.int64) << shift)

    return {(serve, "_kept"): dropped, (serve, "_verdict"): verdict_dropped}


@control("serve", "verify_mask_off_by_one", "kv_bucket verify: the mask lets the first padded key through")
def _verify_mask(case):
    import mlx.core as mx

    from spec_parity.port import compiled

    mask = compiled.VerifyCache.mask

    def leaky(self, n, dtype, window=None):
        m = mask(self, n, dtype, window)
        return mx.where(mx.arange(m.shape[-1]) == self.offset + n, mx.array(0, m.dtype), m)

    return {(compiled.VerifyCache, "mask"): leaky}


@control("serve", "verify_window_off_by_one", "kv_bucket verify: the sliding layers' window one row too wide")
def _verify_window(case):
    from spec_parity.port import compiled

    mask = compiled.VerifyCache.mask

    def wide(self, n, dtype, window=None):
        return mask(self, n, dtype, None if window is None else window + 1)

    return {(compiled.VerifyCache, "mask"): wide}


@control("serve", "compiled_verify_write_off_by_one", "compiled verify: the rows written one before the offset")
def _compiled_verify_write(case):
    from spec_parity.port.fast import verify

    write = verify.BufferView.update_and_fetch

    def shifted(self, keys, values):   # one before, not past: a write past the buffer's end is not checked
        rows, self.rows = self.rows, self.rows - 1
        try:
            return write(self, keys, values)
        finally:
            self.rows = rows

    return {(verify.BufferView, "update_and_fetch"): shifted}


@control("serve", "pipelined_rows_shifted", "pipelined loop: the drafter's context rows one late")
def _pipelined_rows(case):
    """DFlash's and DSpark's pipelined commit (their shared PipelinedRows) keeps the verify's rows
    from the first draft's on (the pending token's row lost), the last repeated so that the shapes
    hold."""
    import mlx.core as mx

    from spec_parity.port.sources import PipelinedRows

    commit = PipelinedRows.commit_pipelined

    def shifted(self, tapped):
        commit(self, [mx.concatenate([t[:, 1:], t[:, -1:]], axis=1) for t in tapped])

    return {(PipelinedRows, "commit_pipelined"): shifted}


@control("serve", "pipelined_offset_behind", "pipelined loop: the verify writes one row before the offset")
def _pipelined_offset(case):
    from spec_parity.port.fast import verify

    forward_at = verify.forward_at
    return {(verify, "forward_at"): lambda target, ids, caches, offset, *rest: forward_at(target, ids, caches, offset - 1,
                                                                                          *rest)}


@control("serve", "dynamic_slice_writes", "K/V rows written with mx.slice_update at an array start (on MLX "
         "CUDA 0.32.4 launched over the whole buffer): spec_parity.port.compiled.written before the scatter")
def _dynamic_slice_writes(case):
    import mlx.core as mx

    from spec_parity.port import compiled

    def written(keys, values, k, v, rows):
        at = rows.reshape(-1)[:1]
        return mx.slice_update(keys, k, at, axes=(2,)), mx.slice_update(values, v, at, axes=(2,))

    return {(compiled, "written"): written}

"""Negative controls of the bench's step counters (spec_parity/bench/counters.py count_step): a draft step
that costs what the port avoids must show in them."""

from __future__ import annotations

from . import control

SEAMS = (   # the port names these controls swap (module:attribute), each held to the port by a test
    "spec_parity.port.dflash:Model.logits", "spec_parity.port.serve:read_at_end", "spec_parity.port.targets:block_ids",
)


@control("bench", "logits_gather", "a lone integer index ([0]) on the DFlash block's logits: one more Gather")
def _gather(case):
    from spec_parity.port import dflash

    logits = dflash.Model.logits
    return {(dflash.Model, "logits"): lambda self, target, h: logits(self, target, h)[None][0]}


@control("bench", "host_filled_block_ids", "a draft block's ids built as one host list: a host-filled buffer")
def _block_ids(case):
    """Built through spec_parity.port.targets' own `mx`, which the bench's HostBuffers watches."""
    from spec_parity.port import targets

    return {(targets, "block_ids"): lambda first, fill, n: targets.mx.array([[first] + [fill] * n])}


@control("bench", "serve_wrong_token", "the serve loop's last committed token replaced: a loop that is not lossless")
def _wrong_token(case):
    """What `bench --serve`'s stream check must catch (spec_parity/bench/loops.py stream_check)."""
    from spec_parity.port import serve

    read = serve.read_at_end

    def wrong(groups):
        out = read(groups)
        out[0][-1] = out[0][-1][:-1] + [out[0][-1][-1] ^ 1]
        return out
    return {(serve, "read_at_end"): wrong}

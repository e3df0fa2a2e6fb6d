"""The drafter ports behind the serve-loop seam (port/serve.py): one source (a request's draft
state) and one provider (a loaded drafter that opens sources) per drafter."""

import mlx.core as mx


def context_bytes(caches, pending) -> int:
    """Bytes of a block source's request: its context K/V (all draft layers) and queued tap rows."""
    kv = sum(c.nbytes for c in caches) if caches is not None else 0
    return kv + (pending.nbytes if pending is not None else 0)


class PipelinedRows:
    """A block source's state in the pipelined loop (port/serve.py `_pipelined`): the last
    verify's tap rows, all of them (`rows`), the committed length they join the context at (`at`,
    an int32 array) and the host's bound on it (`room`). Each source's draft_pipelined sets
    `at` and `room`."""

    rows = at = None
    room = 0

    def commit_pipelined(self, tapped) -> None:
        """`commit` with the accepted count on the device: every row of the verify is kept, and
        the next draft_pipelined counts those before its offset."""
        self.rows = mx.concatenate(tapped, axis=-1)

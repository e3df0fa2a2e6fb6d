"""The drafter ports behind the serve-loop seam (port/serve.py): one source (a request's draft
state) and one provider (a loaded drafter that opens sources) per drafter."""


def context_bytes(caches, pending) -> int:
    """Bytes of a block source's request: its context K/V (all draft layers) and queued tap rows."""
    kv = sum(c.nbytes for c in caches) if caches is not None else 0
    return kv + (pending.nbytes if pending is not None else 0)

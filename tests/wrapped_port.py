"""A third-party port as a user would write one (`--port dflash=tests.wrapped_port:make_port`):
our DFlash adapter under another name, so the harness treats it as not ours; `public_only`
returns only the protocol's required arrays (a port that exposes no internals)."""

from spec_parity import ports, protocol


def make_port() -> ports.Port:
    ours = ports.ours().runs["dflash"]
    return ports.Port("wrapped", "0.1", {"dflash": lambda req: ours(req)})


def public_only() -> ports.Port:
    ours = ports.ours().runs["dflash"]

    def run(req):
        p = protocol.get(req.module, req.kind)
        return {k: v for k, v in ours(req).items() if (q := p.quantity(k)) is not None and q.required}

    return ports.Port("public-only", "0.1", {"dflash": run})

"""A third-party port as a user would write one (`--port dflash=tests.wrapped_port:make_port`):
our DFlash adapter under another name, so the harness treats it as not ours."""

from spec_parity import ports


def make_port() -> ports.Port:
    ours = ports.ours().runs["dflash"]
    return ports.Port("wrapped", "0.1", {"dflash": lambda req: ours(req)})

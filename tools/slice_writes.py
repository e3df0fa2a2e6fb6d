"""spec-parity's CLI with the drafters' and the compiled verify's K/V writes as they were before
the scatter (port.compiled.written up to session 19: mx.slice_update at an array offset), for the
before / after of that change on one machine:

    python3 tools/slice_writes.py bench --sources dflash,dspark ... --out OUT

The runs it makes record the same tree and sources' digest as the plain CLI's: name them apart.
"""

import sys

import mlx.core as mx

from port import compiled


def slice_written(keys, values, k, v, at):
    """port.compiled.written before the scatter."""
    at = at.reshape(1)
    return mx.slice_update(keys, k, at, axes=(2,)), mx.slice_update(values, v, at, axes=(2,))


if __name__ == "__main__":
    compiled.written = slice_written
    from spec_parity import cli
    sys.exit(cli.main(sys.argv[1:]))

"""spec-parity's CLI with the drafters' and the compiled verify's K/V writes as they were before
the scatter (spec_parity.port.compiled.written before the scatter: mx.slice_update at an array offset, the
control "serve" / "dynamic_slice_writes"), for the before / after of that change on one machine:

    python3 tools/slice_writes.py bench --sources dflash,dspark ... --out OUT

The runs it makes record the same tree and sources' digest as the plain CLI's; their `process`
field names this wrapper (name the files apart too).
"""

import sys

from spec_parity import cli, controls

if __name__ == "__main__":
    with controls.planted("serve", "dynamic_slice_writes"):
        status = cli.main(sys.argv[1:])
    sys.exit(status)

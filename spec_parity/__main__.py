"""`python -m spec_parity ...`: the `spec-parity` command, where no script is on PATH."""

import sys

from .cli import main

sys.exit(main())

"""Where the shipped fixtures lie: a leaf both the goldens and the checkpoint factory read."""

from __future__ import annotations

from pathlib import Path


def shipped() -> Path:
    """fixtures/ as it ships: package data beside this file when installed, the repository's top
    folder in a checkout."""
    here = Path(__file__).resolve().parent
    return here / "fixtures" if (here / "fixtures").is_dir() else here.parent / "fixtures"

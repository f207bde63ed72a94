"""`vlmserve preflight` (placeholder until it lands)."""

from __future__ import annotations

import typer


def command() -> None:
    """Not built yet."""
    raise typer.Exit(2)

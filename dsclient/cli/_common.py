"""What the subcommands share: how the CLI reports an error."""

from __future__ import annotations

import sys

__all__ = ["err"]


def err(message: str) -> None:
    """Print ``message`` to stderr (the CLI's own output, so print, not log)."""
    print(message, file=sys.stderr, flush=True)

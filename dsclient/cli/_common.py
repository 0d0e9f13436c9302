"""What the subcommands share: how the CLI reports an error, and how it is told the server."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["URL_ENV", "add_url", "err", "given_url"]

#: Where the server's URL comes from when none is given (``dsclient map`` takes a list).
URL_ENV = "DSCLIENT_URL"


def err(message: str) -> None:
    """Print ``message`` to stderr (the CLI's own output, so print, not log)."""
    print(message, file=sys.stderr, flush=True)


def add_url(parser: argparse.ArgumentParser) -> None:
    """The server's URL: a positional ``URL``, or ``--url URL`` as ``dsclient map`` takes it,
    or ``$DSCLIENT_URL`` (its first, where it names several)."""
    parser.add_argument(
        "url",
        nargs="?",
        help=f"the server's URL, with or without /v1 (or --url URL; default: ${URL_ENV})",
    )
    parser.add_argument("--url", dest="url_option", metavar="URL", help=argparse.SUPPRESS)


def given_url(args: argparse.Namespace) -> str:
    """The URL :func:`add_url` was given: the positional one, else ``--url``, else the
    environment's.

    Raises:
        ValueError: none was given, or two different ones.
    """
    if args.url and args.url_option and args.url != args.url_option:
        raise ValueError(f"two URLs given: {args.url} and --url {args.url_option}")
    found = args.url or args.url_option or os.environ.get(URL_ENV, "").split(",")[0].strip()
    if not found:
        raise ValueError(f"no server: pass its URL or set {URL_ENV}")
    return str(found)

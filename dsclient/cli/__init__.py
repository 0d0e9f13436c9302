"""The ``dsclient`` command line: one module per subcommand.

==============================  ===========================================================
``dsclient serve``              :mod:`dsclient.cli.serve`
``dsclient make-tiny-model``    :mod:`dsclient.cli.tiny_model`
``dsclient install-server``     :mod:`dsclient.cli.install_server`
``dsclient probe``              :mod:`dsclient.cli.probe`
``dsclient map``                :mod:`dsclient.cli.map` (also ``python -m dsclient.cli.map``)
``dsclient bench``              :mod:`dsclient.cli.bench` (policy, workload, runner, report,
                                plot; also ``python -m dsclient.cli.bench``)
==============================  ===========================================================

Each subcommand module has one ``_add_<name>(subparsers)`` (or ``add_<name>_parser``) function
that sets ``func`` (taking the parsed args, returning the exit status); add a new one to
``_COMMANDS``. Output here is the CLI's own, so it prints; progress goes to stderr, results to
stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from .._exceptions import DSClientError
from .._version import __version__
from ._common import err as _err
from .install_server import _add_install_server, _install_server
from .probe import _add_probe
from .serve import _add_serve, _serve
from .tiny_model import _add_make_tiny_model, _make_tiny_model

__all__ = ["LogFormat", "build_parser", "main"]


class LogFormat(logging.Formatter):
    """``LEVEL logger: message`` on stderr, the logger's name left out where the message
    already starts with it: dsclient's own lines say ``dsclient: ...`` so that they read alone
    in any handler, and ``WARNING dsclient: dsclient: ...`` said it twice."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        root = record.name.partition(".")[0]
        if record.message.startswith(f"{root}: "):
            return f"{record.levelname} {record.message}"
        return super().formatMessage(record)


def _add_map(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .map import add_map_parser

    add_map_parser(sub)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .bench import add_bench_parser

    add_bench_parser(sub)


_COMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    _add_serve,
    _add_make_tiny_model,
    _add_install_server,
    _add_probe,
    _add_map,
    _add_bench,
)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``dsclient`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="dsclient",
        description="dsclient: an async SDK for self-hosted LLM servers, and its tools.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    parser.add_argument("-V", "--version", action="version", version=f"dsclient {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_list:  # everything after '--' goes to vLLM untouched
        cut = args_list.index("--")
        args_list, extra = args_list[:cut], args_list[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(args_list)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    if extra and args.func is not _serve:
        parser.error("arguments after '--' are only for 'serve'")
    args.extra_args = extra
    handler = logging.StreamHandler()
    handler.setFormatter(LogFormat())
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    if args.func in (_install_server, _make_tiny_model) and not args.verbose:
        logging.getLogger("dsclient").setLevel(logging.INFO)  # these narrate their steps
    try:
        code: int = args.func(args)
    except (DSClientError, ValueError) as exc:
        _err(f"dsclient: error: {exc}")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())

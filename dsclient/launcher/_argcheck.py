"""Ask the installed vLLM's own argument parser about a planned command line, before starting it.

dsclient checks the flags it sets itself; flags passed through after ``--`` only vLLM knows. So
the server venv's Python runs :data:`CHECK_SCRIPT` once on the planned arguments: it builds
vLLM's parser the way ``python -m vllm.entrypoints.openai.api_server`` does (in 0.32.0:
``vllm.entrypoints.launchers.cli_args.make_arg_parser`` on a
``vllm.utils.argparse_utils.FlexibleArgumentParser``, then ``validate_parsed_serve_args``),
parses, and prints one marked JSON line that :func:`read_check_output` turns into a
:class:`FlagCheck`. Importing vLLM imports torch, about 10 to 25 s on the 2-core reference
machine, so verdicts are cached per (python, arguments, the variables the plan sets).

Example::

    check = check_vllm_flags("/venv/bin/python", ["--model", "/m/tiny", "--enable-flash-attn"])
    check.verdict   # "refused"
    check.message   # "vllm serve: error: unrecognized arguments: --enable-flash-attn"
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CHECK_SCRIPT",
    "FlagCheck",
    "check_command",
    "check_vllm_flags",
    "clear_cache",
    "read_check_output",
    "vllm_arguments",
]

#: The module dsclient starts vLLM with; what follows it in the argv is vLLM's.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: How the check names the program in vLLM's messages ("vllm serve: error: ...").
PROG = "vllm serve"
_MARK = "DSCLIENT-VLLM-FLAGS "
_DEFAULT_TIMEOUT = 180.0  # importing vLLM took up to 26 s on a loaded 2-core machine

#: Run by the server venv's Python as ``python -c CHECK_SCRIPT OWN_COUNT OWNED_DESTS ARG...``:
#: ``OWN_COUNT`` leading arguments are dsclient's own, ``OWNED_DESTS`` a JSON list of the
#: parser destinations dsclient sets. Reports ``overridden``: owned destinations whose value the
#: rest of the arguments changed (an abbreviation, an alias, underscores, ``--config``).
CHECK_SCRIPT = r"""
import contextlib, importlib, io, json, sys

MARK = "DSCLIENT-VLLM-FLAGS "
PROG = "vllm serve"
own_count, owned, args = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]


def report(**fields):
    print(MARK + json.dumps(fields), flush=True)
    sys.exit(0)


def find(candidates):
    failures = []
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name), module
        except Exception as exc:  # ImportError, or whatever importing vLLM raised
            failures.append(f"{module}.{name}: {type(exc).__name__}: {exc}")
    report(status="unavailable", detail="; ".join(failures))


# vLLM 0.32 keeps them here; older releases in vllm.utils and vllm.entrypoints.openai.cli_args.
parser_class, _ = find([("vllm.utils.argparse_utils", "FlexibleArgumentParser"),
                        ("vllm.utils", "FlexibleArgumentParser")])
make_arg_parser, where = find([("vllm.entrypoints.launchers.cli_args", "make_arg_parser"),
                               ("vllm.entrypoints.openai.cli_args", "make_arg_parser")])
validate = getattr(sys.modules[where], "validate_parsed_serve_args", None)
entry = f"{where}.make_arg_parser"


def build():
    parser = make_arg_parser(parser_class(prog=PROG))
    parser.print_usage = lambda file=None: None  # the error line, not 400 lines of usage
    return parser


try:
    parser = build()
except Exception as exc:
    report(status="unavailable", detail=f"{entry} failed: {type(exc).__name__}: {exc}")

said = io.StringIO()
try:
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        namespace = parser.parse_args(args)
        if validate is not None:
            validate(namespace)
except SystemExit as exc:
    report(status="exit", code=exc.code if isinstance(exc.code, int) else 1,
           output=said.getvalue()[-4000:], entry=entry)
except Exception as exc:
    report(status="refused", message=f"{type(exc).__name__}: {exc}", entry=entry)

overridden = []
if own_count < len(args):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        base = build().parse_args(args[:own_count])
    overridden = [d for d in owned if getattr(namespace, d, None) != getattr(base, d, None)]
report(status="accepted", entry=entry, overridden=overridden)
"""


@dataclass(frozen=True, kw_only=True)
class FlagCheck:
    """What vLLM's own argument parser said about a planned command line.

    ``verdict`` is ``"accepted"``, ``"refused"`` (``message`` holds vLLM's own error text) or
    ``"unchecked"`` (the check could not run; ``message`` says why). ``parser`` names vLLM's
    parser entry point when it was found; ``overridden`` lists the settings dsclient makes
    itself (``host``, ``port``, ...) that the extra flags changed anyway.
    """

    verdict: Literal["accepted", "refused", "unchecked"]
    message: str = ""
    parser: str | None = None
    overridden: tuple[str, ...] = ()


def vllm_arguments(argv: Sequence[str]) -> list[str]:
    """The part of a planned argv that vLLM parses: what follows ``-m <server module>``."""
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == SERVER_MODULE:
            return list(argv[i + 2 :])
    raise ValueError(f"not a vLLM server command (no '-m {SERVER_MODULE}'): {list(argv)!r}")


def check_command(
    python: str, args: Sequence[str], *, own_count: int, owned: Sequence[str]
) -> list[str]:
    """The argv that runs :data:`CHECK_SCRIPT` with ``python`` on vLLM arguments ``args``.

    ``own_count``: how many leading ``args`` dsclient set itself; ``owned``: the parser
    destinations (``"host"``, ``"max_num_seqs"``, ...) the rest must not change.
    """
    if not 0 <= own_count <= len(args):
        raise ValueError(f"own_count must be in 0..{len(args)}, got {own_count!r}")
    return [python, "-c", CHECK_SCRIPT, str(own_count), json.dumps(list(owned)), *args]


def read_check_output(returncode: int, stdout: str, stderr: str) -> FlagCheck:
    """Turn what :data:`CHECK_SCRIPT` printed into a :class:`FlagCheck` (pure)."""
    report: dict[str, Any] | None = None
    for line in reversed(stdout.splitlines()):
        if line.startswith(_MARK):
            try:
                loaded = json.loads(line[len(_MARK) :])
            except ValueError:
                break
            report = loaded if isinstance(loaded, dict) else None
            break
    if report is None:
        tail = (stderr.strip().splitlines() or stdout.strip().splitlines() or [""])[-1]
        detail = f": {tail[:300]}" if tail else ""
        return FlagCheck(
            verdict="unchecked",
            message=f"the check exited with status {returncode} without a verdict{detail}",
        )
    status = report.get("status")
    entry = report.get("entry") if isinstance(report.get("entry"), str) else None
    if status == "accepted":
        overridden = report.get("overridden") or []
        return FlagCheck(
            verdict="accepted", parser=entry, overridden=tuple(str(d) for d in overridden)
        )
    if status == "refused":
        return FlagCheck(verdict="refused", message=str(report.get("message", "")), parser=entry)
    if status == "exit":
        return FlagCheck(
            verdict="refused",
            message=_exit_message(int(report.get("code", 1)), str(report.get("output", ""))),
            parser=entry,
        )
    detail = str(report.get("detail") or report)
    return FlagCheck(verdict="unchecked", message=f"vLLM's parser was not found: {detail}")


def _exit_message(code: int, output: str) -> str:
    """The parser exited: ``prog: error: ...`` (and any hint after it), or what made it exit."""
    lines = output.strip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{PROG}: error:"):
            return "\n".join(lines[i:]).strip()
    if code == 0:  # --help, --version: vLLM would print and exit instead of serving
        return "these flags make vLLM print something and exit (status 0) instead of serving"
    return (lines[-1] if lines else f"vLLM's parser exited with status {code}").strip()


Runner = Callable[..., "subprocess.CompletedProcess[str]"]

_Key = tuple[str, tuple[str, ...], int, tuple[str, ...], tuple[tuple[str, str], ...]]
_CACHE: dict[_Key, FlagCheck] = {}
_CACHE_LOCK = threading.Lock()


def check_vllm_flags(
    python: str,
    args: Sequence[str],
    *,
    own_count: int | None = None,
    owned: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = _DEFAULT_TIMEOUT,
    run: Runner = subprocess.run,
) -> FlagCheck:
    """Run vLLM's own parser (in ``python``) on ``args``; cached per python, args and ``env``.

    Example::

        check_vllm_flags(py, ["--model", "m", "--max-num-seqs", "x"]).message
        # "vllm serve: error: argument --max-num-seqs: invalid int value: 'x'"

    Parameters:
        python: the server venv's interpreter.
        args: vLLM's arguments (see :func:`vllm_arguments`).
        own_count: how many leading ``args`` dsclient set (default: all of them).
        owned: parser destinations the arguments after ``own_count`` must not change.
        env: variables set on top of this process's environment, as the server gets them
            (vLLM reads some defaults from them): the plan's ``env``.
        timeout: seconds before giving up; the verdict is then ``"unchecked"``.
        run: ``subprocess.run`` or a stand-in (tests).

    Only ``"accepted"`` and ``"refused"`` are cached: a check that could not run (timeout on a
    busy machine, no vLLM) is tried again next time.
    """
    count = len(args) if own_count is None else own_count
    key: _Key = (
        python,
        tuple(args),
        count,
        tuple(owned),
        tuple(sorted(env.items())) if env is not None else (),
    )
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    argv = check_command(python, args, own_count=count, owned=owned)
    try:
        done = run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return FlagCheck(
            verdict="unchecked", message=f"{python} took more than {timeout:.0f} s to import vLLM"
        )
    except OSError as exc:
        return FlagCheck(verdict="unchecked", message=f"could not run {python}: {exc}")
    result = read_check_output(done.returncode, done.stdout or "", done.stderr or "")
    if result.verdict != "unchecked":
        with _CACHE_LOCK:
            _CACHE[key] = result
    return result


def clear_cache() -> None:
    """Forget every cached verdict (after reinstalling vLLM in the same venv, or in tests)."""
    with _CACHE_LOCK:
        _CACHE.clear()

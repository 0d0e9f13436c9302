"""``dsclient map``: run a JSONL file of requests through map(), writing OpenAI batch output.

    dsclient map requests.jsonl -o results.jsonl --url http://127.0.0.1:8000 --max-tokens 64
    dsclient map requests.jsonl -o results.jsonl --resume      # after a crash or Ctrl-C

Input lines are OpenAI batch requests or plain request dicts::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}}
    {"prompt": "Once upon a time", "id": "r2", "temperature": 0.7}

Output lines follow OpenAI's batch output::

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}, "error": null}
    {"id": "batch_req_...", "custom_id": "r3", "response": null,
     "error": {"code": "timeout_error", "message": "call did not finish within ..."}}

(a refused request keeps its HTTP status and body in ``response``). Lines without an id get
``custom_id`` ``"<index>-<hash>"`` (see :mod:`dsclient.batch._jsonl`); an unreadable line gets
``"line-<n>"``, is reported on stderr with its line number and written as a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import anyio
from anyio.abc import TaskGroup

from .._exceptions import DSClientError, RequestRefused, parse_json
from .._http import httpx
from .._models import ChatResult, CompletionResult, Failure, Result, Usage
from ..batch._batch import InvalidItem, Outcome, _Options, _run_direct
from ..batch._jsonl import JsonlStore, derive_id, explicit_id
from ..batch._progress import wanted
from ..client._client import USE_DEFAULT, AsyncClient
from ._common import URL_ENV

__all__ = [
    "BATCH_RECORDS",
    "BatchRecords",
    "add_map_parser",
    "main",
    "read_requests",
    "resume_command",
    "run",
]

_ENDPOINTS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


# -- output: OpenAI's batch-output line shape ---------------------------------------------------
def error_code(error: BaseException) -> str:
    """``ContextOverflow`` -> ``"context_overflow"``; bad input -> ``"invalid_request"``."""
    if isinstance(error, (ValueError, TypeError)):
        return "invalid_request"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(error).__name__).lower()


class BatchRecords:
    """OpenAI's batch-output shape; ``custom_id`` is the item id resume matches on."""

    def encode(self, index: int, item_id: str, outcome: Result | Failure) -> dict[str, Any]:
        line_id = f"batch_req_{uuid.uuid4().hex}"
        if isinstance(outcome, Failure):
            error = outcome.error
            response = None
            if isinstance(error, RequestRefused):
                try:
                    body: Any = parse_json(error.body)
                except ValueError:
                    body = error.body
                response = {"status_code": error.status, "request_id": "", "body": body}
            return {
                "id": line_id,
                "custom_id": item_id,
                "response": response,
                "error": {"code": error_code(error), "message": str(error)},
            }
        raw = outcome._raw_data
        return {
            "id": line_id,
            "custom_id": item_id,
            "response": {"status_code": 200, "request_id": raw.get("id") or "", "body": raw},
            "error": None,
        }

    def identify(self, record: Mapping[str, Any]) -> tuple[str, bool] | None:
        cid = record.get("custom_id")
        if not isinstance(cid, str) or "error" not in record:
            return None
        response = record.get("response")
        ok = (
            record.get("error") is None
            and isinstance(response, dict)
            and response.get("status_code") == 200
            and _is_result_body(response.get("body"))
        )
        return cid, ok

    def rebuild(self, record: Mapping[str, Any], index: int) -> Result:
        body = record["response"]["body"]  # identify() checked its shape
        choice = body["choices"][0]
        chat = "message" in choice
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        finish = choice.get("finish_reason")
        cls = ChatResult if chat else CompletionResult
        return cls._rebuilt(
            body,
            text=(choice["message"].get("content") or "") if chat else choice["text"],
            finish_reason=finish if isinstance(finish, str) else None,
            usage=Usage(
                prompt_tokens=_count(usage.get("prompt_tokens")),
                completion_tokens=_count(usage.get("completion_tokens")),
            ),
            latency_s=0.0,  # not in OpenAI's shape
            index=index,
        )


BATCH_RECORDS = BatchRecords()


def _is_result_body(body: Any) -> bool:
    """Whether a stored answer has the text rebuild() needs (else the item is run again)."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    if "message" in choice:
        message = choice["message"]
        return isinstance(message, dict) and isinstance(message.get("content") or "", str)
    return isinstance(choice.get("text"), str)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


# -- input ---------------------------------------------------------------------------------------
def request_of(obj: Any, *, drop_model: bool) -> dict[str, Any]:
    """The map() request dict for one parsed input line (batch request or plain dict)."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    if "body" in obj or "url" in obj:
        method = obj.get("method", "POST")
        if method != "POST":
            raise ValueError(f"method must be POST, got {method!r}")
        url = obj.get("url")
        if url not in _ENDPOINTS:
            raise ValueError(f"url must be one of {sorted(_ENDPOINTS)}, got {url!r}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise TypeError(f"body must be a JSON object, got {type(body).__name__}")
        field = _ENDPOINTS[url]
        if field not in body:
            raise ValueError(f"a {url} body needs {field!r}")
        request = dict(body)
        request.pop("prompt" if field == "messages" else "messages", None)
        if obj.get("custom_id") is not None:
            request["custom_id"] = obj["custom_id"]
    else:
        if ("prompt" in obj) == ("messages" in obj):
            raise ValueError(
                "expected an OpenAI batch request (custom_id, method, url, body) or a dict with "
                f"exactly one of 'prompt' or 'messages', got keys {sorted(obj)}"
            )
        request = dict(obj)
    if request.get("stream"):
        raise ValueError("stream is not supported in a batch")
    request.pop("stream", None)
    request.pop("stream_options", None)
    if "max_completion_tokens" in request and "max_tokens" not in request:
        request["max_tokens"] = request.pop("max_completion_tokens")
    if drop_model:
        request.pop("model", None)
    return request


def read_requests(
    f: IO[str], *, drop_model: bool, report: Callable[[str], None], name: str = "input"
) -> Iterator[dict[str, Any] | InvalidItem]:
    """Lazily turn the lines of ``f`` into request dicts; bad lines into :class:`InvalidItem`.

    Blank lines are skipped. Every item gets an explicit ``custom_id`` so that the output and a
    resume agree on it.
    """
    index = 0
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            obj = parse_json(line)
        except ValueError as exc:
            error: Exception = ValueError(f"{name} line {lineno}: not valid JSON ({exc})")
            report(str(error))
            yield InvalidItem(error, id=f"line-{lineno}")
            index += 1
            continue
        own = explicit_id(obj)
        rid = own if own is not None else derive_id(obj, index)
        try:
            request = request_of(obj, drop_model=drop_model)
        except (ValueError, TypeError) as exc:
            error = type(exc)(f"{name} line {lineno}: {exc}")
            report(str(error))
            yield InvalidItem(error, id=rid)
        else:
            request.pop("id", None)
            request["custom_id"] = rid
            yield request
        index += 1


_DESCRIPTION = textwrap.fill(
    'Run every line of INPUT (OpenAI batch requests, or {"prompt": ...} / {"messages": ...}'
    " objects) through the server under dsclient's concurrency governor, appending one OpenAI"
    " batch-output line per item to OUTPUT as it finishes. After a crash or Ctrl-C, --resume"
    " skips what succeeded and retries what failed.",
    width=78,
)
_EPILOG = (
    "examples:\n"
    "  dsclient map requests.jsonl -o results.jsonl --url http://127.0.0.1:8000\n"
    "  dsclient map requests.jsonl -o results.jsonl --resume --max-tokens 64\n"
    "exit status: 0 all succeeded, 1 some failed, 2 usage error, 130 interrupted (Ctrl-C;\n"
    "  it prints the command that resumes)"
)


# -- the command -----------------------------------------------------------------------------------
def add_map_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``map`` to an ``argparse`` subparsers object; sets ``func=run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "map",
        help="run a JSONL file of requests (OpenAI batch format or plain prompts)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="requests, one JSON object per line")
    parser.add_argument("-o", "--output", required=True, help="results, one JSON line per item")
    parser.add_argument(
        "--url",
        action="append",
        default=None,
        help="the server's URL; repeat it for several servers, each request then goes to one "
        "of them (default: $DSCLIENT_URL, comma-separated for several)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue OUTPUT: skip items that succeeded, retry those that failed",
    )
    parser.add_argument("--model", default=None, help="the model for every line (overrides theirs)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="max_tokens for lines that give none"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--order",
        choices=("shape", "input"),
        default="shape",
        help="start order: 'shape' (default) starts lines that share a prompt prefix together "
        "and the longest first, within a window of 1024 lines; 'input' starts them as read "
        "(custom_id and resume do not depend on it)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        metavar="SECONDS",
        help="each request's whole time, waiting for a slot and retries included; 'none' for no "
        "bound (default 600, as AsyncClient's timeout=)",
    )
    parser.add_argument(
        "--outage-wait",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="how long requests wait for a server that stopped answering; 'none' for as long "
        "as --timeout allows. A server that has not answered since the start is given 5 s of "
        "it (a typo'd URL fails fast); 'none' waits for one that is still starting "
        "(default 300, as AsyncClient's outage_wait=)",
    )


def _seconds(text: str) -> float | None:
    """A ``--timeout`` / ``--outage-wait`` value: positive seconds, or ``none``."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'none', got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or 'none', got {text!r}")
    return value


def resume_command(args: argparse.Namespace) -> str:
    """The ``dsclient map`` command line that resumes the run ``args`` describe.

    resume_command(args)  # "dsclient map in.jsonl -o out.jsonl --url http://h:8000 --resume"
    """
    words = ["dsclient", "map", args.input, "-o", args.output]
    for url in args.url or ():
        words += ["--url", url]
    if args.model is not None:
        words += ["--model", args.model]
    if args.max_tokens is not None:
        words += ["--max-tokens", str(args.max_tokens)]
    if args.order != "shape":
        words += ["--order", args.order]
    for flag, value, default in (
        ("--timeout", args.timeout, 600.0),
        ("--outage-wait", args.outage_wait, 300.0),
    ):
        if value != default:
            words += [flag, "none" if value is None else f"{value:g}"]
    if args.no_progress:
        words.append("--no-progress")
    words.append("--resume")
    return shlex.join(words)


def _count_lines(path: str) -> int | None:
    """Non-blank lines of the input, for the progress bar's total (``None``: not a file)."""
    try:
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return None


class _Tally:
    """What a run has done so far: read by the line an interrupted run prints."""

    def __init__(self) -> None:
        self.total = self.failed = self.resumed = 0
        #: The first failure of this run, in words: the summary line names it.
        self.first_error: str | None = None


def run(
    args: argparse.Namespace,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``dsclient map``; 0 if every item succeeded, 1 if some failed, 2 on a usage error."""
    err = stderr if stderr is not None else sys.stderr

    def report(message: str) -> None:
        print(f"dsclient map: {message}", file=err, flush=True)

    given = args.url or os.environ.get(URL_ENV, "").split(",")
    urls = [u.strip() for u in given if u.strip()]
    if not urls:
        report(f"no server: pass --url or set {URL_ENV}")
        return 2
    url: str | list[str] = urls[0] if len(urls) == 1 else urls
    if args.max_tokens is not None and args.max_tokens < 1:
        report(f"--max-tokens must be >= 1, got {args.max_tokens}")
        return 2
    store = JsonlStore(args.output, fmt=BATCH_RECORDS)
    try:
        f = open(args.input, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        report(f"cannot read {args.input}: {exc.strerror}")
        return 2
    tally = _Tally()
    try:
        with f:
            requests = read_requests(
                f, drop_model=args.model is not None, report=report, name=args.input
            )
            elapsed = anyio.run(_run, url, args, requests, store, transport, tally)
    except KeyboardInterrupt:
        # Ctrl-C is how a long run is paused (see --resume): one line, not a traceback.
        written = tally.total - tally.resumed
        report(
            f"interrupted: {written} item{'s' if written != 1 else ''} written to "
            f"{args.output}; resume with: {resume_command(args)}"
        )
        return 130
    except FileExistsError as exc:
        report(str(exc).replace("resume=True", "--resume"))
        return 2
    except (DSClientError, OSError) as exc:
        report(f"stopped: {type(exc).__name__}: {exc}")
        return 1
    total, failed, resumed = tally.total, tally.failed, tally.resumed
    report(
        f"{total} items, {total - failed} ok, {failed} failed"
        f"{f' ({resumed} from an earlier run)' if resumed else ''} in {elapsed:.1f} s "
        f"-> {args.output}"
    )
    if tally.first_error is not None:
        report(f"first failure: {tally.first_error}")
    return 1 if failed else 0


async def _run(
    url: str | list[str],
    args: argparse.Namespace,
    requests: Iterator[dict[str, Any] | InvalidItem],
    store: JsonlStore,
    transport: httpx.AsyncBaseTransport | None,
    tally: _Tally,
) -> float:
    start = time.perf_counter()

    def count(_index: int, outcome: Outcome, from_file: bool) -> None:
        tally.total += 1
        tally.failed += isinstance(outcome, Failure)
        tally.resumed += from_file
        if isinstance(outcome, Failure) and tally.first_error is None and not from_file:
            tally.first_error = f"{type(outcome.error).__name__}: {outcome.error}"

    progress: bool | dict[str, Any] | None = False if args.no_progress else None
    if progress is None and wanted(None):
        lines = _count_lines(args.input)  # a file's length is known: the bar gets a total
        progress = {"total": lines} if lines is not None else None
    async with AsyncClient(
        url,
        model=args.model,
        transport=transport,
        timeout=args.timeout,
        outage_wait=args.outage_wait,
    ) as client:
        options = _Options(
            on_error="return",
            progress=progress,
            output=store,
            resume=args.resume,
            max_tokens=args.max_tokens,
            urgency=0,
            group=None,
            timeout=USE_DEFAULT,
            sampling={},
            order=args.order,
        )
        # The batch runner's direct entry (no consumer task): the client's caller and planner.
        run = anyio.CancelScope()
        error: Exception | None = None
        async with anyio.create_task_group() as group:
            interrupted = _on_ctrl_c(group, run)
            try:
                with run:
                    await _run_direct(
                        client, client._caller, client._planner, requests, count, options
                    )
            except Exception as exc:  # raised past the group as it is, not in a group
                error = exc
            group.cancel_scope.cancel()  # done: stop listening for Ctrl-C
    if error is not None:
        raise error
    if interrupted.is_set():
        raise KeyboardInterrupt
    return time.perf_counter() - start


def _on_ctrl_c(group: TaskGroup, run: anyio.CancelScope) -> threading.Event:
    """Ctrl-C (SIGINT) cancels ``run``; the event it returns is set if that happened.

    asyncio's own handler cancels the main task and leaves the rest to the code it cancels; in
    one CI run the process outlived its Ctrl-C by more than a minute (its calls were taking 30 s
    each; not seen again here). A scope of the run's own, cancelled by the signal, ends the run
    for certain. Where no handler can be set (not the main thread), Ctrl-C works as Python's
    default.
    """
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return interrupted

    async def listen() -> None:
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                interrupted.set()
                run.cancel()
                return

    group.start_soon(listen)
    return interrupted


def main(argv: list[str] | None = None) -> int:
    """``python -m dsclient.cli.map INPUT -o OUTPUT ...``: the command on its own."""
    parser = argparse.ArgumentParser(
        prog="dsclient map",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

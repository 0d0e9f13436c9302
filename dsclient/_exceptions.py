"""The exceptions dsclient raises, and the one place where lower-layer errors are translated.

Exception tree::

    DSClientError
    ├── TransportError            the request never got a complete answer
    │   ├── TimeoutError          the call's time ran out (waiting for a slot included)
    │   │                         (also a builtin ``TimeoutError``)
    │   └── ConnectionError       connecting failed, or the connection dropped mid-body
    │                             (also a builtin ``ConnectionError``, hence an ``OSError``)
    └── ServerError               the server answered, but not with a usable result
        ├── RequestRefused        an error status (``status``, ``body`` kept); itself: a 4xx,
        │   │                     the server refused this request
        │   ├── Overloaded        429 / 503, or the client's own queue bound is full
        │   ├── ContextOverflow   prompt + max_tokens cannot fit the model's context
        │   └── ServerFault       any other 5xx: the server failed on the request (retried)
        └── MalformedResponse     a 2xx whose body is not what the API promises
            └── ResponseTooLarge  a body (or one stream event) over the client's byte cap

``except TimeoutError`` and ``except ConnectionError`` (the builtins, or ``OSError``) catch
dsclient's own, as they catch asyncio's and aiohttp's: code written for any other client keeps
working. ``except RequestRefused`` catches every error status; ``ServerFault`` says the status
was the server's failure (a 500, a 502 from a gateway), not a refusal of what was asked.

``ContextOverflow`` is also raised *before* sending when dsclient can tell the prompt cannot fit.
Programmer mistakes (bad arguments) stay ``ValueError`` / ``TypeError``.

Nothing a server sends can raise anything else: JSON nested past the decoder's recursion limit,
numbers with more digits than ``int()`` converts, a ``charset`` no decoder takes and a body that
fails its ``Content-Encoding`` all end in one of these (``tests/test_fuzz.py`` checks it).
"""

from __future__ import annotations

import builtins
import json
import re
from typing import Any

from ._http import httpx
from ._retry_after import parse_retry_after_header
from ._wire import ERROR_BODY_BYTES as _WIRE_ERROR_BODY_BYTES

__all__ = [
    "ERROR_BODY_BYTES",
    "ConnectionError",
    "ContextOverflow",
    "DSClientError",
    "MalformedResponse",
    "Overloaded",
    "RequestRefused",
    "ResponseTooLarge",
    "ServerError",
    "ServerFault",
    "TimeoutError",
    "TransportError",
    "context_overflow_from_response",
    "decode_text",
    "error_from_response",
    "parse_json",
    "redact",
    "translate_request_error",
    "translate_transport_error",
]

_BODY_KEEP = 4000  # characters of a refused body kept on the exception

#: Bytes of an error body read: every known server's refusal is under 1 KiB, a proxy's HTML error
#: page tens of KiB; the rest is never read (a server must not make the client buffer it). One
#: number, defined by the wire (dsclient/_wire.py), which reads dsclient's own answers.
ERROR_BODY_BYTES = _WIRE_ERROR_BODY_BYTES


class DSClientError(Exception):
    """Root of every error dsclient raises on purpose.

    ``attempts`` is how many tries the failed call made (retries included); ``server`` the root
    URL of the server its last attempt failed at, or for a call's timeout the server whose
    attempt it cut (``None``: the call reached none, e.g. it failed in the client's own queue),
    so that a client of several servers counts a failure against the server that failed, not
    the first one.

    Every dsclient error pickles (process pools, Ray): it is rebuilt from its message and its
    fields, not by calling its constructor again, whose parameters differ per class.
    """

    attempts: int = 1
    server: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.args, dict(self.__dict__)))


def _restore(cls: type[DSClientError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """Unpickle a :class:`DSClientError`: its message (``args``) and fields as they were."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class TransportError(DSClientError):
    """The request did not get a complete answer from the server."""


class TimeoutError(TransportError, builtins.TimeoutError):
    """The call's time budget ran out (client-side queueing included).

    Also the builtin ``TimeoutError``, so ``except TimeoutError`` catches it without
    importing dsclient's (as asyncio's and aiohttp's timeouts are builtin ones).
    """


class ConnectionError(TransportError, builtins.ConnectionError):
    """Connecting failed, or the connection dropped before the body was complete.

    Also the builtin ``ConnectionError`` (an ``OSError``), as aiohttp's connection errors are.
    """


class ServerError(DSClientError):
    """The server answered, but not with a usable result."""


class MalformedResponse(ServerError):
    """A 2xx answer whose body is not valid JSON or lacks the fields the API promises."""

    def __init__(self, message: str, *, body: str = "") -> None:
        super().__init__(message)
        self.body = body[:_BODY_KEEP]


class ResponseTooLarge(MalformedResponse):
    """A body, or one event of a stream, was longer than the client's cap (``limit`` bytes).

    Nothing past the cap is read, and the call is not retried: a server that answers a completion
    with megabytes is broken or hostile, and asking again would only read as much again.
    """

    def __init__(self, what: str, *, limit: int, body: str = "") -> None:
        super().__init__(
            f"{what} over {_size(limit)}; a completion is kilobytes, so the rest was not read "
            "(the cap is max_body_bytes)",
            body=body,
        )
        self.limit = limit


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


class RequestRefused(ServerError):
    """The server answered with an error status: itself, a 4xx (it refused this request).

    The base of every error status: :class:`Overloaded` (429 / 503), :class:`ContextOverflow`
    and :class:`ServerFault` (another 5xx, the server's own failure) are ones too.

    ``status`` is the HTTP status, ``body`` the (possibly truncated) response text,
    ``message`` the server's own message when the body had one, and ``retry_after`` the wait the
    server asked for (``Retry-After`` / ``retry-after-ms``), in seconds, if any.
    """

    _what = "server refused the request"  # how the message opens; ServerFault's differs

    def __init__(
        self,
        status: int,
        body: str = "",
        message: str | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.retry_after = retry_after
        self.body = body[:_BODY_KEEP]
        self.message = message if message is not None else _server_message(body)
        super().__init__(f"{self._what}: HTTP {status}: {self.message}")


class ServerFault(RequestRefused):
    """The server failed on the request: a 5xx other than 503 (a 500, a gateway's 502 / 504).

    Not a refusal of what was asked: the same request may well succeed on a retry, so calls
    retry it (budget permitting). ``status``, ``body`` and ``message`` are kept as for any
    error status.
    """

    _what = "server error"


class Overloaded(RequestRefused):
    """The server (429/503) or the client's own bounded queue cannot take the request now.

    ``retry_after`` is the server's hint in seconds, when it gave one.
    """

    def __init__(
        self,
        status: int,
        body: str = "",
        message: str | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, body, message, retry_after=retry_after)


class ContextOverflow(RequestRefused):
    """The prompt plus ``max_tokens`` cannot fit the model's context.

    ``prompt_tokens``, ``requested_tokens`` and ``context_length`` are filled in when known
    (from dsclient's own count, or parsed from the server's message).
    """

    def __init__(
        self,
        message: str,
        *,
        prompt_tokens: int | None = None,
        requested_tokens: int | None = None,
        context_length: int | None = None,
        status: int = 400,
        body: str = "",
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.requested_tokens = requested_tokens
        self.context_length = context_length
        super().__init__(status, body, message)
        # Replace RequestRefused's wording: for a check done before sending there is no HTTP.
        self.args = (message if not body else f"HTTP {status}: {message}",)

    def __str__(self) -> str:
        return str(self.args[0])


def parse_json(data: str | bytes | bytearray) -> Any:
    """``json.loads`` whose every failure is a ``ValueError``.

    The decoder raises ``RecursionError`` on arrays or objects nested deeper than the interpreter's
    recursion limit (``[[[[...`` of a few thousand brackets), which callers catching
    ``ValueError`` for "not JSON" let through; found by ``tests/test_fuzz.py``.
    """
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def decode_text(data: bytes) -> str:
    """A body as text: UTF-8, the only encoding of JSON (RFC 8259) and of Prometheus text.

    A ``charset`` the server names is ignored on purpose: httpx's ``response.text`` follows it,
    and ``charset=rot13``, ``hex`` or ``idna`` make it raise ``TypeError``, ``AssertionError`` or
    ``UnicodeError`` (found by ``tests/test_fuzz.py``).
    """
    return data.decode("utf-8", "replace")


def _server_message(body: str) -> str:
    """The human message inside an error body (OpenAI, TGI or llama.cpp shape), else the text."""
    try:
        data = parse_json(body)
    except ValueError:
        return body.strip()[:500] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("error") or err.get("detail")
            if isinstance(msg, str):
                return msg[:_BODY_KEEP]
        if isinstance(err, str):
            return err[:_BODY_KEEP]
        if isinstance(data.get("detail"), str):
            return str(data["detail"])[:_BODY_KEEP]
        if isinstance(data.get("message"), str):
            return str(data["message"])[:_BODY_KEEP]
    return body.strip()[:500]


# --- context-overflow wordings ---------------------------------------------------------------
# Each pattern yields some of the named groups ``ctx``, ``prompt``, ``req`` (output tokens
# requested) and ``total``. Sources: ../shared/ENVIRONMENT.md (vLLM 0.4-0.6, 2025, 2026, the
# renderer, the engine, TGI 422, llama.cpp), plus the pre-tokenization character bound.
_N = r"(\d[\d,]*)"
_OVERFLOW_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE | re.DOTALL)
    for p in (
        # vLLM 2026: "... maximum context length is 2048 tokens. However, you requested 1900
        # output tokens and your prompt contains at least 1200 input tokens, for a total ..."
        rf"maximum context length is (?P<ctx>{_N}) tokens\. However, you requested (?P<req>{_N})"
        rf" output tokens and your prompt contains (?:at least )?(?P<prompt>{_N}) input tokens",
        # vLLM 0.4-0.6: "... However, you requested 3100 tokens (1200 in the messages, 1900 in
        # the completion)."
        rf"maximum context length is (?P<ctx>{_N}) tokens\. However, you requested (?P<total>{_N})"
        rf" tokens \((?P<prompt>{_N}) in the messages, (?P<req>{_N}) in the completion\)",
        # vLLM 0.32 prompt alone: "... However, your prompt contains at least 2049 input tokens"
        rf"maximum context length is (?P<ctx>{_N}) tokens\. However, your prompt contains"
        rf" (?:at least )?(?P<prompt>{_N}) input tokens",
        # vLLM's character bound, before tokenizing: "... your prompt contains 18000 characters
        # (more than 12288 characters, which is the upper bound for 2048 input tokens)"
        rf"(?:maximum context length is (?P<ctx>{_N}) tokens.*?)?your prompt contains {_N}"
        rf" characters \(more than {_N} characters, which is the upper bound for {_N} input",
        # vLLM 2025: "'max_tokens' or 'max_completion_tokens' is too large: 1900. This model's
        # maximum context length is 2048 tokens and your request has 1200 input tokens"
        rf"is too large: (?P<req>{_N})\. This model's maximum context length is (?P<ctx>{_N})"
        rf" tokens and your request has (?P<prompt>{_N}) input tokens",
        # vLLM renderer: "You passed 1200 input tokens and requested 1900 output tokens. However,
        # the model's context length is only 2048 tokens"
        rf"You passed (?P<prompt>{_N}) input tokens and requested (?P<req>{_N}) output tokens\."
        rf" However, the model's context length is only (?P<ctx>{_N}) tokens",
        # vLLM engine: "The decoder prompt (length 2300) is longer than the maximum model length
        # of 2048."
        rf"prompt \(length (?P<prompt>{_N})\) is longer than the maximum model length of"
        rf" (?P<ctx>{_N})",
        # TGI: "`inputs` tokens + `max_new_tokens` must be <= 2048. Given: 1200 `inputs` tokens
        # and 1900 `max_new_tokens`"
        rf"`inputs` tokens \+ `max_new_tokens` must be <= (?P<ctx>{_N})\. Given: (?P<prompt>{_N})"
        rf" `inputs` tokens and (?P<req>{_N}) `max_new_tokens`",
        # TGI: "`inputs` must have less than 2047 tokens. Given: 2300"
        rf"`inputs` must have less than (?P<ctx>{_N}) tokens\. Given: (?P<prompt>{_N})",
        # Generic OpenAI-style fallback.
        rf"maximum context length is (?P<ctx>{_N}) tokens",
    )
)


_OVERFLOW_SEARCHED = 2000


def _int(text: str | None) -> int | None:
    if not text:
        return None
    digits = text.replace(",", "")
    # More digits than int() converts (4300) raised ValueError; no real count has 19.
    return int(digits) if digits and len(digits) <= 18 else None


def context_overflow_from_response(status: int, body: str) -> ContextOverflow | None:
    """Recognise a context-overflow refusal in any known server wording, else ``None``."""
    if status not in (400, 413, 422):
        return None
    body = body[:ERROR_BODY_BYTES]
    message = _server_message(body)
    data: Any
    try:
        data = parse_json(body)
    except ValueError:
        data = None
    # llama.cpp: {"error": {"type": "exceed_context_size_error", "n_prompt_tokens", "n_ctx"}}
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
        if err.get("type") == "exceed_context_size_error":
            n_prompt, n_ctx = _as_int(err.get("n_prompt_tokens")), _as_int(err.get("n_ctx"))
            if n_prompt is not None and n_ctx is not None:
                message = f"{message} (prompt has {n_prompt} tokens; model context is {n_ctx})"
            return ContextOverflow(
                message,
                prompt_tokens=n_prompt,
                context_length=n_ctx,
                status=status,
                body=body,
            )
    # Every known wording is under 600 characters; a longer message is not searched whole, so a
    # hostile one cannot make the lazy ``.*?`` patterns scan it once per occurrence.
    searched = message[:_OVERFLOW_SEARCHED]
    for pattern in _OVERFLOW_PATTERNS:
        m = pattern.search(searched)
        if m is None:
            continue
        groups = m.groupdict()
        return ContextOverflow(
            message,
            prompt_tokens=_int(groups.get("prompt")),
            requested_tokens=_int(groups.get("req")),
            context_length=_int(groups.get("ctx")),
            status=status,
            body=body,
        )
    return None


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def error_from_response(response: httpx.Response, body: bytes | None = None) -> RequestRefused:
    """Map a non-2xx response to the exception a caller can act on.

    ``body`` is what was read of it (at most :data:`ERROR_BODY_BYTES` are looked at); ``None``
    takes the response's own content when it has been read, else nothing.
    """
    status = response.status_code
    if body is None:
        try:
            body = response.content
        except httpx.ResponseNotRead:
            body = b""
    text = decode_text(body[:ERROR_BODY_BYTES])
    return _refusal(status, text, response.headers)


def _refusal(status: int, body: str, headers: httpx.Headers) -> RequestRefused:
    overflow = context_overflow_from_response(status, body)
    if overflow is not None:
        return overflow
    retry_after = parse_retry_after_header(headers)
    if status in (429, 503):
        return Overloaded(status, body, retry_after=retry_after)
    if status >= 500:
        return ServerFault(status, body, retry_after=retry_after)
    return RequestRefused(status, body, retry_after=retry_after)


def translate_transport_error(exc: httpx.TransportError) -> TransportError:
    """Translate httpx's transport errors; the caller raises the result ``from exc``."""
    if isinstance(exc, httpx.TimeoutException):
        return TimeoutError(f"request timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.RemoteProtocolError):
        return ConnectionError(f"connection dropped before the answer was complete: {exc}")
    return ConnectionError(f"could not talk to the server ({type(exc).__name__}): {exc}")


def redact(exc: DSClientError, secret: str) -> None:
    """Replace ``secret`` by ``***`` in an error's message and the body it keeps, in place.

    A server that echoes the request (a debugging proxy, a gateway's error page) would otherwise
    put the API key into an error's text, and from there into logs.
    """
    if not secret:
        return
    exc.args = tuple(a.replace(secret, "***") if isinstance(a, str) else a for a in exc.args)
    for name in ("body", "message"):
        value = getattr(exc, name, None)
        if isinstance(value, str) and secret in value:
            setattr(exc, name, value.replace(secret, "***"))


def translate_request_error(exc: httpx.RequestError) -> DSClientError:
    """:func:`translate_transport_error`, plus what can fail while a body is read or decoded.

    A body that fails its ``Content-Encoding`` (``gzip`` over plain bytes) raises
    ``httpx.DecodingError``, which is not a ``TransportError`` and went through untyped (found
    by ``tests/test_fuzz.py``): it is a malformed answer, not a reason to retry.
    """
    if isinstance(exc, httpx.TransportError):
        return translate_transport_error(exc)
    if isinstance(exc, httpx.DecodingError):
        return MalformedResponse(f"server's answer could not be decoded: {exc}")
    return ConnectionError(f"could not talk to the server ({type(exc).__name__}): {exc}")

"""The governor under other SDKs: httpx transports that send inference requests through a
client's request path.

    transport = GovernedTransport(caller, planner, http)
    sdk = openai.AsyncOpenAI(base_url=caller.url + "/v1", api_key="EMPTY", max_retries=0,
                             http_client=httpx.AsyncClient(transport=transport))

:meth:`AsyncClient.openai` and :meth:`AsyncClient.httpx` build exactly that, over the client's
own :class:`~dsclient.client._caller.Caller`, :class:`~dsclient.client._planner.Planner` and
connections. What the transport does with one request the SDK hands it:

* ``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/embeddings`` are *inference*: the
  JSON body is read, its ``prompt`` / ``messages`` / ``input`` and ``max_tokens`` (or
  ``max_completion_tokens``) planned with the client's own planning (:meth:`Planner.plan
  <dsclient.client._planner.Planner.plan>`: the lane, whether ``max_tokens`` fits), and the
  request goes through the client's :class:`~dsclient.client._pipeline.RequestPath` attempt by
  attempt: a slot, one send, the slot back with its outcome, retries with backoff outside the
  slot under the retry budget, the outage gate, the response-size cap. Everything else in the
  body (tools, ``response_format``, vLLM's own fields) is sent as the SDK wrote it.
* Anything else (``GET /v1/models``, ``/tokenize``, ``/health``) passes through ungoverned.
* Every request goes to the client's server: the path is the SDK's, the host is the client's
  (the one place a later router picks a server per attempt). The client's API key, when it has
  one, replaces the SDK's (which can then be a placeholder such as ``"EMPTY"``).

**Errors are the server's.** A refusal (4xx / 5xx) is retried as dsclient retries anything; once
it may not be retried again, the server's last answer (status, headers, body; at most
:data:`~dsclient._exceptions.ERROR_BODY_BYTES` of it) comes back to the SDK, which raises its
own types (``openai.BadRequestError``, ``RateLimitError``, ...). Failures without an answer raise
httpx exceptions, which the openai SDK maps to ``APITimeoutError`` / ``APIConnectionError``; the
dsclient error is their ``__cause__``. Two refusals are the client's own, as the SDK's usual
statuses, marked ``x-dsclient-refused``: ``400`` (``context``) when ``max_tokens`` cannot fit,
``429`` (``queue-full``) when the client's ``max_queue`` is full.

**Per-request options** come in headers (``extra_headers=`` per call, ``default_headers=`` on
the SDK client) or in the body (``extra_body={"dsclient": {...}}``); both are stripped before
sending, and the body wins:

===========================  ===============================  ===================================
header                       body field                       meaning
===========================  ===============================  ===================================
``x-dsclient-urgency: 5``    ``{"urgency": 5}``               admitted first among waiters
``x-dsclient-group: batch``  ``{"group": "batch"}``           the traffic group (``group_caps``)
``x-dsclient-overflow: cut`` ``{"overflow": "cut"}``          cut ``max_tokens`` to the room left
===========================  ===============================  ===================================

**max_tokens that cannot fit** is refused by default (``overflow="refuse"``) rather than cut:
an SDK caller asked for that number, a cut answer can end mid-sentence or mid-JSON without
saying so (``finish_reason`` "length" looks like a plain limit), vLLM 0.32 clamps silently while
other versions and servers refuse, and code written against the SDK already handles
``BadRequestError``. The refusal is exact: it needs the server's own count (``/tokenize``), and
is made only when ``prompt + max_tokens`` passes the context, dsclient's margin not counted.
Without an exact count the request goes as written and the server decides. ``overflow="cut"``
applies what :meth:`AsyncClient.generate` does. A request without ``max_tokens`` is planned as if
it asked for the client's ``default_max_tokens`` and sent without one.

**Timeouts.** The SDK's timeout (its ``read`` value, which ``timeout=20`` sets) bounds the whole
call: waiting for a slot, every attempt and backoff, and for a stream every read until its end.

**Streams** (``"stream": true``) keep their slot until the body is read to its end or closed.

**Observers** (``dsclient.metrics``) hear of every governed call as of a :meth:`generate` call:
one :class:`~dsclient._observe.CallRecord` with its outcome (the server's refusal by its
dsclient error name and status), attempts, lane, group, latency, time queued, and the tokens of
the answer's ``usage`` (a stream's from its last chunk, which vLLM sends with
``stream_options={"include_usage": true}``); ``kind`` is ``"embedding"`` for embeddings and
``"stream"`` for streams. A stream is recorded when it ends or is closed.
"""

from __future__ import annotations

import builtins
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio

from .._exceptions import (
    ContextOverflow,
    DSClientError,
    MalformedResponse,
    Overloaded,
    ResponseTooLarge,
    TimeoutError,
    TransportError,
)
from .._http import httpx
from .._streaming import MAX_BODY_BYTES
from ._request import deadline
from ._sdk_plan import (
    GROUP,
    OVERFLOW,
    URGENCY,
    Governed,
    Overflow,
    parse_options,
    plan_request,
    refusal,
    usage_of,
)

if TYPE_CHECKING:
    from anyio.from_thread import BlockingPortal

    from ..governor._backend import Lease
    from ._caller import Caller
    from ._pipeline import Answer, Call
    from ._planner import Planner

__all__ = [
    "INFERENCE_PATHS",
    "GovernedTransport",
    "SyncGovernedTransport",
    "parse_options",
    "usage_of",
]

logger = logging.getLogger("dsclient")

#: The routes that are governed (a slot per attempt); every other request passes through.
INFERENCE_PATHS: Final = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embedding",
}

#: The option headers (read, never forwarded), as the lower-case bytes httpx keeps.
_OPTIONS_RAW: Final = frozenset({URGENCY.encode(), GROUP.encode(), OVERFLOW.encode()})
#: Request headers never forwarded: what is recomputed for the request actually sent.
_DROP_REQUEST: Final = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})
_RETRY_COUNT: Final = b"x-stainless-retry-count"
#: Answer headers that no longer describe a body read (and decoded) here.
_DROP_READ: Final = frozenset({b"content-length", b"content-encoding", b"transfer-encoding"})
#: How much of a stream's end an observed stream keeps, to find its ``usage`` (vLLM's last
#: chunk with ``stream_options={"include_usage": true}`` is about 300 bytes).
_TAIL_BYTES: Final = 4096
_DECODER: Final = json.JSONDecoder()


class GovernedTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends inference requests through a client's caller (its
    governor, request path and observers; see the module docstring); the rest passes through.

        transport = GovernedTransport(caller, planner, http, group="batch")
        llm = ChatOpenAI(base_url=caller.url + "/v1", http_async_client=httpx.AsyncClient(
            transport=transport), ...)

    Parameters:
        caller: the calls' timeout, attempts (limit, lanes, retries, servers) and observers.
        planner: plans each inference request (lane, fit).
        http: the connections (its headers go on every request; ungoverned ones use it).
        keyed: the client has an API key, which then replaces the SDK's.
        urgency, group, overflow: defaults for requests that do not say (see the table above).

    Closing it does not close ``http``: the client owns the connections.
    """

    def __init__(
        self,
        caller: Caller,
        planner: Planner,
        http: httpx.AsyncClient,
        *,
        keyed: bool = False,
        urgency: int = 0,
        group: str | None = None,
        overflow: Overflow = "refuse",
    ) -> None:
        self._caller = caller
        self._planner = planner
        self._http = http
        self._url = caller.url
        options = {"urgency": urgency, "group": group, "overflow": overflow}
        self._defaults: tuple[int, str | None, Overflow] = parse_options(
            {}, options, urgency=0, group=None, overflow="refuse"
        )
        self._warned: set[str] = set()
        root = httpx.URL(self._url)
        self._origin = (root.scheme, root.host, root.port)
        self._prefix = root.path.rstrip("/")
        # What every governed request sends besides the SDK's own headers, worked out once:
        # the shared client's headers (its User-Agent, its key) where the SDK has none of the
        # same name, as httpx's own merge does; the client's key replaces the SDK's.
        self._host = root.netloc
        self._inner = [(k, v, k.lower()) for k, v in http.headers.raw]
        self._drop = _DROP_REQUEST | ({b"authorization"} if keyed else set())
        self._timeout = http.timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}

    def __repr__(self) -> str:
        return f"GovernedTransport({self._url!r})"

    @property
    def url(self) -> str:
        """The client's server (its first one), where every request goes."""
        return self._url

    @property
    def call_timeout(self) -> float | None:
        """The client's timeout of a call, the SDK's default."""
        return self._caller.timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        caller = self._caller
        path = self._relative(request.url)
        kind = INFERENCE_PATHS.get(path) if request.method == "POST" else None
        content = await request.aread()
        forwarded, options, retried = self._split(request.headers)
        query = request.url.query
        if kind is None:
            target = self._url + path + ("?" + query.decode("ascii") if query else "")
            return await self._pass_through(request, target, forwarded, content)
        if retried:
            self._warn_once(
                "sdk-retries",
                "dsclient: the SDK is retrying a request that dsclient already retried; "
                "give it max_retries=0 (client.openai() does)",
            )
        start = caller.clock()
        ends_at, limit_s = _deadline_of(request)
        planned: Governed | None = None
        call: Call | None = None
        try:
            async with caller.deadline(limit_s):
                plan = await plan_request(self._planner, kind, content, options, self._defaults)
                if isinstance(plan, httpx.Response):
                    if caller.observers:
                        self._observe(kind, None, None, plan, start)
                    return plan
                planned = plan
                outgoing = self._outgoing(path, query, forwarded, planned.content)
                call = caller.path.new_call(planned.admission)
                sent = await caller.path.send_raw(outgoing, call, stream=planned.stream)
        except Exception as exc:
            failure: Exception = exc
            # The call's own deadline (dsclient's TimeoutError from inside is one too, and
            # keeps its words).
            if isinstance(exc, builtins.TimeoutError) and not isinstance(exc, DSClientError):
                failure = late = TimeoutError(
                    f"call did not finish within its timeout of {limit_s} s"
                )
                if call is not None and call.cut is not None:
                    late.server = call.cut.url  # cut in flight there: its record names it
            if caller.observers:
                self._observe(kind, planned, failure, None, start)
            if failure is not exc:
                raise httpx.ReadTimeout(f"dsclient: {failure}", request=request) from exc
            if isinstance(exc, Overloaded) and exc.status == 0:
                message = f"dsclient: the client's queue is full: {exc}"
                return refusal(429, message, why="queue-full", param=None)
            if isinstance(exc, DSClientError):
                raise _as_httpx(exc, request) from exc
            raise
        response, body = sent.response, sent.content
        assert response is not None  # send_raw's answers carry the server's response
        extra = [
            (b"x-dsclient-lane", planned.admission.lane.encode()),
            (b"x-dsclient-attempts", str(sent.attempts).encode()),
            (b"x-dsclient-queued-s", f"{sent.queued_s:.4f}".encode()),
        ]
        if body is not None:
            if caller.observers:
                self._observe(kind, planned, sent.error, sent, start)
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in _DROP_READ]
            out.extend(extra)
            out.append((b"Content-Length", str(len(body)).encode()))
            # stream=, not content=: httpx would work out the same header again, scanning all.
            return httpx.Response(response.status_code, headers=out, stream=httpx.ByteStream(body))
        observe = None
        limit = caller.path.max_body_bytes
        if caller.observers:

            def observe(error: BaseException | None, tail: bytes) -> None:
                failed = _stream_error(error, limit) if isinstance(error, Exception) else None
                self._observe(kind, planned, failed, sent, start, tail)

        stream = GovernedStream(
            response,
            sent.slot,
            limit=limit,
            ends_at=ends_at,
            timeout_s=limit_s,
            observe=observe,
        )
        out = list(response.headers.raw)
        out.extend(extra)
        return httpx.Response(response.status_code, headers=out, stream=stream)

    def _relative(self, url: httpx.URL) -> str:
        """The request's path on the client's server: the SDK's path, less the client URL's own
        path prefix when it has one."""
        path = url.path
        prefix = self._prefix
        if prefix and path.startswith(prefix + "/"):
            path = path[len(prefix) :]
        if (url.scheme, url.host, url.port) != self._origin:
            self._warn_once(
                f"origin:{url.scheme}://{url.host}:{url.port}",
                f"dsclient: a request to {url.scheme}://{url.host}:{url.port} goes to the "
                f"client's server {self._url} (the transport routes; the SDK's host is "
                "not used)",
            )
        return path

    def _split(
        self, headers: httpx.Headers
    ) -> tuple[list[tuple[bytes, bytes]], dict[str, str], bool]:
        """One pass over the SDK's headers: ``(forwarded, options, retried)``: the headers to
        send on (less the client's options, what is recomputed, and the SDK's key when the
        client has its own), the ``x-dsclient-*`` options, and whether the SDK is retrying."""
        forwarded: list[tuple[bytes, bytes]] = []
        options: dict[str, str] = {}
        retried = False
        drop = self._drop
        for key, value in headers.raw:
            lower = key.lower()
            if lower in _OPTIONS_RAW:
                options[lower.decode("ascii")] = value.decode("latin-1")
            elif lower not in drop:
                if lower == _RETRY_COUNT and value not in (b"0", b""):
                    retried = True
                forwarded.append((key, value))
        return forwarded, options, retried

    def _outgoing(
        self, path: str, query: bytes, forwarded: list[tuple[bytes, bytes]], content: bytes
    ) -> httpx.Request:
        """The request every attempt sends: complete (``Host``, ``Content-Length``, the client's
        headers merged under the SDK's, the client's connect timeout), so the request path hands
        it to the connection pool as it is (:meth:`RequestPath._exchange`)."""
        url = self._urls.get(path) if not query else None
        if url is None:
            target = self._url + path + ("?" + query.decode("ascii") if query else "")
            url = httpx.URL(target)
            if not query and len(self._urls) < len(INFERENCE_PATHS):
                self._urls[path] = url
        present = {k.lower() for k, _ in forwarded}
        headers = [(b"Host", self._host)]
        headers.extend((k, v) for k, v, lower in self._inner if lower not in present)
        headers.extend(forwarded)
        headers.append((b"Content-Length", str(len(content)).encode()))
        outgoing = httpx.Request(
            "POST",
            url,
            headers=headers,
            stream=httpx.ByteStream(content),
            extensions={"timeout": self._timeout},
        )
        outgoing.read()  # the body is in memory: keep it readable as request.content
        return outgoing

    def _observe(
        self,
        kind: str,
        planned: Governed | None,
        error: Exception | None,
        sent: Answer | httpx.Response | None,
        start: float,
        tail: bytes | None = None,
    ) -> None:
        """Tell the client's observers about one finished call, as :meth:`AsyncClient.generate`
        does: ``sent`` is the answer (or the client's own refusal), ``tail`` a stream's end."""
        failed: Exception | str | None = error
        status: int | None = None
        attempts: int | None = None
        queued_s: float | None = None
        prompt_tokens: int | None = None
        completion_tokens: int | None = None
        if isinstance(sent, httpx.Response):  # max_tokens refused before sending
            failed, status = ContextOverflow.__name__, sent.status_code
        elif sent is not None:
            attempts = sent.attempts
            if sent.error is not None:  # the server's refusal, handed back as it came
                failed, status = sent.error, sent.error.status
            else:
                body = sent.content if tail is None else tail
                if body is not None:
                    prompt_tokens, completion_tokens = usage_of(body)
                if error is None:  # as generate(): a failed call has no queue time
                    queued_s = sent.queued_s
        stream = planned is not None and planned.stream
        record_kind: Any = "stream" if stream else kind
        caller = self._caller
        caller.record(
            record_kind,
            server=getattr(sent, "server", None) or None,
            lane=planned.admission.lane if planned is not None else None,
            group=planned.admission.group if planned is not None else None,
            error=failed,
            status=status,
            latency_s=caller.clock() - start,
            queued_s=queued_s,
            attempts=attempts,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )

    async def _pass_through(
        self,
        request: httpx.Request,
        target: str,
        headers: list[tuple[bytes, bytes]],
        content: bytes,
    ) -> httpx.Response:
        """Not inference: one send, no slot, no retry; the body streams under the line cap."""
        http = self._http
        outgoing = http.build_request(
            request.method, target, headers=headers, content=content or None
        )
        timeout = request.extensions.get("timeout")
        if timeout is not None:
            outgoing.extensions["timeout"] = timeout
        response = await http.send(outgoing, stream=True)
        stream = GovernedStream(response, None, limit=self._caller.path.max_body_bytes)
        return httpx.Response(response.status_code, headers=response.headers.raw, stream=stream)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    async def aclose(self) -> None:
        """Nothing to close: the :class:`AsyncClient` owns the connections."""


def _deadline_of(request: httpx.Request) -> tuple[float | None, float | None]:
    """``(ends_at on the loop's clock, seconds)`` from the SDK's timeout (its ``read`` value)."""
    timeout = request.extensions.get("timeout")
    seconds = timeout.get("read") if isinstance(timeout, Mapping) else None
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        return None, None
    return anyio.current_time() + seconds, float(seconds)


def _scope(seconds: float | None) -> Any:
    return deadline(seconds)


def _as_httpx(exc: DSClientError, request: httpx.Request) -> httpx.HTTPError:
    """A failure without an answer, as the httpx exception SDKs map (openai:
    ``APITimeoutError`` for timeouts, ``APIConnectionError`` for the rest)."""
    cause = exc.__cause__
    if isinstance(cause, httpx.TransportError) and not isinstance(exc, MalformedResponse):
        return cause
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(f"dsclient: {exc}", request=request)
    if isinstance(exc, (MalformedResponse, ResponseTooLarge)):
        return httpx.RemoteProtocolError(f"dsclient: {exc}", request=request)
    if isinstance(exc, TransportError):
        return httpx.ConnectError(f"dsclient: {exc}", request=request)
    return httpx.RemoteProtocolError(f"dsclient: {exc}", request=request)


def _stream_error(exc: Exception, limit: int) -> Exception:
    """What a governed stream failed with, as dsclient names it for observers (``stream()``
    reports its own errors): the httpx exception the SDK sees carries the dsclient one, or
    stands for it."""
    if isinstance(exc, DSClientError):
        return exc
    if isinstance(exc.__cause__, DSClientError):
        return exc.__cause__
    if isinstance(exc, httpx.TimeoutException):
        return TimeoutError(str(exc))
    if isinstance(exc, httpx.RemoteProtocolError) and "max_response_bytes" in str(exc):
        return ResponseTooLarge("one line of the stream", limit=limit)
    if isinstance(exc, httpx.TransportError):
        return TransportError(str(exc))
    return exc


# -- streams ----------------------------------------------------------------------------------
class GovernedStream(httpx.AsyncByteStream):
    """A streamed answer that holds its slot until read to the end or closed.

    Yields the server's raw bytes (the SDK decodes them), never a line longer than ``limit``
    bytes (then ``httpx.RemoteProtocolError``); each read waits at most for what is left of the
    call's timeout (then ``httpx.ReadTimeout``). ``slot`` ``None``: an ungoverned pass-through.
    ``observe``, when given, is called once at the end with the error (``None``: read to its end
    or closed by the consumer) and the stream's last bytes (where its ``usage`` is).
    """

    def __init__(
        self,
        response: httpx.Response,
        slot: Lease | None,
        *,
        limit: int = MAX_BODY_BYTES,
        ends_at: float | None = None,
        timeout_s: float | None = None,
        observe: Callable[[BaseException | None, bytes], None] | None = None,
    ) -> None:
        self._response = response
        self._slot = slot
        self._limit = limit
        self._ends_at = ends_at
        self._timeout_s = timeout_s
        self._iterated = False
        self._observe = observe
        self._tail = b""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        line = 0  # bytes since the last line break
        if self._iterated:  # as httpx's own streams: once only (openai drains a second time)
            raise httpx.StreamConsumed()
        self._iterated = True
        response = self._response
        # A response already read (httpx.MockTransport's) has no raw stream left, only content.
        chunks = _content_of(response) if response.is_stream_consumed else response.aiter_raw()
        error: BaseException | None = None
        try:
            while True:
                ends_at = self._ends_at
                left = None if ends_at is None else max(0.0, ends_at - anyio.current_time())
                try:
                    async with _scope(left):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except builtins.TimeoutError as exc:
                    raise httpx.ReadTimeout(
                        f"dsclient: stream did not finish within its timeout of {self._timeout_s} s"
                    ) from exc
                cut = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
                line = len(chunk) - cut - 1 if cut >= 0 else line + len(chunk)
                if line > self._limit:
                    raise httpx.RemoteProtocolError(
                        f"dsclient: one line of the stream over {self._limit} bytes "
                        "(max_response_bytes); the rest was not read"
                    )
                if self._observe is not None:
                    self._tail = (self._tail + chunk)[-_TAIL_BYTES:]
                yield chunk
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self._release(error)

    async def _release(self, error: BaseException | None) -> None:
        with anyio.CancelScope(shield=True):
            await self._response.aclose()
        slot, self._slot = self._slot, None
        if slot is not None:
            if isinstance(error, GeneratorExit):  # the consumer stopped reading: not a failure
                error = None
            observe, self._observe = self._observe, None
            try:
                slot.release(error=error)
            finally:
                if observe is not None:
                    observe(error, self._tail)

    async def aclose(self) -> None:
        await self._release(None)


async def _content_of(response: httpx.Response) -> AsyncIterator[bytes]:
    yield response.content


# -- the sync transport ---------------------------------------------------------------------------
class SyncGovernedTransport(httpx.BaseTransport):
    """:class:`GovernedTransport` for ``httpx.Client`` (and ``openai.OpenAI``): each request
    runs on the sync :class:`~dsclient.Client`'s event loop, through its portal.

        sdk = openai.OpenAI(http_client=httpx.Client(transport=SyncGovernedTransport(portal, t)))

    Parameters:
        portal: the blocking portal of the loop the async client lives on.
        transport: the :class:`GovernedTransport` of that client.
    """

    def __init__(self, portal: BlockingPortal, transport: GovernedTransport) -> None:
        self._portal = portal
        self._transport = transport

    def __repr__(self) -> str:
        return repr(self._transport).replace("GovernedTransport", "SyncGovernedTransport", 1)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        content = request.read()
        inner = httpx.Request(
            request.method,
            request.url,
            headers=request.headers,
            content=content,
            extensions=request.extensions,
        )
        response = self._portal.call(self._transport.handle_async_request, inner)
        stream = response.stream
        if isinstance(stream, GovernedStream):
            return httpx.Response(
                response.status_code,
                headers=response.headers.multi_items(),
                stream=_SyncStream(self._portal, stream),
            )
        body = self._portal.call(response.aread)
        return httpx.Response(
            response.status_code, headers=response.headers.multi_items(), content=body
        )

    def close(self) -> None:
        """Nothing to close: the :class:`~dsclient.Client` owns the connections."""


class _SyncStream(httpx.SyncByteStream):
    """A :class:`GovernedStream` read from another thread, one chunk per portal call."""

    def __init__(self, portal: BlockingPortal, stream: GovernedStream) -> None:
        self._portal = portal
        self._stream = stream
        self._chunks: AsyncIterator[bytes] | None = None

    def __iter__(self) -> Iterator[bytes]:
        chunks = self._stream.__aiter__()
        self._chunks = chunks
        while True:
            try:
                yield self._portal.call(chunks.__anext__)
            except StopAsyncIteration:
                return

    def close(self) -> None:
        chunks, self._chunks = self._chunks, None
        if chunks is not None and hasattr(chunks, "aclose"):
            self._portal.call(chunks.aclose)
        self._portal.call(self._stream.aclose)


# -- what AsyncClient.openai() / .httpx() and Client.openai() / .httpx() build -------------------
def _sdk_kwargs(transport: GovernedTransport, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The openai client's options: the client's URL and timeout, openai's retries off."""
    if kwargs.get("max_retries", 0) != 0:
        raise ValueError(
            "max_retries must be 0: dsclient retries (once, under its budget); set the "
            "client's retry=dsclient.Retry(...) instead"
        )
    if "http_client" in kwargs:
        raise TypeError("http_client is dsclient's; use client.httpx() to build your own SDK")
    kwargs["max_retries"] = 0
    kwargs.setdefault("base_url", transport.url + "/v1")
    # A placeholder: the transport sends the client's own key, which the SDK never holds.
    kwargs.setdefault("api_key", "EMPTY")
    kwargs.setdefault("timeout", transport.call_timeout)
    return kwargs


def _http_kwargs(transport: GovernedTransport, kwargs: dict[str, Any]) -> dict[str, Any]:
    if "transport" in kwargs:
        raise TypeError("transport is dsclient's governed transport; it cannot be replaced")
    kwargs.setdefault("base_url", transport.url)
    kwargs.setdefault("timeout", httpx.Timeout(transport.call_timeout))
    return kwargs


def async_openai(transport: GovernedTransport, **kwargs: Any) -> Any:
    """An ``openai.AsyncOpenAI`` over ``transport`` (see :meth:`AsyncClient.openai`)."""
    import openai

    http = async_httpx(transport)
    # openai 3.x is built on httpx2, as dsclient is (dsclient/_http.py): the client is its own.
    return openai.AsyncOpenAI(http_client=http, **_sdk_kwargs(transport, kwargs))


def async_httpx(transport: GovernedTransport, **kwargs: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` over ``transport`` (see :meth:`AsyncClient.httpx`)."""
    return httpx.AsyncClient(transport=transport, **_http_kwargs(transport, kwargs))


def sync_openai(portal: BlockingPortal, transport: GovernedTransport, **kwargs: Any) -> Any:
    """An ``openai.OpenAI`` over the sync client's ``transport`` (see :meth:`Client.openai`)."""
    import openai

    http = sync_httpx(portal, transport)
    return openai.OpenAI(http_client=http, **_sdk_kwargs(transport, kwargs))


def sync_httpx(portal: BlockingPortal, transport: GovernedTransport, **kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` over the sync client's ``transport`` (see :meth:`Client.httpx`)."""
    return httpx.Client(
        transport=SyncGovernedTransport(portal, transport), **_http_kwargs(transport, kwargs)
    )

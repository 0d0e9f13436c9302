"""The HTTP stack, chosen here and nowhere else: httpx2's API over aiohttp's connections.

    from .._http import httpx          # the httpx API every module uses (the httpx2 package)
    http = httpx.AsyncClient(transport=default_transport())

Measured with ``python -m benchmarks client-scale`` (``docs/transport.md``): against a local server
that costs nothing, aiohttp sends a completion for about 0.1 ms of CPU at 16 to 1024 in flight;
httpx2's own pool takes 0.6 ms at 16 and 3 ms at 256, httpx 0.29's 1.4 and 5.5 ms. dsclient keeps
httpx's API (``httpx.Request`` / ``Response``, ``MockTransport`` as the unit-test seam, the
``httpx.AsyncClient`` that :meth:`AsyncClient.httpx` hands to openai 3.x and LangChain) from
the ``httpx2`` package, the API-compatible fork openai 3.x is built on, and sends over
:class:`AiohttpTransport`, an ``httpx.AsyncBaseTransport`` on an aiohttp connection pool.

* :func:`default_transport` gives that transport under asyncio and httpx2's own
  (``httpx.AsyncHTTPTransport``) under trio, which aiohttp does not run on.
* dsclient's own calls skip httpx's objects on it: :meth:`AiohttpTransport.post` takes the URL,
  headers and body as they are, sends them over dsclient's own HTTP/1.1 connections
  (:mod:`dsclient._wire`: httptools' parser, about half of aiohttp's CPU per request) unless a
  proxy in the environment applies to the URL or httptools is not installed, and gives a 2xx
  answer within the cap back read (:class:`Read`); every other answer is an ``httpx.Response``
  as from any transport. Streams and the requests of other SDKs go over aiohttp.
* ``AsyncClient(http_stack="httpx2")`` asks for httpx2's own pool: a choice, never the default.
* A transport of the ``httpx`` package (``httpx.MockTransport`` in a caller's tests) still works:
  :func:`adapt_transport` wraps it so that its requests, answers and errors cross between the two
  packages.
* :data:`READ_TIMEOUT_S` is every request's default read timeout: the longest wait for the next
  byte of an answer.

Errors: the transport turns aiohttp's exceptions into httpx's (``ConnectError``, ``ReadError``,
``ConnectTimeout``, ``RemoteProtocolError``), as httpx's own transports turn httpcore's; dsclient's
errors are made from those in one place, :func:`dsclient._exceptions.translate_request_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from typing import Any

import httpx2 as httpx
import sniffio

from . import _wire
from ._wire import Read, Wire

__all__ = [
    "HTTP_STACKS",
    "READ_TIMEOUT_S",
    "AiohttpTransport",
    "HttpStack",
    "RawHeaders",
    "Read",
    "Timeouts",
    "adapt_transport",
    "default_transport",
    "httpx",
    "transport_for",
]

HttpStack = str
#: Request headers as :meth:`AiohttpTransport.post` takes them: ``((name, value), ...)``, bytes.
RawHeaders = tuple[tuple[bytes, bytes], ...]
#: httpx's ``timeout`` extension: ``{"connect": 10.0, "read": None, ...}``.
Timeouts = dict[str, float | None]
#: The stacks ``AsyncClient(http_stack=...)`` takes; the first is the default.
HTTP_STACKS = ("aiohttp", "httpx2")
#: Seconds a request waits at most for the next byte of its answer (not for the whole of it),
#: unless the client says otherwise. A completion that is not streamed sends nothing until its
#: last token, so this is as long as the slowest whole generation it must let through: 4,096
#: tokens at 15 a second (a loaded server, a large model) take 273 s. A server that hangs is
#: then let go after 5 minutes, where only the call's timeout (600 s, or none) bounded it.
READ_TIMEOUT_S = 300.0


def transport_for(stack: HttpStack, transport: Any = None) -> httpx.AsyncBaseTransport:
    """What a client sends through: ``transport`` if given (:func:`adapt_transport`), else
    ``stack``'s (:func:`default_transport`).

        http = httpx.AsyncClient(transport=transport_for("aiohttp", None))

    Raises:
        ValueError: an unknown ``stack`` (even with a ``transport``: the option is still wrong).
    """
    if stack not in HTTP_STACKS:
        raise ValueError(f"http_stack must be one of {', '.join(HTTP_STACKS)}; got {stack!r}")
    return default_transport(stack) if transport is None else adapt_transport(transport)


def default_transport(stack: HttpStack = "aiohttp") -> httpx.AsyncBaseTransport:
    """The transport of ``stack``: ``"aiohttp"`` (aiohttp's pool under asyncio, httpx2's under
    trio), ``"httpx2"`` (httpx2's pool).

        transport = default_transport("httpx2")

    The pool is unbounded: dsclient's governor is the only concurrency limit.

    Raises:
        ValueError: an unknown stack.
    """
    if stack == "aiohttp":
        return AiohttpTransport()
    if stack == "httpx2":
        return httpx.AsyncHTTPTransport(limits=_LIMITS)
    raise ValueError(f"http_stack must be one of {', '.join(HTTP_STACKS)}; got {stack!r}")


_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=512)


# -- aiohttp under httpx's API -----------------------------------------------------------------
class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends over an aiohttp connection pool (under asyncio).

        http = httpx.AsyncClient(transport=AiohttpTransport())

    The session is made on the first request, in the running loop; under another event loop
    library (trio) every request goes through httpx2's own transport instead. The request's
    ``timeout`` extension bounds connecting and each read (``None``: no bound); bodies are
    handed over undecoded (httpx decodes ``Content-Encoding``), and an answer not read to its
    end closes its connection when the response is closed.
    """

    def __init__(self) -> None:
        self._ssl: ssl.SSLContext | None = None
        self._session: Any = None
        self._timeouts: dict[tuple[float | None, float | None], Any] = {}
        #: What :meth:`post` has turned into aiohttp's types: URLs, header sets (a few each).
        self._urls: dict[str, Any] = {}
        self._headers: dict[RawHeaders, tuple[Any, tuple[str, ...] | None]] = {}
        self._fallback: httpx.AsyncBaseTransport | None = None
        self._closed = False
        #: dsclient's own connections for :meth:`post` (made on first use); ``False``: not
        #: installed (httptools), and every request goes through aiohttp's pool.
        self._wire: Wire | bool | None = None
        #: The proxies set in the environment (``None``: not read yet), and for each URL sent
        #: to whether it goes over the wire (no proxy applies to it).
        self._proxies: dict[str, str] | None = None
        self._direct_urls: dict[str, bool] = {}

    @property
    def ssl_context(self) -> ssl.SSLContext:
        """What every TLS connection verifies against: certificates and host names, as httpx's
        default (made on first use: loading the CA bundle takes milliseconds)."""
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl

    def _open(self) -> Any:
        import aiohttp

        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=30.0, ssl=self.ssl_context
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # httpx decodes, under dsclient's byte cap
            # No skip_auto_headers here: aiohttp would rebuild that set for every request. A
            # request that lacks one of _AUTO's headers names it instead (_skipped).
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
            # Proxies from the environment (HTTP_PROXY, NO_PROXY), as httpx's own pool takes
            # them; read per request only where one is set.
            trust_env=bool(self._environment_proxies()),
        )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        if not _in_asyncio():
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport(limits=_LIMITS)
            return await self._fallback.handle_async_request(request)
        session = self._session or self._open()
        from yarl import URL

        body = request.content if isinstance(request.stream, httpx.ByteStream) else None
        if body is None:
            body = await request.aread()
        headers = request.headers.multi_items()
        try:
            response = await session.request(
                request.method,
                URL(str(request.url), encoded=True),
                headers=headers,
                data=body or None,
                timeout=self._timeout(request.extensions.get("timeout")),
                allow_redirects=False,
                skip_auto_headers=_skipped(name for name, _ in headers),
            )
        except Exception as exc:
            error = _as_httpx(exc, request)
            if error is None:
                raise
            raise error from exc
        return _response(response, request)

    @property
    def direct(self) -> bool:
        """Whether :meth:`post` may be used now: the transport is open, on asyncio."""
        return not self._closed and _in_asyncio()

    def post(
        self,
        url: str,
        headers: RawHeaders,
        content: bytes,
        timeout: Timeouts | None,
        *,
        read_up_to: int | None = None,
    ) -> Awaitable[httpx.Response | Read]:
        """POST ``content`` to ``url`` without an ``httpx.Request``: what
        :meth:`handle_async_request` does for a request of these parts, the answer's ``request``
        left unset. Only while :attr:`direct` (the caller checks).

            answer = await transport.post(url, ((b"Content-Type", b"application/json"),),
                                          b"{}", {"connect": 10.0, "read": None}, read_up_to=2**20)

        dsclient's own calls come this way: building an ``httpx.Request`` (its headers
        normalized, its URL parsed), turning it back into aiohttp's arguments and the answer
        into an ``httpx.Response`` cost about as much as aiohttp itself per call
        (``python -m benchmarks client-scale``). ``headers`` and ``url`` are converted once each
        and kept.

        With ``read_up_to`` (an answer to be read whole: not a stream), the request goes over
        dsclient's own HTTP/1.1 connections (:class:`dsclient._wire.Wire`), which cost about
        half of aiohttp's CPU per request, unless a proxy in the environment applies to ``url``
        (``NO_PROXY`` alone sets none) or httptools is not installed.

        Parameters:
            read_up_to: read a 2xx answer here and give it back whole (:class:`Read`, its
                connection back in the pool) when it is at most this many bytes and has no
                ``Content-Encoding``; any other answer comes back as an ``httpx.Response``
                (through the wire: with what was read of its body, at most ``read_up_to + 1``
                bytes, or 64 KiB of an error's). ``None``: always an ``httpx.Response``, unread
                (a stream), through aiohttp.

        What it gives is the sending coroutine itself (one frame fewer a call).

        Raises:
            httpx.TransportError: as :meth:`handle_async_request` (``request`` unset).
        """
        if read_up_to is not None:
            wire = self._wire
            if wire is None:
                wire = self._wire = _wire.AVAILABLE and Wire(lambda: self.ssl_context)
            direct = self._direct_urls.get(url)
            if direct is None:
                direct = self._goes_direct(url)
            if direct and wire is not False:
                assert isinstance(wire, Wire)
                bounds = timeout or {}
                return wire.post(
                    url,
                    headers,
                    content,
                    connect_timeout=bounds.get("connect"),
                    read_timeout=bounds.get("read"),
                    read_up_to=read_up_to,
                )
        return self._post(url, headers, content, timeout, read_up_to)

    def _environment_proxies(self) -> dict[str, str]:
        """The proxies the environment sets (``HTTP_PROXY``, ``ALL_PROXY``, ...), read once.
        ``NO_PROXY`` alone sets none: it only says where the others do not apply."""
        if self._proxies is None:
            found = urllib.request.getproxies()
            self._proxies = {k: v for k, v in found.items() if k != "no" and v}
        return self._proxies

    def _goes_direct(self, url: str) -> bool:
        """Whether ``url`` may go over the wire: one it takes, with no proxy that applies."""
        direct = Wire.takes(url)
        proxies = self._environment_proxies()
        if direct and proxies:
            scheme = url.split("://", 1)[0]
            if scheme in proxies or "all" in proxies:
                host = urllib.parse.urlsplit(url).hostname or ""
                direct = bool(urllib.request.proxy_bypass(host))
        if len(self._direct_urls) >= 256:  # a few per server; bound it anyway
            self._direct_urls.clear()
        self._direct_urls[url] = direct
        return direct

    async def _post(
        self,
        url: str,
        headers: RawHeaders,
        content: bytes,
        timeout: Timeouts | None,
        read_up_to: int | None,
    ) -> httpx.Response | Read:
        """:meth:`post` over aiohttp's pool."""
        session = self._session or self._open()
        target = self._urls.get(url)
        if target is None:
            from yarl import URL

            if len(self._urls) >= 256:  # a few per server; bound it anyway
                self._urls.clear()
            target = self._urls[url] = URL(url)
        known = self._headers.get(headers)
        if known is None:
            from multidict import CIMultiDict

            if len(self._headers) >= 64:
                self._headers.clear()
            prepared = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)
            known = self._headers[headers] = (prepared, _skipped(prepared))
        prepared, skipped = known
        try:
            response = await session.request(
                "POST",
                target,
                headers=prepared,
                data=content,
                timeout=self._timeout(timeout),
                allow_redirects=False,
                skip_auto_headers=skipped,
            )
            if read_up_to is not None and response.status < 400:
                answer = response.headers
                declared = answer.get("Content-Length", "")
                if (
                    "Content-Encoding" not in answer
                    and declared.isascii()
                    and declared.isdigit()
                    and len(declared) <= 15
                    and int(declared) <= read_up_to
                ):
                    # aiohttp reads no further than the declared length.
                    return Read(response.status, answer, await response.read())
        except Exception as exc:
            error = _as_httpx(exc, None)
            if error is None:
                raise
            raise error from exc
        return _response(response, None)

    def _timeout(self, timeouts: Timeouts | None) -> Any:
        """aiohttp's timeout for httpx's ``timeout`` extension: connect and each read bounded
        (``None``: not), the whole of it never (the call's deadline is dsclient's)."""
        bounds = (None, None) if not timeouts else (timeouts.get("connect"), timeouts.get("read"))
        timeout = self._timeouts.get(bounds)
        if timeout is None:  # a few distinct pairs: the client's, a probe's
            import aiohttp

            if len(self._timeouts) >= 64:
                self._timeouts.clear()
            timeout = self._timeouts[bounds] = aiohttp.ClientTimeout(
                total=None, sock_connect=bounds[0], sock_read=bounds[1]
            )
        return timeout

    async def aclose(self) -> None:
        self._closed = True
        if isinstance(self._wire, Wire):
            await self._wire.aclose()
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        if self._fallback is not None:
            await self._fallback.aclose()


def _response(response: Any, request: httpx.Request | None) -> httpx.Response:
    """aiohttp's answer as httpx's, its body unread."""
    return httpx.Response(
        response.status,
        headers=response.raw_headers,
        stream=_AiohttpStream(response, request),
        extensions={
            "http_version": b"HTTP/1.1",
            "reason_phrase": (response.reason or "").encode("ascii", "replace"),
        },
    )


class _AiohttpStream(httpx.AsyncByteStream):
    def __init__(self, response: Any, request: httpx.Request | None) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except Exception as exc:
            error = _as_httpx(exc, self._request)
            if error is None:
                raise
            raise error from exc

    async def aclose(self) -> None:
        # An answer read to its end gives its connection back to the pool; one that was not
        # (over the cap, cancelled) closes it.
        self._response.release()


#: The headers aiohttp adds to a request that lacks them (its own ``User-Agent``, ``Accept:
#: */*``, ``Accept-Encoding: gzip, deflate``); a request through this transport carries what
#: httpx's does, and none of aiohttp's.
_AUTO = ("user-agent", "accept", "accept-encoding")


def _skipped(names: Iterable[str]) -> tuple[str, ...] | None:
    """What a request with headers ``names`` must tell aiohttp not to add: those of
    :data:`_AUTO` it lacks (``None``: it has them all, as httpx's requests do)."""
    have = {name.lower() for name in names}
    missing = tuple(name for name in _AUTO if name not in have)
    return missing or None


def _in_asyncio() -> bool:
    """Whether this task runs on an asyncio loop (not trio): ``sniffio``'s answer, at a fraction
    of its cost on every request."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return sniffio.thread_local.name in (None, "asyncio")


def _as_httpx(exc: Exception, request: httpx.Request | None) -> httpx.TransportError | None:
    """aiohttp's exception as httpx's, for the caller to raise ``from exc``; ``None`` for an
    exception that is not aiohttp's (it goes on as it is)."""
    import aiohttp

    if isinstance(exc, asyncio.TimeoutError):  # a read (or connect) past the request's timeout
        return httpx.ReadTimeout(str(exc) or "read timed out", request=request)
    if not isinstance(exc, aiohttp.ClientError):
        return None
    message = str(exc) or type(exc).__name__
    kind: type[httpx.TransportError]
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        kind = httpx.ConnectTimeout
    elif isinstance(exc, aiohttp.ServerTimeoutError):
        kind = httpx.ReadTimeout
    elif isinstance(exc, aiohttp.ClientConnectorError):
        kind = httpx.ConnectError
    elif isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)):
        kind = httpx.RemoteProtocolError
    elif isinstance(exc, aiohttp.InvalidURL):
        kind = httpx.UnsupportedProtocol
    else:
        kind = httpx.ReadError
    return kind(message, request=request)


# -- a transport of the httpx package ----------------------------------------------------------
def adapt_transport(transport: Any) -> httpx.AsyncBaseTransport:
    """``transport`` as an httpx2 transport: itself if it is one, else (an ``httpx`` package
    transport: ``httpx.MockTransport(handler)``) wrapped so that requests, answers and errors
    cross between the two packages.

    Raises:
        TypeError: neither an httpx2 nor an httpx async transport.
    """
    if isinstance(transport, httpx.AsyncBaseTransport):
        return transport
    legacy = sys.modules.get("httpx")
    if legacy is not None and isinstance(transport, legacy.AsyncBaseTransport):
        return _FromHttpx(transport, legacy)
    raise TypeError(
        f"transport must be an httpx.AsyncBaseTransport (httpx2 or httpx), got "
        f"{type(transport).__name__}"
    )


class _FromHttpx(httpx.AsyncBaseTransport):
    """An ``httpx`` package transport behind httpx2's interface."""

    def __init__(self, inner: Any, module: Any) -> None:
        self._inner = inner
        self._module = module

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        legacy = self._module
        outgoing = legacy.Request(
            request.method,
            str(request.url),
            headers=request.headers.raw,
            content=await request.aread(),
            extensions=request.extensions,
        )
        with self._errors(request):
            response = await self._inner.handle_async_request(outgoing)
        return httpx.Response(
            response.status_code,
            headers=response.headers.raw,
            stream=_FromHttpxStream(response.stream, request, self),
            extensions=response.extensions,
        )

    @contextlib.contextmanager
    def _errors(self, request: httpx.Request) -> Iterator[None]:
        try:
            yield
        except self._module.HTTPError as exc:
            kind = getattr(httpx, type(exc).__name__, None)
            if not (isinstance(kind, type) and issubclass(kind, httpx.RequestError)):
                kind = httpx.TransportError
            raise kind(str(exc), request=request) from exc

    async def aclose(self) -> None:
        await self._inner.aclose()


class _FromHttpxStream(httpx.AsyncByteStream):
    def __init__(self, stream: Any, request: httpx.Request, owner: _FromHttpx) -> None:
        self._stream = stream
        self._request = request
        self._owner = owner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with self._owner._errors(self._request):
            async for chunk in self._stream:
                yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()

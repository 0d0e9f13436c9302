"""dsclient's own HTTP/1.1 connections, for its JSON calls: :class:`Wire`.

    wire = Wire(ssl_context)
    answer = await wire.post("http://127.0.0.1:8000/v1/completions", headers, b'{"prompt": ...}',
                             connect_timeout=10.0, read_timeout=300.0, read_up_to=2**24)
    await wire.aclose()

A call of dsclient's own (``generate``, ``chat``, ``map()``, embeddings) is one POST of a JSON
body whose answer is read whole. aiohttp's ``ClientSession`` spent about 85 us of CPU on each
(its request and response objects, cookie, redirect and tracing hooks, its timers), more than
the rest of the call, governor included (``python -m benchmarks client-scale``,
``docs/transport.md``). This module sends just that: the request in one write on a kept-alive
connection, and the answer parsed by `httptools <https://github.com/MagicStack/httptools>`_
(llhttp, the parser of uvicorn and Node.js, strict: no bare LF, no ``Content-Length`` beside
``Transfer-Encoding``, no status that is not three digits) and read under a cap.

What it does not do stays with the transport around it (aiohttp's pool): proxies, streams, the
requests of other SDKs, anything not ``http`` / ``https``, and everything where httptools is
not installed (:data:`AVAILABLE`).

Contracts:

* One request at a time on a connection. A connection goes back to the idle pool only when its
  answer was read to its end and neither side said ``Connection: close``; any other (an answer
  over the cap, a cancelled call, a failure, data nobody asked for) is closed. So a cancelled
  call never leaves half an answer for the next one.
* At most ``read_up_to`` bytes of a body are kept. A body over it comes back cut (the caller's
  reader, :func:`dsclient._streaming.read_body`, raises ``ResponseTooLarge`` on it; an error's
  first bytes still reach its message) and its connection is closed.
* Bounded: at most :data:`MAX_FIELDS` header and trailer lines and :data:`MAX_HEAD` bytes of
  them, :data:`MAX_INTERIM` ``1xx`` answers before the final one; ``read_timeout`` is the
  longest wait for the next byte (not for the whole answer).
* Connecting tries every address of the host, the next one :data:`HAPPY_EYEBALLS_DELAY_S`
  after the one before (Happy Eyeballs, RFC 8305, with aiohttp's ``aiohappyeyeballs``), over
  addresses kept :data:`DNS_TTL_S` seconds.
* An idle connection is kept below the server's keep-alive (its ``Keep-Alive: timeout=``, or
  :data:`KEEPALIVE_S`), closed when it expires, and checked before reuse (a socket that is
  readable or closed is not reused). A request whose reused connection was closed before any
  byte of the answer came is sent again at once on a new connection: the server closed an idle
  connection as it went out, and did not read it.
* Errors are httpx's, as the aiohttp transport's are: ``ConnectError`` and ``ConnectTimeout``
  (connecting), ``RemoteProtocolError`` (the server closed the connection before the answer was
  complete, or sent what is not strict HTTP/1.x), ``ReadTimeout``; dsclient's own are made from
  them in one place (:func:`dsclient._exceptions.translate_request_error`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import re
import select
import socket
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import aiohappyeyeballs
import httpx2 as httpx
from multidict import CIMultiDict

try:
    import httptools
except ImportError:  # pragma: no cover - no wheel for this platform: aiohttp carries the calls
    httptools = None  # type: ignore[assignment]

__all__ = [
    "AVAILABLE",
    "DNS_TTL_S",
    "ERROR_BODY_BYTES",
    "HAPPY_EYEBALLS_DELAY_S",
    "KEEPALIVE_S",
    "MAX_FIELDS",
    "MAX_HEAD",
    "MAX_INTERIM",
    "Read",
    "Wire",
]

RawHeaders = tuple[tuple[bytes, bytes], ...]
#: What a resolver gives: ``socket.getaddrinfo``'s tuples.
AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]
Resolver = Callable[[str, int], Awaitable[list[AddrInfo]]]

#: Whether the wire can be used: httptools is installed.
AVAILABLE = httptools is not None


class Read(NamedTuple):
    """An answer read whole: its status, its headers (names in any case), its body."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


#: Headers the wire writes itself; a caller's are not sent twice.
_OWN = frozenset((b"host", b"content-length", b"transfer-encoding"))
#: Most idle connections kept for one server; beyond them a finished connection is closed.
_MAX_IDLE = 1024
#: Most bytes of an error's body read: what an error message keeps of it. Defined here, with the
#: reader that enforces it first; ``dsclient._exceptions`` (which imports this module through
#: ``_http``) takes it from here.
ERROR_BODY_BYTES = 64 * 1024
#: Most bytes of an answer's header lines, and of its trailer lines, and of what comes between
#: two pieces of its body (a chunk's size line and extensions).
MAX_HEAD = 64 * 1024
#: Most header lines of an answer, trailers included (aiohttp's default is 128 as well).
MAX_FIELDS = 128
#: Most interim (``1xx``) answers before the final one.
MAX_INTERIM = 16
#: Seconds an idle connection is kept when the server does not say: under uvicorn's (and so
#: vLLM's) 5 s, so that the client lets go first.
KEEPALIVE_S = 4.0
#: The share of a server's ``Keep-Alive: timeout=`` an idle connection is kept, and the most
#: seconds whatever it says.
_KEEPALIVE_SHARE = 0.8
_KEEPALIVE_MAX_S = 60.0
#: Seconds before the next address is tried while one is still connecting (aiohttp's too).
HAPPY_EYEBALLS_DELAY_S = 0.25
#: Seconds idle after which a connection's socket is checked before reuse: under any server's
#: keep-alive (uvicorn takes whole seconds).
_CHECK_IDLE_S = 1.0
#: The most seconds between two looks at the answers waited for under a read timeout.
_WATCH_TICK_S = 1.0
#: Seconds a host name's addresses are kept (aiohttp's default too).
DNS_TTL_S = 10.0

_KEEP_ALIVE_TIMEOUT = re.compile(rb"(?:^|[\s,])timeout\s*=\s*(\d+(?:\.\d*)?)", re.IGNORECASE)
#: What a path and a query may hold as they are; anything else is percent-encoded (as httpx
#: does: a space is ``%20``); ``%`` stays, so what is encoded already is not encoded twice.
_PATH_SAFE = "/%!$&'()*+,;=:@-._~"
_QUERY_SAFE = _PATH_SAFE + "?"
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


class _Target(NamedTuple):
    """What one URL comes to on the wire."""

    key: tuple[str, str, int]  # scheme, host, port: the connections it may share
    start: bytes  # b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"


class _Stale(httpx.RemoteProtocolError):
    """A connection closed before any byte of its answer came."""


class Wire:
    """Kept-alive HTTP/1.1 connections for POSTs of JSON read whole (see the module).

        wire = Wire(ssl_context, keepalive=4.0)
        answer = await wire.post(url, headers, body, read_up_to=2**20)

    Parameters:
        ssl_context: what ``https`` connections verify against, or what makes it on the first
            one (loading certificates takes milliseconds); default: Python's default context.
        keepalive: seconds an idle connection is kept when the server's ``Keep-Alive`` does
            not say (when it does: :data:`_KEEPALIVE_SHARE` of its timeout).
        resolver: ``async (host, port) -> getaddrinfo tuples``; default: the loop's
            ``getaddrinfo`` (tests give a name two addresses).
        happy_eyeballs_delay: seconds before the next address is tried.
    """

    def __init__(
        self,
        ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
        keepalive: float = KEEPALIVE_S,
        *,
        resolver: Resolver | None = None,
        happy_eyeballs_delay: float = HAPPY_EYEBALLS_DELAY_S,
    ) -> None:
        if not AVAILABLE:  # pragma: no cover - see AVAILABLE
            raise RuntimeError("dsclient's wire needs httptools (pip install httptools)")
        self._ssl = ssl_context
        self._keepalive = keepalive
        self._resolver = resolver
        self._delay = happy_eyeballs_delay
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, _Target] = {}
        self._blocks: dict[RawHeaders, tuple[bytes, bool]] = {}
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None
        #: The connections waiting for an answer under a read timeout, and the one timer that
        #: looks at them every ``_tick`` seconds (a timer per request cost a fifth of the
        #: wire's CPU per request).
        self._watched: set[_Connection] = set()
        self._watchdog: asyncio.TimerHandle | None = None
        self._tick = _WATCH_TICK_S
        self._poll = select.poll()
        #: The loop the connections belong to: a client used on a new loop (``asyncio.run``
        #: again) starts afresh, as an old loop's connection would never hear its answer.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: (host, port) -> (until when, the lookup): see :meth:`_addresses`.
        self._dns: dict[tuple[str, int], tuple[float, asyncio.Task[list[AddrInfo]]]] = {}

    @staticmethod
    def takes(url: str) -> bool:
        """Whether ``url`` is one this wire sends to: ``http`` or ``https``, in ASCII, with no
        user name in it. Others go through aiohttp, which encodes international names and
        sends a URL's credentials as basic auth."""
        if not (url.isascii() and url.startswith(("http://", "https://"))):
            return False
        authority = url.split("://", 1)[1].split("/", 1)[0]
        return "@" not in authority

    async def post(
        self,
        url: str,
        headers: RawHeaders,
        content: bytes,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        read_up_to: int,
    ) -> Read | httpx.Response:
        """POST ``content`` to ``url``: a 2xx answer read whole within ``read_up_to`` bytes
        (no ``Content-Encoding``) as a :class:`Read`; any other as an ``httpx.Response``
        holding what was read of its body (at most ``read_up_to + 1`` bytes; more means it was
        cut there), for the caller's readers (error prefix, decoding, the cap).

        Parameters:
            connect_timeout: seconds for connecting (every address together).
            read_timeout: the longest wait for the next byte of the answer (``None``: none).
            read_up_to: the most bytes of a body kept.

        Raises:
            httpx.TransportError: see the module.
            httpx.LocalProtocolError: a header name or value with a line break in it.
            RuntimeError: the wire is closed.
        """
        if self._closed:
            raise RuntimeError("the transport is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._move_to(loop)
        target = self._targets.get(url) or self._target(url)
        known = self._blocks.get(headers)
        block, keep = known if known is not None else self._block(headers)
        request = b"%s%sContent-Length: %d\r\n\r\n%s" % (target.start, block, len(content), content)
        connection = self._reuse(target.key)
        if connection is not None:
            try:
                return await connection.send(loop, request, read_up_to, read_timeout, keep)
            except _Stale:
                pass  # closed as the request went out, unread: once more on a new connection
            except BaseException:
                connection.abort()  # half an exchange is never reused
                raise
        connection = await self._connect(target.key, connect_timeout)
        try:
            return await connection.send(loop, request, read_up_to, read_timeout, keep)
        except BaseException:
            connection.abort()
            raise

    # -- connections ---------------------------------------------------------------------------
    def _move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let go of the connections of the loop before, which cannot be used on ``loop``."""
        for connection in list(self._open):
            # Its loop may be closed: then the socket goes with the transport.
            with contextlib.suppress(RuntimeError):
                connection.abort()
        self._open.clear()
        self._idle.clear()
        self._dns.clear()
        self._sweep = self._watchdog = None
        self._watched.clear()
        self._tick = _WATCH_TICK_S
        self._loop = loop

    def _reuse(self, key: tuple[str, str, int]) -> _Connection | None:
        """An idle connection to ``key`` that is still there, the most recently used first (the
        least likely to be closing); the expired and the closed ones met on the way are closed."""
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        poll = self._poll
        while idle:
            connection = idle.pop()
            transport = connection.transport
            if (
                connection.usable
                and connection.expires > now
                and transport is not None
                and not transport.is_closing()
            ):
                # The loop hears of a server's FIN only when it reads the socket: one that
                # closed while the loop was busy reads as open. A readable idle socket holds a
                # FIN, a reset or bytes nobody asked for: none is a connection to send on.
                # Asked (a syscall) only of a connection idle long enough for a server's
                # keep-alive to have closed it; a sooner close is met by the resend in post().
                if now - connection.idle_since < _CHECK_IDLE_S:
                    return connection
                poll.register(connection.fd, select.POLLIN)
                try:
                    readable = poll.poll(0)
                finally:
                    poll.unregister(connection.fd)
                if not readable:
                    return connection
            connection.abort()
        return None

    async def _connect(self, key: tuple[str, str, int], timeout: float | None) -> _Connection:
        _, host, port = key
        try:
            return await asyncio.wait_for(self._open_to(key), timeout)
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
        except (OSError, UnicodeError) as exc:  # UnicodeError: a name the resolver refuses
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc

    async def _open_to(self, key: tuple[str, str, int]) -> _Connection:
        """A new connection to the server of ``key``: to every one of its addresses, the next
        one started :data:`HAPPY_EYEBALLS_DELAY_S` after the one before while that one has not
        connected (the first to connect wins, the others are closed)."""
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if scheme == "https":
            if not isinstance(self._ssl, ssl.SSLContext):
                self._ssl = ssl.create_default_context() if self._ssl is None else self._ssl()
            context = self._ssl
        addresses = await self._addresses(host, port)
        sock = await aiohappyeyeballs.start_connection(
            addresses, happy_eyeballs_delay=self._delay, interleave=1
        )
        try:
            _, connection = await loop.create_connection(
                lambda: _Connection(self, key),
                sock=sock,
                ssl=context,
                server_hostname=host if context is not None else None,
            )
        except BaseException:
            sock.close()
            raise
        if self._closed:  # closed while connecting
            connection.abort()
            raise RuntimeError("the transport is closed")
        return connection

    async def _addresses(self, host: str, port: int) -> list[AddrInfo]:
        """The addresses of ``host``: itself if it is one; else what the resolver said in the
        last :data:`DNS_TTL_S` seconds, one lookup shared by the connections opened meanwhile
        (a thousand calls at once open a thousand connections; each asking the resolver
        queued them behind a handful of threads)."""
        if _is_address(host):
            if ":" in host:
                return [
                    (
                        socket.AF_INET6,
                        socket.SOCK_STREAM,
                        socket.IPPROTO_TCP,
                        "",
                        (host, port, 0, 0),
                    )
                ]
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
        now = time.monotonic()
        known = self._dns.get((host, port))
        if known is None or known[0] < now:
            loop = asyncio.get_running_loop()
            lookup = loop.create_task(self._resolve(loop, host, port))
            known = self._dns[(host, port)] = (now + DNS_TTL_S, lookup)
        try:
            return await asyncio.shield(known[1])  # one waiter cancelled is not all of them
        except OSError:
            if self._dns.get((host, port)) is known:
                del self._dns[(host, port)]  # a failed lookup is asked again next time
            raise

    async def _resolve(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int
    ) -> list[AddrInfo]:
        if self._resolver is not None:
            return await self._resolver(host, port)
        return await _lookup(loop, host, port)

    def _release(self, connection: _Connection, keep_s: float) -> None:
        """``connection`` finished an exchange and may take another for ``keep_s`` seconds."""
        if self._closed or keep_s <= 0:
            connection.abort()
            return
        idle = self._idle.get(connection.key)
        if idle is None:
            idle = self._idle[connection.key] = collections.deque()
        if len(idle) >= _MAX_IDLE:
            connection.abort()
            return
        connection.idle_since = now = time.monotonic()
        connection.expires = now + keep_s
        idle.append(connection)
        if self._sweep is None and self._loop is not None:
            self._sweep = self._loop.call_later(keep_s, self._expire)

    def _expire(self) -> None:
        """Close the idle connections whose time is up (the oldest are on the left); come back
        when the next one's is."""
        self._sweep = None
        now = time.monotonic()
        nearest: float | None = None
        for idle in self._idle.values():
            while idle and idle[0].expires <= now:
                idle.popleft().abort()
            if idle and (nearest is None or idle[0].expires < nearest):
                nearest = idle[0].expires
        if nearest is not None and self._loop is not None and not self._closed:
            self._sweep = self._loop.call_later(nearest - now, self._expire)

    def _watch(self, connection: _Connection, timeout: float) -> None:
        """Look at ``connection``'s read timeout until its answer is in: every quarter of the
        shortest timeout (at most every :data:`_WATCH_TICK_S`), so a timeout fires at most a
        quarter late."""
        self._watched.add(connection)
        tick = timeout / 4
        if tick < self._tick:
            self._tick = tick
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
        if self._watchdog is None and self._loop is not None:
            self._watchdog = self._loop.call_later(self._tick, self._look)

    def _look(self) -> None:
        self._watchdog = None
        if not self._watched or self._loop is None:
            return
        now = self._loop.time()
        for connection in list(self._watched):
            connection._read_timed_out(now)  # a failed answer leaves the set
        if self._watched:
            self._watchdog = self._loop.call_later(self._tick, self._look)

    def _forget(self, connection: _Connection) -> None:
        """``connection`` is closed."""
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)

    async def aclose(self) -> None:
        """Close every connection, idle or in use."""
        self._closed = True
        for timer in (self._sweep, self._watchdog):
            if timer is not None:
                timer.cancel()
        self._sweep = self._watchdog = None
        for connection in list(self._open):
            with contextlib.suppress(RuntimeError):  # a closed loop's: see _move_to
                connection.abort()
        self._idle.clear()
        if self._open:
            await asyncio.sleep(0)  # the loop closes the sockets on its next turn

    # -- what a request starts with ------------------------------------------------------------
    def _target(self, url: str) -> _Target:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme
        if scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"cannot send to {url!r}")
        default = 443 if scheme == "https" else 80
        port = parts.port or default
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        authority = shown if port == default else f"{shown}:{port}"
        path = urllib.parse.quote(parts.path or "/", safe=_PATH_SAFE)
        if parts.query:
            path += "?" + urllib.parse.quote(parts.query, safe=_QUERY_SAFE)
        start = f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n".encode("ascii")
        target = _Target((scheme, host, port), start)
        if len(self._targets) >= 256:  # a few per server; bound it anyway
            self._targets.clear()
        self._targets[url] = target
        return target

    def _block(self, headers: RawHeaders) -> tuple[bytes, bool]:
        """The header lines of ``headers``, and whether the connection may be kept after (not
        when they say ``Connection: close``)."""
        lines = []
        keep = True
        for name, value in headers:
            if any(c in name or c in value for c in (b"\r", b"\n", b"\0")) or b":" in name:
                raise httpx.LocalProtocolError(f"header {name!r} cannot be sent")
            lower = name.lower()
            if lower == b"connection" and b"close" in _tokens(value):
                keep = False
            if lower not in _OWN:
                lines.append(b"%s: %s\r\n" % (name, value))
        known = (b"".join(lines), keep)
        if len(self._blocks) >= 64:
            self._blocks.clear()
        self._blocks[headers] = known
        return known


class _Connection(asyncio.Protocol):
    """One connection, and the answer it is reading (httptools' callbacks fill it in)."""

    def __init__(self, wire: Wire, key: tuple[str, str, int]) -> None:
        self.wire = wire
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.usable = False
        self.idle_since = 0.0
        self.expires = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Read | httpx.Response] | None = None
        self._cap = 0
        self._keep = True
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0  # body bytes kept
        self._heard = False  # any byte of this answer
        self._head_done = False  # the final answer's headers are in
        self._complete = False
        self._keeps = False  # the server keeps the connection (llhttp's reading of the answer)
        self._cut = False  # over the cap: the answer ends here
        self._stop: Exception | None = None  # why a callback stopped the parser
        self._fields = 0
        self._field_bytes = 0
        self._interim = 0
        self._framing = 0  # bytes in a row that brought no body and no head
        self._until_close = False
        self._encoded = False
        self._read_timeout: float | None = None
        self._last = 0.0  # when the last byte came (the loop's clock)
        self._clock: Callable[[], float] = time.monotonic

    # -- asyncio's side --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1
        self.usable = True
        self.wire._open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        self.wire._watched.discard(self)
        self.wire._forget(self)
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._until_close and exc is None:  # the end of a body read to the end
            self._finish(whole=True, reuse=False)
            return
        why = "the server closed the connection before the answer was complete"
        if exc is not None:
            why += f" ({exc})"
        self._fail(httpx.RemoteProtocolError(why) if self._heard else _Stale(why))

    def eof_received(self) -> bool:
        self.usable = False  # at once: connection_lost comes on the loop's next turn
        return False  # close our side too

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: not a connection to reuse
            self.abort()
            return
        self._heard = True
        if self._read_timeout is not None:
            self._last = self._clock()
        before = self._size, self._head_done
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # A callback of ours stopped it (self._stop or self._cut says why), or failed.
            if self._stop is None and not self._cut and not self._complete:
                self._stop = httpx.RemoteProtocolError(f"malformed answer: {exc.__context__}")
        except httptools.HttpParserUpgrade:
            self._stop = httpx.RemoteProtocolError("the server switched protocols")
        except httptools.HttpParserError as exc:
            self._stop = httpx.RemoteProtocolError(_malformed(exc, data, self._head_done))
        if self._complete:
            self._finish(whole=True, reuse=self._stop is None)
        elif self._cut:
            self._finish(whole=False, reuse=False)
        elif self._stop is not None:
            self._fail(self._stop)
        elif (self._size, self._head_done) == before:
            self._framing += len(data)
            if self._framing > MAX_HEAD:
                self._fail(
                    httpx.RemoteProtocolError(
                        f"over {MAX_HEAD} bytes of the answer without a header's end or any body"
                    )
                )
        else:
            self._framing = 0

    # -- httptools' side -------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._complete:  # a second answer to one request
            self._stop = httpx.RemoteProtocolError("bytes after the answer")
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        self._field_bytes += len(name) + len(value)
        if self._fields > MAX_FIELDS or self._field_bytes > MAX_HEAD:
            self._stop = httpx.RemoteProtocolError(
                f"more than {MAX_FIELDS} header lines or {MAX_HEAD} bytes of them"
            )
            raise _Stop
        if not self._head_done:
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            self._interim += 1
            if status == 101 or self._interim > MAX_INTERIM:
                self._stop = httpx.RemoteProtocolError(
                    "the server switched protocols"
                    if status == 101
                    else f"more than {MAX_INTERIM} interim answers"
                )
                raise _Stop
            self._headers = []  # an interim answer (100 Continue, 103 Early Hints): skipped
            return
        self._status = status
        self._head_done = True
        length = -1
        chunked = False
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)  # llhttp took only digits, and one value
            elif lower == b"transfer-encoding":
                if value.strip().lower() != b"chunked":
                    # Another coding (gzip, chunked) would come back still coded: refused, as
                    # httpx2 (h11) refuses it.
                    self._stop = httpx.RemoteProtocolError(
                        f"unsupported Transfer-Encoding {value[:40]!r}"
                    )
                    raise _Stop
                chunked = True
            elif lower == b"content-encoding":
                self._encoded = True
        if status >= 400:  # only an error message's first bytes are read (read_prefix)
            self._cap = min(self._cap, ERROR_BODY_BYTES)
        self._until_close = length < 0 and not chunked and status not in (204, 304)
        if length > self._cap and status < 400:  # refused on its declared length, unread
            self._cut = True
            raise _Stop

    def on_body(self, body: bytes) -> None:
        room = self._cap + 1 - self._size
        if len(body) >= room:
            self._body.append(body[:room])
            self._size += room
            self._cut = True
            raise _Stop
        self._body.append(body)
        self._size += len(body)

    def on_message_complete(self) -> None:
        if self._head_done:
            self._complete = True
            # Asked here: once the answer is complete the parser starts afresh and says no.
            self._keeps = self._parser.should_keep_alive()
        else:  # an interim answer's end: the fields it counted are not the final one's
            self._fields = self._field_bytes = 0

    # -- the exchange ----------------------------------------------------------------------------
    def send(
        self,
        loop: asyncio.AbstractEventLoop,
        request: bytes,
        cap: int,
        read_timeout: float | None,
        keep: bool,
    ) -> asyncio.Future[Read | httpx.Response]:
        """Write ``request``; the answer's future (on ``loop``, the running one). ``keep``:
        the connection may be kept after it (the request did not say ``Connection: close``)."""
        assert self.transport is not None
        self._waiter = waiter = loop.create_future()
        self._cap = cap
        self._keep = keep
        self._status = self._size = self._fields = self._field_bytes = 0
        self._interim = self._framing = 0
        self._heard = self._head_done = self._complete = self._cut = False
        self._until_close = self._encoded = False
        self._stop = None
        self._read_timeout = read_timeout
        self.usable = False
        if read_timeout is not None:
            self._clock = loop.time
            self._last = loop.time()
            self.wire._watch(self, read_timeout)
        self.transport.write(request)
        return waiter

    def abort(self) -> None:
        self.usable = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        self.wire._watched.discard(self)
        self.abort()
        self._body, self._headers = [], []
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _finish(self, *, whole: bool, reuse: bool) -> None:
        """The answer is in: its body ``whole``, or cut at the cap; the connection may take
        another request if ``reuse`` (and neither side said ``Connection: close``)."""
        waiter, self._waiter = self._waiter, None
        self.wire._watched.discard(self)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        headers, status = self._headers, self._status
        self._body, self._headers = [], []
        transport = self.transport
        if (
            whole
            and reuse
            and self._keep
            and not self._until_close
            and self._keeps
            and transport is not None
            and not transport.is_closing()
        ):
            self.usable = True
            self.wire._release(self, self._keep_for(headers))
        else:
            self.abort()
        if waiter is None or waiter.done():
            return
        answer: Read | httpx.Response
        if whole and 200 <= status < 300 and not self._encoded:
            named = CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in headers)
            answer = Read(status, named, body)
        else:
            answer = httpx.Response(status, headers=headers, content=body)
        waiter.set_result(answer)

    def _keep_for(self, headers: list[tuple[bytes, bytes]]) -> float:
        """Seconds this connection may stay idle: below the server's ``Keep-Alive: timeout=``
        where it says one, else the wire's default."""
        for name, value in headers:
            if len(name) == 10 and name.lower() == b"keep-alive":
                said = _KEEP_ALIVE_TIMEOUT.search(value)
                if said is not None:
                    return min(float(said.group(1)) * _KEEPALIVE_SHARE, _KEEPALIVE_MAX_S)
        return self.wire._keepalive

    # -- the read timeout --------------------------------------------------------------------
    def _read_timed_out(self, now: float) -> None:
        """Fail the answer if no byte of it came for ``read_timeout`` seconds."""
        timeout = self._read_timeout
        if timeout is not None and now - self._last >= timeout:
            self._fail(httpx.ReadTimeout(f"no byte of the answer for {timeout} s"))


class _Stop(Exception):
    """Raised in a callback to stop httptools (it comes back as ``HttpParserCallbackError``)."""


def _tokens(value: bytes) -> set[bytes]:
    return {t.strip() for t in value.lower().split(b",")}


def _malformed(exc: Exception, data: bytes, head_done: bool) -> str:
    """What is wrong with an answer, for its error: llhttp's words, and in the head the name of
    the first header line that is not ``name: value`` (its value never: it may echo a key)."""
    why = f"malformed answer: {exc}"
    if head_done:
        return why
    for line in data.split(b"\r\n")[1:]:
        if not line:
            break
        name = line.partition(b":")[0]
        if _TOKEN.fullmatch(name) is None or b"\n" in line:
            shown = name.strip().split(b"\n")[0][:40]
            return f"{why} (bad header line starting {shown!r})"
    return why


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _lookup(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[AddrInfo]:
    """``host``'s addresses for a TCP connection, in the resolver's order, each once."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[tuple[int, str], AddrInfo] = {}
    for info in infos:
        seen.setdefault((info[0], str(info[4][0])), info)
    return list(seen.values())

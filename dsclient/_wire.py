"""dsclient's own HTTP/1.1 connections, for its JSON calls: :class:`Wire`.

    wire = Wire(ssl_context)
    answer = await wire.post("http://127.0.0.1:8000/v1/completions", headers, b'{"prompt": ...}',
                             connect_timeout=10.0, read_up_to=2**24)
    await wire.aclose()

A call of dsclient's own (``generate``, ``chat``, ``map()``, embeddings) is one POST of a JSON
body whose answer is read whole. aiohttp's ``ClientSession`` spent about 85 us of CPU on each
(its request and response objects, cookie, redirect and tracing hooks, its timers), more than
the rest of the call, governor included (``python -m benchmarks client-scale``,
``docs/transport.md``). This module sends just that: the request in one write on a kept-alive
connection, the answer's status line and headers parsed, its body framed by ``Content-Length``,
by chunked transfer coding or by the end of the connection, and read under a cap.

What it does not do stays with the transport around it (aiohttp's pool): proxies, streams, the
requests of other SDKs, and anything not ``http`` / ``https``.

Contracts:

* One request at a time on a connection. A connection goes back to the idle pool only when its
  answer was read to its end and neither side said ``Connection: close``; any other (an answer
  over the cap, a cancelled call, a failure, data nobody asked for) is closed. So a cancelled
  call never leaves half an answer for the next one.
* At most ``read_up_to`` bytes of a body are kept. A body over it comes back cut (the caller's
  reader, :func:`dsclient._streaming.read_body`, raises ``ResponseTooLarge`` on it; an error's
  first bytes still reach its message) and its connection is closed.
* Errors are httpx's, as the aiohttp transport's are: ``ConnectError`` and ``ConnectTimeout``
  (connecting), ``RemoteProtocolError`` (the server closed the connection before the answer was
  complete, or sent what is not HTTP/1.x), ``ReadTimeout``, ``WriteError``; dsclient's own are
  made from them in one place (:func:`dsclient._exceptions.translate_request_error`).
* Idle connections are closed after ``keepalive`` seconds unused, and every connection, idle or
  not, by :meth:`Wire.aclose`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import re
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import NamedTuple

import httpx2 as httpx
from multidict import CIMultiDict

__all__ = ["ERROR_BODY_BYTES", "Read", "Wire"]

RawHeaders = tuple[tuple[bytes, bytes], ...]


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
#: Longest status line and header block read before the answer is called malformed.
_MAX_HEAD = 64 * 1024

#: A chunk's size: hex digits, no sign, prefix or underscore (which ``int(x, 16)`` would take).
_CHUNK_SIZE_DIGITS = re.compile(rb"[0-9A-Fa-f]{1,16}")
#: Seconds a host name's addresses are kept (aiohttp's default too).
_DNS_TTL = 10.0

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class _Target(NamedTuple):
    """What one URL comes to on the wire."""

    key: tuple[str, str, int]  # scheme, host, port: the connections it may share
    start: bytes  # b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"


class Wire:
    """Kept-alive HTTP/1.1 connections for POSTs of JSON read whole (see the module).

    Parameters:
        ssl_context: what ``https`` connections verify against, or what makes it on the first
            one (loading certificates takes milliseconds); default: Python's default context.
        keepalive: seconds an idle connection is kept.
    """

    def __init__(
        self,
        ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
        keepalive: float = 30.0,
    ) -> None:
        self._ssl = ssl_context
        self._keepalive = keepalive
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, _Target] = {}
        self._blocks: dict[RawHeaders, bytes] = {}
        self._closed = False
        #: The loop the connections belong to: a client used on a new loop (``asyncio.run``
        #: again) starts afresh, as an old loop's connection would never hear its answer.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: (host, port) -> (until when, the lookup): see :meth:`_addresses`.
        self._dns: dict[tuple[str, int], tuple[float, asyncio.Task[list[tuple[int, str]]]]] = {}

    @staticmethod
    def takes(url: str) -> bool:
        """Whether ``url`` is one this wire sends to: ``http`` or ``https``, in ASCII, with no
        user name in it. Others go through aiohttp, which encodes international names and
        paths and sends a URL's credentials as basic auth."""
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
        block = self._blocks.get(headers)
        if block is None:
            block = self._block(headers)
        request = b"%s%sContent-Length: %d\r\n\r\n%s" % (target.start, block, len(content), content)
        connection = self._reuse(target.key)
        if connection is None:
            connection = await self._connect(target.key, connect_timeout)
        waiter = connection.send(loop, request, read_up_to, read_timeout)
        try:
            return await waiter
        except BaseException:
            connection.abort()  # half an exchange is never reused
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
        self._loop = loop

    def _reuse(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest = time.monotonic() - self._keepalive
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be closing
            transport = connection.transport
            if (
                connection.usable
                and connection.idle_since > oldest
                and transport is not None
                and not transport.is_closing()
            ):
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
        """A new connection to the server of ``key``: to each of its addresses in turn, as
        aiohttp does, until one answers (the last one's error if none does)."""
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if scheme == "https":
            if not isinstance(self._ssl, ssl.SSLContext):
                self._ssl = ssl.create_default_context() if self._ssl is None else self._ssl()
            context = self._ssl
        failed: OSError | None = None
        for family, address in await self._addresses(host, port):
            try:
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, key),
                    address,
                    port,
                    family=family,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
            except OSError as exc:  # ssl.SSLError is one too
                failed = exc
                continue
            if self._closed:  # closed while connecting
                connection.abort()
                raise RuntimeError("the transport is closed")
            return connection
        assert failed is not None  # getaddrinfo gives at least one address or raises
        raise failed

    async def _addresses(self, host: str, port: int) -> list[tuple[int, str]]:
        """The addresses of ``host``: itself if it is one; else what the resolver said in the
        last :data:`_DNS_TTL` seconds, one lookup shared by the connections opened meanwhile
        (a thousand calls at once open a thousand connections; each asking the resolver
        queued them behind a handful of threads)."""
        if _is_address(host):
            return [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]
        now = time.monotonic()
        known = self._dns.get((host, port))
        if known is None or known[0] < now:
            loop = asyncio.get_running_loop()
            lookup = loop.create_task(_lookup(loop, host, port))
            known = self._dns[(host, port)] = (now + _DNS_TTL, lookup)
        try:
            return await asyncio.shield(known[1])  # one waiter cancelled is not all of them
        except OSError:
            if self._dns.get((host, port)) is known:
                del self._dns[(host, port)]  # a failed lookup is asked again next time
            raise

    def _release(self, connection: _Connection) -> None:
        """``connection`` finished an exchange and may take another."""
        if self._closed:
            connection.abort()
            return
        idle = self._idle.get(connection.key)
        if idle is None:
            idle = self._idle[connection.key] = collections.deque()
        if len(idle) >= _MAX_IDLE:
            connection.abort()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        """``connection`` is closed."""
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)

    async def aclose(self) -> None:
        """Close every connection, idle or in use."""
        self._closed = True
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
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        start = f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n".encode("ascii")
        target = _Target((scheme, host, port), start)
        if len(self._targets) >= 256:  # a few per server; bound it anyway
            self._targets.clear()
        self._targets[url] = target
        return target

    def _block(self, headers: RawHeaders) -> bytes:
        lines = []
        for name, value in headers:
            if any(c in name or c in value for c in (b"\r", b"\n", b"\0")) or b":" in name:
                raise httpx.LocalProtocolError(f"header {name!r} cannot be sent")
            if name.lower() not in _OWN:
                lines.append(b"%s: %s\r\n" % (name, value))
        block = b"".join(lines)
        if len(self._blocks) >= 64:
            self._blocks.clear()
        self._blocks[headers] = block
        return block


class _Connection(asyncio.Protocol):
    """One connection, and the answer it is reading (a small state machine over its bytes)."""

    def __init__(self, wire: Wire, key: tuple[str, str, int]) -> None:
        self.wire = wire
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.usable = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[Read | httpx.Response] | None = None
        self._buffer = b""
        self._state = _DONE
        self._cap = 0
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0  # body bytes kept
        self._left = 0  # of a Content-Length body, or of the chunk being read
        self._keep = True
        self._encoded = False
        self._read_timeout: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio's side --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.usable = True
        self.wire._open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.usable = False
        self._stop_timer()
        self.wire._forget(self)
        if self._state == _UNTIL_CLOSE and exc is None:  # the end of a body read to the end
            self._finish(whole=True, reuse=False)
        elif self._waiter is not None and not self._waiter.done():
            why = "the server closed the connection before the answer was complete"
            if exc is not None:
                why += f" ({exc})"
            self._fail(httpx.RemoteProtocolError(why))

    def eof_received(self) -> bool:
        self.usable = False  # at once: connection_lost comes on the loop's next turn
        return False  # close our side too

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: not a connection to reuse
            self.abort()
            return
        if self._timer is not None:
            self._arm_timer()
        self._buffer = self._buffer + data if self._buffer else data
        try:
            self._parse()
        except httpx.RemoteProtocolError as exc:
            self._fail(exc)

    # -- the exchange ----------------------------------------------------------------------------
    def send(
        self, loop: asyncio.AbstractEventLoop, request: bytes, cap: int, read_timeout: float | None
    ) -> asyncio.Future[Read | httpx.Response]:
        """Write ``request``; the answer's future (on ``loop``, the running one)."""
        assert self.transport is not None
        self._waiter = waiter = loop.create_future()
        self._state = _HEAD
        self._cap = cap
        self._keep = True
        self._read_timeout = read_timeout
        self.usable = False
        if read_timeout is not None:
            self._arm_timer()
        try:
            self.transport.write(request)
        except Exception as exc:  # pragma: no cover - write buffers; a closed socket reports later
            self._fail(httpx.WriteError(str(exc)))
        return waiter

    def abort(self) -> None:
        self.usable = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        self._state = _DONE
        self._stop_timer()
        self.abort()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _finish(self, *, whole: bool, reuse: bool) -> None:
        """The answer is in: its body ``whole``, or cut at the cap; the connection may take
        another request if ``reuse`` (and the answer did not say ``Connection: close``)."""
        waiter, self._waiter = self._waiter, None
        self._state = _DONE
        self._stop_timer()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        headers, status = self._headers, self._status
        self._body, self._headers, self._buffer = [], [], b""
        transport = self.transport
        if whole and reuse and self._keep and transport is not None and not transport.is_closing():
            self.usable = True
            self.wire._release(self)
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

    def _keep_body(self, piece: bytes) -> bool:
        """Keep ``piece`` of the body; whether the cap still holds (else the answer is cut)."""
        room = self._cap + 1 - self._size
        if len(piece) >= room:
            self._body.append(piece[:room])
            self._size += room
            return False
        self._body.append(piece)
        self._size += len(piece)
        return True

    def _take_counted(self) -> bool:
        """Move the buffer's next bytes, up to ``_left`` (a declared length's, or a chunk's),
        into the body; ``False`` when that went over the cap and the answer is finished, cut."""
        left = self._left
        piece, self._buffer = self._buffer[:left], self._buffer[left:]
        self._left = left - len(piece)
        if self._keep_body(piece):
            return True
        self._finish(whole=False, reuse=False)
        return False

    def _parse(self) -> None:
        while True:
            state = self._state
            buffer = self._buffer
            if state == _HEAD:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > _MAX_HEAD:
                        raise httpx.RemoteProtocolError("the answer's head is too long")
                    return
                self._buffer = buffer[end + 4 :]
                self._head(buffer[:end])
            elif state == _LENGTH:
                if not buffer or not self._take_counted():
                    return
                if self._left == 0:
                    self._finish(whole=True, reuse=not self._buffer)
                    return
            elif state == _CHUNK_SIZE:
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 4096:
                        raise httpx.RemoteProtocolError("a chunk size line is too long")
                    return
                size = buffer[:end].split(b";", 1)[0].strip()
                if _CHUNK_SIZE_DIGITS.fullmatch(size) is None:
                    raise httpx.RemoteProtocolError(f"bad chunk size {size[:20]!r}")
                self._left = int(size, 16)
                self._buffer = buffer[end + 2 :]
                self._state = _CHUNK_DATA if self._left else _TRAILER
            elif state == _CHUNK_DATA:
                if not buffer or not self._take_counted():
                    return
                if self._left == 0:
                    self._state = _CHUNK_END
            elif state == _CHUNK_END:
                if len(buffer) < 2:
                    return
                if buffer[:2] != b"\r\n":
                    raise httpx.RemoteProtocolError("a chunk does not end with CRLF")
                self._buffer = buffer[2:]
                self._state = _CHUNK_SIZE
            elif state == _TRAILER:
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > _MAX_HEAD:
                        raise httpx.RemoteProtocolError("the answer's trailer is too long")
                    return
                self._buffer = buffer[end + 2 :]
                if end == 0:  # the empty line after the trailer fields
                    self._finish(whole=True, reuse=not self._buffer)
                    return
            elif state == _UNTIL_CLOSE:
                if buffer:
                    self._buffer = b""
                    if not self._keep_body(buffer):
                        self._finish(whole=False, reuse=False)
                return
            else:
                return

    def _head(self, head: bytes) -> None:
        """The status line and headers: how the body is framed (or none)."""
        lines = head.split(b"\r\n")
        line = lines[0]
        if not (line.startswith(b"HTTP/1.") and len(line) >= 12 and line[9:12].isdigit()):
            raise httpx.RemoteProtocolError(f"not an HTTP/1.x answer: {line[:40]!r}")
        status = int(line[9:12])
        if 100 <= status < 200:
            if status == 101:
                raise httpx.RemoteProtocolError("the server switched protocols")
            return  # an interim answer (100 Continue, 103 Early Hints): the final one follows
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = coded = False  # chunked framing; any transfer coding at all
        encoded = False  # a Content-Encoding: the body is httpx's to decode
        keep = line[7:8] == b"1"  # HTTP/1.1 keeps the connection unless told otherwise
        for field in lines[1:]:
            name, colon, value = field.partition(b":")
            if not colon or not name or name != name.strip():
                # The name only: a server that echoes the request's headers may echo its key.
                raise httpx.RemoteProtocolError(f"bad header line starting {name[:40]!r}")
            name = name.lower()
            value = value.strip()
            headers.append((name, value))
            if name == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise httpx.RemoteProtocolError(f"bad Content-Length {value[:20]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                coded = True
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
                if not chunked:  # a coding without chunked framing: read to the end
                    keep = False
            elif name == b"content-encoding":
                encoded = True
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                if b"close" in tokens:
                    keep = False
                elif b"keep-alive" in tokens:
                    keep = True
        self._status = status
        self._headers = headers
        self._keep = keep
        self._encoded = encoded
        self._size = 0
        if status >= 400:  # only an error message's first bytes are read (read_prefix)
            self._cap = min(self._cap, ERROR_BODY_BYTES)
        if status in (204, 304):
            self._finish(whole=True, reuse=not self._buffer)
        elif chunked:
            self._state = _CHUNK_SIZE
        elif length is not None and not coded:
            self._left = length
            self._state = _LENGTH
            if length == 0:
                self._finish(whole=True, reuse=not self._buffer)
            elif length > self._cap and status < 400:  # refused on its declared length unread
                self._finish(whole=False, reuse=False)
        else:
            self._keep = False
            self._state = _UNTIL_CLOSE

    # -- the read timeout --------------------------------------------------------------------
    def _arm_timer(self) -> None:
        self._stop_timer()
        assert self._read_timeout is not None
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._read_timeout, self._timed_out)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        self._fail(httpx.ReadTimeout(f"no answer within {self._read_timeout} s"))


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _lookup(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[tuple[int, str]]:
    """``host``'s addresses for a TCP connection, in the resolver's order, each once."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[tuple[int, str], None] = {}
    for family, _, _, _, sockaddr in infos:
        seen[(family, str(sockaddr[0]))] = None
    return list(seen)

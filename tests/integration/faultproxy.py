"""A fault-injecting HTTP/1.1 proxy for tests: it sits between dsclient and a real server.

    with FaultProxy("http://127.0.0.1:8000") as proxy:
        proxy.inject(Status(503, retry_after=0.2), times=3)
        async with dsclient.AsyncClient(proxy.url) as client:
            await client.generate("Hello", max_tokens=4)  # three 503s from the proxy, then vLLM
        assert proxy.fired["status"] == 3

The proxy runs its own asyncio loop in a background thread (plain asyncio streams), so sync and
async tests use it alike. It parses just enough HTTP/1.1 to know where each request and each
response ends, so keep-alive connections carry faulted and clean requests side by side.

Faults (what the proxy does instead of relaying a request faithfully):

=============================  ==================================================================
``Latency(s)``                 holds the request ``s`` seconds, then relays it
``Status(503, retry_after=)``  answers the status itself (vLLM's busy body), keeps the connection
``Garbage()``                  answers bytes that are not HTTP, then closes
``GarbageBody()``              answers 200 with a body that is not what the API promises (not
                               JSON; a stream's event not JSON)
``Reset()``                    resets the connection once the request is read (no answer at all)
``Truncate(after_bytes=)``     relays the head and part of the body, then closes cleanly (FIN)
``Drop(after_bytes=)``         the same cut, then resets (RST)
``Stall(after_bytes=0, ...)``  relays the head (``before_headers=True``: not even that) and part
                               of the body, then nothing, or one byte every ``trickle`` seconds
=============================  ==================================================================

``after_bytes`` counts body bytes as they go on the wire (chunk framing included); ``None`` cuts
half way through a ``Content-Length`` body, or after the first chunk of a chunked one (the first
server-sent event of a stream). A cut closes the upstream connection too, so the server stops.

Rules: ``inject(fault, times=1, paths=INFERENCE_PATHS, per="request")`` applies ``fault`` to the
next ``times`` requests to those paths (``times=None``: until :meth:`FaultProxy.clear`;
``paths=None``: any path). With ``per="connection"`` a rule takes the connection of the next
matching request: every later request to those paths on that connection gets the fault too, and
``times`` counts connections. Rules fire in the order they were injected. ``fired`` counts faults
that took effect by name (a cut that found the body already complete does not count).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import struct
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Literal

__all__ = [
    "INFERENCE_PATHS",
    "Drop",
    "Event",
    "Fault",
    "FaultProxy",
    "Garbage",
    "GarbageBody",
    "Latency",
    "Reset",
    "Stall",
    "Status",
    "Truncate",
]

#: The generation endpoints: where rules apply unless told otherwise (discovery, /tokenize and
#: the /metrics poller pass untouched).
INFERENCE_PATHS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")

_READ = 64 * 1024
_HEAD_LIMIT = 1024 * 1024

#: vLLM 0.32's own answer when its admission queue is full (ENVIRONMENT.md).
BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "The engine is currently busy and cannot accept new requests. Please try "
            "again later or on a different instance.",
            "type": "Service Unavailable",
            "param": None,
            "code": 503,
        }
    }
).encode()

_REASONS = {
    200: "OK",
    408: "Request Timeout",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


# -- faults ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Latency:
    """Hold the request ``seconds`` before relaying it."""

    seconds: float
    name: str = field(default="latency", init=False)


@dataclass(frozen=True)
class Status:
    """Answer ``status`` from the proxy (the server never sees the request)."""

    status: int = 503
    _: KW_ONLY
    retry_after: float | None = None
    retry_after_ms: float | None = None
    body: bytes = BUSY_BODY
    name: str = field(default="status", init=False)


@dataclass(frozen=True, kw_only=True)
class Garbage:
    """Answer ``data`` (not HTTP), then close."""

    data: bytes = b"\x00\xff\xfe SSH-2.0-not-http \x1b[0m\r\n\r\n"
    name: str = field(default="garbage", init=False)


@dataclass(frozen=True, kw_only=True)
class GarbageBody:
    """Answer 200 with a body that is not what the API promises: not JSON, or, for a streaming
    request, a server-sent event that is not JSON."""

    name: str = field(default="garbage_body", init=False)


@dataclass(frozen=True, kw_only=True)
class Reset:
    """Reset the connection (RST) once the request is read: no answer at all."""

    name: str = field(default="reset", init=False)


@dataclass(frozen=True, kw_only=True)
class Truncate:
    """Relay the head and ``after_bytes`` of the body, then close the connection (FIN)."""

    after_bytes: int | None = None
    name: str = field(default="truncate", init=False)


@dataclass(frozen=True, kw_only=True)
class Drop:
    """Relay the head and ``after_bytes`` of the body, then reset the connection (RST)."""

    after_bytes: int | None = None
    name: str = field(default="drop", init=False)


@dataclass(frozen=True, kw_only=True)
class Stall:
    """Relay the head (unless ``before_headers``) and ``after_bytes`` of the body, then send
    nothing (``trickle=None``) or one byte every ``trickle`` seconds, until the client leaves."""

    after_bytes: int | None = 0
    before_headers: bool = False
    trickle: float | None = None
    name: str = field(default="stall", init=False)


Fault = Latency | Status | Garbage | GarbageBody | Reset | Truncate | Drop | Stall


# -- HTTP/1.1, just enough ----------------------------------------------------------------------
class _ProtocolError(Exception):
    """A peer sent something this proxy cannot frame."""


@dataclass
class _Request:
    head: bytes
    body: bytes
    method: str
    path: str
    keep_alive: bool
    stream: bool


@dataclass
class _ResponseHead:
    raw: bytes
    status: int
    framing: Literal["none", "length", "chunked", "close"]
    length: int
    keep_alive: bool


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise _ProtocolError(f"bad header line {line!r}")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return lines[0], headers


def _wants_close(version: str, headers: dict[str, str]) -> bool:
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    return "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """One message head, ``None`` at a clean end of stream."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise _ProtocolError("connection closed inside a message head") from exc
    except asyncio.LimitOverrunError as exc:
        raise _ProtocolError("message head too large") from exc


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """A chunked body, one raw chunk (size line, data, CRLF) at a time; the last piece is the
    zero chunk with its trailers."""
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise _ProtocolError(f"bad chunk size line {line!r}") from exc
        if size == 0:
            tail = b""
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                tail += trailer
            yield line + tail + b"\r\n"
            return
        yield line + await reader.readexactly(size + 2)


async def _fixed(reader: asyncio.StreamReader, length: int) -> AsyncIterator[bytes]:
    left = length
    while left > 0:
        piece = await reader.read(min(left, _READ))
        if not piece:
            raise _ProtocolError(f"body ended {left} bytes early")
        left -= len(piece)
        yield piece


async def _until_close(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while piece := await reader.read(_READ):
        yield piece


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    head = await _read_head(reader)
    if head is None:
        return None
    start, headers = _headers(head)
    parts = start.split(" ")
    if len(parts) != 3:
        raise _ProtocolError(f"bad request line {start!r}")
    method, target, version = parts
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = b"".join([piece async for piece in _chunks(reader)])
    else:
        length = int(headers.get("content-length", "0") or 0)
        body = await reader.readexactly(length) if length else b""
    stream = False
    if body and "json" in headers.get("content-type", ""):
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            data = json.loads(body)
            stream = isinstance(data, dict) and data.get("stream") is True
    return _Request(
        head=head,
        body=body,
        method=method,
        path=target.split("?", 1)[0],
        keep_alive=not _wants_close(version, headers),
        stream=stream,
    )


async def _read_response_head(reader: asyncio.StreamReader, method: str) -> _ResponseHead:
    head = await _read_head(reader)
    if head is None:
        raise _ProtocolError("upstream closed without answering")
    start, headers = _headers(head)
    parts = start.split(" ", 2)
    try:
        version, status = parts[0], int(parts[1])
    except (IndexError, ValueError) as exc:
        raise _ProtocolError(f"bad status line {start!r}") from exc
    framing: Literal["none", "length", "chunked", "close"]
    length = 0
    if method == "HEAD" or status < 200 or status in (204, 304):
        framing = "none"
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        framing = "chunked"
    elif "content-length" in headers:
        framing, length = "length", int(headers["content-length"])
    else:
        framing = "close"
    keep = framing != "close" and not _wants_close(version, headers)
    return _ResponseHead(head, status, framing, length, keep)


def _body(reader: asyncio.StreamReader, head: _ResponseHead) -> AsyncIterator[bytes]:
    if head.framing == "chunked":
        return _chunks(reader)
    if head.framing == "length":
        return _fixed(reader, head.length)
    if head.framing == "close":
        return _until_close(reader)
    return _fixed(reader, 0)


def _answer(status: int, body: bytes, content_type: str, extra: Iterable[str] = ()) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}",
        f"content-type: {content_type}",
        f"content-length: {len(body)}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset: linger on, timeout zero, then abort."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# -- the proxy ----------------------------------------------------------------------------------
@dataclass
class _Rule:
    fault: Fault
    times: int | None
    paths: tuple[str, ...] | None
    per: Literal["request", "connection"]

    def matches(self, path: str) -> bool:
        return self.paths is None or path in self.paths


@dataclass(frozen=True)
class Event:
    """One request the proxy saw: its connection, method, path and the fault chosen (if any)."""

    connection: int
    method: str
    path: str
    fault: str | None


class _Upstream:
    """The upstream connection of one client connection, opened on first use."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(
                self._host, self._port, limit=_HEAD_LIMIT
            )
        return self.reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class FaultProxy:
    """An HTTP/1.1 proxy in a background thread that injects the faults it is told to.

        with FaultProxy(server.url) as proxy:
            proxy.inject(Truncate(), times=1)
            ...  # point the client at proxy.url

    Parameters:
        upstream: the server's root URL (``http://host:port``).
    """

    def __init__(self, upstream: str) -> None:
        rest = upstream.split("://", 1)[-1].split("/", 1)[0]
        host, _, port = rest.rpartition(":")
        self._upstream = (host or "127.0.0.1", int(port))
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._bound: dict[int, _Rule] = {}
        self._fired: Counter[str] = Counter()
        self._events: list[Event] = []
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    def __repr__(self) -> str:
        return f"FaultProxy({self.url!r} -> {self._upstream[0]}:{self._upstream[1]})"

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Listen on a free loopback port (see :attr:`url`)."""
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start within 10 s")
        if self._error is not None:
            raise RuntimeError("the fault proxy failed to start") from self._error

    def close(self) -> None:
        """Stop listening, cut every open connection and join the thread."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already stopped
                loop.call_soon_threadsafe(stop.set)
        if thread is not None:
            thread.join(10)
            if thread.is_alive():
                raise RuntimeError("the fault proxy's thread did not stop within 10 s")
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return len(self._tasks)

    # -- rules --------------------------------------------------------------------------------
    def inject(
        self,
        fault: Fault,
        *,
        times: int | None = 1,
        paths: Iterable[str] | None = INFERENCE_PATHS,
        per: Literal["request", "connection"] = "request",
    ) -> None:
        """Apply ``fault`` to the next ``times`` matching requests (or connections)."""
        if times is not None and (isinstance(times, bool) or times < 1):
            raise ValueError(f"times must be >= 1 or None, got {times!r}")
        if per not in ("request", "connection"):
            raise ValueError(f"per must be 'request' or 'connection', got {per!r}")
        rule = _Rule(fault, times, tuple(paths) if paths is not None else None, per)
        with self._lock:
            self._rules.append(rule)

    def clear(self) -> None:
        """Forget every rule, connection-wide ones included: from now on the proxy relays."""
        with self._lock:
            self._rules.clear()
            self._bound.clear()

    @property
    def pending(self) -> int:
        """Requests (or connections) that counted rules have still to fault."""
        with self._lock:
            return sum(r.times or 0 for r in self._rules)

    @property
    def fired(self) -> Counter[str]:
        """Faults that took effect, by name (a copy)."""
        with self._lock:
            return Counter(self._fired)

    @property
    def events(self) -> list[Event]:
        """Every request seen, in order (a copy)."""
        with self._lock:
            return list(self._events)

    def _choose(self, connection: int, request: _Request) -> Fault | None:
        with self._lock:
            fault: Fault | None = None
            bound = self._bound.get(connection)
            if bound is not None:
                if bound.matches(request.path):
                    fault = bound.fault
            else:
                for rule in self._rules:
                    if not rule.matches(request.path):
                        continue
                    if rule.times is not None:
                        rule.times -= 1
                        if rule.times == 0:
                            self._rules.remove(rule)
                    if rule.per == "connection":
                        self._bound[connection] = rule
                    fault = rule.fault
                    break
            name = fault.name if fault is not None else None
            self._events.append(Event(connection, request.method, request.path, name))
            return fault

    def _count(self, name: str) -> None:
        with self._lock:
            self._fired[name] += 1

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # start() is waiting for it
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0, limit=_HEAD_LIMIT)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        connection = next(self._ids)
        upstream = _Upstream(*self._upstream)
        try:
            while (request := await _read_request(reader)) is not None:
                fault = self._choose(connection, request)
                if not await self._handle(request, fault, reader, writer, upstream):
                    break
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # either side went away mid-message: this connection is over
        except _ProtocolError:
            pass  # either side spoke something this proxy cannot frame
        except asyncio.CancelledError:
            # The proxy is closing. Ending normally keeps asyncio's stream callback quiet (on
            # 3.11 it calls task.exception() on the finished task, which raises when cancelled).
            pass
        finally:
            upstream.close()
            if not writer.transport.is_closing():
                writer.close()
            self._tasks.discard(task)

    async def _handle(
        self,
        request: _Request,
        fault: Fault | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: _Upstream,
    ) -> bool:
        """Serve one request with its fault; whether the client connection stays open.

        A fault is counted before the client can see its effect, so that a test reading
        :attr:`fired` after a call returns never misses it.
        """
        if isinstance(fault, Status):
            extra = []
            if fault.retry_after is not None:
                extra.append(f"retry-after: {fault.retry_after:g}")
            if fault.retry_after_ms is not None:
                extra.append(f"retry-after-ms: {fault.retry_after_ms:g}")
            self._count(fault.name)
            writer.write(_answer(fault.status, fault.body, "application/json", extra))
            await writer.drain()
            return request.keep_alive
        if isinstance(fault, Garbage):
            self._count(fault.name)
            writer.write(fault.data)
            await writer.drain()
            return False
        if isinstance(fault, GarbageBody):
            self._count(fault.name)
            if request.stream:
                body = b"data: {not json at all\n\ndata: [DONE]\n\n"
                writer.write(_answer(200, body, "text/event-stream"))
            else:
                writer.write(_answer(200, b"<html>not json</html>", "application/json"))
            await writer.drain()
            return request.keep_alive
        if isinstance(fault, Reset):
            self._count(fault.name)
            _reset(writer)
            return False
        if isinstance(fault, Stall) and fault.before_headers:
            self._count(fault.name)
            await _until_client_leaves(reader)
            return False
        if isinstance(fault, Latency):
            await asyncio.sleep(fault.seconds)
            self._count(fault.name)
        return await self._relay(request, fault, reader, writer, upstream)

    async def _relay(
        self,
        request: _Request,
        fault: Fault | None,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: _Upstream,
    ) -> bool:
        up_reader, up_writer = await upstream.open()
        up_writer.write(request.head + request.body)
        await up_writer.drain()
        head = await _read_response_head(up_reader, request.method)
        pieces = aiter(_body(up_reader, head))
        writer.write(head.raw)
        if not isinstance(fault, (Truncate, Drop, Stall)):
            async for piece in pieces:
                writer.write(piece)
                await writer.drain()
            await writer.drain()
            if not head.keep_alive:
                upstream.close()
            return request.keep_alive and head.keep_alive
        limit = fault.after_bytes
        if limit is None and head.framing == "length":
            limit = head.length // 2
        cut, rest = await _relay_part(pieces, writer, limit)
        if not cut:  # the body was shorter than the cut: it went through whole
            await writer.drain()
            return request.keep_alive and head.keep_alive
        self._count(fault.name)
        # The cut ends this exchange, and the server stops working on it.
        if isinstance(fault, Truncate):
            upstream.close()
            await writer.drain()
            return False
        if isinstance(fault, Drop):
            upstream.close()
            _reset(writer)
            return False
        if fault.trickle is None:
            upstream.close()
            await _until_client_leaves(reader)
            return False
        await _trickle(rest, pieces, writer, fault.trickle)
        return False


async def _relay_part(
    pieces: AsyncIterator[bytes], writer: asyncio.StreamWriter, limit: int | None
) -> tuple[bool, bytes]:
    """Relay body pieces up to ``limit`` wire bytes (``None``: the first piece).

    Returns ``(cut, rest)``: whether body was left unsent, and the unsent part of the piece in
    hand (the pieces after it are still in ``pieces``).
    """
    sent = 0
    await writer.drain()  # the head
    async for piece in pieces:
        if limit is None:
            limit = len(piece)
        room = limit - sent
        if room <= 0:
            return True, piece
        if len(piece) > room:
            writer.write(piece[:room])
            await writer.drain()
            return True, piece[room:]
        writer.write(piece)
        await writer.drain()
        sent += len(piece)
    return False, b""


async def _trickle(
    rest: bytes, pieces: AsyncIterator[bytes], writer: asyncio.StreamWriter, every: float
) -> None:
    """Send the rest of the body one byte every ``every`` seconds (slowloris)."""
    piece: bytes | None = rest
    while piece is not None:
        for i in range(len(piece)):
            await asyncio.sleep(every)
            writer.write(piece[i : i + 1])
            await writer.drain()
        piece = await anext(pieces, None)


async def _until_client_leaves(reader: asyncio.StreamReader) -> None:
    """Hold the connection until the client closes it (or the proxy stops)."""
    while await reader.read(_READ):
        pass

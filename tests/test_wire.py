"""dsclient's own HTTP/1.1 connections (dsclient/_wire.py) against a real socket server that
answers each path with scripted bytes: framing (length, chunked, to the end), reuse and when a
connection is not reused, the cap, errors, cancellation, the read timeout and closing."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import random
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dsclient import _wire as wire_module
from dsclient._exceptions import ERROR_BODY_BYTES
from dsclient._wire import ERROR_BODY_BYTES as WIRE_ERROR_BYTES
from dsclient._wire import Read, Wire

pytestmark = pytest.mark.anyio

HEADERS = ((b"Content-Type", b"application/json"), (b"User-Agent", b"dsclient-test"))
BODY = json.dumps({"choices": [{"text": " the sea"}]}).encode()

Script = Callable[[asyncio.StreamWriter, bytes], Awaitable[None]]


def _ok(body: bytes = BODY, extra: bytes = b"", status: bytes = b"200 OK") -> bytes:
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%s" % (status, extra)
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


async def _write(data: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(data)
    await writer.drain()


def _chunked(writer: asyncio.StreamWriter, request: bytes) -> Awaitable[None]:
    half = len(BODY) // 2
    data = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x;ext=1\r\n%s\r\n" % (half, BODY[:half])
        + b"%x\r\n%s\r\n" % (len(BODY) - half, BODY[half:])
        + b"0\r\nx-trailer: 1\r\n\r\n"
    )

    async def byte_by_byte() -> None:
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0)

    return byte_by_byte()


async def _to_the_end(writer: asyncio.StreamWriter, request: bytes) -> None:
    await _write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + BODY, writer)
    writer.close()


async def _silent(writer: asyncio.StreamWriter, request: bytes) -> None:
    await asyncio.sleep(30)


async def _slow_body(writer: asyncio.StreamWriter, request: bytes) -> None:
    await _write(_ok()[:-5], writer)
    await asyncio.sleep(30)


async def _hang_up(writer: asyncio.StreamWriter, request: bytes) -> None:
    writer.close()


async def _cut(writer: asyncio.StreamWriter, request: bytes) -> None:
    await _write(_ok()[:-5], writer)
    writer.close()


async def _trailers_forever(writer: asyncio.StreamWriter, request: bytes) -> None:
    await _write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n", writer)
    for i in itertools.count():
        await _write(b"x-trailer-%d: %s\r\n" % (i, b"t" * 100), writer)


async def _interim_forever(writer: asyncio.StreamWriter, request: bytes) -> None:
    while True:
        await _write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n", writer)


async def _header_forever(writer: asyncio.StreamWriter, request: bytes) -> None:
    await _write(b"HTTP/1.1 200 OK\r\nx-long: ", writer)
    while True:
        await _write(b"v" * 4096, writer)


async def _trickle(writer: asyncio.StreamWriter, request: bytes) -> None:
    """An answer in pieces 0.1 s apart: slower as a whole than the read timeout, never silent."""
    for i in range(len(answer := _ok())):
        await _write(answer[i : i + 1], writer)
        await asyncio.sleep(0.1 if i % 10 == 0 else 0)


async def _forget_the_second(writer: asyncio.StreamWriter, request: bytes) -> None:
    """Answers the first request on a connection; closes it, unanswered, on the next (a server
    that closed an idle connection as the request went out)."""
    seen = _SEEN.setdefault(writer, 0)
    _SEEN[writer] = seen + 1
    if seen:
        writer.close()
    else:
        await _write(_ok(), writer)


async def _half_then_close_the_second(writer: asyncio.StreamWriter, request: bytes) -> None:
    seen = _SEEN.setdefault(writer, 0)
    _SEEN[writer] = seen + 1
    if seen:
        await _write(_ok()[:20], writer)
        writer.close()
    else:
        await _write(_ok(), writer)


_SEEN: dict[asyncio.StreamWriter, int] = {}


SCRIPTS: dict[str, Script] = {
    "/ok": lambda w, r: _write(_ok(), w),
    "/echo": lambda w, r: _write(_ok(r), w),
    "/chunked": _chunked,
    "/to-the-end": _to_the_end,
    "/close": lambda w, r: _write(_ok(extra=b"Connection: close\r\n"), w),
    "/http10": lambda w, r: _write(_ok().replace(b"HTTP/1.1", b"HTTP/1.0"), w),
    "/continue": lambda w, r: _write(b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(), w),
    "/no-content": lambda w, r: _write(b"HTTP/1.1 204 No Content\r\n\r\n", w),
    "/big": lambda w, r: _write(_ok(b"x" * 5000), w),
    "/big-chunked": lambda w, r: _write(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"1388\r\n" + b"x" * 5000, w
    ),
    "/refused": lambda w, r: _write(_ok(b'{"error": "busy"}', status=b"429 Too Many"), w),
    "/error-page": lambda w, r: _write(_ok(b"e" * 100_000, status=b"500 Oops"), w),
    "/gzip": lambda w, r: _write(_ok(gzip.compress(BODY), b"content-encoding: gzip\r\n"), w),
    "/garbage": lambda w, r: _write(b"SSH-2.0-OpenSSH\r\n\r\n", w),
    "/bad-chunk": lambda w, r: _write(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", w
    ),
    "/extra": lambda w, r: _write(_ok() + b"HTTP/1.1 200 OK\r\n", w),
    "/echo-key": lambda w, r: _write(
        b"HTTP/1.1 200 OK\r\n Authorization: Bearer sk-secret-key\r\n\r\n", w
    ),
    "/silent": _silent,
    "/slow-body": _slow_body,
    "/hang-up": _hang_up,
    "/cut": _cut,
    "/trailers-forever": _trailers_forever,
    "/interim-forever": _interim_forever,
    "/header-forever": _header_forever,
    "/many-headers": lambda w, r: _write(
        _ok(extra=b"".join(b"x-%d: 1\r\n" % i for i in range(200))), w
    ),
    "/trickle": _trickle,
    "/forget-the-second": _forget_the_second,
    "/half-then-close-the-second": _half_then_close_the_second,
    "/keep-alive-1s": lambda w, r: _write(_ok(extra=b"Keep-Alive: timeout=1, max=100\r\n"), w),
    # Framing that RFC 9112 and llhttp refuse and the hand-written parser took (issue 42, item 5).
    "/length-and-chunked": lambda w, r: _write(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 7\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n",
        w,
    ),
    "/gzip-chunked": lambda w, r: _write(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(gzip.compress(BODY)), gzip.compress(BODY)),
        w,
    ),
    "/bare-lf": lambda w, r: _write(_ok().replace(b"\r\n", b"\n"), w),
    "/status-2000": lambda w, r: _write(_ok(status=b"2000 OK"), w),
    "/status-200OK": lambda w, r: _write(_ok(status=b"200OK"), w),
    "/lf-in-value": lambda w, r: _write(
        b"HTTP/1.1 200 OK\r\nx-a: 1\ncontent-length: 2\r\ncontent-length: %d\r\n\r\n%s"
        % (len(BODY), BODY),
        w,
    ),
}


class Server:
    """A socket server in the test's loop; ``connections`` counts the connections it took."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                path = head.split(b" ")[1].decode().split("?")[0]
                await SCRIPTS[path](writer, body)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went, or the test ended
        finally:
            writer.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Server, str]]:
    server = Server()
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        for writer in server.writers:
            writer.close()
        listening.close()


@pytest.fixture
async def wire() -> AsyncIterator[Wire]:
    wire = Wire()
    try:
        yield wire
    finally:
        await wire.aclose()


async def _post(wire: Wire, url: str, *, cap: int = 1000, **kw: float) -> Read | httpx.Response:
    return await wire.post(url, HEADERS, b'{"prompt": "hi"}', read_up_to=cap, **kw)


async def test_a_length_answer_is_read_whole_and_its_connection_reused(served, wire):
    server, url = served
    for _ in range(3):
        answer = await _post(wire, url + "/ok")
        assert isinstance(answer, Read)
        assert answer.status_code == 200 and answer.content == BODY
        assert answer.headers["Content-Type"] == "application/json"  # names in any case
    assert server.connections == 1


async def test_the_request_carries_the_callers_headers_once_and_its_body(served, wire):
    server, url = served
    headers = (*HEADERS, (b"Host", b"elsewhere"), (b"Content-Length", b"999"))
    answer = await wire.post(url + "/echo?x=1", headers, b"[1, 2]", read_up_to=1000)
    assert answer.content == b"[1, 2]"
    lines = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert lines[0] == b"POST /echo?x=1 HTTP/1.1"
    names = sorted(line.split(b":")[0].lower() for line in lines[1:])
    assert names == [b"content-length", b"content-type", b"host", b"user-agent"]
    assert b"Host: " + url[7:].encode() in lines


async def test_a_chunked_answer_in_pieces_is_joined_and_its_connection_reused(served, wire):
    server, url = served
    for _ in range(2):
        answer = await _post(wire, url + "/chunked")
        assert isinstance(answer, Read) and answer.content == BODY
    assert server.connections == 1


@pytest.mark.parametrize("path", ["/to-the-end", "/close", "/http10"])
async def test_an_answer_that_ends_its_connection_is_read_and_the_connection_not_reused(
    served, wire, path
):
    server, url = served
    for _ in range(2):
        answer = await _post(wire, url + path)
        assert isinstance(answer, Read) and answer.content == BODY
    assert server.connections == 2


async def test_an_interim_answer_is_skipped_and_no_content_has_no_body(served, wire):
    _, url = served
    assert (await _post(wire, url + "/continue")).content == BODY
    answer = await _post(wire, url + "/no-content")
    assert isinstance(answer, Read) and (answer.status_code, answer.content) == (204, b"")


async def test_a_body_over_the_cap_comes_back_cut_and_its_connection_closed(served, wire):
    server, url = served
    declared = await _post(wire, url + "/big")  # refused on its Content-Length, unread
    assert isinstance(declared, httpx.Response) and declared.headers["content-length"] == "5000"
    assert len(declared.content) <= 1001
    chunked = await _post(wire, url + "/big-chunked")
    assert isinstance(chunked, httpx.Response) and len(chunked.content) == 1001
    assert (await _post(wire, url + "/ok")).content == BODY
    assert server.connections == 3


async def test_an_error_comes_back_as_a_response_with_its_first_bytes(served, wire):
    server, url = served
    refused = await _post(wire, url + "/refused", cap=2**20)
    assert isinstance(refused, httpx.Response) and refused.status_code == 429
    assert refused.content == b'{"error": "busy"}'
    page = await _post(wire, url + "/error-page", cap=2**20)
    assert page.status_code == 500 and len(page.content) == ERROR_BODY_BYTES + 1
    assert WIRE_ERROR_BYTES == ERROR_BODY_BYTES
    await _post(wire, url + "/ok")
    assert server.connections == 2  # the small refusal's connection was reused


async def test_an_encoded_answer_is_left_for_httpx_to_decode(served, wire):
    _, url = served
    answer = await _post(wire, url + "/gzip")
    assert isinstance(answer, httpx.Response)
    assert answer.content == BODY  # httpx decodes what the wire read


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/hang-up", httpx.RemoteProtocolError),
        ("/cut", httpx.RemoteProtocolError),
        ("/garbage", httpx.RemoteProtocolError),
        ("/bad-chunk", httpx.RemoteProtocolError),
    ],
)
async def test_a_broken_answer_is_httpxs_error_and_the_next_call_gets_a_new_connection(
    served, wire, path, error
):
    server, url = served
    with pytest.raises(error):
        await _post(wire, url + path)
    assert (await _post(wire, url + "/ok")).content == BODY
    assert server.connections == 2


async def test_a_malformed_header_is_named_without_its_value(served, wire):
    _, url = served
    with pytest.raises(httpx.RemoteProtocolError) as bad:
        await _post(wire, url + "/echo-key")
    assert "Authorization" in str(bad.value) and "sk-secret-key" not in str(bad.value)


async def test_bytes_after_the_answer_close_the_connection(served, wire):
    server, url = served
    assert (await _post(wire, url + "/extra")).content == BODY
    assert (await _post(wire, url + "/ok")).content == BODY
    assert server.connections == 2


async def test_a_refused_connection_is_a_connect_error(wire):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(httpx.ConnectError):
        await _post(wire, f"http://127.0.0.1:{port}/ok")


async def test_a_host_name_is_looked_up_once_for_the_connections_opened_together(
    served, wire, monkeypatch
):
    server, url = served
    lookups: list[str] = []
    lookup = wire_module._lookup

    async def counted(loop: asyncio.AbstractEventLoop, host: str, port: int) -> object:
        lookups.append(host)
        return await lookup(loop, host, port)

    monkeypatch.setattr(wire_module, "_lookup", counted)
    named = url.replace("127.0.0.1", "localhost")
    answers = await asyncio.gather(*(_post(wire, named + "/ok") for _ in range(5)))
    assert [a.content for a in answers] == [BODY] * 5
    assert lookups == ["localhost"] and server.connections == 5
    with pytest.raises(httpx.ConnectError, match="no-such-host.invalid"):
        await _post(wire, "http://no-such-host.invalid:80/ok")
    with pytest.raises(httpx.ConnectError):  # a failed lookup is not kept: asked again
        await _post(wire, "http://no-such-host.invalid:80/ok")
    assert lookups == ["localhost"] + ["no-such-host.invalid"] * 2


async def test_a_cancelled_call_closes_its_connection(served, wire):
    server, url = served
    task = asyncio.ensure_future(_post(wire, url + "/slow-body"))
    while not server.requests:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the head and part of the body are in
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await _post(wire, url + "/ok")).content == BODY
    assert server.connections == 2


async def test_the_read_timeout_bounds_a_silent_server(served, wire):
    _, url = served
    with pytest.raises(httpx.ReadTimeout):
        await _post(wire, url + "/silent", read_timeout=0.2)


async def test_a_header_with_a_line_break_is_refused_before_sending(served, wire):
    server, url = served
    with pytest.raises(httpx.LocalProtocolError):
        await wire.post(url + "/ok", ((b"X-Evil", b"a\r\nHost: b"),), b"{}", read_up_to=10)
    assert server.connections == 0


async def test_aclose_closes_idle_and_busy_connections(served):
    server, url = served
    wire = Wire()
    busy = asyncio.ensure_future(_post(wire, url + "/silent"))
    while not server.requests:
        await asyncio.sleep(0.01)
    await _post(wire, url + "/ok")  # on a second connection, idle after it
    assert len(wire._open) == 2
    await wire.aclose()
    with pytest.raises(httpx.RemoteProtocolError):
        await busy
    assert not wire._open
    with pytest.raises(RuntimeError, match="closed"):
        await _post(wire, url + "/ok")


async def test_a_connection_the_server_closed_while_idle_is_not_used(served, wire):
    server, url = served
    await _post(wire, url + "/ok")
    for writer in server.writers:
        writer.close()
    for _ in range(500):  # until the wire has heard of it (a busy machine takes a while)
        if not any(c.usable for idle in wire._idle.values() for c in idle):
            break
        await asyncio.sleep(0.01)
    assert (await _post(wire, url + "/ok")).content == BODY
    assert server.connections == 2


def test_what_a_url_comes_to_on_the_wire():
    wire = Wire()
    assert wire._target("http://[::1]:8000/v1/x?a=b").start == (
        b"POST /v1/x?a=b HTTP/1.1\r\nHost: [::1]:8000\r\n"
    )
    assert wire._target("https://example.com/v1").key == ("https", "example.com", 443)
    assert wire._target("http://example.com").start == (b"POST / HTTP/1.1\r\nHost: example.com\r\n")
    assert Wire.takes("http://x") and Wire.takes("https://x:8443/v1?a=b@c")
    assert not Wire.takes("unix:///s")
    assert not Wire.takes("http://user:key@x/v1")  # aiohttp sends it as basic auth
    assert not Wire.takes("http://bücher.example/v1")  # aiohttp encodes the name


async def test_https_verifies_the_servers_certificate_and_name(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    make = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    make += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
    make += ["-addext", "subjectAltName=DNS:localhost"]
    subprocess.run(make, check=True, capture_output=True)
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(cert, key)
    server = Server()
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=serving)
    port = listening.sockets[0].getsockname()[1]
    trusting = ssl.create_default_context(cafile=str(cert))
    wire = Wire(lambda: trusting)  # made on the first https connection
    try:
        answer = await _post(wire, f"https://localhost:{port}/ok")
        assert isinstance(answer, Read) and answer.content == BODY
        with pytest.raises(httpx.ConnectError, match="certificate"):  # not the name it is for
            await _post(wire, f"https://127.0.0.1:{port}/ok")
        with pytest.raises(httpx.ConnectError, match="certificate"):  # nobody vouches for it
            await _post(Wire(), f"https://localhost:{port}/ok")
    finally:
        await wire.aclose()
        for writer in server.writers:
            writer.close()
        listening.close()


class _Transport(asyncio.Transport):
    """Enough of a transport for a connection fed by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.aborted = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += data

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


def _fed(answer: bytes, cuts: list[int], cap: int = 10_000) -> tuple[object, bool]:
    """What a connection makes of ``answer`` arriving in pieces cut at ``cuts``, and whether
    it would be reused."""
    loop = asyncio.new_event_loop()
    try:
        wire = Wire()
        connection = wire_module._Connection(wire, ("http", "h", 80))
        transport = _Transport()
        connection.connection_made(transport)
        waiter = connection.send(loop, b"POST / HTTP/1.1\r\n\r\n", cap, None, True)
        edges = [0, *sorted(set(cuts)), len(answer)]
        for start, end in itertools.pairwise(edges):
            if start < end and not waiter.done():
                connection.data_received(answer[start:end])
        if not waiter.done():
            connection.connection_lost(None)
        result = waiter.exception() or waiter.result()
        return result, not transport.aborted
    finally:
        loop.close()


@given(
    body=st.binary(max_size=300),
    sizes=st.lists(st.integers(1, 40), max_size=12),
    cuts=st.lists(st.integers(0, 2000), max_size=30),
)
def test_an_answer_in_any_pieces_reads_the_same(body, sizes, cuts):
    chunks, rest = [], body
    for size in sizes:  # the body in chunks of these sizes, the rest in one
        chunks.append(rest[:size])
        rest = rest[size:]
    chunks = [c for c in [*chunks, rest] if c]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    answers = {
        "length": (_ok(body), True),
        "chunked": (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked, True),
        "to the end": (b"HTTP/1.1 200 OK\r\n\r\n" + body, False),
    }
    for answer, reused in answers.values():
        result, kept = _fed(answer, [c % (len(answer) + 1) for c in cuts])
        assert isinstance(result, Read) and result.content == body
        assert kept == reused


@given(cut=st.integers(1, 200))
def test_an_answer_cut_short_is_an_error_not_a_shorter_answer(cut):
    answer = _ok(BODY)
    result, kept = _fed(answer[: min(cut, len(answer) - 1)], [])
    assert isinstance(result, httpx.RemoteProtocolError) and not kept


# -- issue 42: each hole found in the hand-written wire, against a real socket ------------------
class _DeadAddress:
    """A listener on 127.0.0.2 whose accept queue is full: a connect to it hangs (its SYNs are
    dropped), as to a dual-stack name's broken address. Loopback only."""

    def __enter__(self) -> int:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.2", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.fillers = []
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.2", self.port))
            self.fillers.append(filler)
        return self.port

    def __exit__(self, *exc: object) -> None:
        for filler in self.fillers:
            filler.close()
        self.listener.close()


def _info(address: str, port: int) -> tuple:
    return (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))


async def test_a_name_whose_first_address_is_dead_connects_to_the_next_one(served):
    server, url = served
    port = int(url.rsplit(":", 1)[1])
    with _DeadAddress() as dead_port:
        assert dead_port  # a connect to 127.0.0.2 hangs; the same port on 127.0.0.1 answers
        probe = socket.socket()
        probe.settimeout(0.3)
        with pytest.raises(TimeoutError):
            probe.connect(("127.0.0.2", dead_port))
        probe.close()

        async def resolve(host: str, _: int) -> list:
            assert host == "dual.test"
            return [_info("127.0.0.2", dead_port), _info("127.0.0.1", port)]

        wire = Wire(resolver=resolve)
        try:
            start = asyncio.get_running_loop().time()
            answer = await _post(wire, f"http://dual.test:{port}/ok", connect_timeout=2.0)
            took = asyncio.get_running_loop().time() - start
            assert isinstance(answer, Read) and answer.content == BODY
            assert took < 1.5  # the hand-written wire: ConnectTimeout after 2.0 s, every time
            assert server.requests[0].split(b"\r\n")[1] == f"Host: dual.test:{port}".encode()
        finally:
            await wire.aclose()


async def test_chunks_of_one_byte_are_read_in_linear_time(served, wire):
    _, url = served
    body = bytes(range(256)) * 1024  # 256 KiB, one chunk a byte: 558 ms by hand, quadratic
    data = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    data += b"".join(b"1\r\n%s\r\n" % body[i : i + 1] for i in range(len(body))) + b"0\r\n\r\n"
    SCRIPTS["/one-byte-chunks"] = lambda w, r: _write(data, w)
    cpu = time.process_time()
    answer = await _post(wire, url + "/one-byte-chunks", cap=2**20)
    assert answer.content == body
    assert time.process_time() - cpu < 0.5  # ~0.05 s here; the server's writing counted in it


async def test_a_connection_the_server_closed_while_the_loop_was_busy_is_not_reused(monkeypatch):
    """The server (a thread) closes the idle connection while the loop is blocked: the wire's
    flags still say open, the socket says readable; the call goes on a new connection."""
    closed, connections = threading.Event(), []
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn)
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(b'"hi"}'):
                data += conn.recv(65536)
            conn.sendall(_ok())
            if len(connections) == 1:
                time.sleep(0.1)  # the client has read the answer
                conn.close()
                closed.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/ok"
    wire = Wire()
    sent_on: list[object] = []
    send = wire_module._Connection.send

    def recorded(self, *args):
        sent_on.append(self)
        return send(self, *args)

    monkeypatch.setattr(wire_module._Connection, "send", recorded)
    try:
        assert (await _post(wire, url)).content == BODY
        closed.wait(5)  # blocking, on purpose: the loop does not hear the FIN
        time.sleep(wire_module._CHECK_IDLE_S)  # idle long enough to be checked
        assert (await _post(wire, url)).content == BODY
        assert len(connections) == 2
        # Not sent on the closed connection and then again (the resend would also answer):
        # the check took it out before anything was written.
        assert len(sent_on) == 2 and sent_on[0] is not sent_on[1]
    finally:
        await wire.aclose()
        listener.close()
        for conn in connections:
            conn.close()


async def test_a_reused_connection_closed_before_any_byte_is_sent_again_at_once(served, wire):
    server, url = served
    assert (await _post(wire, url + "/forget-the-second")).content == BODY
    assert (await _post(wire, url + "/forget-the-second")).content == BODY  # resent, answered
    assert server.connections == 2 and len(server.requests) == 3


async def test_a_reused_connection_closed_after_part_of_the_answer_is_not_sent_again(served, wire):
    server, url = served
    assert (await _post(wire, url + "/half-then-close-the-second")).content == BODY
    with pytest.raises(httpx.RemoteProtocolError):
        await _post(wire, url + "/half-then-close-the-second")
    assert server.connections == 1 and len(server.requests) == 2


async def test_a_fresh_connection_closed_before_any_byte_is_not_sent_again(served, wire):
    server, url = served
    with pytest.raises(httpx.RemoteProtocolError):
        await _post(wire, url + "/hang-up")
    assert server.connections == 1 and len(server.requests) == 1


async def test_idle_connections_expire_below_the_servers_keep_alive(served):
    server, url = served
    assert wire_module.KEEPALIVE_S < 5  # uvicorn's (vLLM's) is 5 s: the client lets go first
    wire = Wire(keepalive=0.3)
    try:
        # Three connections at once, then idle: the oldest expire too, not only the newest.
        answers = await asyncio.gather(*(_post(wire, url + "/ok") for _ in range(3)))
        assert [a.content for a in answers] == [BODY] * 3
        assert sum(len(q) for q in wire._idle.values()) == 3
        await asyncio.sleep(0.6)
        assert not wire._open and not any(wire._idle.values())
        # The server said timeout=1: kept 0.8 s, not the wire's 0.3 s, then closed.
        await _post(wire, url + "/keep-alive-1s")
        await asyncio.sleep(0.5)
        assert len(wire._open) == 1
        await asyncio.sleep(0.6)
        assert not wire._open
        await _post(wire, url + "/ok")
        assert server.connections == 5
    finally:
        await wire.aclose()


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/trailers-forever", "header lines"),
        ("/interim-forever", "interim answers"),
        ("/header-forever", "without a header's end"),
        ("/many-headers", "header lines"),
    ],
)
async def test_an_answer_that_never_ends_its_head_or_trailer_fails_at_once(
    served, wire, path, says
):
    _, url = served
    start = asyncio.get_running_loop().time()
    with pytest.raises(httpx.RemoteProtocolError, match=says):
        await _post(wire, url + path, read_timeout=30.0)
    assert asyncio.get_running_loop().time() - start < 5


async def test_the_read_timeout_is_for_the_next_byte_not_the_whole_answer(served, wire):
    _, url = served
    start = asyncio.get_running_loop().time()
    answer = await _post(wire, url + "/trickle", read_timeout=0.4)
    assert answer.content == BODY
    assert asyncio.get_running_loop().time() - start > 0.4  # longer than the timeout, whole
    with pytest.raises(httpx.ReadTimeout, match="no byte"):
        await _post(wire, url + "/slow-body", read_timeout=0.3)


@pytest.mark.parametrize(
    "path",
    [
        "/length-and-chunked",
        "/gzip-chunked",
        "/bare-lf",
        "/status-2000",
        "/status-200OK",
        "/lf-in-value",
    ],
)
async def test_framing_that_rfc_9112_refuses_is_an_error_and_not_reused(served, wire, path):
    server, url = served
    with pytest.raises(httpx.RemoteProtocolError):
        await asyncio.wait_for(_post(wire, url + path), 5)  # bare LF hung by hand
    assert (await _post(wire, url + "/ok")).content == BODY
    assert server.connections == 2


async def test_the_path_is_percent_encoded_and_a_close_request_is_not_pooled(served, wire):
    server, url = served
    answer = await wire.post(url + "/echo?x=1 2&y=%C3%A9", HEADERS, b"{}", read_up_to=100)
    assert answer.status_code == 200  # the hand-written wire sent the space as it was
    assert server.requests[0].split(b"\r\n")[0] == b"POST /echo?x=1%202&y=%C3%A9 HTTP/1.1"
    assert wire._target(url + "/v1/a b").start.split(b"\r\n")[0] == b"POST /v1/a%20b HTTP/1.1"
    closing = (*HEADERS, (b"Connection", b"close"))
    for _ in range(2):
        assert (await wire.post(url + "/ok", closing, b"{}", read_up_to=1000)).content == BODY
    # The first closing call takes the pooled connection and leaves it closed; the second needs
    # a new one (the hand-written wire pooled both: one connection in all).
    assert server.connections == 2 and not wire._open


def _chunked_answer(body: bytes, sizes: random.Random, largest: int) -> bytes:
    pieces, at = [], 0
    while at < len(body):
        size = sizes.randint(1, largest)
        pieces.append(b"%x\r\n%s\r\n" % (len(body[at : at + size]), body[at : at + size]))
        at += size
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(pieces) + b"0\r\n\r\n"


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@example(length=2**20, largest=1, seed=0)  # the worst case: 1 MiB in one-byte chunks
@given(
    length=st.integers(0, 2**20),
    largest=st.integers(1, 2**20),
    seed=st.integers(0, 2**32),
)
def test_bodies_up_to_a_mib_in_chunks_of_any_size_are_read_whole_in_bounded_time(
    length, largest, seed
):
    rng = random.Random(seed)
    body = rng.randbytes(length)
    data = _chunked_answer(body, rng, largest)

    async def run() -> tuple[bytes, float]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b'"hi"}')
            writer.write(data)
            await writer.drain()
            await reader.read()  # until the client closes
            writer.close()

        listening = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        wire = Wire()
        try:
            cpu = time.process_time()
            answer = await _post(wire, f"http://127.0.0.1:{port}/", cap=2**21, read_timeout=10)
            return answer.content, time.process_time() - cpu
        finally:
            await wire.aclose()
            listening.close()

    content, cpu = asyncio.run(run())
    assert content == body
    # CPU of both ends; 1 MiB in one-byte chunks takes ~0.3 s here, about 9 s by hand.
    assert cpu < 2.0

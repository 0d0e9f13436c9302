"""dsclient's own HTTP/1.1 connections (dsclient/_wire.py) against a real socket server that
answers each path with scripted bytes: framing (length, chunked, to the end), reuse and when a
connection is not reused, the cap, errors, cancellation, the read timeout and closing."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx2 as httpx
import pytest
from hypothesis import given
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
        waiter = connection.send(loop, b"POST / HTTP/1.1\r\n\r\n", cap, None)
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

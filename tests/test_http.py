"""The HTTP stack (dsclient/_http.py) against a real local server: each stack answers, closes
every socket and leaves no ResourceWarning; aiohttp's errors, the byte cap, gzip, streams,
timeouts and cancellation through the default transport; httpx-package transports adapted.

The server is a raw asyncio protocol in a subprocess (this file run as a script), so that the
sockets counted here are the client's only.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import httpx as httpx_package
import httpx2
import openai
import pytest

import dsclient
from dsclient import AsyncClient, ConnectionError, ResponseTooLarge, Retry, TimeoutError, _wire
from dsclient._http import READ_TIMEOUT_S, AiohttpTransport, adapt_transport, transport_for

COMPLETION = json.dumps(
    {
        "id": "c",
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": " the sea", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]}).encode()
SSE = (
    b"".join(
        b"data: "
        + json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": f}]}).encode()
        + b"\n\n"
        for t, f in (("one", None), (" two", "length"))
    )
    + b"data: [DONE]\n\n"
)


# -- the server (this file as a script) --------------------------------------------------------
def _answer(body: bytes, *, status: str = "200 OK", headers: str = "") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{headers}"
    return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body


_ANSWERING: set[asyncio.Future[None]] = set()


class _Server(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            body, self.buffer = rest[:length], rest[length:]
            task = asyncio.ensure_future(self.answer(head.split(b" ")[1].decode(), body, head))
            _ANSWERING.add(task)  # a strong reference until it is done
            task.add_done_callback(_ANSWERING.discard)

    async def answer(self, path: str, body: bytes, head: bytes = b"") -> None:
        prompt = json.loads(body).get("prompt", "") if body else ""
        if path == "/v1/headers":  # the request's header lines, as they came
            lines = head.decode("latin-1").split("\r\n")[1:]
            self.transport.write(_answer(json.dumps(lines).encode()))
        elif path.startswith("/v1/models"):
            self.transport.write(_answer(MODELS))
        elif path != "/v1/completions":
            self.transport.write(_answer(b"{}", status="404 Not Found"))
        elif b'"stream": true' in body or b'"stream":true' in body:
            head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            self.transport.write(f"{head}content-length: {len(SSE)}\r\n\r\n".encode() + SSE)
        elif prompt == "slow":
            await asyncio.sleep(30)
        elif prompt == "big":
            self.transport.write(_answer(b" " * 2**20 + COMPLETION))
        elif prompt == "chunked":  # no Content-Length: the transport does not read it whole
            size = f"{len(COMPLETION):x}".encode()
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            chunked = b"transfer-encoding: chunked\r\n\r\n" + size + b"\r\n"
            self.transport.write(head + chunked + COMPLETION + b"\r\n0\r\n\r\n")
        elif prompt == "refused":
            body = b'{"error": "busy"}'
            self.transport.write(_answer(body, status="429 Too Many", headers="retry-after: 0\r\n"))
        elif prompt == "not json":
            self.transport.write(_answer(b"<html>"))
        elif prompt == "cut":  # the connection closes inside the declared body
            self.transport.write(_answer(COMPLETION)[:-10])
            self.transport.close()
        elif prompt == "gzip":
            self.transport.write(
                _answer(gzip.compress(COMPLETION), headers="content-encoding: gzip\r\n")
            )
        else:
            self.transport.write(_answer(COMPLETION))


def _serve(port: int) -> None:
    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(_Server, "127.0.0.1", port)
        print("ready", flush=True)
        await server.serve_forever()

    asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, str(port)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- each stack --------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("stack", ["aiohttp", "httpx2"])
async def test_each_stack_answers_and_closes_every_socket_without_resource_warnings(url, stack):
    gc.collect()
    before = _fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        async with AsyncClient(url, limit=32, http_stack=stack) as client:

            async def one(i: int) -> str:
                return (await client.generate(f"p{i}", max_tokens=2)).text

            texts = await asyncio.gather(*(one(i) for i in range(300)))
            assert texts == [" the sea"] * 300
            assert _fds() > before  # the pool holds connections while the client is open
        gc.collect()
    assert _fds() == before
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_an_unknown_stack_is_refused_and_httpx_029s_pool_is_gone():
    for gone in ("curl", "httpx"):
        with pytest.raises(ValueError, match="http_stack must be one of aiohttp, httpx2; got"):
            AsyncClient("http://127.0.0.1:1", http_stack=gone)


def test_the_default_is_aiohttp_and_a_given_transport_wins():
    assert isinstance(transport_for("aiohttp"), AiohttpTransport)
    mock = httpx2.MockTransport(lambda r: httpx2.Response(200))
    assert transport_for("aiohttp", mock) is mock
    with pytest.raises(TypeError, match="transport must be an httpx.AsyncBaseTransport"):
        adapt_transport(object())


# -- the default transport: contracts ----------------------------------------------------------
@pytest.mark.anyio
async def test_a_refused_connection_is_a_connection_error():
    async with AsyncClient(
        f"http://127.0.0.1:{_free_port()}",
        model="tiny",
        max_num_seqs=4,
        retry=Retry(attempts=1),
        outage_wait=0.1,
    ) as client:
        with pytest.raises(ConnectionError) as info:
            await client.generate("x", max_tokens=1)
        assert isinstance(info.value.__cause__, httpx2.ConnectError)
        assert client.in_flight == 0


@pytest.mark.anyio
async def test_an_answer_over_the_cap_is_not_read_and_its_connection_not_reused(url):
    async with AsyncClient(url, limit=1, max_response_bytes=64 * 1024) as client:
        with pytest.raises(ResponseTooLarge):
            await client.generate("big", max_tokens=1)
        assert (await client.generate("next", max_tokens=1)).text == " the sea"
        assert client.in_flight == 0


@pytest.mark.anyio
async def test_a_gzip_answer_is_decoded_once(url):
    async with AsyncClient(url, limit=2) as client:
        assert (await client.generate("gzip", max_tokens=1)).text == " the sea"


@pytest.mark.anyio
async def test_a_stream_holds_its_slot_until_read(url):
    async with AsyncClient(url, limit=2) as client:
        async with client.stream("x", max_tokens=2) as stream:
            assert client.in_flight == 1
            assert [piece async for piece in stream] == ["one", " two"]
        assert client.in_flight == 0


@pytest.mark.anyio
async def test_the_calls_timeout_bounds_a_silent_server_and_frees_the_slot(url):
    async with AsyncClient(url, limit=2, retry=Retry(attempts=1)) as client:
        with pytest.raises(TimeoutError):
            await client.generate("slow", max_tokens=1, timeout=0.3)
        assert client.in_flight == 0


@pytest.mark.anyio
async def test_a_cancelled_call_frees_its_slot(url):
    async with AsyncClient(url, limit=2) as client:
        task = asyncio.ensure_future(client.generate("slow", max_tokens=1))
        while client.in_flight == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.in_flight == 0
        assert (await client.generate("after", max_tokens=1)).text == " the sea"


def test_a_client_used_again_on_a_new_event_loop_answers_there(url):
    # asyncio.run() once per cell, as a notebook or a script may do: the connections of the
    # loop before cannot hear an answer on this one, so they are let go, not reused (a hang).
    client = AsyncClient(url, limit=2, timeout=10)
    for _ in range(3):
        assert asyncio.run(client.generate("x", max_tokens=1)).text == " the sea"
    # A closed loop's transports cannot be closed from another loop (asyncio closes a socket on
    # its own loop's next turn), nor can aiohttp's session: they go with the collector, here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del client
        gc.collect()


@pytest.mark.anyio
async def test_generate_hands_the_transport_its_parts_and_gets_the_answer_read(url, monkeypatch):
    answers: list[str] = []
    post = AiohttpTransport.post

    async def spy(self: AiohttpTransport, *args: Any, **kwargs: Any) -> Any:
        answer = await post(self, *args, **kwargs)
        answers.append(type(answer).__name__)
        return answer

    monkeypatch.setattr(AiohttpTransport, "post", spy)
    async with AsyncClient(url, limit=2) as client:
        assert (await client.generate("x", max_tokens=1)).text == " the sea"
        assert (await client.generate("chunked", max_tokens=1)).text == " the sea"
        assert (await client.generate("gzip", max_tokens=1)).text == " the sea"
    # read whole by the transport (over dsclient's own connections, chunked too); the gzip
    # answer comes back as a response for httpx to decode
    assert answers == ["Read", "Read", "Response"]


@pytest.mark.anyio
async def test_a_request_carries_its_own_headers_and_none_that_aiohttp_would_add(url):
    transport = AiohttpTransport()
    full = (
        (b"Accept", b"*/*"),
        (b"Accept-Encoding", b"gzip, deflate"),
        (b"User-Agent", b"dsclient/0.1"),
        (b"Content-Type", b"application/json"),
    )
    bare = ((b"Content-Type", b"application/json"),)

    async def sent(headers: tuple[tuple[bytes, bytes], ...]) -> list[str]:
        answer = await transport.post(url + "/v1/headers", headers, b"{}", None, read_up_to=2**20)
        return sorted(line.split(":")[0].lower() for line in json.loads(answer.content))

    try:
        for _ in range(2):  # the second time from the transport's own cache of header sets
            assert await sent(full) == [
                "accept",
                "accept-encoding",
                "content-length",
                "content-type",
                "host",
                "user-agent",
            ]
            assert await sent(bare) == ["content-length", "content-type", "host"]
        request = httpx2.Request("GET", url + "/v1/headers", headers={"X-Probe": "1"})
        response = await transport.handle_async_request(request)
        lines = json.loads(await response.aread())
        assert sorted(line.split(":")[0].lower() for line in lines) == ["host", "x-probe"]
    finally:
        await transport.aclose()


@pytest.mark.anyio
async def test_refusals_bad_bodies_and_cut_answers_through_the_default_transport(url):
    async with AsyncClient(url, limit=2, retry=Retry(attempts=1), outage_wait=0.1) as client:
        with pytest.raises(dsclient.Overloaded) as refused:
            await client.generate("refused", max_tokens=1)
        assert refused.value.status == 429 and "busy" in refused.value.body
        with pytest.raises(dsclient.MalformedResponse, match="not JSON"):
            await client.generate("not json", max_tokens=1)
        with pytest.raises(ConnectionError) as cut:
            await client.generate("cut", max_tokens=1)
        assert isinstance(cut.value.__cause__, httpx2.RemoteProtocolError)
        assert client.in_flight == 0
        assert (await client.generate("after", max_tokens=1)).text == " the sea"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_the_default_stack_sends_through_httpx2(url, anyio_backend):
    async with AsyncClient(url, limit=2) as client:
        assert (await client.generate("x", max_tokens=1)).text == " the sea"


# -- what other libraries are handed -----------------------------------------------------------
@pytest.mark.anyio
async def test_openai_and_langchain_take_the_clients_httpx(url):
    from langchain_openai import ChatOpenAI

    async with AsyncClient(url, limit=2) as client:
        http = client.httpx()
        assert isinstance(http, httpx2.AsyncClient)
        sdk = client.openai()
        assert isinstance(sdk, openai.AsyncOpenAI)
        completion = await sdk.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert completion.choices[0].text == " the sea"
        chat = ChatOpenAI(model="tiny", base_url=url + "/v1", api_key="k", http_async_client=http)
        assert chat.async_client is not None
        await sdk.close()
        await http.aclose()


# -- transports of the httpx package -----------------------------------------------------------
@pytest.mark.anyio
async def test_an_httpx_package_mock_transport_still_works():
    def handle(request: httpx_package.Request) -> httpx_package.Response:
        if request.url.path == "/v1/models":
            return httpx_package.Response(200, content=MODELS)
        if request.url.path != "/v1/completions":
            return httpx_package.Response(404, content=b"{}")
        if json.loads(request.content)["prompt"] == "fail":
            raise httpx_package.ConnectError("refused", request=request)
        return httpx_package.Response(200, content=COMPLETION)

    transport = httpx_package.MockTransport(handle)
    async with AsyncClient(
        "http://s", transport=transport, retry=Retry(attempts=1), outage_wait=0.1
    ) as client:
        assert (await client.generate("x", max_tokens=1)).text == " the sea"
        with pytest.raises(ConnectionError) as info:
            await client.generate("fail", max_tokens=1)
    # httpx's error, made into httpx2's at the transport, into dsclient's in _exceptions
    assert isinstance(info.value.__cause__, httpx2.ConnectError)
    assert isinstance(info.value.__cause__.__cause__, httpx_package.ConnectError)


def test_dsclient_exports_no_http_stack_names():
    assert "httpx" not in dsclient.__all__


if __name__ == "__main__":
    _serve(int(sys.argv[1]))


# -- which requests go over the wire (issue 42) ------------------------------------------------
async def _sent_by(transport: AiohttpTransport, url: str) -> str:
    answer = await transport.post(
        url + "/v1/completions",
        ((b"Content-Type", b"application/json"),),
        b"{}",
        {"connect": 5.0, "read": 5.0},
        read_up_to=2**20,
    )
    assert answer.status_code == 200
    return (
        "wire" if isinstance(transport._wire, _wire.Wire) and transport._wire._open else "aiohttp"
    )


@pytest.mark.anyio
async def test_no_proxy_alone_leaves_the_wire_on_and_a_proxy_that_applies_turns_it_off(
    url, monkeypatch
):
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setenv("NO_PROXY", "example.com")  # getproxies(): {"no": ...}, truthy
    transport = AiohttpTransport()
    try:
        assert await _sent_by(transport, url) == "wire"
    finally:
        await transport.aclose()
    # A proxy set, and NO_PROXY naming the server: still the wire. Not naming it: aiohttp, which
    # speaks to the proxy (one that refuses every connection here: the request fails there).
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    transport = AiohttpTransport()
    try:
        assert await _sent_by(transport, url) == "wire"
    finally:
        await transport.aclose()
    monkeypatch.setenv("NO_PROXY", "example.com")
    transport = AiohttpTransport()
    try:
        with pytest.raises(httpx2.ConnectError):
            await _sent_by(transport, url)
        assert transport._wire is not None and not transport._wire._open
    finally:
        await transport.aclose()


@pytest.mark.anyio
async def test_without_httptools_the_calls_go_through_aiohttp(url, monkeypatch):
    monkeypatch.setattr(_wire, "AVAILABLE", False)
    async with AsyncClient(url, limit=2) as client:
        assert (await client.generate("x", max_tokens=1)).text == " the sea"
        transport = client._http._transport
        assert isinstance(transport, AiohttpTransport) and transport._wire is False


def test_every_request_has_a_read_timeout_that_fits_a_generation():
    client = AsyncClient("http://127.0.0.1:1", model="tiny")
    timeout = client._http.timeout
    assert timeout.read == READ_TIMEOUT_S and 60 <= READ_TIMEOUT_S < 600  # under the call's
    assert timeout.connect == 10.0 and timeout.pool is None and timeout.write is None

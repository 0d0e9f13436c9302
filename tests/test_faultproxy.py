"""The fault proxy's own fault modes, against a trivial local HTTP responder (no vLLM), and
dsclient through them: each fault ends a call in a result or in its typed error."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest

from dsclient import (
    AsyncClient,
    ConnectionError,
    MalformedResponse,
    Overloaded,
    Retry,
    TimeoutError,
)
from dsclient._http import httpx
from tests.integration.faultproxy import (
    Drop,
    FaultProxy,
    Garbage,
    GarbageBody,
    Latency,
    Reset,
    Stall,
    Status,
    Truncate,
)

from .fakes import RecordedSleep, chat_body, completion_body

pytestmark = pytest.mark.anyio

#: Server-sent events the responder streams, one chunk each.
EVENTS = 6


def _sse_event(i: int) -> bytes:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "tiny",
        "choices": [
            {"index": 0, "text": f" w{i}", "finish_reason": "length" if i == EVENTS - 1 else None}
        ],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class Responder:
    """A trivial OpenAI-shaped HTTP/1.1 server on asyncio streams: ``/v1/models``, completions
    and chat completions (``Content-Length`` JSON, or chunked server-sent events when the body
    asks to stream); 404 for anything else. Keep-alive, like uvicorn."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self._writers):  # their handlers then end at end of stream
            writer.transport.abort()
        await self.server.wait_closed()
        with anyio.fail_after(10):
            while self._writers:
                await anyio.sleep(0.01)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                length = int(headers.get("content-length", "0"))
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.requests.append((method, path))
                await self._answer(writer, method, path, body)
        except (OSError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()
            self._writers.discard(writer)

    async def _answer(
        self, writer: asyncio.StreamWriter, method: str, path: str, body: dict[str, object]
    ) -> None:
        if method == "GET" and path == "/v1/models":
            data = {"data": [{"id": "tiny", "owned_by": "vllm", "max_model_len": 2048}]}
            writer.write(_json(200, data))
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            if body.get("stream"):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for i in range(EVENTS):
                    event = _sse_event(i)
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            else:
                chat = path.endswith("chat/completions")
                writer.write(_json(200, chat_body() if chat else completion_body("hello " * 40)))
        else:
            writer.write(_json(404, {"detail": "Not Found"}))
        await writer.drain()


def _json(status: int, data: object) -> bytes:
    body = json.dumps(data).encode()
    reason = {200: "OK", 404: "Not Found"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


@pytest.fixture
async def responder() -> AsyncIterator[Responder]:
    server = Responder()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
def proxy(responder: Responder) -> Iterator[FaultProxy]:
    with FaultProxy(responder.url) as running:
        yield running


COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
STREAM = {**COMPLETION, "stream": True}


async def _post(http: httpx.AsyncClient, proxy: FaultProxy, body: object) -> httpx.Response:
    return await http.post(proxy.url + "/v1/completions", json=body)


# -- the proxy's fault modes, seen by httpx ------------------------------------------------------
async def test_relays_requests_on_one_keep_alive_connection(proxy, responder):
    async with httpx.AsyncClient() as http:
        models = await http.get(proxy.url + "/v1/models")
        first = await _post(http, proxy, COMPLETION)
        second = await _post(http, proxy, COMPLETION)
        async with http.stream("POST", proxy.url + "/v1/completions", json=STREAM) as s:
            raw = b"".join([piece async for piece in s.aiter_bytes()])
    assert models.json()["data"][0]["id"] == "tiny"
    assert first.json() == second.json() == completion_body("hello " * 40)
    assert raw.count(b"data: ") == EVENTS + 1 and raw.endswith(b"data: [DONE]\n\n")
    events = proxy.events
    assert [(e.method, e.path, e.fault) for e in events] == [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", None),
        ("POST", "/v1/completions", None),
        ("POST", "/v1/completions", None),
    ]
    assert {e.connection for e in events} == {events[0].connection}
    assert len(responder.requests) == 4
    assert not proxy.fired


async def test_status_answers_the_next_requests_itself_and_keeps_the_connection(proxy, responder):
    proxy.inject(Status(503, retry_after=1.5), times=2)
    proxy.inject(Status(429, retry_after_ms=250), times=1)
    async with httpx.AsyncClient() as http:
        models = await http.get(proxy.url + "/v1/models")  # not an inference path
        answers = [await _post(http, proxy, COMPLETION) for _ in range(4)]
    assert models.status_code == 200
    assert [r.status_code for r in answers] == [503, 503, 429, 200]
    assert answers[0].headers["retry-after"] == "1.5"
    assert "retry-after" not in answers[2].headers and answers[2].headers["retry-after-ms"] == "250"
    assert "currently busy" in answers[0].json()["error"]["message"]
    assert proxy.fired == {"status": 3} and proxy.pending == 0
    assert responder.requests.count(("POST", "/v1/completions")) == 1  # the server saw one
    assert len({e.connection for e in proxy.events}) == 1


async def test_paths_none_faults_every_path_and_times_none_until_cleared(proxy):
    proxy.inject(Status(500), times=None, paths=None)
    async with httpx.AsyncClient() as http:
        assert (await http.get(proxy.url + "/v1/models")).status_code == 500
        assert (await http.get(proxy.url + "/metrics")).status_code == 500
        assert (await _post(http, proxy, COMPLETION)).status_code == 500
        proxy.clear()
        assert (await _post(http, proxy, COMPLETION)).status_code == 200
    assert proxy.fired == {"status": 3}


async def test_garbage_is_not_http(proxy):
    proxy.inject(Garbage())
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await _post(http, proxy, COMPLETION)
        assert (await _post(http, proxy, COMPLETION)).status_code == 200
    assert proxy.fired == {"garbage": 1}


async def test_garbage_body_is_http_200_but_not_json(proxy):
    proxy.inject(GarbageBody(), times=2)
    async with httpx.AsyncClient() as http:
        plain = await _post(http, proxy, COMPLETION)
        streamed = await _post(http, proxy, STREAM)
    assert plain.status_code == 200
    with pytest.raises(ValueError):
        plain.json()
    assert streamed.status_code == 200
    assert streamed.headers["content-type"] == "text/event-stream"
    assert streamed.text.startswith("data: {not json")
    assert proxy.fired == {"garbage_body": 2}


async def test_reset_answers_nothing(proxy, responder):
    proxy.inject(Reset())
    async with httpx.AsyncClient() as http:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await _post(http, proxy, COMPLETION)
    assert proxy.fired == {"reset": 1}
    assert ("POST", "/v1/completions") not in responder.requests


async def test_truncate_cuts_a_content_length_body_half_way(proxy):
    proxy.inject(Truncate())
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=COMPLETION) as r:
            expected = int(r.headers["content-length"])
            got = bytearray()
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete|complete message"):
                async for piece in r.aiter_raw():
                    got += piece
    assert len(got) == expected // 2
    assert proxy.fired == {"truncate": 1}


async def test_truncate_cuts_a_chunked_stream_after_its_first_event(proxy):
    proxy.inject(Truncate())
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=STREAM) as r:
            lines = []
            with pytest.raises(httpx.RemoteProtocolError):
                async for line in r.aiter_lines():
                    lines.append(line)
    assert lines == [_sse_event(0).decode().rstrip("\n"), ""]
    assert proxy.fired == {"truncate": 1}


async def test_truncate_after_bytes_can_cut_inside_a_chunk(proxy):
    proxy.inject(Truncate(after_bytes=10))
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=STREAM) as r:
            got = bytearray()
            with pytest.raises(httpx.RemoteProtocolError):
                async for piece in r.aiter_raw():
                    got += piece
    size_line = b"%x\r\n" % len(_sse_event(0))
    assert bytes(got) == _sse_event(0)[: 10 - len(size_line)]
    assert proxy.fired == {"truncate": 1}


async def test_a_cut_beyond_the_body_lets_it_through(proxy):
    proxy.inject(Truncate(after_bytes=10**6))
    async with httpx.AsyncClient() as http:
        response = await _post(http, proxy, COMPLETION)
    assert response.json() == completion_body("hello " * 40)
    assert not proxy.fired


async def test_drop_resets_mid_body(proxy):
    proxy.inject(Drop(after_bytes=20))
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=COMPLETION) as r:
            assert r.status_code == 200
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                await r.aread()
    assert proxy.fired == {"drop": 1}


async def test_stall_sends_the_head_then_nothing(proxy):
    proxy.inject(Stall())
    timeout = httpx.Timeout(5.0, read=0.3)
    async with httpx.AsyncClient(timeout=timeout) as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=STREAM) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                await r.aread()
    assert proxy.fired == {"stall": 1}


async def test_stall_before_headers_sends_nothing(proxy, responder):
    proxy.inject(Stall(before_headers=True))
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await _post(http, proxy, COMPLETION)
    assert proxy.fired == {"stall": 1}
    assert ("POST", "/v1/completions") not in responder.requests


async def test_trickle_sends_one_byte_at_a_time(proxy):
    proxy.inject(Stall(after_bytes=None, trickle=0.01))
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=COMPLETION) as r:
            half = int(r.headers["content-length"]) // 2
            pieces = []
            async for piece in r.aiter_raw():
                pieces.append(piece)
                if len(pieces) == 6:
                    break
    assert len(pieces[0]) == half
    assert [len(p) for p in pieces[1:]] == [1] * 5
    assert proxy.fired == {"stall": 1}


async def test_latency_holds_the_request(proxy):
    proxy.inject(Latency(1.0))
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.1)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await _post(http, proxy, COMPLETION)
    proxy.inject(Latency(0.05))
    async with httpx.AsyncClient() as http:
        assert (await _post(http, proxy, COMPLETION)).status_code == 200
    with anyio.fail_after(10):
        while proxy.fired["latency"] < 2:  # the first one finishes its sleep in the background
            await anyio.sleep(0.05)


async def test_per_connection_rule_holds_a_whole_connection(proxy):
    proxy.inject(Status(502), per="connection", times=1)
    async with httpx.AsyncClient() as first, httpx.AsyncClient() as second:
        a = [(await _post(first, proxy, COMPLETION)).status_code for _ in range(3)]
        b = [(await _post(second, proxy, COMPLETION)).status_code for _ in range(2)]
        models = await first.get(proxy.url + "/v1/models")  # not one of the rule's paths
    assert a == [502, 502, 502] and b == [200, 200] and models.status_code == 200
    assert proxy.fired == {"status": 3} and proxy.pending == 0
    proxy.clear()
    async with httpx.AsyncClient() as http:
        assert (await _post(http, proxy, COMPLETION)).status_code == 200


def test_inject_checks_its_arguments():
    proxy = FaultProxy("http://127.0.0.1:9")  # not started: rules only
    with pytest.raises(ValueError, match="times"):
        proxy.inject(Reset(), times=0)
    with pytest.raises(ValueError, match="per"):
        proxy.inject(Reset(), per="socket")  # type: ignore[arg-type]


# -- dsclient through the faults (the responder stands in for vLLM) ---------------------------
def _client(proxy: FaultProxy, **kwargs: object) -> AsyncClient:
    kwargs.setdefault("retry", Retry(base=0.01, cap=0.05))
    kwargs.setdefault("rng", random.Random(0))
    return AsyncClient(proxy.url, **kwargs)  # type: ignore[arg-type]


async def _drained(client: AsyncClient) -> None:
    stats = client.stats()
    assert (stats.in_flight, stats.waiting) == (0, 0)


async def test_a_cut_or_reset_answer_is_retried(proxy):
    proxy.inject(Truncate())
    proxy.inject(Drop(after_bytes=5))
    proxy.inject(Reset())
    proxy.inject(Garbage())
    async with _client(proxy, retry=Retry(attempts=5, base=0.01, cap=0.05)) as client:
        result = await client.generate("Hello", max_tokens=4)
        await _drained(client)
    assert result.text == "hello " * 40 and result.attempts == 5
    assert proxy.fired == {"truncate": 1, "drop": 1, "reset": 1, "garbage": 1}


async def test_a_cut_that_never_ends_is_a_connection_error(proxy):
    proxy.inject(Truncate(), times=None)
    async with _client(proxy, retry=Retry(attempts=3, base=0.01, cap=0.05)) as client:
        with pytest.raises(ConnectionError) as info:
            await client.chat([{"role": "user", "content": "Hi"}], max_tokens=4)
        await _drained(client)
    assert info.value.attempts == 3
    assert proxy.fired == {"truncate": 3}


async def test_a_body_that_is_not_json_is_malformed_and_not_retried(proxy):
    proxy.inject(GarbageBody(), times=2)
    async with _client(proxy) as client:
        with pytest.raises(MalformedResponse):
            await client.generate("Hello", max_tokens=4)
        with pytest.raises(MalformedResponse):
            async with client.stream("Hello", max_tokens=4) as s:
                async for _ in s:
                    pass
        await _drained(client)
        assert (await client.generate("Hello", max_tokens=4)).attempts == 1
    assert proxy.fired == {"garbage_body": 2}


async def test_retry_after_from_a_burst_of_503_is_what_the_client_waits(proxy):
    sleep = RecordedSleep()
    proxy.inject(Status(503, retry_after=0.25), times=2)
    proxy.inject(Status(429, retry_after_ms=125), times=1)
    async with _client(proxy, sleep=sleep, retry=Retry(base=0.01, cap=1.0)) as client:
        result = await client.generate("Hello", max_tokens=4)
        await _drained(client)
    assert result.attempts == 4
    assert sleep.delays == [0.25, 0.25, 0.125]
    assert proxy.fired == {"status": 3}


async def test_a_refusing_server_ends_in_overloaded(proxy):
    proxy.inject(Status(503), times=None)
    retry = Retry(attempts=2, overload_attempts=3, base=0.01, cap=0.05)
    async with _client(proxy, retry=retry) as client:
        with pytest.raises(Overloaded) as info:
            await client.generate("Hello", max_tokens=4)
        await _drained(client)
    assert info.value.status == 503 and info.value.attempts == 3


async def test_a_stream_cut_after_its_first_event_raises_connection_error(proxy):
    proxy.inject(Drop())
    async with _client(proxy) as client:
        deltas = []
        with pytest.raises(ConnectionError):
            async with client.stream("Hello", max_tokens=4) as s:
                async for delta in s:
                    deltas.append(delta)
        await _drained(client)
    assert deltas == [" w0"]  # what came before the cut, and no retry after it
    assert proxy.fired == {"drop": 1}


@pytest.mark.parametrize(
    "stall",
    [Stall(before_headers=True), Stall(), Stall(after_bytes=None), Stall(trickle=0.05)],
    ids=["before-headers", "after-headers", "after-first-event", "trickle"],
)
async def test_a_stalled_stream_times_out_within_the_call_timeout(proxy, stall):
    """The call's timeout covers the whole stream, reading included: neither a silent server
    nor one trickling a byte at a time (which defeats a per-read timeout) holds it longer."""
    proxy.inject(stall)
    async with _client(proxy, timeout=60) as client:
        with anyio.fail_after(30):  # a guard against a hang, not a measurement
            with pytest.raises(TimeoutError):
                async with client.stream("Hello", max_tokens=4, timeout=0.5) as s:
                    async for _ in s:
                        pass
        await _drained(client)
    assert proxy.fired == {"stall": 1}


@pytest.mark.parametrize("stall", [Stall(before_headers=True), Stall(trickle=0.05)])
async def test_a_stalled_answer_times_out_within_the_call_timeout(proxy, stall):
    proxy.inject(stall)
    async with _client(proxy, timeout=60) as client:
        with anyio.fail_after(30):
            with pytest.raises(TimeoutError):
                await client.generate("Hello", max_tokens=4, timeout=0.5)
        await _drained(client)
        assert (await client.generate("Hello", max_tokens=4)).attempts == 1
    assert proxy.fired == {"stall": 1}


async def test_a_call_may_take_longer_than_the_client_wide_timeout_when_it_says_so(proxy):
    """A per-call timeout (or ``None``) overrides the client's, as documented: the client's
    timeout must not cut each attempt of a slower call short on the way."""
    proxy.inject(Latency(1.0), times=None)
    async with _client(proxy, timeout=0.3) as client:
        with anyio.fail_after(30):
            assert (await client.generate("Hello", max_tokens=4, timeout=10)).attempts == 1
            assert (
                await client.chat([{"role": "user", "content": "Hi"}], timeout=None)
            ).attempts == 1
            async with client.stream("Hello", max_tokens=4, timeout=10) as s:
                assert [d async for d in s] == [f" w{i}" for i in range(EVENTS)]
            assert s.attempts == 1
        await _drained(client)
    assert proxy.fired == {"latency": 3}

"""Limits on what a server can make the client do: how much it reads, how long it waits, how often
it tries, whether it checks TLS, and that it never shows the API key.

Bodies here are lazy streams that count what the client pulled, so a test can tell that the
client stopped reading at the cap, rather than read everything and then complain.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import logging
import random
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from dsclient import (
    AsyncClient,
    Client,
    ConnectionError,
    DSClientError,
    MalformedResponse,
    Overloaded,
    RequestRefused,
    Retry,
    ServerFault,
)
from dsclient._exceptions import ERROR_BODY_BYTES, ResponseTooLarge
from dsclient._http import httpx
from dsclient._models import Failure
from dsclient._streaming import MAX_BODY_BYTES, sse_events
from dsclient.client._discovery import PROBE_BODY_BYTES, discover
from dsclient.client._pipeline import RequestPath
from dsclient.client._retry import RetryBudget
from dsclient.governor._admission import Admission
from dsclient.governor._endpoint import METRICS_BODY_BYTES, ControlOptions, Endpoint, fetch_load

from .fakes import FakeServer, RecordedSleep, completion_body

MiB = 2**20


class Lazy(httpx.AsyncByteStream):
    """A body of ``total`` bytes in pieces of ``chunk``, never held whole; ``pulled`` counts the
    bytes the client asked for."""

    def __init__(self, total: int, *, chunk: int = MiB, head: bytes = b"", fill: bytes = b"a"):
        self.total = total
        self.head = head
        self.piece = (fill * (chunk // len(fill) + 1))[:chunk]
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.head:
            self.pulled += len(self.head)
            yield self.head
        while self.pulled < self.total:
            data = self.piece[: self.total - self.pulled]
            self.pulled += len(data)
            yield data


def client_for(fake: FakeServer, **kwargs: Any) -> AsyncClient:
    kwargs.setdefault("sleep", RecordedSleep())
    kwargs.setdefault("rng", random.Random(0))
    return AsyncClient("http://127.0.0.1:8000", transport=fake.transport, **kwargs)


# -- how much a server can make the client read -------------------------------------------------
@pytest.mark.anyio
async def test_a_huge_answer_is_not_read_past_the_cap():
    # Found: a server that answered with a 512 MiB body grew the client by about 2 GiB before
    # anything stopped it. 64 MiB stands for it here; the client must stop at 16 MiB.
    body = Lazy(64 * MiB, head=b'{"choices": [{"text": "')
    fake = FakeServer(script=[lambda _: httpx.Response(200, stream=body)])
    async with client_for(fake) as client:
        with pytest.raises(ResponseTooLarge) as info:
            await client.generate("x", max_tokens=1)
    assert body.pulled <= MAX_BODY_BYTES + MiB
    assert "over 16 MiB" in str(info.value) and "kilobytes" in str(info.value)
    assert info.value.limit == MAX_BODY_BYTES
    assert len(fake.requests) == 1 and info.value.attempts == 1  # not retried
    assert isinstance(info.value, MalformedResponse)


@pytest.mark.anyio
async def test_a_declared_length_over_the_cap_is_refused_before_reading():
    body = Lazy(64 * MiB)
    fake = FakeServer(
        script=[lambda _: httpx.Response(200, headers={"content-length": str(2**40)}, stream=body)]
    )
    async with client_for(fake) as client:
        with pytest.raises(ResponseTooLarge, match="Content-Length: 1099511627776"):
            await client.generate("x", max_tokens=1)
    assert body.pulled == 0


@pytest.mark.anyio
async def test_the_request_path_takes_its_cap_as_a_parameter():
    answer = json.dumps(completion_body(text="x" * 3000)).encode()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=answer)

    endpoint = Endpoint("http://s", ControlOptions(adaptive=False), {}, start=2)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:

        def send(path: RequestPath) -> Any:
            return path.send_json("/v1/completions", {}, path.new_call(Admission("short")))

        def path(cap: int) -> RequestPath:
            return RequestPath(
                http,
                endpoint,
                Retry(attempts=1),
                RetryBudget(),
                sleep=RecordedSleep(),
                rng=random.Random(0),
                max_body_bytes=cap,
            )

        assert path(MAX_BODY_BYTES).max_body_bytes == 16 * MiB
        with pytest.raises(ResponseTooLarge, match="over 2 KiB") as info:
            await send(path(2048))
        assert info.value.limit == 2048
        sent = await send(path(len(answer)))
        assert sent.data is not None and sent.data["choices"][0]["text"] == "x" * 3000
        assert sent.attempts == 1
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_body_bytes"):
            path(bad)
    with pytest.raises(TypeError, match="max_body_bytes"):
        path(1.5)  # type: ignore[arg-type]


@pytest.mark.anyio
@pytest.mark.parametrize("status", [500, 503, 400])
async def test_an_error_body_is_read_only_as_far_as_its_message(status):
    body = Lazy(64 * MiB, chunk=16 * 1024, head=b"upstream failed: ")
    fake = FakeServer(script=[lambda _: httpx.Response(status, stream=body)])
    async with client_for(fake, retry=Retry(attempts=1)) as client:
        with pytest.raises(RequestRefused) as info:
            await client.generate("x", max_tokens=1)
    assert info.value.status == status
    assert body.pulled <= ERROR_BODY_BYTES + 16 * 1024
    assert len(info.value.body) <= 4000 and info.value.body.startswith("upstream failed: ")


@contextlib.asynccontextmanager
async def streamed(stream: httpx.AsyncByteStream) -> AsyncIterator[httpx.Response]:
    """An open streaming response whose body is ``stream``."""
    transport = httpx.MockTransport(lambda _: httpx.Response(200, stream=stream))
    async with httpx.AsyncClient(transport=transport) as http:
        request = http.build_request("POST", "http://s/v1/completions")
        response = await http.send(request, stream=True)
        try:
            yield response
        finally:
            await response.aclose()


@pytest.mark.anyio
async def test_one_stream_line_is_never_buffered_past_the_cap():
    # httpx's aiter_lines would hold a 64 MiB line whole; the stream stops at the cap.
    body = Lazy(64 * MiB, head=b'data: {"choices": [{"text": "')
    async with streamed(body) as response:
        with pytest.raises(ResponseTooLarge, match="one line of the stream over 16 MiB"):
            async for _ in sse_events(response):
                pass
    assert body.pulled <= MAX_BODY_BYTES + MiB


@pytest.mark.anyio
async def test_one_event_of_many_lines_is_capped_but_a_long_stream_is_not():
    line = b"data: " + b"x" * 1000 + b"\n"
    body = Lazy(64 * MiB, chunk=len(line) * 10, fill=line)  # one event that never ends
    async with streamed(body) as response:
        with pytest.raises(ResponseTooLarge, match="one event of the stream over 64 KiB"):
            async for _ in sse_events(response, limit=64 * 1024):
                pass
    assert body.pulled <= 64 * 1024 + len(line) * 10

    event = b'data: {"choices": [{"text": "' + b"y" * 1000 + b'"}]}\n\n'
    body = Lazy(len(event) * 500, chunk=len(event) * 7, fill=event)  # 0.5 MB in small events
    async with streamed(body) as response:
        events = [e async for e in sse_events(response, limit=64 * 1024)]
    assert len(events) == 500


@pytest.mark.anyio
async def test_a_stream_that_fails_to_decode_is_a_typed_error():
    # Found by tests/test_fuzz.py: "Content-Encoding: gzip" over plain bytes raises
    # httpx.DecodingError, which is not a TransportError and escaped every handler.
    stream = httpx.ByteStream(b'data: {"choices": []}\n\n')
    http = httpx.AsyncClient(
        transport=httpx.MockTransport(
            lambda _: httpx.Response(200, headers={"content-encoding": "gzip"}, stream=stream)
        )
    )
    async with http:
        response = await http.send(http.build_request("GET", "http://s/"), stream=True)
        with pytest.raises(MalformedResponse, match="could not be decoded"):
            async for _ in sse_events(response):
                pass
        await response.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["long line", "bad gzip"])
async def test_the_clients_stream_reads_under_the_cap_and_raises_typed_errors(case):
    if case == "long line":
        body: httpx.AsyncByteStream = Lazy(64 * MiB, head=b'data: {"choices": [{"text": "')
        headers = {}
    else:
        body = httpx.ByteStream(b'data: {"choices": [{"text": "x"}]}\n\n')
        headers = {"content-encoding": "gzip"}
    fake = FakeServer(script=[lambda _: httpx.Response(200, headers=headers, stream=body)])
    async with client_for(fake) as client:
        with pytest.raises(ResponseTooLarge if case == "long line" else MalformedResponse):
            async with client.stream("x", max_tokens=1) as s:
                async for _ in s:
                    pass
    if isinstance(body, Lazy):
        assert body.pulled <= MAX_BODY_BYTES + MiB


@pytest.mark.anyio
async def test_a_huge_metrics_answer_is_a_failed_scrape():
    body = Lazy(64 * MiB, head=b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n# ")
    http = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, stream=body))
    )
    async with http:
        assert await fetch_load(http, "http://s", model=None, timeout=30.0) is None
    assert body.pulled <= METRICS_BODY_BYTES + MiB


@pytest.mark.anyio
async def test_a_huge_probe_answer_tells_discovery_nothing():
    bodies: list[Lazy] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(Lazy(64 * MiB, head=b'{"data": [{"id": "tiny", "x": "'))
        return httpx.Response(200, stream=bodies[-1])

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        info = await discover(http, "http://s", records=None, timeout=30.0)
    assert info.models == () and info.sources["max_num_seqs"] == "default"
    assert len(bodies) >= 9
    assert all(b.pulled <= PROBE_BODY_BYTES + MiB for b in bodies)


# -- how long a server can make the client wait -------------------------------------------------
FUTURE = email.utils.formatdate(time.time() + 86400 * 365, usegmt=True)
PAST = email.utils.formatdate(time.time() - 3600, usegmt=True)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "1e9"}, 8.0),
        ({"retry-after": "99999999999999999999999999"}, 8.0),
        ({"retry-after": FUTURE}, 8.0),
        ({"retry-after-ms": "1e300"}, 8.0),
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": PAST}, 0.0),
        ({"retry-after": "inf"}, None),  # not a wait: backoff with jitter instead
        ({"retry-after": "nan"}, None),
        ({"retry-after": "-5"}, None),
        ({"retry-after": "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"}, None),
        ({"retry-after": "soon"}, None),
    ],
)
async def test_retry_after_can_not_park_the_client(headers, expected):
    fake = FakeServer(
        script=[
            httpx.Response(503, headers=headers, text="busy"),
            httpx.Response(200, json=completion_body()),
        ]
    )
    sleep = RecordedSleep()
    async with client_for(fake, sleep=sleep) as client:
        result = await client.generate("x", max_tokens=1)
    assert result.attempts == 2
    (delay,) = sleep.delays
    if expected is None:
        assert 0.0 <= delay <= Retry().base  # the first backoff's jitter
    else:
        assert delay == expected


def test_the_retry_cap_must_be_finite():
    with pytest.raises(ValueError, match=r"Retry\.cap must be a finite"):
        Retry(cap=float("inf"))
    with pytest.raises(ValueError, match=r"Retry\.base"):
        Retry(base=float("nan"))


# -- how many times a server can make the client try --------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "kwargs", "tries"),
    [
        (503, {}, 12),  # a refusal for load under an adaptive limit: Retry.overload_attempts
        (429, {}, 12),
        (503, {"adaptive": False}, 4),  # otherwise Retry.attempts
        (500, {}, 4),
        (503, {"retry": Retry(overload_attempts=3)}, 4),  # never fewer than attempts
        (503, {"retry": Retry(attempts=2, overload_attempts=5)}, 5),
        (503, {"retry": Retry(attempts=1)}, 1),
    ],
)
async def test_a_server_that_refuses_forever_sees_a_bounded_number_of_tries(status, kwargs, tries):
    fake = FakeServer(script=[httpx.Response(status, headers={"retry-after": "1e9"}, text="no")])
    sleep = RecordedSleep()
    async with client_for(fake, sleep=sleep, **kwargs) as client:
        for _ in range(2):  # per call: the second call gets as many tries as the first
            before = len(fake.requests)
            with pytest.raises(RequestRefused) as info:
                await client.generate("x", max_tokens=1)
            assert len(fake.requests) - before == tries
            assert info.value.attempts == tries
            assert isinstance(info.value, Overloaded) == (status in (429, 503))
    assert all(0.0 <= d <= Retry().cap for d in sleep.delays)
    assert len(sleep.delays) == 2 * (tries - 1)


@pytest.mark.anyio
async def test_a_stream_that_is_refused_forever_sees_a_bounded_number_of_tries():
    fake = FakeServer(script=[httpx.Response(503, text="busy")])
    async with client_for(fake) as client:
        with pytest.raises(Overloaded) as info:
            async with client.stream("x", max_tokens=1):
                pass
        assert client.in_flight == 0
    assert len(fake.requests) == info.value.attempts == Retry().overload_attempts


# -- TLS ---------------------------------------------------------------------------------------
def _ssl_context(http: httpx.AsyncClient) -> ssl.SSLContext:
    # The default transport (aiohttp's pool) keeps the context it hands every TLS connection;
    # no connection is made to read it.
    context = http._transport.ssl_context  # type: ignore[attr-defined]
    assert isinstance(context, ssl.SSLContext)
    return context


@pytest.mark.anyio
async def test_tls_is_verified_by_default():
    client = AsyncClient("https://llm.example.invalid:8443", api_key="k")
    try:
        context = _ssl_context(client._http)
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.check_hostname is True
    finally:
        await client.aclose()


def test_tls_is_verified_by_default_in_the_sync_client_too():
    with pytest.MonkeyPatch.context() as mp:
        seen: list[dict[str, Any]] = []
        original = httpx.AsyncClient.__init__

        def spy(self: httpx.AsyncClient, *args: Any, **kwargs: Any) -> None:
            seen.append(kwargs)
            original(self, *args, **kwargs)

        mp.setattr(httpx.AsyncClient, "__init__", spy)
        client = Client("https://llm.example.invalid:8443")
    try:
        assert seen and all(kwargs.get("verify", True) is True for kwargs in seen)
        context = _ssl_context(client._async._http)
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    finally:
        client.close()


# -- the API key -------------------------------------------------------------------------------
SECRET = "sk-secret-123"


def _echo(request: httpx.Request) -> str:
    """What a debugging proxy's error page says: the request's headers, key included."""
    return "; ".join(f"{k}: {v}" for k, v in request.headers.items())


@pytest.mark.anyio
async def test_the_api_key_appears_in_no_repr_error_or_log_line(caplog):
    caplog.set_level(logging.DEBUG)  # every logger, httpx's included
    calls = {"n": 0}

    def answer(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        prompt = json.loads(request.content).get("prompt", "")
        if prompt == "ok":
            return httpx.Response(200, json=completion_body())
        if prompt == "unauthorized":
            return httpx.Response(401, json={"error": {"message": f"bad key; {_echo(request)}"}})
        if prompt == "server error":
            return httpx.Response(500, text=f"<pre>{_echo(request)}</pre>")
        if prompt == "not json":
            return httpx.Response(200, text=f"debug: {_echo(request)}")
        if prompt == "too large":
            return httpx.Response(200, stream=Lazy(32 * MiB, head=_echo(request).encode()))
        raise httpx.ConnectError(f"connection refused by {request.url}", request=request)

    fake = FakeServer(script=[answer])
    errors: list[BaseException] = []
    texts: list[str] = []
    async with client_for(fake, api_key=SECRET, retry=Retry(attempts=2)) as client:
        texts += [repr(client), str(client), repr(client.server), str(client.server)]
        result = await client.generate("ok", max_tokens=1)
        texts.append(repr(result))
        for prompt in ("unauthorized", "server error", "not json", "too large", "unreachable"):
            with pytest.raises(DSClientError) as info:
                await client.generate(prompt, max_tokens=1)
            errors.append(info.value)
        with pytest.raises(DSClientError) as info:
            async with client.stream([{"role": "user", "content": "x"}], max_tokens=1):
                pass
        errors.append(info.value)
    # The key was sent, and the server said it back each time: the test can fail.
    assert all(r.headers["authorization"] == f"Bearer {SECRET}" for r in fake.requests)
    assert [type(e) for e in errors] == [
        RequestRefused,
        ServerFault,  # a 500: the server's failure, not a refusal (issue 45)
        MalformedResponse,
        ResponseTooLarge,
        ConnectionError,
        ConnectionError,
    ]
    for error in errors:
        texts += [
            str(error),
            repr(error),
            getattr(error, "body", ""),
            getattr(error, "message", ""),
        ]
        texts.append(repr(Failure(index=0, id="a", error=error)))
        cause = error.__cause__
        if cause is not None:
            texts += [str(cause), repr(cause)]
            request = getattr(cause, "_request", None)
            if request is not None:
                texts += [repr(request), repr(request.headers)]
    texts += [caplog.text, *(str(r.args) for r in caplog.records)]
    assert caplog.records  # DEBUG was on: discovery, retries and probes were logged
    leaks = [t for t in texts if SECRET in t]
    assert not leaks, leaks[:3]


def test_the_sync_clients_repr_hides_the_key():
    fake = FakeServer()
    with Client("http://127.0.0.1:8000", api_key=SECRET, transport=fake.transport) as client:
        text = repr(client)
    assert SECRET not in text and "api_key=***" in text


@pytest.mark.anyio
async def test_an_error_reported_mid_stream_does_not_carry_the_key():
    # vLLM reports an error raised mid-stream as a data event; a server that echoes the
    # request's headers there put the key into the error's text.
    def answer(request: httpx.Request) -> httpx.Response:
        event = json.dumps({"error": {"message": f"failed: {_echo(request)}"}})
        first = json.dumps({"choices": [{"text": "a", "finish_reason": None}]})
        body = f"data: {first}\n\ndata: {event}\n\n".encode()
        return httpx.Response(200, stream=httpx.ByteStream(body))

    fake = FakeServer(script=[answer])
    async with client_for(fake, api_key=SECRET) as client:
        with pytest.raises(MalformedResponse) as info:
            async with client.stream("x", max_tokens=2) as s:
                async for _ in s:
                    pass
    assert SECRET in fake.requests[-1].headers["authorization"]  # it was sent
    error = info.value
    assert "failed:" in str(error)
    assert SECRET not in str(error) and SECRET not in getattr(error, "body", "")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_response_bytes": 0}, "max_response_bytes must be an int >= 1"),
        ({"max_response_bytes": 1.5}, "max_response_bytes must be an int >= 1"),
        ({"outage_wait": -1}, "outage_wait must be a positive number of seconds or None"),
        ({"outage_wait": True}, "outage_wait must be a positive number of seconds or None"),
    ],
)
def test_the_clients_limits_refuse_nonsense_by_their_own_names(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncClient("http://127.0.0.1:8000", **kwargs)


@pytest.mark.anyio
async def test_the_outage_probe_reads_no_body():
    # A /health that answers 64 MiB: the probe takes the status and leaves the body unread.
    body = Lazy(64 * MiB, head=b"ok")

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        from dsclient.client._pipeline import RequestPath
        from dsclient.client._retry import RetryBudget
        from dsclient.governor._endpoint import ControlOptions, Endpoint

        endpoint = Endpoint("http://x", ControlOptions(), {}, start=1)
        path = RequestPath(http, endpoint, Retry(), RetryBudget(), sleep=anyio.sleep, rng=random.Random(0))
        path.reach.mark_down("refused")
        await path.reach.wait_up()
    assert not path.reach.down
    assert body.pulled <= MiB

"""Discovery that failed once is asked again; a failed ``async with`` / ``with`` leaves nothing
open."""

from __future__ import annotations

import random
import threading

import anyio
import pytest

import dsclient
from dsclient import AsyncClient, ConnectionError, Retry
from dsclient._http import httpx

from .fakes import FakeServer, RecordedSleep

pytestmark = pytest.mark.anyio


class Flaky:
    """Wraps a FakeServer; ``/v1/models`` fails ``fail_models`` times first (a 503, a reset or
    a stall, as ``how`` says); counts what it was asked."""

    def __init__(self, fake: FakeServer, fail_models: int, how: str = "503") -> None:
        self.fake = fake
        self.fail_models = fail_models
        self.how = how
        self.models_asked = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            self.models_asked += 1
            if self.models_asked <= self.fail_models:
                if self.how == "reset":
                    raise httpx.ReadError("connection reset by peer", request=request)
                if self.how == "stall":
                    await anyio.sleep(30)  # longer than discovery's probe timeout
                return httpx.Response(503, json={"error": {"message": "busy"}})
        return self.fake(request)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _client(handler, **kw) -> AsyncClient:
    kw.setdefault("sleep", RecordedSleep())
    kw.setdefault("rng", random.Random(0))
    return AsyncClient("http://127.0.0.1:8000", transport=httpx.MockTransport(handler), **kw)


@pytest.mark.parametrize("how", ["503", "reset", "stall"])
async def test_a_failed_models_probe_is_asked_again_and_no_call_goes_without_a_model(how):
    fake = FakeServer()
    flaky = Flaky(fake, fail_models=1, how=how)
    async with _client(flaky) as client:
        assert client.server is not None and not client.server.complete
        assert client.model is None
        result = await client.generate("hello", max_tokens=4)
        assert result.text == "hello"
        assert client.server.complete and client.model == "tiny"
        assert client.server.max_model_len == 2048
    assert [body["model"] for body in fake.bodies] == ["tiny"]
    assert flaky.models_asked == 2


async def test_with_a_model_given_the_listing_is_asked_again_after_its_backoff():
    # The model is known, so calls go out at once; the context (from /v1/models) is asked for
    # again, but not before the backoff is over.
    fake = FakeServer()
    flaky = Flaky(fake, fail_models=2)
    clock = Clock()
    async with _client(flaky, model="tiny", clock=clock) as client:
        assert not client.server.complete and client.server.max_model_len is None
        await client.generate("a", max_tokens=2)
        assert flaky.models_asked == 1  # within the backoff: not asked again
        clock.now += 1.0  # past the first backoff (0.25-0.5 s)
        await client.generate("b", max_tokens=2)
        assert flaky.models_asked == 2 and not client.server.complete
        clock.now += 0.5  # the second backoff is 0.5-1 s: not over yet
        await client.generate("c", max_tokens=2)
        assert flaky.models_asked == 2
        clock.now += 1.0
        await client.generate("d", max_tokens=2)
        assert flaky.models_asked == 3 and client.server.complete
        assert client.server.max_model_len == 2048
        await client.generate("e", max_tokens=2)
        assert flaky.models_asked == 3  # complete: never asked again
    assert [body["model"] for body in fake.bodies] == ["tiny"] * 5


async def test_a_listing_that_never_answers_fails_the_call_without_sending_it():
    fake = FakeServer()
    flaky = Flaky(fake, fail_models=10**6)
    sleep = RecordedSleep()
    async with _client(flaky, sleep=sleep, retry=Retry(attempts=3)) as client:
        with pytest.raises(
            ConnectionError,
            match=r"/v1/models gave no model list in 3 tries \(it answered HTTP 503\)",
        ):
            await client.generate("hello", max_tokens=4)
    assert fake.bodies == []  # nothing was sent without a model
    assert flaky.models_asked == 1 + 3
    assert len(sleep.delays) == 2 and all(0 < d <= 1.0 for d in sleep.delays)


async def test_a_server_down_at_start_is_waited_for_then_discovered():
    # Nothing answers at first (not even /health): the call waits like in an outage, then
    # discovers the model and sends with it.
    fake = FakeServer()
    state = {"up": False, "health": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            state["health"] += 1
            if state["health"] >= 3:
                state["up"] = True
        if not state["up"]:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return fake(request)

    async with _client(handler) as client:
        assert client.server.kind == "unknown" and not client.server.complete
        result = await client.generate("hello", max_tokens=4)
        assert result.text == "hello" and client.model == "tiny"
        assert client.reachability.outages == 1 and not client.reachability.down
    assert [body["model"] for body in fake.bodies] == ["tiny"]


async def test_a_failed_async_with_closes_the_http_client():
    fake = FakeServer(models=["a", "b"])
    client = _client(fake)
    with pytest.raises(ValueError, match="serves 2 models"):
        async with client:
            pass
    assert client._http.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        await client.generate("x", max_tokens=1)


async def test_a_cancelled_async_with_closes_the_http_client():
    async def handler(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(30)
        raise AssertionError("unreachable")

    client = _client(handler)
    with anyio.move_on_after(0.2):
        async with client:
            pass
    assert client._http.is_closed


def _portal_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()
    ]


def test_a_failed_sync_with_stops_the_portal_thread():
    before = set(_portal_threads())
    fake = FakeServer(models=["a", "b"])
    client = dsclient.Client("http://127.0.0.1:8000", transport=fake.transport)
    assert set(_portal_threads()) - before  # the portal's loop thread runs
    with pytest.raises(ValueError, match="serves 2 models"):
        with client:
            pass
    for _ in range(100):
        if not set(_portal_threads()) - before:
            break
        threading.Event().wait(0.02)
    assert not set(_portal_threads()) - before
    assert client.aclient._http.is_closed


async def test_a_typod_port_fails_in_seconds_and_says_nothing_listens():
    # Issue 45: AsyncClient("http://127.0.0.1:8001") with nothing there failed after 301.6 s
    # ("has not answered for 301 s (max_wait 300 s)"). The real HTTP stack, a real closed port.
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    async with AsyncClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(ConnectionError) as info:
            await client.generate("hello", max_tokens=4)
    assert time.monotonic() - started < 20
    assert f"nothing listens on 127.0.0.1:{port}" in str(info.value)
    assert "has not answered since the client started" in str(info.value)
    assert isinstance(info.value, OSError)  # the builtin ConnectionError too


async def test_a_server_seen_once_is_waited_for_past_the_first_wait():
    # An outage of a server that answered before is waited through (outage_wait), not cut at
    # the few seconds a never-seen server gets.
    fake = FakeServer()
    state = {"down_probes": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if state["down_probes"] and request.url.path == "/health":
            state["down_probes"] -= 1
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if state["down_probes"]:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return fake(request)

    sleep = RecordedSleep()
    async with _client(handler, sleep=sleep) as client:
        await client.generate("one", max_tokens=2)
        state["down_probes"] = 12
        result = await client.generate("two", max_tokens=2)
        assert client.reachability.outages == 1 and not client.reachability.down
    assert result.text and sum(sleep.delays) > 5.0  # waited past FIRST_WAIT_S


async def test_several_typod_urls_fail_in_seconds_each_with_its_reason():
    import socket
    import time

    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    started = time.monotonic()
    async with AsyncClient(urls, model="m") as client:
        with pytest.raises(ConnectionError) as info:
            await client.generate("hello", max_tokens=4)
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert "has not answered since the client started" in message
    for url, port in zip(urls, ports):
        assert f"{url}: nothing listens on 127.0.0.1:{port}" in message

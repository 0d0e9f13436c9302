"""Several servers behind one client (``AsyncClient([url1, url2])``), with scripted servers.

Each fake server is a host of one ``httpx.MockTransport``; the tests check where calls go, that
none waits behind a busy server while another has room, failover, the all-down bound, the model
filter, readmission after a probe, and that SDK requests are re-aimed at the chosen server.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import dsclient
from dsclient._http import httpx
from tests.fakes import completion_body

pytestmark = pytest.mark.anyio


@dataclass
class Replica:
    """One scripted server: its model, whether it is up, an optional gate its answers wait on."""

    host: str
    model: str = "tiny"
    up: bool = True
    gate: anyio.Event | None = None
    drop_in_flight: bool = False  # answers fail with a dropped connection (the process died)
    status: int = 200
    seen: list[str] = field(default_factory=list)  # prompts answered
    metrics: list[str] = field(default_factory=list)  # /metrics bodies in order (last repeats)
    delay: float = 0.0  # seconds each answer takes
    tickets: anyio.Semaphore | None = None  # when set, each answer waits for one ticket
    scrapes: int = 0
    running: int = 0
    peak: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:8000"


def make_transport(replicas: list[Replica]) -> httpx.MockTransport:
    by_host = {r.host: r for r in replicas}

    async def handler(request: httpx.Request) -> httpx.Response:
        replica = by_host[request.url.host]
        if not replica.up:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(
                200, json={"data": [{"id": replica.model, "max_model_len": 2048}]}
            )
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics" and replica.metrics:
            body = replica.metrics[min(replica.scrapes, len(replica.metrics) - 1)]
            replica.scrapes += 1
            return httpx.Response(200, text=body)
        if path != "/v1/completions":
            return httpx.Response(404)
        body = json.loads(request.content)
        replica.running += 1
        replica.peak = max(replica.peak, replica.running)
        try:
            if replica.gate is not None:
                await replica.gate.wait()
            if replica.delay:
                await anyio.sleep(replica.delay)
            if replica.tickets is not None:
                await replica.tickets.acquire()
            if replica.drop_in_flight or not replica.up:
                raise httpx.ReadError("connection reset by peer", request=request)
            if replica.status != 200:
                return httpx.Response(replica.status, json={"error": {"message": "boom"}})
            replica.seen.append(body["prompt"])
            return httpx.Response(200, json=completion_body(text=replica.host))
        finally:
            replica.running -= 1

    return httpx.MockTransport(handler)


def client_for(replicas: list[Replica], **kwargs: Any) -> dsclient.AsyncClient:
    kwargs.setdefault("max_num_seqs", 4)
    kwargs.setdefault("adaptive", False)
    return dsclient.AsyncClient(
        [r.url for r in replicas], transport=make_transport(replicas), **kwargs
    )


async def test_a_list_of_urls_makes_one_client_over_every_server() -> None:
    a, b = Replica("a"), Replica("b")
    seen: list[dsclient.CallRecord] = []
    async with client_for([a, b], headroom=0.5) as client:
        client.add_observer(seen.append)
        assert client.urls == (a.url, b.url) and client.url == a.url
        assert [s.url for s in client.servers] == [a.url, b.url]
        assert client.limit == 4  # 2 + 2: the sum over the servers
        assert all(s.limit == 2 and s.health == "up" for s in client.servers)
        assert client.server is not None and client.server.model == "tiny"
        results = await client.map([f"p{i}" for i in range(40)], max_tokens=4)
        assert "urls=" in repr(client)
    assert all(r.ok for r in results)
    servers = Counter(r.server for r in results)
    assert set(servers) == {a.url, b.url} and sum(servers.values()) == 40
    assert {r.server for r in seen} == {a.url, b.url}
    assert sorted(a.seen + b.seen) == sorted(f"p{i}" for i in range(40))  # each once
    assert a.peak <= 2 and b.peak <= 2  # each server's own limit held


async def test_a_call_never_waits_behind_a_busy_server_while_another_has_room() -> None:
    a, b = Replica("a", gate=anyio.Event()), Replica("b")
    async with client_for([a, b], limit=2) as client:
        results: list[dsclient.CompletionResult] = []

        async def call(i: int) -> None:
            results.append(await client.generate(f"p{i}", max_tokens=4))

        async with anyio.create_task_group() as group:
            for i in range(12):
                group.start_soon(call, i)
            # a holds two calls it does not answer; the other ten go through b meanwhile
            with anyio.fail_after(5):
                while len(results) + a.running < 12:
                    await anyio.sleep(0.01)
            held = a.running
            assert held >= 1 and all(r.server == b.url for r in results)
            assert a.gate is not None
            a.gate.set()
    assert len(results) == 12 and len(a.seen) == held


async def test_a_server_that_refuses_connections_leaves_the_rotation_and_calls_go_on() -> None:
    a, b = Replica("a"), Replica("b")
    async with client_for([a, b]) as client:
        a.up = False  # killed after discovery
        results = await client.map([f"p{i}" for i in range(30)], max_tokens=4)
        health = {s.url: s.health for s in client.servers}
    assert all(r.ok for r in results), [r for r in results if not r.ok][:2]
    assert {r.server for r in results} == {b.url}
    assert sorted(b.seen) == sorted(f"p{i}" for i in range(30))
    assert health == {a.url: "down", b.url: "up"}
    assert all(r.attempts <= 2 for r in results)  # at most one failed try, on a


async def test_calls_in_flight_on_a_server_that_dies_finish_elsewhere_once() -> None:
    a, b = Replica("a", gate=anyio.Event()), Replica("b", gate=anyio.Event())
    async with client_for([a, b], limit=3) as client:
        results: list[dsclient.CompletionResult] = []

        async def call(i: int) -> None:
            results.append(await client.generate(f"p{i}", max_tokens=4))

        async with anyio.create_task_group() as group:
            for i in range(6):
                group.start_soon(call, i)
            with anyio.fail_after(5):
                while a.running + b.running < 6:
                    await anyio.sleep(0.01)
            a.up = False  # a dies with three calls in flight: their connections drop
            assert a.gate is not None and b.gate is not None
            a.gate.set()
            await anyio.sleep(0.05)
            b.gate.set()
    assert sorted(r.text for r in results) == ["b"] * 6
    assert sorted(b.seen) == sorted(f"p{i}" for i in range(6)) and a.seen == []
    assert all(r.attempts in (1, 2) for r in results)


async def test_with_every_server_down_a_call_fails_with_connection_error_not_a_hang() -> None:
    a, b = Replica("a"), Replica("b")
    client = client_for([a, b], outage_wait=0.5, timeout=30)
    async with client:
        a.up = b.up = False
        with anyio.fail_after(20), pytest.raises(dsclient.ConnectionError) as info:
            await client.generate("hello", max_tokens=4)
    assert isinstance(info.value, dsclient.DSClientError)
    assert "every server" in str(info.value)


async def test_a_server_that_answers_again_comes_back_into_rotation() -> None:
    a, b = Replica("a"), Replica("b")
    async with client_for([a, b]) as client:
        a.up = False
        await client.map([f"p{i}" for i in range(8)], max_tokens=4)
        assert client.servers[0].health == "down"
        a.up = True
        with anyio.fail_after(10):  # the first half-open probe comes within 0.5-1 s
            while client.servers[0].health != "up":
                await client.generate("tick", max_tokens=1)
                await anyio.sleep(0.05)
        before = len(a.seen)
        await client.map([f"q{i}" for i in range(20)], max_tokens=4)
    assert len(a.seen) > before  # traffic is back on the restarted server


async def test_servers_of_another_model_are_never_chosen() -> None:
    big, small1, small2 = Replica("a", model="big"), Replica("b"), Replica("c")
    async with client_for([big, small1, small2], model="tiny") as client:
        limits = [s.limit for s in client.servers]
        assert client.limit == limits[1] + limits[2]  # the servers that serve "tiny"
        results = await client.map([f"p{i}" for i in range(20)], max_tokens=4)
        assert [s.info.model for s in client.servers if s.info] == ["big", "tiny", "tiny"]
    assert big.seen == [] and all(r.ok for r in results)
    assert {r.server for r in results} <= {small1.url, small2.url}


async def test_a_failed_call_is_recorded_against_the_server_that_failed() -> None:
    # Records feed the per-server Prometheus series: a failure on b must not count against a
    # (the first server), which every failure record named before.
    a, b = Replica("a"), Replica("b", status=400)
    seen: list[dsclient.CallRecord] = []
    async with client_for([a, b], retry=dsclient.Retry(attempts=1)) as client:
        client.add_observer(seen.append)
        results = await client.map([f"p{i}" for i in range(30)], max_tokens=4)
    failed = [r for r in seen if not r.ok]
    assert 0 < len(failed) < 30  # the router sent calls to both servers; b's failed
    assert {r.server for r in failed} == {b.url}
    assert {r.status for r in failed} == {400}
    assert {r.server for r in seen if r.ok} == {a.url}
    assert sum(not r.ok for r in results) == len(failed)


async def test_a_call_to_the_only_server_of_its_model_fails_under_that_server() -> None:
    other, tiny = Replica("a", model="big"), Replica("b", status=400)
    seen: list[dsclient.CallRecord] = []
    async with client_for([other, tiny], model="tiny") as client:
        client.add_observer(seen.append)
        with pytest.raises(dsclient.RequestRefused) as info:
            await client.generate("hello", max_tokens=4)
        tiny.status, tiny.drop_in_flight = 200, True
        with pytest.raises(dsclient.ConnectionError):
            await client.generate("again", max_tokens=4)
    assert info.value.server == tiny.url
    assert [(r.server, r.error) for r in seen] == [
        (tiny.url, "RequestRefused"),
        (tiny.url, "ConnectionError"),
    ]


async def test_an_sdk_call_that_fails_is_recorded_against_the_server_that_failed() -> None:
    other, tiny = Replica("a", model="big"), Replica("b", drop_in_flight=True)
    seen: list[dsclient.CallRecord] = []
    async with client_for([other, tiny], model="tiny", retry=dsclient.Retry(attempts=1)) as client:
        client.add_observer(seen.append)
        http = client.httpx()
        with pytest.raises(httpx.TransportError):
            await http.post(
                client.url + "/v1/completions",  # the SDK's base URL names the first server
                json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
            )
        await http.aclose()
    assert [(r.server, r.error) for r in seen] == [(tiny.url, "ConnectionError")]


async def test_a_call_its_timeout_cuts_at_a_server_is_recorded_against_that_server() -> None:
    other, tiny = Replica("a", model="big"), Replica("b", gate=anyio.Event())  # b never answers
    seen: list[dsclient.CallRecord] = []
    async with client_for([other, tiny], model="tiny") as client:
        client.add_observer(seen.append)
        with anyio.fail_after(10), pytest.raises(dsclient.TimeoutError) as info:
            await client.generate("hello", max_tokens=4, timeout=0.3)
        http = client.httpx(timeout=0.3)
        with anyio.fail_after(10), pytest.raises(httpx.TimeoutException):
            await http.post(
                client.url + "/v1/completions",
                json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
            )
        await http.aclose()
    assert info.value.server == tiny.url
    assert [(r.server, r.error) for r in seen] == [
        (tiny.url, "TimeoutError"),
        (tiny.url, "TimeoutError"),
    ]


async def test_a_model_no_server_serves_is_refused_at_discovery_naming_what_is_served() -> None:
    a, b = Replica("a", model="big"), Replica("b", model="small")
    with pytest.raises(ValueError, match=r"'nope'.*'big'.*'small'"):
        async with client_for([a, b], model="nope"):
            pass


async def test_servers_of_different_models_need_a_model_named() -> None:
    a, b = Replica("a", model="big"), Replica("b", model="small")
    with pytest.raises(ValueError, match="different models"):
        async with client_for([a, b]):
            pass


async def test_requests_sharing_a_long_prefix_land_on_the_same_server() -> None:
    a, b = Replica("a"), Replica("b")
    system = "You are a careful assistant. " * 40  # about 1200 characters: 4 blocks
    async with client_for([a, b], limit=8) as client:
        first = await client.generate(system + "question 0", max_tokens=4)
        for i in range(1, 10):
            result = await client.generate(system + f"question {i}", max_tokens=4)
            assert result.server == first.server


async def test_a_5xx_server_is_ejected_after_consecutive_failures_and_retries_go_elsewhere() -> (
    None
):
    a, b = Replica("a", status=500), Replica("b")
    retry = dsclient.Retry(attempts=4, base=0.01, cap=0.02)
    slow_probe = dsclient.RoutingPolicy(eject_after=3, backoff_base=30.0, backoff_cap=60.0)
    async with client_for([a, b], retry=retry, routing=slow_probe) as client:
        results = await client.map([f"p{i}" for i in range(40)], max_tokens=4)
        health = client.servers[0].health
    assert all(r.ok for r in results)
    assert health == "down"


async def test_sdk_requests_are_re_aimed_at_the_server_the_router_chose() -> None:
    a, b = Replica("a", gate=anyio.Event()), Replica("b", gate=anyio.Event())
    async with client_for([a, b], limit=1) as client:
        http = client.httpx()
        hosts: list[str] = []

        async def post(i: int) -> None:
            response = await http.post(
                client.url + "/v1/completions",  # the SDK's base URL names the first server
                json={"model": "tiny", "prompt": f"p{i}", "max_tokens": 4},
            )
            assert response.status_code == 200
            hosts.append(response.json()["choices"][0]["text"])

        async with anyio.create_task_group() as group:
            for i in range(4):
                group.start_soon(post, i)
            with anyio.fail_after(5):
                while a.running + b.running < 2:  # one slot on each
                    await anyio.sleep(0.01)
            assert b.gate is not None and a.gate is not None
            b.gate.set()  # b answers; the two waiting calls go to b, a still holds one
            with anyio.fail_after(5):
                while len(hosts) < 3:
                    await anyio.sleep(0.01)
            a.gate.set()
        await http.aclose()
    assert sorted(hosts) == ["a", "b", "b", "b"]


async def test_shared_budget_with_several_servers_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="shared= works with one server"):
        dsclient.AsyncClient(["http://a:1", "http://b:2"], shared="redis://localhost:6379/0")


def test_a_url_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="named twice"):
        dsclient.AsyncClient(["http://a:1/v1", "http://a:1"])
    with pytest.raises(ValueError, match="empty list"):
        dsclient.AsyncClient([])


def test_the_sync_client_takes_a_list_of_urls_too() -> None:
    a, b = Replica("a"), Replica("b")
    with dsclient.Client(
        [a.url, b.url], transport=make_transport([a, b]), max_num_seqs=4, adaptive=False
    ) as client:
        assert client.urls == (a.url, b.url)
        results = client.map([f"p{i}" for i in range(20)], max_tokens=4)
        assert [s.url for s in client.servers] == [a.url, b.url]
    assert all(r.ok for r in results) and {r.server for r in results} == {a.url, b.url}


def gauges(waiting: int) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {waiting}.0\n'
    )


async def test_a_queue_seen_at_discovery_does_not_keep_a_server_out_under_a_fixed_limit() -> None:
    """Under a fixed limit nothing is scraped for the limit's sake; a pool scrapes anyway (the
    router compares queues), and gauges older than ``stale_after`` count as unknown: a queue of
    5 seen at discovery kept the hand-started server of the two-server integration test out of
    almost every call (4 of 160)."""
    a = Replica("a", metrics=[gauges(5), gauges(0)], delay=0.02)
    b = Replica("b", metrics=[gauges(0)], delay=0.02)
    async with client_for([a, b], limit=2) as client:
        await anyio.sleep(0.05)
        results = await client.map([f"p{i}" for i in range(60)], max_tokens=4)
    assert all(r.ok for r in results)
    assert a.scrapes > 1 and b.scrapes > 1  # scraped while the batch ran
    assert len(a.seen) >= 10, (len(a.seen), len(b.seen))


async def test_a_freed_slot_goes_to_a_waiting_call_whose_prefix_that_server_holds() -> None:
    """Under saturation the first slot freed anywhere went to the head of the line, whatever
    its prefix: affinity decided only while two servers had room. Now the front queue lets the
    freed server take a call whose prefix it holds (within 32 calls of the head)."""
    a = Replica("a", tickets=anyio.Semaphore(0))
    b = Replica("b", tickets=anyio.Semaphore(0))
    p_doc = "Document P. " * 60  # 720 characters: 2 blocks
    q_doc = "Document Q. " * 60
    async with client_for([a, b], limit=1) as client:
        results: dict[str, dsclient.CompletionResult] = {}

        async def call(name: str, doc: str) -> None:
            results[name] = await client.generate(doc + name, max_tokens=4)

        async with anyio.create_task_group() as group:
            group.start_soon(call, "p0", p_doc)
            with anyio.fail_after(5):
                while a.running + b.running < 1:
                    await anyio.sleep(0.01)
            x, y = (a, b) if a.running else (b, a)  # x holds P
            group.start_soon(call, "q0", q_doc)
            with anyio.fail_after(5):
                while y.running < 1:
                    await anyio.sleep(0.01)
            for name, doc in (("q1", q_doc), ("q2", q_doc), ("p1", p_doc)):
                group.start_soon(call, name, doc)
                await anyio.sleep(0.02)  # in this order in the line
            assert x.tickets is not None and y.tickets is not None
            x.tickets.release()  # p0 finishes on x: x's slot goes to p1, not to q1
            with anyio.fail_after(5):
                while len(x.seen) < 2 and x.running < 1:
                    await anyio.sleep(0.01)
            for _ in range(3):
                x.tickets.release()
                y.tickets.release()
    assert x.seen[:2] == [p_doc + "p0", p_doc + "p1"], x.seen
    assert results["q1"].server == y.url or results["q2"].server == y.url

"""The backend interface (``dsclient.governor._backend``): one server behind the interface a pool
has, so that the request path and discovery take one path for both."""

from __future__ import annotations

import random

import anyio
import pytest

from dsclient._exceptions import ConnectionError
from dsclient.client._discovery import ServerInfo
from dsclient.governor._admission import Admission
from dsclient.governor._backend import Backend, SingleServer, rediscover_backoff
from dsclient.governor._endpoint import ControlOptions, Endpoint
from dsclient.governor._pool import ServerPool
from dsclient.governor._routing import Router

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def endpoint(url: str = "http://a:8000", *, model: str = "tiny", complete: bool = True) -> Endpoint:
    e = Endpoint(url, ControlOptions(adaptive=False), {}, start=2)
    e.seed(ServerInfo(url=url, kind="vllm", model=model, models=(model,), complete=complete), None)
    return e


def single(e: Endpoint, probe_answers: bool = True, clock: Clock | None = None) -> SingleServer:
    async def probe(url: str) -> bool:
        return probe_answers

    return SingleServer(
        e, probe=probe, rng=random.Random(0), clock=clock or Clock(), outage_wait=1.0
    )


def test_both_implementations_are_backends() -> None:
    a, b = endpoint("http://a:8000"), endpoint("http://b:8000")

    async def probe(url: str) -> bool:
        return True

    backends: list[Backend] = [
        single(endpoint()),
        ServerPool([a, b], Router(None), {}, probe=probe),
    ]
    assert [len(x.endpoints) for x in backends] == [1, 2]
    assert [x.prefix_of("hello") for x in backends] == [None, "hello"]  # only a router uses it


async def test_one_server_acquires_its_governors_slot_and_names_itself() -> None:
    e = endpoint()
    backend = single(e)
    slot = await backend.acquire(Admission("short", model="tiny"))
    assert backend.server_of(slot) is e and backend.in_flight == 1 == e.governor.in_flight
    assert backend.limit_for("tiny") == e.governor.limit == 5  # 0.7 x the default 8
    assert backend.settle(slot, None, "tiny") is False  # no other server to fail over to
    await slot.__aexit__(None, None, None)
    assert backend.in_flight == 0
    assert backend.stats("tiny").limit == 5


async def test_one_servers_gate_is_its_reachability_and_its_health() -> None:
    e = endpoint()
    backend = single(e, probe_answers=True)
    assert backend.gate_is_open("tiny") and e.view().health == "up"
    backend.reach.mark_down("connection refused")
    assert not backend.gate_is_open("tiny") and e.view().health == "down"
    with anyio.fail_after(5):
        await backend.gate("tiny")  # the probe answers: open again
    assert backend.gate_is_open("tiny")
    slot = await backend.acquire(Admission("short", model="tiny"))
    backend.reach.mark_down("a dropped connection")
    backend.settle(slot, None, "tiny")  # an answer opens the gate
    assert not backend.reach.down
    await slot.__aexit__(None, None, None)


async def test_one_server_that_never_answers_fails_the_gate_typed() -> None:
    backend = single(endpoint(), probe_answers=False)
    backend.reach.mark_down("connection refused")
    with anyio.fail_after(10), pytest.raises(ConnectionError):
        await backend.gate("tiny")


def test_one_server_serves_the_models_it_lists() -> None:
    e = endpoint(model="tiny")
    backend = single(e)
    assert backend.serving("tiny") == [e] and backend.serving("big") == []
    assert backend.info("tiny") is e.info


def test_an_unanswered_listing_is_asked_again_after_a_growing_backoff() -> None:
    clock = Clock()
    e = endpoint(complete=False)
    backend = single(e, clock=clock)
    assert backend.rediscover_due()
    waits = []
    for _ in range(4):
        start = clock.now
        backend.discovered(e)
        assert not backend.rediscover_due()
        clock.now += 60.0
        assert backend.rediscover_due()
        waits.append(backend._again_at - start)
    ceilings = [0.5, 1.0, 2.0, 4.0]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings)), waits
    e.seed(ServerInfo(url=e.url, kind="vllm", model="tiny", models=("tiny",)), None)
    backend.discovered(e)  # it answers: the count starts again
    assert backend._failures == 0 and backend.rediscover_due()


def test_rediscover_backoff_doubles_to_a_cap_with_jitter() -> None:
    rng = random.Random(0)
    for failures, ceiling in [(1, 0.5), (2, 1.0), (7, 30.0), (40, 30.0)]:
        assert ceiling / 2 <= rediscover_backoff(failures, rng) <= ceiling


async def test_a_pool_names_the_server_its_router_chose() -> None:
    a, b = endpoint("http://a:8000"), endpoint("http://b:8000", model="big")

    async def probe(url: str) -> bool:
        return True

    pool = ServerPool([a, b], Router(None), {}, probe=probe)
    assert pool.gate_is_open("tiny") and pool.rediscover_due()
    slot = await pool.acquire(Admission("short", model="big"))
    assert pool.server_of(slot) is b
    await slot.__aexit__(None, None, None)
    with pytest.raises(TypeError):
        pool.server_of(await single(a).acquire(Admission("short", model="tiny")))

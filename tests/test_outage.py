"""The calls in flight when a server dies are victims of one outage: they wait for the server and
try again, outside the retry budget, however many there are; a live server that drops a
connection still spends the budget (the rule in docs/robustness.md, "Server outages")."""

from __future__ import annotations

import json
import random

import anyio
import pytest

from dsclient import AsyncClient, ConnectionError, Retry
from dsclient._http import httpx

from .fakes import completion_body

pytestmark = pytest.mark.anyio

MODELS = {
    "object": "list",
    "data": [{"id": "tiny", "object": "model", "owned_by": "vllm", "max_model_len": 2048}],
}


class DyingServer:
    """A server that holds every completion until :meth:`kill`, which drops them all; while dead
    it refuses connections (``/health`` too) until :meth:`restart`."""

    def __init__(self) -> None:
        self.alive = True
        self.in_flight = 0
        self.peak = 0
        self.hold = True  # completions wait for kill() (or release) while this is set
        self.completions = 0
        self.refused = 0
        self.health_probes = 0
        self._killed = anyio.Event()
        self._released = anyio.Event()

    def kill(self) -> None:
        self.alive = False
        self._killed.set()

    def restart(self) -> None:
        self.alive = True
        self.hold = False
        self._released.set()

    def release(self) -> None:
        """Answer the held calls (a live server that finishes its work)."""
        self.hold = False
        self._released.set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            self.health_probes += 1
        if not self.alive:
            self.refused += 1
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if path == "/health":
            return httpx.Response(200)
        if path != "/v1/completions":
            return httpx.Response(404)
        json.loads(request.content)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.hold:
                with anyio.move_on_after(5):  # a test bug must not hang the suite
                    async with anyio.create_task_group() as tg:

                        async def on_kill() -> None:
                            await self._killed.wait()
                            tg.cancel_scope.cancel()

                        async def on_release() -> None:
                            await self._released.wait()
                            tg.cancel_scope.cancel()

                        tg.start_soon(on_kill)
                        tg.start_soon(on_release)
            if not self.alive:
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=request
                )
            self.completions += 1
            return httpx.Response(200, json=completion_body())
        finally:
            self.in_flight -= 1


class ProbeCountingSleep:
    """Injected sleep: returns at once; after ``restart_after`` sleeps while the server is dead
    (the probe's backoff), the server comes back."""

    def __init__(self, server: DyingServer, restart_after: int) -> None:
        self.server = server
        self.restart_after = restart_after
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        if not self.server.alive and len(self.delays) >= self.restart_after:
            self.server.restart()
        await anyio.sleep(0)


def _client(server: DyingServer, sleep, retry: Retry, **kw) -> AsyncClient:
    return AsyncClient(
        "http://127.0.0.1:8000",
        transport=httpx.MockTransport(server),
        sleep=sleep,
        rng=random.Random(0),
        retry=retry,
        adaptive=False,
        **kw,
    )


async def _wait_for(predicate, seconds: float = 5.0) -> None:
    with anyio.fail_after(seconds):
        while not predicate():
            await anyio.sleep(0.001)


async def test_more_calls_in_flight_than_the_budget_all_survive_a_restart():
    # The budget allows 2 retries; 12 calls die with the server. Before, 10 of them failed with
    # "retry budget spent" (the restart test lost 11 of 200 items that way).
    server = DyingServer()
    retry = Retry(budget_floor=2, budget_ratio=0.0)
    sleep = ProbeCountingSleep(server, restart_after=3)
    results = []
    async with _client(server, sleep, retry, limit=12) as client:

        async def one(i: int) -> None:
            results.append(await client.generate(f"item {i}", max_tokens=4))

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
            await _wait_for(lambda: server.in_flight == 12)
            assert retry.budget_floor + 1 < 12
            server.kill()
        reach = client.reachability
        budget_retries = len(client._budget._retries)
        in_flight = client.in_flight

    assert len(results) == 12
    assert all(r.attempts == 2 for r in results)  # the killed attempt and one after the outage
    assert budget_retries == 0  # no retry was charged to the budget
    assert reach.outages == 1 and not reach.down and reach.confirmed(1)
    assert server.health_probes >= 2  # at least one failed probe confirmed the outage
    assert server.completions == 12 and server.peak == 12 and in_flight == 0


async def test_a_live_server_that_drops_connections_still_spends_the_budget():
    # The first /health probe answers: the outage is not confirmed, so each retry is charged, and
    # with a budget of 1 only one of the three calls is retried.
    server = DyingServer()
    server.hold = False
    calls = 0

    def drop_then_answer(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise httpx.RemoteProtocolError("peer closed connection", request=request)
        return httpx.Response(200, json=completion_body())

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return drop_then_answer(request)
        return await server(request)

    retry = Retry(budget_floor=1, budget_ratio=0.0)
    outcomes: list[object] = []
    async with AsyncClient(
        "http://127.0.0.1:8000",
        transport=httpx.MockTransport(handler),
        sleep=ProbeCountingSleep(server, restart_after=99),
        rng=random.Random(0),
        retry=retry,
        limit=3,
    ) as client:

        async def one() -> None:
            try:
                outcomes.append(await client.generate("x", max_tokens=4))
            except ConnectionError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
        spent = len(client._budget._retries)
        reach = client.reachability
    failed = [o for o in outcomes if isinstance(o, ConnectionError)]
    assert len(failed) == 2 and spent == 1
    assert reach.outages >= 1 and not any(reach.confirmed(n) for n in range(1, reach.outages + 1))


async def test_outage_retries_zero_charges_victims_to_the_budget():
    server = DyingServer()
    retry = Retry(budget_floor=1, budget_ratio=0.0, outage_retries=0)
    sleep = ProbeCountingSleep(server, restart_after=3)
    outcomes: list[object] = []
    async with _client(server, sleep, retry, limit=4) as client:

        async def one(i: int) -> None:
            try:
                outcomes.append(await client.generate(f"item {i}", max_tokens=4))
            except ConnectionError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
            await _wait_for(lambda: server.in_flight == 4)
            server.kill()
    assert sum(isinstance(o, ConnectionError) for o in outcomes) == 3


async def test_victims_give_up_with_the_gate_after_outage_wait():
    # The server never comes back: the victims wait out outage_wait, then fail with a typed
    # ConnectionError (not a hang), each counting the one attempt it made.
    server = DyingServer()
    sleep = ProbeCountingSleep(server, restart_after=10**9)
    retry = Retry(budget_floor=0, budget_ratio=0.0)
    errors: list[ConnectionError] = []
    async with _client(server, sleep, retry, limit=5, outage_wait=5.0) as client:

        async def one(i: int) -> None:
            try:
                await client.generate(f"item {i}", max_tokens=4)
            except ConnectionError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(one, i)
            await _wait_for(lambda: server.in_flight == 5)
            server.kill()
        assert client.in_flight == 0
        # A call after the give-up probes once and fails at once: the gate's verdict is not
        # retried (no backoff sleep, no budget, no second probe).
        slept, probes = len(sleep.delays), server.health_probes
        with pytest.raises(ConnectionError, match="has not answered") as info:
            await client.generate("late", max_tokens=4)
        assert info.value.attempts == 1
        assert len(sleep.delays) == slept and server.health_probes == probes + 1
    assert len(errors) == 5
    assert all("has not answered" in str(e) and e.attempts == 1 for e in errors)


async def test_a_server_dying_twice_costs_one_outage_retry_each_time():
    server = DyingServer()
    sleep = ProbeCountingSleep(server, restart_after=2)
    retry = Retry(budget_floor=0, budget_ratio=0.0)
    results = []
    async with _client(server, sleep, retry, limit=3) as client:

        async def one(i: int) -> None:
            results.append(await client.generate(f"item {i}", max_tokens=4))

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
            await _wait_for(lambda: server.in_flight == 3)
            server.kill()
            await _wait_for(lambda: server.alive and server.in_flight == 0 and len(results) == 3)
        # Second life: hold again, kill again.
        server.hold = True
        server._killed = anyio.Event()
        server._released = anyio.Event()
        sleep.delays.clear()
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
            await _wait_for(lambda: server.in_flight == 3)
            server.kill()
        reach = client.reachability
    assert len(results) == 6 and all(r.attempts == 2 for r in results)
    assert reach.outages == 2 and reach.confirmed(1) and reach.confirmed(2)

"""Tests for dsclient.governor._shared: the fair-share policy and the fall-back state (pure, fake clock),
then the lease script and the client's wiring against a real redis-server (marked integration:
they need ``redis-server`` on PATH, which ``.ci/run`` installs; the vLLM is not involved: the
server is an in-process counting fake behind ``httpx.MockTransport``)."""

from __future__ import annotations

import logging
import math

import anyio
import pytest

from dsclient import AsyncClient
from dsclient._http import httpx
from dsclient.governor._fair import Fair
from dsclient.governor._shared import (
    LEASE_S,
    Peer,
    SharedBudget,
    SharedState,
    SyncResult,
    fair_shares,
    parse_sync,
    redact_url,
)
from tests.fakes import completion_body
from tests.redis_server import RedisServer

pytestmark = pytest.mark.anyio

# -- fair shares (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "demands", "expected"),
    [
        (12, [10, 10, 10], [4, 4, 4]),
        (12, [1, 10, 10], [1, 6, 5]),  # the small demand is met; the rest split, remainder first
        (12, [0, 0, 0], [1, 1, 1]),  # idle clients keep one lease each, the rest is not handed out
        (20, [2, 3], [2, 3]),  # demand met: no more than asked
        (5, [10, 10, 10, 10], [2, 1, 1, 1]),
        (3, [5, 5, 5, 5], [1, 1, 1, 1]),  # a limit under the clients: one each (documented)
        (16, [100, 100, 100, 100], [4, 4, 4, 4]),
        (10, [7], [7]),
        (10, [], []),
    ],
)
def test_fair_shares(limit: int, demands: list[int], expected: list[int]) -> None:
    assert fair_shares(limit, demands) == expected


@pytest.mark.parametrize("seed", range(30))
def test_fair_shares_properties(seed: int) -> None:
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 8)
    limit = rng.randint(n, 64)
    demands = [rng.choice([0, 1, 2, rng.randint(0, 80)]) for _ in range(n)]
    shares = fair_shares(limit, demands)
    assert all(s >= 1 for s in shares)
    assert sum(shares) <= limit
    # Nobody gets more than it asks for (beyond the one lease every client keeps) ...
    assert all(s <= max(1, d) for s, d in zip(shares, demands))
    # ... and if someone's demand is unmet, no room is left and nobody unmet has 2+ fewer than
    # another (max-min fairness with integer shares).
    unmet = [s for s, d in zip(shares, demands) if s < max(1, d)]
    if unmet:
        assert sum(shares) == limit
        assert max(shares) - min(unmet) <= 1


def test_target_for_replaces_this_clients_demand_with_the_fresh_one() -> None:
    peers = (Peer("a", 10, 4, True), Peer("b", 10, 4, True))
    result = SyncResult(granted=4, limit=8, leader=True, capacity=8, peers=peers)
    assert result.target_for("a", 10) == 4
    assert result.target_for("a", 1) == 1  # a is now idle: its share falls at once
    assert result.target_for("c", 10) == 2  # a newcomer counts itself in (3 + 3 + 2)
    # Growth per sync is at most an equal split: the others' demands are a sync old.
    quiet = (Peer("a", 0, 0, False), Peer("b", 0, 0, False), Peer("c", 0, 0, False))
    start = SyncResult(granted=1, limit=16, leader=False, capacity=8, peers=quiet)
    assert start.target_for("c", 100) == 14  # the others look idle ...
    assert start.target_for("c", 100, held=1) == 1 + 6  # ... but it grows by 16 / 3 -> 6 per sync
    assert start.target_for("c", 100, held=7) == 13
    assert start.target_for("c", 3, held=1) == 3
    assert result.total_in_flight == 8 and result.held_back


def test_parse_sync_reads_bytes_and_str() -> None:
    raw = [b"3", 12, 1, b"8", b"h:1:aa", b"5 3 1", "h:2:bb", "0 0 0"]
    result = parse_sync(raw)
    assert (result.granted, result.limit, result.leader, result.capacity) == (3, 12, True, 8)
    assert result.peers == (Peer("h:1:aa", 5, 3, True), Peer("h:2:bb", 0, 0, False))
    assert parse_sync([1, 5, 0, b""]).capacity is None


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@cache:6379/0", "redis://***@cache:6379/0"),
        ("redis://user:s3cret@cache:6379/2", "redis://***@cache:6379/2"),
        ("rediss://cache:6380/0", "rediss://cache:6380/0"),
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# -- the fall-back state (pure, fake clock) -------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_state_logs_one_warning_per_outage_and_says_when_it_rejoins() -> None:
    clock = FakeClock()
    state = SharedState(interval=0.2, retry=1.0, lease_s=3.0, clock=clock)
    assert state.mode == "local" and not state.block_alive()
    assert state.succeeded() is False  # the first join is not a rejoin
    assert state.mode == "shared" and state.next_delay() == 0.2
    clock.now += 1
    assert state.failed() is True  # log it
    assert state.failed() is False  # ... once
    assert state.mode == "local" and state.next_delay() == 1.0 and state.failures == 2
    assert state.succeeded() is True  # rejoined: say so
    assert state.failed() is True  # a second outage is logged again


def test_state_block_lives_for_the_lease_time_after_the_last_sync() -> None:
    clock = FakeClock()
    state = SharedState(lease_s=3.0, clock=clock)
    state.succeeded()
    clock.now += 2.9
    assert state.block_alive()
    clock.now += 0.2
    assert not state.block_alive()


def test_state_rejects_an_interval_longer_than_the_lease() -> None:
    with pytest.raises(ValueError, match="interval"):
        SharedState(interval=5.0, lease_s=3.0)


def test_client_refuses_a_bad_shared_url_without_showing_its_password() -> None:
    with pytest.raises(ValueError, match="shared must be a Redis URL") as info:
        AsyncClient("http://h:1", shared="http://:pw123@h:1")
    assert "pw123" not in str(info.value)
    with pytest.raises(ValueError, match="shared_key"):
        AsyncClient("http://h:1", shared="redis://127.0.0.1:1/0", shared_key="")


# -- against a real redis-server ------------------------------------------------------------------


class _Secret:
    def __init__(self, value: str) -> None:
        self.value = value

    def reveal(self) -> str:
        return self.value


class StubGovernor:
    def __init__(self, in_flight: int = 0, waiting: int = 0) -> None:
        self.in_flight, self.waiting = in_flight, waiting

    @property
    def held_back(self) -> bool:
        return self.waiting > 0

    #: No tenants here (tests/test_shared_fair.py runs the tenants' sync on real governors).
    held_by_fairness = 0
    fair = Fair()

    def sync_fair(self, *args: object) -> None:
        raise AssertionError("a governor without tenants has nothing to sync")

    def unsync_fair(self) -> None:
        pass


class StubController:
    def __init__(self, limit: int) -> None:
        self.limit, self.capacity = limit, None


class StubEndpoint:
    """The local side of a client, scripted: the lease script itself runs in the real Redis."""

    url = "http://fake:1"

    def __init__(self, limit: int, in_flight: int = 0, waiting: int = 0) -> None:
        self.governor = StubGovernor(in_flight, waiting)
        self.controller = StubController(limit)
        self.applied: list[SyncResult] = []
        self.left = 0

    def apply_shared(self, result: SyncResult, *, became_leader: bool, allowed: int) -> None:
        self.applied.append(result)
        self.allowed = allowed

    def leave_shared(self) -> None:
        self.left += 1


def _budget(redis_url: str) -> SharedBudget:
    return SharedBudget(_Secret(redis_url), key="t", server_url="http://fake:1")


class CountingServer:
    """An async fake vLLM: counts the requests in flight across every client that uses it."""

    def __init__(self, service_s: float = 0.02) -> None:
        self.service_s = service_s
        self.in_flight = 0
        self.most = 0
        self.done = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            data = [{"id": "tiny", "object": "model", "max_model_len": 2048}]
            return httpx.Response(200, json={"object": "list", "data": data})
        if path == "/v1/completions":
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            try:
                await anyio.sleep(self.service_s)
            finally:
                self.in_flight -= 1
            self.done += 1
            return httpx.Response(200, json=completion_body())
        return httpx.Response(404, json={"detail": "Not Found"})


async def _flood(client: AsyncClient, n: int) -> None:
    async with anyio.create_task_group() as group:
        for _ in range(n):
            group.start_soon(lambda: client.generate("hi", max_tokens=2))


@pytest.mark.integration
async def test_lease_script_grants_within_the_limit_and_shares_fairly(redis_url: str) -> None:
    endpoints = [StubEndpoint(6, in_flight=0, waiting=10) for _ in range(3)]
    budgets = [_budget(redis_url) for _ in range(3)]
    try:
        await budgets[0].step(endpoints[0])  # type: ignore[arg-type]
        assert budgets[0].granted == 6  # alone: all the room it wants
        for budget, endpoint in zip(budgets[1:], endpoints[1:]):
            await budget.step(endpoint)  # type: ignore[arg-type]
            assert budget.granted == 0  # no room: a first lease waits for it
        endpoints[0].governor.in_flight = 6  # its requests run; its share is now 2
        for _ in range(2):
            for budget, endpoint in zip(budgets, endpoints):
                await budget.step(endpoint)  # type: ignore[arg-type]
                assert sum(b.granted for b in budgets) <= 6
        assert [b.granted for b in budgets] == [6, 0, 0]  # ... but they are in flight
        endpoints[0].governor.in_flight = 0  # they ended
        for _ in range(2):
            for budget, endpoint in zip(budgets, endpoints):
                await budget.step(endpoint)  # type: ignore[arg-type]
                assert sum(b.granted for b in budgets) <= 6
        assert [b.granted for b in budgets] == [2, 2, 2]
        assert all(b.limit == 6 for b in budgets)
        assert sum(1 for b in budgets if b.leader) == 1
        # One goes idle: it keeps one lease, the others take its share.
        endpoints[0].governor.waiting = 0
        for _ in range(3):
            for budget, endpoint in zip(budgets, endpoints):
                await budget.step(endpoint)  # type: ignore[arg-type]
        assert sorted(b.granted for b in budgets) == [1, 2, 3]
    finally:
        for budget in budgets:
            await budget.aclose()


@pytest.mark.integration
async def test_a_client_never_holds_fewer_leases_than_requests_in_flight(redis_url: str) -> None:
    busy, newcomer = StubEndpoint(4, in_flight=4), StubEndpoint(4, waiting=10)
    budgets = [_budget(redis_url), _budget(redis_url)]
    try:
        await budgets[0].step(busy)  # type: ignore[arg-type]
        await budgets[1].step(newcomer)  # type: ignore[arg-type]
        await budgets[0].step(busy)  # type: ignore[arg-type]
        await budgets[0].step(busy)  # the share is computed from the last sync's demands
        # busy's fair share is now 2, but 4 of its requests run: it keeps 4 leases until they
        # end, and admits none meanwhile (its governor's limit is its share, 2)
        assert budgets[0].granted == 4 and budgets[1].granted == 0
        assert budgets[0].allowed == 2 and busy.allowed == 2
        busy.governor.in_flight = 2
        await budgets[0].step(busy)  # type: ignore[arg-type]
        await budgets[1].step(newcomer)  # type: ignore[arg-type]
        assert (budgets[0].granted, budgets[1].granted) == (2, 2)
    finally:
        for budget in budgets:
            await budget.aclose()


@pytest.mark.integration
async def test_three_clients_never_pass_the_shared_limit(redis_url: str) -> None:
    server = CountingServer()
    clients = [
        AsyncClient(
            "http://fake:1", limit=6, shared=redis_url, transport=httpx.MockTransport(server)
        )
        for _ in range(3)
    ]
    async with clients[0], clients[1], clients[2]:
        assert clients[0].limit == 6  # the shared limit, not this client's block
        async with anyio.create_task_group() as group:
            for client in clients:
                group.start_soon(_flood, client, 60)
        assert all(client.limit == 6 for client in clients)
    assert server.done == 180
    assert server.most <= 6
    assert server.most >= 4  # they did share it: one lease each would be 3


@pytest.mark.integration
async def test_closing_gives_the_leases_back_at_once(redis_url: str) -> None:
    import redis

    server = CountingServer()
    client = AsyncClient(
        "http://fake:1", limit=6, shared=redis_url, transport=httpx.MockTransport(server)
    )
    async with client:
        await _flood(client, 20)
    raw = redis.Redis.from_url(redis_url)
    assert raw.zcard("dsclient:{http://fake:1}:leases") == 0
    assert raw.zcard("dsclient:{http://fake:1}:clients") == 0
    # What stays (the limit) expires a minute after the last sync: nothing is left for good.
    assert raw.get("dsclient:{http://fake:1}:limit") == b"6"
    assert 0 < raw.pttl("dsclient:{http://fake:1}:limit") <= 60_000


@pytest.mark.integration
async def test_a_silent_clients_share_comes_back_within_the_lease_time(redis_url: str) -> None:
    a, b = StubEndpoint(8, in_flight=4), StubEndpoint(8, waiting=8)
    budget_a, budget_b = _budget(redis_url), _budget(redis_url)
    try:
        for _ in range(2):
            await budget_a.step(a)  # type: ignore[arg-type]
            await budget_b.step(b)  # type: ignore[arg-type]
        assert (budget_a.granted, budget_b.granted) == (4, 4)
        # a stops syncing without a goodbye (what kill -9 does); b syncs on and gets it all.
        silent_at = anyio.current_time()
        while budget_b.granted < 8:
            await anyio.sleep(0.05)
            await budget_b.step(b)  # type: ignore[arg-type]
            assert anyio.current_time() - silent_at < LEASE_S + 2.0, "the share never came back"
        took = anyio.current_time() - silent_at
        assert LEASE_S - 0.3 <= took <= LEASE_S + 1.0, took
    finally:
        await budget_a.aclose()
        await budget_b.aclose()


@pytest.mark.integration
async def test_redis_restart_falls_back_logs_once_and_rejoins_without_losing_a_request(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = CountingServer(service_s=0.05)
    clients = [
        AsyncClient(
            "http://fake:1",
            limit=4,
            shared=redis_server.url,
            transport=httpx.MockTransport(server),
        )
        for _ in range(2)
    ]
    caplog.set_level(logging.INFO, logger="dsclient")
    async with clients[0], clients[1]:

        async def bounce() -> None:
            await anyio.sleep(0.5)
            redis_server.kill()
            await anyio.sleep(1.5)
            assert not any(c._endpoint.shared_active for c in clients)
            redis_server.start()
            await anyio.sleep(2.0)

        async with anyio.create_task_group() as group:
            group.start_soon(bounce)
            for client in clients:
                group.start_soon(_flood, client, 150)
        assert all(c._endpoint.shared_active for c in clients)
    assert server.done == 300  # no request lost
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    away = [m for m in warnings if "does not answer" in m]
    back = [m for m in warnings if "answers again" in m]
    assert len(away) == 2, warnings  # once per client
    assert len(back) == 2, warnings


@pytest.mark.integration
async def test_the_password_never_shows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "pw-Zq81xT"
    caplog.set_level(logging.DEBUG, logger="dsclient")
    with RedisServer(password=secret) as redis_server:
        good = redis_server.url
        bad = good.replace(secret, secret + "-wrong")
        server = CountingServer()
        for url in (good, bad):
            client = AsyncClient(
                "http://fake:1", limit=2, shared=url, transport=httpx.MockTransport(server)
            )
            async with client:
                await _flood(client, 5)
                assert secret not in repr(client)
                assert "***@127.0.0.1" in repr(client)
                assert client._endpoint.shared_active is (url == good)
    assert server.done == 10
    text = caplog.text
    assert secret not in text
    assert "does not answer" in text  # the wrong password fell back, and said so


def test_lease_time_is_a_few_seconds() -> None:
    assert 1.0 <= LEASE_S <= 10.0 and math.isfinite(LEASE_S)


@pytest.mark.integration
def test_the_sync_client_takes_shared_too(redis_url: str) -> None:
    from dsclient import Client

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            data = [{"id": "tiny", "object": "model", "max_model_len": 2048}]
            return httpx.Response(200, json={"object": "list", "data": data})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json=completion_body())
        return httpx.Response(404)

    with Client(
        "http://fake:1",
        limit=3,
        shared=redis_url,
        shared_key="sync",
        transport=httpx.MockTransport(handler),
    ) as client:
        assert client.generate("hi", max_tokens=2).text == "hello"
        assert client.limit == 3
        assert "shared='redis://127.0.0.1:" in repr(client)


# -- the endpoint's side (pure: results handed in) ------------------------------------------------


def test_a_new_leader_takes_over_the_shared_limit_without_slow_start() -> None:
    from dsclient.governor._endpoint import ControlOptions, Endpoint

    endpoint = Endpoint("http://fake:1", ControlOptions(), {}, start=16)
    endpoint.use_shared(_budget_stub())
    assert endpoint.governor.limit == 1  # nothing sent before the first lease
    first = endpoint.controller
    mine = SyncResult(granted=4, limit=16, leader=True, capacity=24, peers=())
    endpoint.apply_shared(mine, became_leader=True)
    assert endpoint.controller is first  # the budget's first leader published its own limit
    assert endpoint.governor.limit == 4 and endpoint.controller.capacity == 24
    grown = SyncResult(granted=6, limit=45, leader=True, capacity=24, peers=())
    endpoint.apply_shared(grown, became_leader=True)  # took over from another process
    assert endpoint.controller is not first and endpoint.controller.limit == 45
    assert endpoint.controller.slow_start < 1.05  # grows by one a period, not x2
    assert endpoint.governor.limit == 6
    endpoint.leave_shared()  # Redis away: its own loop, from the share it held
    assert not endpoint.shared_active and endpoint.controller.limit == 6
    assert endpoint.governor.limit == 6


def _budget_stub() -> SharedBudget:
    return SharedBudget(_Secret("redis://127.0.0.1:1/0"), key="t", server_url="http://fake:1")


def test_the_leader_counts_a_rise_of_the_shared_limit_as_in_flight_while_anyone_waits() -> None:
    from dsclient.governor._endpoint import ControlOptions, Endpoint

    endpoint = Endpoint("http://fake:1", ControlOptions(), {}, start=16)
    budget = _budget_stub()
    endpoint.use_shared(budget)
    peers = (Peer(budget.client_id, 9, 0, True), Peer("other", 9, 5, True))
    endpoint.apply_shared(
        SyncResult(granted=4, limit=16, leader=True, capacity=24, peers=peers), became_leader=True
    )
    assert endpoint._in_flight() == 16  # 5 sent; the other 11 of the limit follow a sync later
    quiet = (Peer(budget.client_id, 0, 0, False), Peer("other", 5, 5, False))
    endpoint.apply_shared(
        SyncResult(granted=4, limit=16, leader=True, capacity=24, peers=quiet), became_leader=False
    )
    assert endpoint._in_flight() == 5  # nobody waits: only what was sent

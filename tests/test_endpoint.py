"""Tests for dsclient.governor._endpoint: seeding, learning the capacity, the limit applied to the real
governor (no leaked slots), raise callbacks, and the /metrics poller.

Everything but the poller runs on a hand-driven clock; the poller tests use anyio's real clock
with a 0.05 s scrape interval, each bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import pytest

from dsclient._http import httpx
from dsclient.client._discovery import ServerInfo
from dsclient.governor._endpoint import LEARNED_SOURCE, ControlOptions, Endpoint, fetch_load
from dsclient.governor._governor import Slot
from dsclient.governor._load import Load

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:8000"

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 8.0
vllm:num_requests_running{engine="0",model_name="other"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting{engine="0",model_name="other"} 40.0
"""


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def server(max_num_seqs: int = 8, source: str = "default") -> ServerInfo:
    return ServerInfo(
        url=URL,
        kind="vllm",
        model="tiny",
        models=("tiny",),
        max_num_seqs=max_num_seqs,
        sources={"max_num_seqs": source, "kind": "/version"},
    )


def load(running: int | None, waiting: int | None, **more: object) -> Load:
    return Load(source="vllm /metrics", running=running, waiting=waiting, **more)  # type: ignore[arg-type]


def make(options: ControlOptions | None = None, clock: FakeClock | None = None) -> Endpoint:
    # The numbers below were worked out for a target of a quarter of the batch.
    options = options or ControlOptions(queue_share=0.25, slow_start=1.5)
    return Endpoint(URL, options, {}, start=5, clock=clock or FakeClock())


async def hold(endpoint: Endpoint, n: int) -> list[Slot]:
    """Take ``n`` free slots (entering a free slot never waits)."""
    slots = [endpoint.governor.slot() for _ in range(n)]
    for slot in slots:
        await slot.__aenter__()
    return slots


async def until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` on the real clock (the caller bounds it with ``fail_after``)."""
    while not condition():
        await anyio.sleep(0.005)


async def release(slots: list[Slot], outcome: str = "ok") -> None:
    for slot in slots:
        slot.set_outcome(outcome)
        await slot.__aexit__(None, None, None)


# --- seed ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_num_seqs", "headroom", "start"),
    [(8, 0.7, 5), (32, 0.7, 22), (256, 0.7, 179), (8, 2.0, 16)],
)
def test_seed_metrics_mode_and_start(max_num_seqs: int, headroom: float, start: int) -> None:
    endpoint = make(ControlOptions(headroom=headroom))
    info = server(max_num_seqs, "vllm /server_info")
    endpoint.seed(info, load(0, 0))
    control = endpoint.controller
    assert (control.mode, control.start, control.limit, control.capacity) == (
        "metrics",
        start,
        start,
        max_num_seqs,
    )
    assert endpoint.governor.limit == start
    assert endpoint.info is info
    assert endpoint.start_limit(info) == start


@pytest.mark.parametrize(
    "first",
    [
        None,
        load(None, None, kv_usage=0.4),
        load(3, None),
        load(None, 2),
    ],
)
def test_seed_throughput_mode_without_both_queue_gauges(first: Load | None) -> None:
    endpoint = make()
    endpoint.seed(server(32, "explicit"), first)
    assert endpoint.controller.mode == "throughput"
    assert endpoint.governor.limit == 22
    assert endpoint.controller.ceiling == 1024  # max_num_seqs is where it starts, not a bound
    assert endpoint.route is None and endpoint.wants_load_header
    assert endpoint.control_stats().signal == "throughput"


def test_seed_throughput_mode_with_a_guessed_capacity_starts_there_and_may_grow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dsclient")
    endpoint = make()
    endpoint.seed(server(8, "default"), None)
    assert (endpoint.controller.mode, endpoint.controller.capacity) == ("throughput", None)
    # A server that states nothing: the limit starts at 1 (a server of one seat never holds
    # more than two waiting) and slow start finds the rest.
    assert endpoint.governor.limit == 1 and endpoint.controller.ceiling == 1024
    assert "finds the server's knee from its answers" in caplog.text


@pytest.mark.parametrize(
    ("options", "start"),
    [
        (ControlOptions(adaptive=False), 22),
        (ControlOptions(limit=12), 12),
        (ControlOptions(limit=40, adaptive=True), 40),
    ],
)
def test_seed_fixed_mode(options: ControlOptions, start: int) -> None:
    endpoint = make(options)
    endpoint.seed(server(32, "explicit"), load(0, 0))
    control = endpoint.controller
    assert (control.mode, control.limit, control.ceiling) == ("fixed", start, start)
    assert endpoint.governor.limit == start


@pytest.mark.parametrize(
    ("source", "known"),
    [
        ("default", None),
        ("ollama default", None),
        (LEARNED_SOURCE, 24),
        ("launcher record", 24),
        ("explicit", 24),
        ("vllm /server_info", 24),
    ],
)
def test_seed_trusts_stated_capacities_only(source: str, known: int | None) -> None:
    endpoint = make()
    endpoint.seed(server(24, source), load(0, 0))
    assert endpoint.controller.capacity == known


def test_seed_passes_the_options_to_the_controller() -> None:
    options = ControlOptions(max_limit=40, queue_share=0.5, latency_target=3.0, scrape_interval=0.1)
    endpoint = make(options)
    endpoint.seed(server(32, "explicit"), load(0, 0))
    control = endpoint.controller
    assert (control.ceiling, control.queue_share, control.latency_target, control.period) == (
        40,
        0.5,
        3.0,
        0.1,
    )


def test_control_stats_and_repr() -> None:
    endpoint = make()
    endpoint.seed(server(8, "explicit"), load(0, 0))
    stats = endpoint.control_stats()
    assert (stats.mode, stats.limit, stats.ceiling, stats.learned_max_num_seqs) == (
        "metrics",
        5,
        64,
        None,
    )
    assert repr(endpoint) == (
        "Endpoint(url='http://127.0.0.1:8000', mode='metrics', limit=5, in_flight=0)"
    )


# --- learned capacity ---------------------------------------------------------------------------


@pytest.mark.parametrize("guess", ["default", "ollama default"])
def test_learned_capacity_replaces_a_guess(guess: str) -> None:
    endpoint = make()
    endpoint.seed(server(8, guess), load(0, 0))
    endpoint.observe_load(load(24, 3), 1.0)
    assert endpoint.info is not None and endpoint.info.max_num_seqs == 8  # one scrape: not yet
    endpoint.observe_load(load(20, 1), 1.25)
    info = endpoint.info
    assert info is not None
    assert info.max_num_seqs == 24
    assert info.sources["max_num_seqs"] == LEARNED_SOURCE
    assert "metrics" in info.sources["max_num_seqs"]
    assert (info.model, info.sources["kind"]) == ("tiny", "/version")  # the rest is kept
    assert endpoint.controller.capacity == 24
    assert endpoint.control_stats().learned_max_num_seqs == 24
    # A learned value goes on learning (it only rises).
    endpoint.observe_load(load(30, 2), 1.5)
    assert endpoint.info is not None and endpoint.info.max_num_seqs == 30
    assert endpoint.controller.capacity == 30
    assert endpoint.scrapes == 3
    assert (endpoint.load, endpoint.load_at) == (load(30, 2), 1.5)


def test_the_first_load_counts_towards_learning() -> None:
    endpoint = make()
    endpoint.seed(server(8, "default"), load(16, 4))
    endpoint.observe_load(load(16, 2), 0.25)
    assert endpoint.info is not None and endpoint.info.max_num_seqs == 16


@pytest.mark.parametrize("stated", ["launcher record", "explicit", "vllm /server_info"])
def test_learned_capacity_never_overwrites_a_stated_one(stated: str) -> None:
    endpoint = make()
    info = server(8, stated)
    endpoint.seed(info, load(0, 0))
    for step in range(4):
        endpoint.observe_load(load(24, 3), step * 0.25)
    assert endpoint.info is info  # what the server was said to be stays reported
    assert endpoint.controller.capacity == 8
    assert endpoint.learner.value == 24  # still reported in the stats
    assert endpoint.control_stats().learned_max_num_seqs == 24


def test_isolated_transient_queues_teach_nothing() -> None:
    endpoint = make()
    endpoint.seed(server(8, "default"), load(0, 0))
    endpoint.observe_load(load(2, 1), 0.0)  # a request caught before its first scheduler step
    for step in range(1, 100):
        endpoint.observe_load(load(2, 0), step * 0.25)
    endpoint.observe_load(load(2, 1), 100 * 0.25)
    assert endpoint.learner.value is None
    assert endpoint.info is not None and endpoint.info.max_num_seqs == 8
    assert endpoint.controller.capacity is None


def test_learning_counts_the_whole_queue() -> None:
    endpoint = make()
    endpoint.seed(server(8, "default"), load(0, 0))
    # The rule: running while num_requests_waiting > 0, whatever the reason vLLM gives
    # (its "capacity" reason stayed 0 on a hand-started server under load, and nothing was
    # learned).
    for step in range(2):
        endpoint.observe_load(load(24, 3, waiting_capacity=0), step * 0.25)
    assert endpoint.learner.value == 24
    assert endpoint.info is not None and endpoint.info.max_num_seqs == 24


def test_learning_is_bounded_by_the_kv_cache() -> None:
    endpoint = make()
    endpoint.seed(server(8, "default"), load(0, 0, kv_cache_size_tokens=1280, block_size=128))
    endpoint.observe_load(load(24, 3), 0.25)
    endpoint.observe_load(load(24, 3), 0.5)
    assert endpoint.info is not None and endpoint.info.max_num_seqs == 10


def test_a_scrape_without_queue_gauges_is_an_idle_period() -> None:
    endpoint = make()
    endpoint.seed(server(8, "explicit"), load(0, 0))
    endpoint.observe_load(load(None, None, kv_usage=0.5), 0.25)
    assert endpoint.scrapes == 1
    assert endpoint.governor.limit == 5
    assert endpoint.controller.server_running is None


# --- the limit on the real governor --------------------------------------------------------------


async def test_growth_needs_demand_on_the_governor() -> None:
    endpoint = make()
    endpoint.seed(server(8, "explicit"), load(0, 0))
    slots = await hold(endpoint, 4)  # 4 of 5 slots: no demand
    endpoint.observe_load(load(4, 0), 0.0)
    assert endpoint.governor.limit == 5
    slots += await hold(endpoint, 1)  # every slot used: demand
    endpoint.observe_load(load(5, 0), 0.25)
    assert endpoint.governor.limit == 8
    await release(slots)


async def test_no_slot_leaks_when_the_limit_drops_under_load() -> None:
    clock = FakeClock()
    endpoint = make(ControlOptions(headroom=1.0, queue_share=0.25, slow_start=1.5), clock)
    endpoint.seed(server(8, "explicit"), load(0, 0))
    governor = endpoint.governor
    assert governor.limit == 8
    events = [anyio.Event() for _ in range(12)]
    outcomes = {0: "overloaded", 1: "overloaded", 2: "overloaded"}
    admitted: list[tuple[int, int, int]] = []  # (call, in flight, limit) at admission

    async def call(i: int) -> None:
        async with governor.slot() as slot:
            admitted.append((i, governor.in_flight, governor.limit))
            await events[i].wait()
            slot.set_outcome(outcomes.get(i, "ok"))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(call, i)
            await anyio.wait_all_tasks_blocked()
            assert (governor.in_flight, governor.waiting) == (8, 4)

            clock.now = 1.0
            endpoint.observe_load(load(8, 30), clock.now)  # queue 30 > target 2
            assert governor.limit == 4  # ceil(8 x 0.5)
            for i in (0, 1, 2):  # three 429s: one cut (cooldown), nobody admitted
                events[i].set()
                await anyio.wait_all_tasks_blocked()
            assert governor.limit == 2  # floor(4 x 0.7)
            assert endpoint.controller.reason == "the server refused for load"
            assert (governor.in_flight, governor.waiting) == (5, 4)

            for event in events:
                event.set()

    assert (governor.in_flight, governor.waiting) == (0, 0)
    assert sorted(i for i, _, _ in admitted) == list(range(12))
    late = [(in_flight, limit) for i, in_flight, limit in admitted if i >= 8]
    assert all(in_flight <= limit == 2 for in_flight, limit in late), late
    lanes = governor.stats().lanes
    assert (lanes["short"].done, lanes["short"].failed) == (9, 3)

    # The new limit, exactly: 2 at once, the third waits.
    slots = await hold(endpoint, 2)
    assert governor.in_flight == 2

    third_in = anyio.Event()

    async def third() -> None:
        async with governor.slot():
            third_in.set()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            await anyio.wait_all_tasks_blocked()
            assert governor.waiting == 1 and not third_in.is_set()
            await release(slots[:1])
            await third_in.wait()
    await release(slots[1:])
    assert (governor.in_flight, governor.waiting) == (0, 0)


async def test_cancelled_waiters_never_leak_while_the_limit_moves() -> None:
    clock = FakeClock()
    endpoint = make(ControlOptions(headroom=1.0, queue_share=0.25, slow_start=1.5), clock)
    # max_num_seqs a guess: slow start is not bounded by batch + target queue (8 -> 12 here).
    endpoint.seed(server(8, "default"), load(0, 0))
    governor = endpoint.governor
    holders = [anyio.Event() for _ in range(8)]
    scopes = [anyio.CancelScope() for _ in range(8)]
    go = anyio.Event()
    ran: list[int] = []

    async def holder(i: int) -> None:
        async with governor.slot():
            await holders[i].wait()

    async def waiter(i: int) -> None:
        with scopes[i]:
            async with governor.slot():
                ran.append(i)
                await go.wait()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(holder, i)
            await anyio.wait_all_tasks_blocked()
            for i in range(8):
                tg.start_soon(waiter, i)
                await anyio.wait_all_tasks_blocked()  # arrival order 0..7
            assert (governor.in_flight, governor.waiting) == (8, 8)

            # Waiter 0 is cancelled, then (before it runs) the limit rises by slow start with
            # demand waiting: waiters 0-3 are granted. 0 sees its cancellation in the wait and
            # passes the slot on. 1 is cancelled after the grant: it runs up to its next
            # checkpoint, then leaves and releases. 6 gives up while still waiting.
            scopes[0].cancel()
            endpoint.observe_load(load(4, 0), 0.0)
            assert governor.limit == 12
            for i in (1, 6):
                scopes[i].cancel()
            await anyio.wait_all_tasks_blocked()
            assert sorted(ran) == [1, 2, 3, 4, 5]
            assert (governor.in_flight, governor.waiting) == (12, 1)

            # The limit falls; the last waiter gives up.
            endpoint.observe_load(load(8, 30), 0.25)
            assert governor.limit == 6  # ceil(12 x 0.5)
            scopes[7].cancel()
            await anyio.wait_all_tasks_blocked()
            assert (governor.in_flight, governor.waiting) == (12, 0)

            for event in holders:
                event.set()
            go.set()

    assert (governor.in_flight, governor.waiting) == (0, 0)
    slots = await hold(endpoint, 6)
    assert governor.in_flight == governor.limit == 6
    blocked = governor.slot()
    with anyio.move_on_after(0.01):  # the seventh must wait
        await blocked.__aenter__()
        pytest.fail("a seventh slot was admitted under a limit of 6")
    assert governor.waiting == 0  # the timed-out waiter left the queue
    await release(slots)


# --- on_raise -----------------------------------------------------------------------------------


async def test_on_raise_fires_when_the_limit_rises_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dsclient")
    clock = FakeClock()
    endpoint = make(clock=clock)
    endpoint.seed(server(8, "explicit"), load(0, 0))
    seen: list[int] = []
    other: list[int] = []
    remove = endpoint.on_raise(lambda: seen.append(endpoint.governor.limit))
    endpoint.on_raise(lambda: other.append(endpoint.governor.limit))
    slots = await hold(endpoint, 5)

    endpoint.observe_load(load(5, 0), 0.0)  # room and demand: x1.5
    assert seen == other == [8]  # the governor already has the new limit
    assert "limit 5 -> 8" in caplog.text

    endpoint.observe_load(load(8, 20), 0.25)  # a queue: cut
    assert endpoint.governor.limit == 3
    clock.now = 0.5
    await release(slots[:1], "overloaded")  # a 429: cut again
    assert endpoint.governor.limit == 2
    assert seen == other == [8]

    remove()
    remove()  # twice is harmless
    # In flight 4 >= 2: demand; past the cooldown, and past the 10 s that growth stays under the
    # limit the server refused at (3).
    endpoint.observe_load(load(3, 0), 11.5)
    assert endpoint.governor.limit == 6
    assert seen == [8]
    assert other == [8, 6]
    await release(slots[1:])


async def test_on_raise_fires_in_throughput_mode() -> None:
    endpoint = make()
    endpoint.seed(server(8, "explicit"), None)  # starts at 5
    seen: list[int] = []
    endpoint.on_raise(lambda: seen.append(endpoint.governor.limit))
    slots = await hold(endpoint, 5)  # every slot used: demand
    t = 0.0
    while not seen and t < 10:
        t += 0.25
        for _ in range(2):
            endpoint.controller.on_outcome(t, "ok", 0.2, 16.0)
        endpoint.tick(t)
    # The first epoch measured: slow start (x3), within 2.5x what the server is seen to run
    # and the batch it states (8) plus its target queue.
    assert len(seen) == 1 and 5 < seen[0] <= 12, seen
    await release(slots)


# --- fetch_load and the poller ------------------------------------------------------------------


async def test_fetch_load_reads_the_served_model_only() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=METRICS))
    async with httpx.AsyncClient(transport=transport) as http:
        got = await fetch_load(http, URL, model="tiny", timeout=1.0)
    assert got is not None
    assert (got.source, got.running, got.waiting) == ("vllm /metrics", 8, 5)


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(500, text=METRICS),
        httpx.Response(404, text="not found"),
        httpx.Response(200, text="# nothing we know\nprocess_cpu_seconds_total 3.0\n"),
        httpx.ConnectError("refused"),
    ],
)
async def test_fetch_load_fails_quietly(answer: httpx.Response | Exception) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        return answer

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        assert await fetch_load(http, URL, model="tiny", timeout=1.0) is None


async def test_poller_scrapes_only_while_there_is_traffic() -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, text=METRICS)

    endpoint = Endpoint(URL, ControlOptions(scrape_interval=0.05), {}, start=5)  # real clock
    endpoint.seed(server(8, "default"), load(0, 0))
    assert endpoint.controller.mode == "metrics"
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(endpoint.run_poller, http)
                await anyio.sleep(0.12)
                assert paths == []  # no traffic: no scrape

                slot = endpoint.governor.slot()
                await slot.__aenter__()
                started = time.monotonic()
                endpoint.wake()
                await until(lambda: len(paths) >= 2)
                assert set(paths) == {"/metrics"}
                assert endpoint.load == load(8, 5)  # the other model's series left out
                assert (endpoint.controller.server_running, endpoint.controller.server_waiting) == (
                    8,
                    5,
                )
                # Fed to the controller: queue 5 > target 2 with 1 in flight cuts to 1...
                assert endpoint.governor.limit == 1
                # ...and two scrapes with a queue taught the capacity.
                assert endpoint.info is not None and endpoint.info.max_num_seqs == 8
                assert endpoint.info.sources["max_num_seqs"] == LEARNED_SOURCE
                await anyio.sleep(0.1)
                # At most one scrape per interval.
                assert len(paths) <= (time.monotonic() - started) / 0.05 + 1

                await slot.__aexit__(None, None, None)
                settled = len(paths)  # a scrape is counted as it starts
                await anyio.sleep(0.15)
                assert len(paths) == settled  # idle again: no scrape

                slot = endpoint.governor.slot()
                await slot.__aenter__()
                endpoint.wake()
                await until(lambda: len(paths) > settled)  # wakes at once
                await slot.__aexit__(None, None, None)
                tg.cancel_scope.cancel()


async def test_poller_without_load_gauges_ticks() -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(503)

    endpoint = Endpoint(URL, ControlOptions(scrape_interval=0.05), {}, start=5)
    endpoint.seed(server(8, "explicit"), load(0, 0))
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                slots = await hold(endpoint, 5)
                tg.start_soon(endpoint.run_poller, http)
                await until(lambda: len(paths) >= 2)
                assert endpoint.scrapes == 0 and endpoint.load == load(0, 0)  # discovery's, kept
                assert endpoint.governor.limit == 5  # metrics mode moves on the queue only
                await release(slots)
                tg.cancel_scope.cancel()


async def test_poller_in_throughput_mode_only_ticks() -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, text=METRICS)

    endpoint = Endpoint(URL, ControlOptions(scrape_interval=0.03), {}, start=5)
    endpoint.seed(server(8, "explicit"), None)
    assert endpoint.controller.mode == "throughput"

    async def call() -> None:
        async with endpoint.governor.slot() as slot:
            await anyio.sleep(0.01)
            slot.work = 16.0

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                async with anyio.create_task_group() as calls:
                    for _ in range(400):  # far more calls than the limit: demand throughout
                        calls.start_soon(call)
                    await anyio.wait_all_tasks_blocked()
                    tg.start_soon(endpoint.run_poller, http)
                    # the knee finder's first epoch (8 answers) ends in slow start: x4
                    await until(lambda: endpoint.governor.limit > 5)
                assert paths == []  # nothing to scrape: the answers are the signal
                stats = endpoint.control_stats()
                assert stats.signal == "throughput" and stats.knee_phase is not None
                assert stats.signal_age_s is not None and stats.throughput is not None
                tg.cancel_scope.cancel()


async def test_poller_in_fixed_mode_returns() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("a fixed limit scrapes nothing")

    endpoint = Endpoint(URL, ControlOptions(limit=4), {}, start=5)
    endpoint.seed(server(8, "explicit"), load(0, 0))
    slots = await hold(endpoint, 1)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        with anyio.fail_after(1):
            await endpoint.run_poller(http)
    await release(slots)


async def test_limit_changes_are_logged_at_most_every_two_seconds(caplog) -> None:
    clock = FakeClock(0.0)
    endpoint = make(clock=clock)
    endpoint.seed(server(), load(0, 0))
    caplog.set_level(logging.DEBUG, logger="dsclient")
    slots = await hold(endpoint, 5)
    for step in range(12):  # a queue, then room, then a queue...: the limit moves every time
        clock.now = step * 1.25
        waiting = 9 if step % 2 else 0
        endpoint.observe_load(load(8, waiting), clock.now)
    changes = [r for r in caplog.records if " limit " in r.getMessage()]
    info = [r for r in changes if r.levelno == logging.INFO]
    assert len(changes) > len(info) >= 2
    assert len(info) <= 1 + int(12 * 1.25 / 2)
    assert any("changes since the last line" in r.getMessage() for r in info)
    for slot in slots:
        await slot.__aexit__(None, None, None)


@pytest.mark.parametrize(
    ("text", "source"),
    [
        (
            'sglang:num_running_reqs{model_name="tiny"} 12\n'
            'sglang:num_queue_reqs{model_name="tiny"} 3\n',
            "sglang /metrics",
        ),
        ("llamacpp:requests_processing 12\nllamacpp:requests_deferred 3\n", "llama.cpp /metrics"),
        ("tgi_batch_current_size 12\ntgi_queue_size 3\n", "tgi /metrics"),
    ],
)
async def test_other_servers_metrics_close_the_loop_and_teach_the_capacity(text, source) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=text)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        first = await fetch_load(http, URL, model="tiny", timeout=1.0)
    assert first is not None and first.source == source
    clock = FakeClock(0.0)
    endpoint = make(clock=clock)
    endpoint.seed(server(), first)
    assert endpoint.controller.mode == "metrics"
    slots = await hold(endpoint, 5)
    for step in range(3):
        clock.now = step * 0.25
        endpoint.observe_load(first, clock.now)
    assert endpoint.info is not None and endpoint.info.max_num_seqs == 12
    assert endpoint.info.sources["max_num_seqs"] == LEARNED_SOURCE
    for slot in slots:
        await slot.__aexit__(None, None, None)


# --- load from every answer, and the other load routes -----------------------------------------

HEADER = "TEXT named_metrics.num_requests_waiting=3.0, named_metrics.kv_cache_usage_perc=0.5"


async def test_an_answer_with_vllms_load_header_moves_throughput_mode_to_the_queue() -> None:
    clock = FakeClock()
    endpoint = make(clock=clock)
    endpoint.seed(server(8, "default"), None)
    assert endpoint.controller.mode == "throughput" and endpoint.wants_load_header
    endpoint.observe_answer(None)  # a server that does not send it: nothing changes
    endpoint.observe_answer("garbage")
    assert endpoint.controller.mode == "throughput"
    endpoint.observe_answer(HEADER)
    assert endpoint.controller.mode == "metrics"
    assert endpoint.wants_load_header  # still the only queue signal: keep asking
    slots = await hold(endpoint, 5)
    clock.now = 0.5
    fed = endpoint._answer_signal(clock.now)
    # No running count in the header: the controller estimates the batch from the queue.
    assert fed is not None and (fed.waiting, fed.running, fed.kv_usage) == (3, None, 0.5)
    assert endpoint._answer_signal(clock.now) is None  # each answer's load is fed once
    endpoint.observe_load(fed, clock.now)
    control = endpoint.control_stats()
    assert (control.server_running, control.server_waiting) == (2, 3)  # 5 in flight, 3 queued
    assert control.knee_phase is None  # the queue drives it, on an estimated batch
    clock.now = 1.5
    stats = endpoint.control_stats()
    assert stats.signal == "endpoint-load-metrics" and stats.signal_age_s == 1.5
    await release(slots)


def test_one_request_a_half_period_asks_for_the_load_header() -> None:
    """vLLM collects its whole Prometheus registry for each header it sends: asked on every
    request, a batch through nginx took 1.45-1.6x as long. The controller reads one a period."""
    clock = FakeClock()
    endpoint = make(clock=clock)
    endpoint.seed(server(8, "default"), None)
    half = endpoint.options.scrape_interval / 2
    asked = []
    for step in range(40):  # 40 requests sent over two periods
        clock.now = step * half / 10
        asked.append(endpoint.ask_load_header())
    assert asked[0] and sum(asked) == 4  # at 0, 1/2, 1 and 3/2 periods
    clock.now = 100.0  # a request after a quiet spell asks at once
    assert endpoint.ask_load_header() and not endpoint.ask_load_header()


async def test_a_server_with_metrics_is_not_asked_for_the_header() -> None:
    endpoint = make()
    endpoint.seed(server(8, "default"), load(2, 0))
    assert endpoint.route == "/metrics" and not endpoint.wants_load_header
    endpoint.observe_answer(HEADER)
    assert endpoint.control_stats().signal == "/metrics"


async def test_fetch_load_falls_back_to_sglang_loads_and_llamacpp_slots() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/loads":
            return httpx.Response(200, json={"loads": [{"num_running_reqs": 4, "num_waiting_reqs": 2}]})
        if request.url.path == "/slots":
            return httpx.Response(200, json=[{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}])
        return httpx.Response(404, text="metrics are off")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        sglang = await fetch_load(http, URL, model=None, timeout=1.0, kind="sglang")
        llama = await fetch_load(http, URL, model=None, timeout=1.0, kind="llamacpp")
        vllm = await fetch_load(http, URL, model=None, timeout=1.0, kind="vllm")
    assert sglang is not None and (sglang.source, sglang.running, sglang.waiting) == (
        "sglang /v1/loads", 4, 2)
    assert llama is not None and (llama.source, llama.running, llama.max_num_seqs) == (
        "llama.cpp /slots", 1, 2)
    assert vllm is None  # vLLM has neither route


async def test_llamacpp_slots_count_this_clients_calls_beyond_the_busy_slots_as_waiting() -> None:
    endpoint = make()
    first = Load(source="llama.cpp /slots", running=0, waiting=0)
    endpoint.seed(server(4, "llama.cpp /props"), first)
    assert endpoint.controller.mode == "metrics" and endpoint.route == "/slots"
    assert endpoint.control_stats().signal == "llama.cpp /slots"
    slots = await hold(endpoint, 2)
    endpoint.observe_load(Load(source="llama.cpp /slots", running=1, waiting=0), 0.25)
    assert endpoint.load is not None and endpoint.load.waiting == 1
    await release(slots)

"""Tenants across processes (dsclient.governor._shared's FAIR_SCRIPT): real governors, one per
"process", syncing their tenants' counters through a real redis-server (marked integration:
``redis-server`` on PATH, as ``.ci/run`` installs it)."""

from __future__ import annotations

import anyio
import pytest

from dsclient.governor._fair import OUTPUT_WEIGHT
from dsclient.governor._governor import Governor
from dsclient.governor._shared import SharedBudget, fair_args, parse_fair

pytestmark = [pytest.mark.anyio, pytest.mark.integration]


class _Secret:
    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value


def _budget(redis_url: str, lease_s: float = 3.0) -> SharedBudget:
    return SharedBudget(
        _Secret(redis_url), key="t", server_url="http://fake:1", lease_s=lease_s, interval=0.1
    )


async def _served(governor: Governor, group: str | None, tokens: int, output: int = 0) -> None:
    slot = await governor.acquire(group=group, input_tokens=tokens, max_tokens=output)
    slot.work = float(output)
    slot.release()


def test_args_and_answer_round_trip_the_no_group_tenant() -> None:
    args = fair_args("c1", 3000, {None: 1.5, "a": 2.0}, ["a"], [None])
    assert args == ["c1", 3000, 2, "\0", "1.5", "a", "2.0", 1, "a", 1, "\0"]
    counters, active, waiting = parse_fair([[b"\0", b"1.5", b"a", b"2"], [b"a"], [b"\0"]])
    assert counters == {None: 1.5, "a": 2.0} and active == ["a"] and waiting == [None]


async def test_counters_are_shared_and_a_killed_processs_charge_stays(redis_url: str) -> None:
    one, two = Governor(4), Governor(4)
    first, second = _budget(redis_url, lease_s=0.5), _budget(redis_url)
    try:
        await _served(one, "a", 100, 10)
        await _served(two, "b", 30)
        await first.sync_fair(one)
        await second.sync_fair(two)
        await first.sync_fair(one)
        a = 100 + OUTPUT_WEIGHT * 10
        assert one.fair.counter("a") == two.fair.counter("a") == pytest.approx(a)
        assert one.fair.counter("b") == two.fair.counter("b") == pytest.approx(30)
        # "one" dies with a call of "a" in flight: no leave, no correction; its charge (the
        # estimate at admission) reached Redis at its last sync and stays there.
        await one.acquire(group="a", input_tokens=50, max_tokens=0)  # never released
        await first.sync_fair(one)
        await second.sync_fair(two)
        assert two.fair.counter("a") == pytest.approx(a + 50)
        await anyio.sleep(0.6)  # its marks outlive it by a lease only
        await second.sync_fair(two)
        assert two.fair.counter("a") == pytest.approx(a + 50)
        assert not two.fair.held(two.fair.tenant("b"))
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_tenant_ahead_waits_for_one_waiting_in_another_process(redis_url: str) -> None:
    one, two = Governor(1), Governor(1)
    first, second = _budget(redis_url), _budget(redis_url)
    try:
        # Process one has served "a" 5000 tokens; process two has "b" backlogged.
        for _ in range(5):
            await _served(one, "a", 1000)
        b_running = await two.acquire(group="b", input_tokens=100)
        b_waiting: list[object] = []

        async def wait_b() -> None:
            b_waiting.append(await two.acquire(group="b", input_tokens=100))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_b)
            await anyio.wait_all_tasks_blocked()
            await second.sync_fair(two)  # "b" waits there, at its counter
            await first.sync_fair(one)
            a_calls: list[object] = []

            async def call_a() -> None:
                a_calls.append(await one.acquire(group="a", input_tokens=1000))

            tg.start_soon(call_a)
            await anyio.wait_all_tasks_blocked()
            # One has a free slot, but "a" is 5000 tokens ahead of "b", which waits elsewhere.
            assert one.in_flight == 0 and one.held_by_fairness == 1 and not a_calls
            # "b" catches up (its calls run in process two) while a call of it still waits
            # there: once "a" is no more than one call (1000) ahead, "a" goes.
            b_running.release()
            await anyio.wait_all_tasks_blocked()
            b_waiting.pop().release()  # type: ignore[attr-defined]
            big = await two.acquire(group="b", input_tokens=4000)  # b: 4200
            tg.start_soon(wait_b)
            await anyio.wait_all_tasks_blocked()
            assert two.waiting == 1
            await second.sync_fair(two)
            await first.sync_fair(one)
            await anyio.wait_all_tasks_blocked()
            assert a_calls and one.held_by_fairness == 0
            big.release()
            await anyio.wait_all_tasks_blocked()
            for slot in [*a_calls, *b_waiting]:
                slot.release()  # type: ignore[attr-defined]
    finally:
        await first.aclose()
        await second.aclose()


async def test_redis_away_orders_each_process_alone() -> None:
    governor = Governor(1)
    budget = SharedBudget(_Secret("redis://127.0.0.1:1/0"), key="t", server_url="http://fake:1")
    try:
        await _served(governor, "a", 10)
        with pytest.raises(Exception):  # redis-py's connection error
            await budget.sync_fair(governor)
        assert governor.fair.take_pending() == {"a": 10.0}  # kept for the next sync
    finally:
        await budget.aclose()

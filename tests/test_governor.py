"""Tests for dsclient.governor._governor: cap, lanes, urgency, groups, queue bound, stats, cancellation."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Hashable

import anyio
import pytest

from dsclient._exceptions import Overloaded
from dsclient.governor._governor import Governor, GovernorStats, LaneStats, Slot, compute_limit
from dsclient.governor._lanes import (
    LONG_THRESHOLD_FALLBACK,
    Lane,
    RecentSizes,
    choose_lane,
    default_long_threshold,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Crowd:
    """Tasks that each hold a slot until told to release it; records the order of admission."""

    def __init__(self, governor: Governor, tg: anyio.abc.TaskGroup) -> None:
        self.governor = governor
        self.tg = tg
        self.admitted: list[str] = []
        self.slots: dict[str, Slot] = {}
        self._release: dict[str, anyio.Event] = {}

    async def add(
        self,
        name: str,
        *,
        lane: Lane = "short",
        urgency: int = 0,
        group: str | None = None,
        batch: Hashable = False,
        tokens: int = 0,
        prompt_tokens: int = 0,
    ) -> None:
        # Settle after each start: trio runs a batch of new tasks in random order, and the
        # tests below depend on arrival order.
        self._release[name] = anyio.Event()

        async def run() -> None:
            async with self.governor.slot(
                lane=lane,
                urgency=urgency,
                group=group,
                batch=batch,
                tokens=tokens,
                prompt_tokens=prompt_tokens,
            ) as slot:
                self.slots[name] = slot
                self.admitted.append(name)
                await self._release[name].wait()

        self.tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()

    async def release(self, *names: str) -> None:
        for name in names:
            self._release[name].set()
        await anyio.wait_all_tasks_blocked()

    async def release_all(self) -> None:
        await self.release(*self._release)


# --- pure functions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_num_seqs", "headroom", "expected"),
    [
        (8, 0.7, 5),
        (1, 0.7, 1),
        (256, 0.7, 179),
        (2, 0.3, 1),  # floor is 0, the cap never goes below one
        (8, 1.0, 8),
        (8, 2.0, 16),
        (100, 0.57, 57),  # 0.57 * 100 == 56.99999999999999 in binary floating point
        (3, 0.7, 2),
    ],
)
def test_compute_limit(max_num_seqs: int, headroom: float, expected: int) -> None:
    assert compute_limit(max_num_seqs, headroom) == expected


@pytest.mark.parametrize(
    ("max_num_seqs", "headroom", "error", "match"),
    [
        (8, 0.0, ValueError, r"headroom must be in \(0, 2\], got 0.0"),
        (8, -0.5, ValueError, r"headroom must be in \(0, 2\]"),
        (8, 2.01, ValueError, r"headroom must be in \(0, 2\], got 2.01"),
        (8, math.nan, ValueError, r"headroom must be in \(0, 2\], got nan"),
        (0, 0.7, ValueError, r"max_num_seqs must be >= 1, got 0"),
        (-3, 0.7, ValueError, r"max_num_seqs must be >= 1"),
        (8.0, 0.7, TypeError, r"max_num_seqs must be an int, got float"),
        (True, 0.7, TypeError, r"max_num_seqs must be an int, got bool"),
    ],
)
def test_compute_limit_rejects(
    max_num_seqs: int, headroom: float, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        compute_limit(max_num_seqs, headroom)


def test_default_long_threshold() -> None:
    assert default_long_threshold(2048) == 512
    assert default_long_threshold(4096) == 1024
    assert default_long_threshold(None) == 1024
    assert default_long_threshold(2) == 1
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        default_long_threshold(0)


def test_choose_lane_splits_the_reference_workload() -> None:
    threshold = default_long_threshold(2048)
    # ENVIRONMENT.md: long = ~1000-token prompts + 256 out; short = small prompts + 64 out.
    assert choose_lane(estimated_total_tokens=1000 + 256, threshold=threshold) == "long"
    assert choose_lane(estimated_total_tokens=120 + 64, threshold=threshold) == "short"
    assert choose_lane(estimated_total_tokens=threshold, threshold=threshold) == "short"
    assert choose_lane(estimated_total_tokens=threshold + 1, threshold=threshold) == "long"
    with pytest.raises(ValueError, match="threshold must be >= 1"):
        choose_lane(estimated_total_tokens=10, threshold=0)
    with pytest.raises(ValueError, match="estimated_total_tokens must be >= 0"):
        choose_lane(estimated_total_tokens=-1, threshold=10)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"limit": 0}, ValueError, "limit must be >= 1, got 0"),
        ({"limit": 4, "long_share": 0.0}, ValueError, r"long_share must be in \(0, 1\], got 0.0"),
        ({"limit": 4, "long_share": 1.5}, ValueError, r"long_share must be in \(0, 1\]"),
        ({"limit": 4, "long_share": math.nan}, ValueError, r"long_share must be in \(0, 1\]"),
        (
            {"limit": 4, "group_caps": {"batch": 0}},
            ValueError,
            r"group_caps\['batch'\] must be in \(0, 1\], got 0",
        ),
        ({"limit": 4, "group_caps": {"batch": 1.1}}, ValueError, r"group_caps\['batch'\]"),
        ({"limit": 4, "max_queue": -1}, ValueError, "max_queue must be >= 0, got -1"),
        ({"limit": 4, "latency_window": 99}, ValueError, "latency_window must be >= 100"),
    ],
)
def test_governor_rejects_bad_config(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Governor(**kwargs)  # type: ignore[arg-type]


def test_slot_rejects_bad_arguments() -> None:
    governor = Governor(2)
    with pytest.raises(ValueError, match="lane must be 'short' or 'long', got 'medium'"):
        governor.slot(lane="medium")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="urgency must be an int, got float"):
        governor.slot(urgency=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        governor.set_limit(0)


def test_lane_and_group_limits_follow_the_shares() -> None:
    governor = Governor(5, long_share=0.5, group_caps={"batch": 0.5, "tiny": 0.01})
    lanes = governor.stats().lanes
    assert (lanes["short"].limit, lanes["long"].limit) == (5, 2)
    governor.set_limit(1)
    lanes = governor.stats().lanes
    assert (lanes["short"].limit, lanes["long"].limit) == (1, 1)


# --- the cap -------------------------------------------------------------------------------


async def test_in_flight_never_exceeds_the_caps_under_random_load() -> None:
    rng = random.Random(1234)
    governor = Governor(5, long_share=0.4, group_caps={"batch": 0.6})  # caps: 5, long 2, batch 3
    seen = {"total": 0, "long": 0, "batch": 0}
    now = {"total": 0, "long": 0, "batch": 0}

    async def request(lane: Lane, group: str | None, urgency: int, duration: float) -> None:
        async with governor.slot(lane=lane, urgency=urgency, group=group):
            keys = ["total"] + (["long"] if lane == "long" else []) + (["batch"] if group else [])
            for key in keys:
                now[key] += 1
                seen[key] = max(seen[key], now[key])
            assert governor.in_flight <= governor.limit
            await anyio.sleep(duration)
            for key in keys:
                now[key] -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(300):
            lane: Lane = rng.choice(["short", "long"])
            group = rng.choice([None, "batch"])
            tg.start_soon(request, lane, group, rng.randint(0, 3), rng.uniform(0, 0.003))
            if rng.random() < 0.3:
                await anyio.sleep(0)

    assert seen == {"total": 5, "long": 2, "batch": 3}
    stats = governor.stats()
    assert (stats.in_flight, stats.waiting) == (0, 0)
    assert sum(lane.done for lane in stats.lanes.values()) == 300


# --- lanes ---------------------------------------------------------------------------------


async def test_long_lane_held_to_its_share_while_shorts_get_the_rest() -> None:
    governor = Governor(8, long_idle_borrow=None)  # long share 0.5: at most 4 long
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(10):
            await crowd.add(f"L{i}", lane="long")
        lanes = governor.stats().lanes
        assert (lanes["long"].in_flight, lanes["long"].waiting) == (4, 6)
        for i in range(4):
            await crowd.add(f"S{i}")
        assert governor.in_flight == 8
        assert governor.stats().lanes["short"].in_flight == 4
        await crowd.add("S4")  # every slot is taken now
        assert governor.stats().lanes["short"].waiting == 1
        await crowd.release("S0")  # six long requests wait longer, but their lane is full
        assert crowd.admitted[-1] == "S4"
        await crowd.release("L0")
        assert crowd.admitted[-1] == "L4"
        assert governor.stats().lanes["long"].in_flight == 4
        await crowd.release_all()


async def test_shorts_pass_a_long_waiter_blocked_by_its_lane() -> None:
    governor = Governor(4, long_idle_borrow=None)  # long cap 2
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("L1", lane="long")
        await crowd.add("L2", lane="long")
        await crowd.add("L3", lane="long", urgency=10)  # first in line, but its lane is full
        await crowd.add("S1")  # admitted at once, past L3
        await crowd.add("S2")
        assert crowd.admitted == ["L1", "L2", "S1", "S2"]
        await crowd.add("S3")  # the cap is full: waits behind L3
        await crowd.release("S1")
        assert crowd.admitted[-1] == "S3"  # L3 is older and more urgent, but cannot run
        await crowd.release("L1")
        assert crowd.admitted[-1] == "L3"
        await crowd.release_all()


async def test_shares_are_a_ceiling_not_a_fixed_split() -> None:
    governor = Governor(8)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(8):
            await crowd.add(f"S{i}")
        assert governor.in_flight == 8  # shorts alone use every slot
        await crowd.release_all()
    assert governor.in_flight == 0
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(6):
            await crowd.add(f"L{i}", lane="long")
        assert governor.in_flight == 4  # longs alone use the whole long share
        await crowd.release_all()


# --- urgency and groups --------------------------------------------------------------------


async def test_urgency_order_and_fifo_within_equal_urgency() -> None:
    governor = Governor(1)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("holder")
        for name, urgency in [("a0", 0), ("b5", 5), ("c1", 1), ("d5", 5), ("e0", 0), ("f-2", -2)]:
            await crowd.add(name, urgency=urgency)
        for _ in range(6):
            await crowd.release(crowd.admitted[-1])
        await crowd.release_all()
    assert crowd.admitted == ["holder", "b5", "d5", "c1", "a0", "e0", "f-2"]


async def test_urgency_orders_across_lanes() -> None:
    governor = Governor(2)  # long cap 1
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("S0")
        await crowd.add("S1")
        await crowd.add("s-low")
        await crowd.add("L-high", lane="long", urgency=3)
        await crowd.release("S0")
        assert crowd.admitted[-1] == "L-high"
        await crowd.release_all()


async def test_group_cap_keeps_slots_for_everyone_else() -> None:
    governor = Governor(4, group_caps={"batch": 0.5})
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(5):
            await crowd.add(f"B{i}", group="batch")
        assert crowd.admitted == ["B0", "B1"]
        await crowd.add("interactive")  # admitted at once despite three batch waiters ahead
        await crowd.add("other", group="uncapped")
        assert crowd.admitted[-2:] == ["interactive", "other"]
        assert (governor.in_flight, governor.waiting) == (4, 3)
        await crowd.release("interactive")  # a free slot, but the batch group is full
        assert (governor.in_flight, governor.waiting) == (3, 3)
        await crowd.release("B0")
        assert crowd.admitted[-1] == "B2"
        await crowd.release_all()
    assert sorted(crowd.admitted[-2:]) == ["B3", "B4"]  # woken together; trio picks the order


# --- queue bound and limit changes ---------------------------------------------------------


async def test_max_queue_raises_overloaded_at_once() -> None:
    governor = Governor(1, max_queue=2)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("holder")
        await crowd.add("w1")
        await crowd.add("w2")
        with pytest.raises(Overloaded) as info:
            async with governor.slot():
                pytest.fail("admitted past a full queue")
        assert info.value.status == 0
        assert "max_queue=2" in str(info.value)
        assert governor.waiting == 2
        await crowd.release_all()
    assert crowd.admitted == ["holder", "w1", "w2"]


async def test_max_queue_zero_admits_free_slots_and_never_waits() -> None:
    governor = Governor(1, max_queue=0)
    async with governor.slot():
        with pytest.raises(Overloaded):
            async with governor.slot():
                pass
    async with governor.slot():
        assert governor.in_flight == 1


async def test_raising_the_limit_admits_waiters_at_once() -> None:
    governor = Governor(1)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(4):
            await crowd.add(f"R{i}")
        assert (governor.in_flight, governor.waiting) == (1, 3)
        governor.set_limit(3)
        assert (governor.in_flight, governor.waiting) == (3, 1)
        await anyio.wait_all_tasks_blocked()
        # Granted in order R1, R2; trio may run the two woken tasks in either order.
        assert sorted(crowd.admitted) == ["R0", "R1", "R2"]
        await crowd.release_all()


async def test_lowering_the_limit_cancels_nothing_and_waits_for_the_drain() -> None:
    governor = Governor(3)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(3):
            await crowd.add(f"R{i}")
        await crowd.add("waiter")
        governor.set_limit(1)
        assert (governor.limit, governor.in_flight, governor.waiting) == (1, 3, 1)
        await crowd.release("R0")
        await crowd.release("R1")
        assert "waiter" not in crowd.admitted  # in_flight 1 is not below the new cap
        await crowd.release("R2")
        assert crowd.admitted[-1] == "waiter"
        await crowd.release_all()


# --- stats ---------------------------------------------------------------------------------


async def test_stats_percentiles_with_a_fake_clock() -> None:
    now = [0.0]
    governor = Governor(4, latency_window=100, clock=lambda: now[0])
    empty = governor.stats().lanes["short"]
    assert (empty.p50, empty.p95, empty.p99) == (None, None, None)
    for _ in range(50):  # pushed out of the 100-sample window below
        async with governor.slot():
            now[0] += 1000.0
    for seconds in random.Random(7).sample(range(1, 101), 100):
        async with governor.slot() as slot:
            now[0] += seconds
        assert slot.queued_s == 0.0
    async with governor.slot(lane="long") as slot:
        now[0] += 2.5
        slot.fail()

    stats = governor.stats()
    assert isinstance(stats, GovernorStats)
    short = stats.lanes["short"]
    assert short == LaneStats(
        in_flight=0, waiting=0, done=150, failed=0, p50=50.0, p95=95.0, p99=99.0, limit=4
    )
    assert stats.lanes["long"] == LaneStats(
        in_flight=0, waiting=0, done=0, failed=1, p50=2.5, p95=2.5, p99=2.5, limit=2
    )
    with pytest.raises(AttributeError):
        short.p50 = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        stats.lanes["x"] = short  # type: ignore[index]


async def test_queued_s_and_latency_include_the_wait() -> None:
    now = [0.0]
    governor = Governor(1, clock=lambda: now[0])
    queued: list[float] = []

    async def late() -> None:
        async with governor.slot() as slot:
            queued.append(slot.queued_s)
            now[0] = 6.0

    async with anyio.create_task_group() as tg, governor.slot():
        now[0] = 1.0
        tg.start_soon(late)
        await anyio.wait_all_tasks_blocked()
        assert governor.stats().lanes["short"].waiting == 1
        now[0] = 4.0
    assert queued == [3.0]
    short = governor.stats().lanes["short"]
    # Latencies 4 (0 -> 4) and 5 (1 -> 6); nearest rank: p50 is the first, p99 the second.
    assert (short.p50, short.p99, short.done) == (4.0, 5.0, 2)


# --- failures and cancellation -------------------------------------------------------------


async def test_exception_inside_the_slot_counts_as_failed_and_releases() -> None:
    governor = Governor(1)
    with pytest.raises(ZeroDivisionError):
        async with governor.slot():
            1 / 0
    async with governor.slot() as slot:
        slot.fail()
    assert slot.failed
    short = governor.stats().lanes["short"]
    assert (short.done, short.failed, governor.in_flight) == (0, 2, 0)
    async with governor.slot():
        pass
    assert governor.stats().lanes["short"].done == 1


async def test_a_slot_is_entered_once() -> None:
    governor = Governor(1)
    slot = governor.slot()
    async with slot:
        pass
    with pytest.raises(RuntimeError, match="entered only once"):
        async with slot:
            pass
    assert governor.in_flight == 0


async def test_timeout_while_waiting_leaves_the_queue() -> None:
    governor = Governor(1)
    async with governor.slot():
        with anyio.move_on_after(0.01) as scope:
            async with governor.slot():
                pytest.fail("admitted while the only slot was held")
        assert scope.cancelled_caught
        assert (governor.in_flight, governor.waiting) == (1, 0)
    assert governor.in_flight == 0
    assert governor.stats().lanes["short"].failed == 0  # never admitted, never counted


def _queued_entries(governor: Governor) -> int:
    return sum(len(queue.heap) for queue in governor._queues)


async def test_thousands_of_cancelled_waiters_leak_nothing() -> None:
    governor = Governor(1)
    entered = 0

    async def waiter() -> None:
        nonlocal entered
        async with governor.slot():
            entered += 1

    async with governor.slot():
        async with anyio.create_task_group() as tg:
            for _ in range(5000):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert governor.waiting == 5000
            tg.cancel_scope.cancel()
        assert (governor.in_flight, governor.waiting, entered) == (1, 0, 0)
        assert _queued_entries(governor) == 0
    assert governor.in_flight == 0
    async with governor.slot():
        assert governor.in_flight == 1
    stats = governor.stats()
    assert (stats.in_flight, stats.waiting, stats.lanes["short"].done) == (0, 0, 2)


async def test_random_timeouts_and_releases_leak_nothing() -> None:
    rng = random.Random(99)
    # No idle borrowing: when the loop stalls for a second (a loaded machine), long requests may
    # borrow idle short slots, and in-flight may then pass the limit by design (the module
    # docstring); this test is about leaks under a strict limit. (peak 4 <= 3 failed twice so.)
    governor = Governor(3, group_caps={"batch": 0.5}, long_idle_borrow=None)
    peak = 0

    async def request(lane: Lane, group: str | None, deadline: float, duration: float) -> None:
        nonlocal peak
        with anyio.move_on_after(deadline):
            async with governor.slot(lane=lane, group=group):
                peak = max(peak, governor.in_flight)
                await anyio.sleep(duration)

    async with anyio.create_task_group() as tg:
        for _ in range(2000):
            lane: Lane = rng.choice(["short", "long"])
            group = rng.choice([None, "batch"])
            tg.start_soon(request, lane, group, rng.uniform(0, 0.02), rng.uniform(0, 0.002))
    assert peak <= 3
    assert (governor.in_flight, governor.waiting, _queued_entries(governor)) == (0, 0, 0)
    lanes = governor.stats().lanes.values()
    assert all((lane.in_flight, lane.waiting) == (0, 0) for lane in lanes)
    async with governor.slot(lane="long", group="batch"):
        assert governor.in_flight == 1


async def test_cancelled_after_grant_passes_the_slot_on() -> None:
    governor = Governor(1)
    did_work: list[str] = []
    scope_b = anyio.CancelScope()

    async def worker(name: str, scope: anyio.CancelScope | None = None) -> None:
        with scope or anyio.CancelScope():
            async with governor.slot():
                # anyio delivers the cancellation at B's next checkpoint once B has woken:
                # here. The slot must still not leak, and C must get it.
                await anyio.sleep(0)
                did_work.append(name)

    async with anyio.create_task_group() as tg:
        holder = governor.slot()
        await holder.__aenter__()
        tg.start_soon(worker, "B", scope_b)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(worker, "C")
        await anyio.wait_all_tasks_blocked()
        assert governor.waiting == 2
        await holder.__aexit__(None, None, None)  # grants B synchronously, B has not run yet
        assert (governor.in_flight, governor.waiting) == (1, 1)
        scope_b.cancel()
    assert did_work == ["C"]
    assert (governor.in_flight, governor.waiting) == (0, 0)


def test_native_asyncio_cancel_after_grant_hands_the_slot_over() -> None:
    # A plain task.cancel() (asyncio.timeout, wait_for) lands inside the wait even after the
    # grant: the governor must undo the grant and admit the next waiter, counting nothing.
    async def main() -> None:
        governor = Governor(1)
        order: list[str] = []

        async def worker(name: str) -> None:
            async with governor.slot():
                order.append(name)

        holder = governor.slot()
        await holder.__aenter__()
        task_b = asyncio.create_task(worker("B"))
        await asyncio.sleep(0)
        task_c = asyncio.create_task(worker("C"))
        await asyncio.sleep(0)
        assert governor.waiting == 2
        await holder.__aexit__(None, None, None)  # grants B, which has not run yet
        task_b.cancel()
        await asyncio.gather(task_b, task_c, return_exceptions=True)
        assert task_b.cancelled()
        assert order == ["C"]
        short = governor.stats().lanes["short"]
        assert (governor.in_flight, governor.waiting, short.done, short.failed) == (0, 0, 2, 0)

    asyncio.run(main())


# --- borrowing: the long lane is not a bottleneck on an otherwise idle client ---------------


async def test_long_lane_borrows_idle_short_slots_but_keeps_one_free() -> None:
    now = [100.0]
    governor = Governor(8, clock=lambda: now[0])  # long share 4, borrowing after 1 s idle
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(10):
            await crowd.add(f"L{i}", lane="long")
        # no short ever came: longs may take all but one slot
        assert governor.stats().lanes["long"].in_flight == 7
        await crowd.add("S0")  # the slot kept free takes a short at once
        assert crowd.admitted[-1] == "S0" and governor.in_flight == 8
        await crowd.release("L0")  # a short is in flight: back to the long share (7 > 4)
        assert governor.stats().lanes["long"].in_flight == 6
        await crowd.release("S0")
        await crowd.release("L1")  # the short left less than 1 s ago: still the share
        assert governor.stats().lanes["long"].in_flight == 5
        now[0] += 1.5  # shorts idle for 1.5 s: the next release lets longs borrow again
        await crowd.release("L2")
        assert governor.stats().lanes["long"].in_flight == 7
        await crowd.release_all()


# --- batches: a map()'s own short items do not hold its long ones to the share --------------


async def test_a_batchs_long_items_borrow_beside_its_short_ones() -> None:
    """A map() starts its longest items first; held to the long share beside the batch's own
    short items, they ran 4 at a time of 8 and the order bought nothing."""
    now = [100.0]
    governor = Governor(8, clock=lambda: now[0])
    governor.set_limit(8, batch=8)  # long share 4
    governor.set_kv(100_000, block=16)  # a cache that holds them all
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("s0", batch=True)
        await crowd.add("s1", batch=True)
        for i in range(8):
            await crowd.add(f"L{i}", lane="long", batch=True)
        await crowd.add("s2", batch=True)  # waits: a batch's short item reclaims nothing
        assert governor.stats().lanes["long"].in_flight == 6  # the rest of the limit
        assert "s2" not in crowd.admitted and governor.in_flight == 8
        await crowd.release("L0")
        # FIFO across lanes: the long items read first go first
        assert crowd.admitted[-1] == "L6" and "s2" not in crowd.admitted
        await crowd.release_all()


async def test_short_calls_someone_waits_on_keep_the_long_share() -> None:
    now = [100.0]
    governor = Governor(8, clock=lambda: now[0])
    governor.set_limit(8, batch=8)  # long share 4
    governor.set_kv(100_000)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("call")  # a generate() beside the batch
        await crowd.add("s0", batch=True)
        for i in range(10):
            await crowd.add(f"L{i}", lane="long", batch=True)
        # shorts about, batch known: the batch less the shorts in flight and a reserve of 2
        assert governor.stats().lanes["long"].in_flight == 4
        await crowd.release("call")
        now[0] += 0.5  # the call left 0.5 s ago: still about (long_idle_borrow 1 s)
        await crowd.release("L0")
        assert governor.stats().lanes["long"].in_flight == 5  # 8 less s0 and a reserve of 2
        now[0] += 1.0
        await crowd.release("L1")  # no call about for 1.5 s: the batch's longs borrow
        assert governor.stats().lanes["long"].in_flight == 7
        await crowd.release_all()
    assert governor.in_flight == 0 and governor.waiting == 0
    lanes = governor.stats().lanes
    assert (lanes["short"].in_flight, lanes["long"].in_flight) == (0, 0)
    assert governor._short.batch_in_flight == governor._long.batch_waiting == 0


@pytest.mark.parametrize(("longs", "shorts_running", "held_back"), [(10, 1, False), (7, 2, False)])
async def test_a_batchs_long_items_take_the_servers_batch_not_the_limits_excess(
    longs: int, shorts_running: int, held_back: bool
) -> None:
    """The limit may pass the server's batch (calls in transit); long items beyond the batch
    would only queue in the server, ahead of the short items that could fill it. While some of
    the batch's long items wait (10 of them), its short items fill the server's batch, not the
    limit: beyond it they would queue in the server ahead of the next long item, and a higher
    limit would run none of them. Once no long item waits (7 running, 3 more than their share
    of 4), the short ones queue in the server no deeper than the one seat left to short calls
    (7 + 2 of a batch of 8): only that seat turns over, and a call someone waits on would queue
    behind them there."""
    now = [100.0]
    governor = Governor(12, clock=lambda: now[0])
    governor.set_limit(12, batch=8)  # long share 4
    governor.set_kv(100_000)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(longs):
            await crowd.add(f"L{i}", lane="long", batch=True)
        for i in range(6):
            await crowd.add(f"s{i}", batch=True)
        assert governor.stats().lanes["long"].in_flight == 7  # the batch less one
        assert governor.stats().lanes["short"].in_flight == shorts_running
        assert governor.held_back is held_back
        await crowd.release_all()


async def test_a_batchs_long_items_borrow_beside_its_short_ones_where_the_kv_cache_is_not_known() -> None:
    """The flat-step server of issue 46 (16 seats, no /metrics, the client told its batch):
    held to the long share beside the batch's own short items, its 27 long items ran 8 at a
    time and map() took 1.17x the plain semaphore's time given the same order. Without the
    cache they take the server's batch less one (as where it is known and holds them); a call
    someone waits on still reclaims a borrowed slot, and brings the long share back."""
    now = [100.0]
    governor = Governor(16, clock=lambda: now[0])
    governor.set_limit(16, batch=16)  # long share 8; no set_kv
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("s0", batch=True)
        for i in range(20):
            await crowd.add(f"L{i}", lane="long", batch=True)
        assert governor.stats().lanes["long"].in_flight == 15  # the server's batch less one
        await crowd.add("s1", batch=True)  # the limit is full: it takes no borrowed slot
        assert "s1" not in crowd.admitted
        await crowd.add("call")  # someone waits on this one: it reclaims a borrowed slot
        assert crowd.admitted[-1] == "call" and governor.in_flight == 17
        await crowd.release("L0", "L1", "L2")
        # a call about: the batch's long items keep to the share with the reserve (16 less 3
        # shorts in flight and 4, below the share of 8), and the freed slots go to s1
        assert governor.stats().lanes["long"].in_flight == 12
        assert "s1" in crowd.admitted and "L15" not in crowd.admitted
        await crowd.release_all()
    assert governor.in_flight == 0 and governor._short.own == governor._long.own == {}


async def test_a_batchs_short_items_queue_in_the_server_no_deeper_than_the_short_seats() -> None:
    """The flat-step server: 16 seats, a limit of 24 (the batch and half a batch of queue).
    With 15 of a batch's long items running, one seat turns over; the batch's short items
    filling the limit queued 8 deep behind it, and a call every 0.25 s took 1.2-7 s at p99. As
    the long items end, the short items may queue deeper again."""
    now = [100.0]
    governor = Governor(24, clock=lambda: now[0])
    governor.set_limit(24, batch=16)  # long share 8
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(15):
            await crowd.add(f"L{i}", lane="long", batch=True)
        for i in range(6):
            await crowd.add(f"s{i}", batch=True)
        # 15 + 2: one short item on the free seat, one queued behind it
        assert governor.stats().lanes["short"].in_flight == 2 and governor.in_flight == 17
        assert not governor.held_back  # a higher limit would run none of them
        await crowd.add("call")  # someone waits on it: it is not held
        assert crowd.admitted[-1] == "call"
        await crowd.release("L0", "L1", "L2")  # 12 long: 4 short seats, 4 queued at most
        assert governor.stats().lanes["short"].in_flight == 1 + 6 and governor.in_flight == 19
        await crowd.release_all()


async def test_another_batchs_short_items_hold_a_batchs_long_items_to_the_share() -> None:
    """Two map()s at once: each one's short items are not waited on one by one, but the other
    batch's makespan is; its short items count as calls about, as a generate()'s do."""
    now = [100.0]
    governor = Governor(16, clock=lambda: now[0])
    governor.set_limit(16, batch=16)  # long share 8
    a, b = object(), object()
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("a0", batch=a)
        await crowd.add("b0", batch=b)
        for i in range(20):
            await crowd.add(f"A{i}", lane="long", batch=a)
        # b0 is about: 16 less 2 shorts in flight and a reserve of 4 = 10
        assert governor.stats().lanes["long"].in_flight == 10
        assert not governor.admits(lane="long", batch=a)
        assert governor.admits(batch=b)  # a free slot for either batch's short item
        await crowd.release("b0")  # b has nothing about: a's long items borrow again
        assert governor.stats().lanes["long"].in_flight == 15  # the server's batch less one
        assert governor.in_flight == 16
        await crowd.release_all()


async def test_long_calls_borrow_only_as_far_as_the_kv_cache_holds_them() -> None:
    """The benchmark's vLLM: 24 blocks of 128 tokens; a long item (~60 tokens in, 512 out)
    grows to 5 blocks, a short one holds 1. Four long items and four short fill the cache."""
    now = [100.0]
    governor = Governor(8, clock=lambda: now[0])
    governor.set_limit(8, batch=8)  # long share 4
    governor.set_kv(24 * 128, block=128)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(2):
            await crowd.add(f"s{i}", batch=True, tokens=92)  # 1 block each
        for i in range(8):
            await crowd.add(f"L{i}", lane="long", batch=True, tokens=572)  # 5 blocks each
        # the share, 4, always runs; a 5th would need 2 + 25 blocks of 24
        assert governor.stats().lanes["long"].in_flight == 4
        assert governor._tokens == (2 + 4 * 5) * 128
        await crowd.add("s2", batch=True, tokens=92)  # a free slot: shorts are not held
        assert "s2" in crowd.admitted
        await crowd.release("L0")
        assert crowd.admitted[-1] == "L4"  # its blocks came back: the next one fits
        await crowd.release("s0", "s1", "s2")  # 3 blocks back: not 5
        assert governor.stats().lanes["long"].in_flight == 4
        governor.set_kv(64 * 128, block=128)  # a bigger cache: they borrow at once
        assert governor.stats().lanes["long"].in_flight == 7  # limit - 1
        await crowd.release_all()
    assert governor.in_flight == 0 and governor._tokens == 0


async def test_the_kv_cache_holds_back_idle_borrowing_too() -> None:
    now = [100.0]
    governor = Governor(8, clock=lambda: now[0])
    governor.set_kv(2000, block=100)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(8):
            await crowd.add(f"L{i}", lane="long", tokens=450)  # 5 blocks of 100
        assert governor.stats().lanes["long"].in_flight == 4  # the share, 20 blocks
        assert governor.admits(lane="long", tokens=0)  # unknown size: not held by the cache
        assert not governor.admits(lane="long", tokens=1)
        governor.set_kv(None)
        assert governor.stats().lanes["long"].in_flight == 7  # no shorts: limit - 1
        await crowd.release_all()


def test_set_kv_is_validated() -> None:
    governor = Governor(8)
    with pytest.raises(ValueError, match="tokens"):
        governor.set_kv(0)
    with pytest.raises(ValueError, match="block"):
        governor.set_kv(100, block=0)
    governor.set_kv(1000, block=16)
    assert governor.kv_tokens == 1000
    assert governor.slot(lane="long", tokens=17).tokens == 32  # whole blocks


async def test_borrowing_can_be_turned_off_and_is_validated() -> None:
    governor = Governor(8, long_idle_borrow=None)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(6):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 4
        await crowd.release_all()
    with pytest.raises(ValueError, match="long_idle_borrow"):
        Governor(8, long_idle_borrow=-1.0)


# --- shortest job first at equal urgency ----------------------------------------------------


async def test_waiting_shorts_go_before_earlier_longs_at_equal_urgency() -> None:
    governor = Governor(3, long_idle_borrow=None, short_first=True)  # long cap 1
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("L0", lane="long")
        await crowd.add("S0")
        await crowd.add("S1")  # every slot taken
        await crowd.add("L1", lane="long")  # waits first
        await crowd.add("S2")  # arrives later
        await crowd.release("L0")  # L1 goes: no long is in flight, so longs never starve
        assert crowd.admitted[-1] == "L1"
        await crowd.add("L2", lane="long")
        await crowd.add("S3")
        await crowd.release("S0")  # long lane full anyway: S2
        assert crowd.admitted[-1] == "S2"
        await crowd.release("L1")  # both fit; L2 came first, but a short goes first...
        assert crowd.admitted[-1] == "L2"  # ...unless no long is in flight, as here
        await crowd.release_all()


async def test_short_first_prefers_shorts_when_longs_are_running() -> None:
    governor = Governor(4, long_idle_borrow=None, short_first=True)  # long cap 2
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("L0", lane="long")
        await crowd.add("S0")
        await crowd.add("S1")
        await crowd.add("S2")  # full: 1 long, 3 short
        await crowd.add("L1", lane="long")  # waits, long lane has room
        await crowd.add("S3")  # waits, arrived after L1
        await crowd.release("S0")
        assert crowd.admitted[-1] == "S3"  # a long is running, so the short goes first
        await crowd.release("S1")
        assert crowd.admitted[-1] == "L1"
        await crowd.release_all()


async def test_strict_arrival_order_by_default() -> None:
    governor = Governor(4, long_idle_borrow=None)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for name in ("L0", "S0", "S1", "S2"):
            await crowd.add(name, lane="long" if name[0] == "L" else "short")
        await crowd.add("L1", lane="long")
        await crowd.add("S3")
        await crowd.release("S0")
        assert crowd.admitted[-1] == "L1"
        await crowd.release_all()


async def test_shorts_reclaim_borrowed_slots_at_once() -> None:
    # A long call runs for seconds on the reference server: borrowed slots must not lock shorts
    # out for that long. Shorts count long calls only up to the long share.
    now = [100.0]
    governor = Governor(8, clock=lambda: now[0])  # long share 4
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(7):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 7  # 3 borrowed
        for i in range(5):
            await crowd.add(f"S{i}")
        # 4 shorts go at once (short + min(long, 4) < 8); the fifth waits for a short to end.
        assert [name for name in crowd.admitted if name.startswith("S")] == [
            "S0",
            "S1",
            "S2",
            "S3",
        ]
        assert governor.in_flight == 11 and governor.waiting == 1
        await crowd.release("L0", "L1", "L2")  # borrowed longs ending free nothing for shorts
        assert governor.waiting == 1
        await crowd.release("S0")
        assert crowd.admitted[-1] == "S4"
        await crowd.add("L7", lane="long")  # the long lane is at its share and shorts are busy
        assert "L7" not in crowd.admitted
        await crowd.release_all()
    assert (governor.in_flight, governor.waiting) == (0, 0)


async def test_the_long_share_is_of_the_servers_batch_when_the_limit_is_above_it() -> None:
    # An adaptive limit of 12 over a batch of 8 (transit, a short server queue): long requests
    # get half of the 8 sequences the server runs, not half of the 12 slots.
    governor = Governor(12, long_idle_borrow=None)
    assert governor.stats().lanes["long"].limit == 6
    governor.set_limit(12, batch=8)
    assert governor.stats().lanes["long"].limit == 4
    governor.set_limit(6, batch=8)  # under the batch: the share of the limit, as before
    assert governor.stats().lanes["long"].limit == 3
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        governor.set_limit(12, batch=8)
        for i in range(6):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 4
        await crowd.release_all()


async def test_long_calls_fill_what_the_shorts_leave_of_a_known_batch() -> None:
    # Batch 8 known, limit 10: the long share is 4, but with one short in flight and a reserve
    # of 2 kept for the next shorts, long calls may run 8 - 1 - 2 = 5.
    now = [100.0]
    governor = Governor(10, clock=lambda: now[0])
    governor.set_limit(10, batch=8)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("S0")
        for i in range(8):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 5
        await crowd.add("S1")  # a short is admitted at once: 2 + min(5, 4) < 10
        assert crowd.admitted[-1] == "S1"
        await crowd.release("L0")  # now 2 shorts: 8 - 2 - 2 = 4 long at most, no new long
        assert governor.stats().lanes["long"].in_flight == 4
        await crowd.release("S0", "S1")  # shorts gone (but recent): back to 8 - 0 - 2 = 6
        assert governor.stats().lanes["long"].in_flight == 6
        await crowd.release_all()
    assert (governor.in_flight, governor.waiting) == (0, 0)


async def test_held_back_is_about_the_limit_not_a_lanes_share() -> None:
    governor = Governor(8, long_idle_borrow=None)  # long share 4
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(6):
            await crowd.add(f"L{i}", lane="long")
        assert governor.waiting == 2 and not governor.held_back  # waiting on the share only
        for i in range(4):
            await crowd.add(f"S{i}")
        assert governor.in_flight == 8 and governor.held_back
        await crowd.add("S4")
        await crowd.release("L0", "S0")
        assert governor.held_back  # S4 took the short slot at once; the limit is full again
        await crowd.release_all()
    assert not governor.held_back


async def test_long_calls_borrowing_up_to_the_limit_are_held_back_by_it() -> None:
    now = [100.0]
    governor = Governor(4, clock=lambda: now[0])  # long share 2; no short ever came
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(5):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 3  # limit - 1
        assert governor.held_back  # a higher limit would run more of them
        await crowd.release_all()


async def test_pick_chooses_among_the_first_waiters_and_never_starves_the_head() -> None:
    """``pick`` (a pool's prefix affinity) may admit a waiter past the head, within the head's
    urgency and ``pick_window``; a head passed over ``pick_window`` times goes next anyway."""
    from dsclient.governor._governor import Governor

    admitted: list[str] = []
    wanted = {"x"}

    def pick(waiters) -> int:  # the first waiter tagged with a wanted name
        for i, slot in enumerate(waiters):
            if slot.tag in wanted:
                return i
        return 0

    governor = Governor(1, pick=pick, pick_window=2)
    hold = governor.slot()
    await hold.__aenter__()

    async def wait(tag: str, urgency: int = 0) -> None:
        slot = governor.slot(urgency=urgency)
        slot.tag = tag
        async with slot:
            admitted.append(tag)

    async with anyio.create_task_group() as group:
        for tag in ("a", "b", "x", "c", "x"):
            group.start_soon(wait, tag)
            await anyio.sleep(0)
        await anyio.sleep(0.01)
        await hold.__aexit__(None, None, None)
    # "x" is third: within the window of 2? No: the window is the first two ("a", "b"), so "a"
    # goes; then ("b", "x"): "x" goes past "b" (passed once); then ("b", "c"); ...
    assert admitted[0] == "a" and admitted[1] == "x"
    assert sorted(admitted) == ["a", "b", "c", "x", "x"]
    # "b" was passed over once, then twice by the second "x" at most: it never waits forever.
    assert admitted.index("b") <= 3


async def test_long_calls_stop_borrowing_from_the_batch_once_the_shorts_slow_down() -> None:
    # Batch 8 known, limit 10, one short in flight: longs may run 8 - 1 - 2 = 5 (share 4)
    # while the shorts keep their pace; once the shorts' latest 8 took more than twice their
    # quickest 8's time per output token, the longs keep to their share.
    now = [100.0]
    governor = Governor(10, clock=lambda: now[0])
    governor.set_limit(10, batch=8)

    async def shorts(n: int, seconds: float, tokens: int = 16) -> None:
        for _ in range(n):
            async with governor.slot(lane="short") as slot:
                now[0] += seconds
                slot.work = tokens

    await shorts(8, 0.1)  # 6.25 ms a token: the quickest window
    await shorts(8, 0.15, tokens=20)  # 7.5 ms a token: not slowed
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("S0")
        for i in range(8):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 5  # borrowing
        await crowd.release("L0", "L1", "L2", "L3", "L4")  # longs done; shorts slow meanwhile
        tg.cancel_scope.cancel()
    await shorts(8, 0.25)  # 15.6 ms a token: 2.5x the quickest
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("S0")
        for i in range(8):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 4  # the share, no more
        await crowd.release("S0")
        now[0] += 0.5  # shorts recent, none in flight: still the share while they are slowed
        await crowd.release("L0")
        assert governor.stats().lanes["long"].in_flight == 4
        now[0] += 1.0  # no short for 1.5 s: idle borrowing as before, up to limit - 1
        await crowd.release("L1")
        assert governor.stats().lanes["long"].in_flight == 6  # the 6 left, all admitted
        tg.cancel_scope.cancel()
    await shorts(8, 0.1)  # back to their pace: borrowing from the batch again
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("S0")
        for i in range(8):
            await crowd.add(f"L{i}", lane="long")
        assert governor.stats().lanes["long"].in_flight == 5
        tg.cancel_scope.cancel()
    assert (governor.in_flight, governor.waiting) == (0, 0)


async def test_without_a_known_batch_long_calls_beside_shorts_grow_with_the_shorts_pace() -> None:
    # No batch known (a server that says nothing), limit 40: the long share is 20. Beside
    # short calls the long lane starts at 1 and takes one more for each window of 8 shorts that
    # kept their pace while it was full; a window that took more than twice the quickest's time
    # per token halves it. Longs already running are never touched, and with no short call
    # about the longs borrow every slot but one, as before.
    now = [100.0]
    governor = Governor(40, clock=lambda: now[0], long_pacing=True)

    async def shorts(n: int, seconds: float, tokens: int = 16) -> None:
        for _ in range(n):
            async with governor.slot(lane="short") as slot:
                now[0] += seconds
                slot.work = tokens

    def longs_in() -> int:
        return governor.stats().lanes["long"].in_flight

    await shorts(8, 0.1)  # the quickest window; no long waited, so no growth
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("S0")  # shorts are about
        for i in range(24):
            await crowd.add(f"L{i}", lane="long")
        assert longs_in() == 1
        for expected in (2, 3, 4, 5):
            await shorts(8, 0.1)  # at their pace, the long lane full: one more
            assert longs_in() == expected
        await shorts(8, 0.25)  # 2.5x the quickest: halved, 5 -> 2
        await crowd.release("L0", "L1", "L2")
        assert longs_in() == 2  # none admitted: 2 is the cap now
        await shorts(8, 0.3)  # 2 -> 1
        await shorts(8, 0.1)  # 1 -> 2 (2 in flight: full)
        await shorts(8, 0.1)  # 2 -> 3
        assert longs_in() == 3
        await crowd.release("S0")
        now[0] += 1.5  # no short for 1.5 s: idle borrowing, up to limit - 1
        await crowd.release("L3")
        assert longs_in() == 20  # the 20 left, all admitted
        tg.cancel_scope.cancel()
    # A known batch: borrowing follows the shorts' pace instead, and the long lane's own pace
    # is gone.
    governor.set_limit(40, batch=32)
    assert governor._long_paced is None
    assert (governor.in_flight, governor.waiting) == (0, 0)


def test_recent_sizes_set_the_long_threshold_where_the_context_is_unknown() -> None:
    sizes = RecentSizes()
    assert sizes.threshold == LONG_THRESHOLD_FALLBACK
    assert [sizes.lane_of(900) for _ in range(2)] == ["short"] * 2  # the fallback: 1024
    for _ in range(2):
        sizes.lane_of(60)
    # 4 short calls: the first quartile is 60, and 4 x 60 = 240 is raised to the floor, 256.
    assert sizes.threshold == 256
    assert [sizes.lane_of(900) for _ in range(40)] == ["long"] * 40  # a burst: not usual
    assert sizes.threshold == 256
    assert sizes.lane_of(257) == "long" and sizes.lane_of(256) == "short"
    for _ in range(256):
        sizes.lane_of(200)  # calls that grow slowly move the usual size with them
    assert sizes.threshold == 800
    assert sizes.lane_of(801) == "long"
    for size in range(200, 4000, 100):
        sizes.lane_of(size)  # never above the fallback, however large the usual call
    assert sizes.threshold <= LONG_THRESHOLD_FALLBACK


async def test_acquire_gives_a_slot_that_release_gives_back_once_with_its_outcome():
    released: list[str] = []
    governor = Governor(2, on_release=lambda slot, outcome, service_s: released.append(outcome))
    first = await governor.acquire(lane="short")
    second = await governor.acquire(lane="long", urgency=1)
    assert isinstance(first, Slot) and governor.in_flight == 2
    first.release("overloaded")
    first.release()  # a second release does nothing
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await anyio.sleep(1)
        except anyio.get_cancelled_exc_class() as cancelled:
            second.release(error=cancelled)
            raise
    third = await governor.acquire()
    third.set_outcome("error")
    third.release(error=RuntimeError("boom"))  # what was recorded wins over the error
    fourth = await governor.acquire()
    fourth.release()
    assert released == ["overloaded", "cancelled", "error", "ok"]
    assert governor.in_flight == 0
    with pytest.raises(ValueError, match="outcome"):
        fourth.release("fine")


async def test_long_calls_the_cache_or_batch_holds_are_not_held_back_by_the_limit() -> None:
    """A higher limit would not run them: the limit controller must not grow for them."""
    now = [100.0]
    governor = Governor(12, clock=lambda: now[0])
    governor.set_limit(12, batch=8)  # long share 4
    governor.set_kv(24 * 128, block=128)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(6):
            await crowd.add(f"L{i}", lane="long", tokens=572)  # 5 blocks: 4 fit
        assert governor.stats().lanes["long"].in_flight == 4
        assert governor.stats().kv_tokens_in_flight == 20 * 128
        assert not governor.held_back  # the cache holds them
        governor.set_kv(100 * 128, block=128)
        assert governor.stats().lanes["long"].in_flight == 6
        for i in range(6, 10):
            await crowd.add(f"B{i}", lane="long", batch=True, tokens=572)
        assert governor.stats().lanes["long"].in_flight == 7  # the batch less one
        assert not governor.held_back  # the server's batch holds them
        await crowd.release_all()


# --- growth: a batch's long items counted as they answer -----------------------------------------


async def _paced(governor: Governor, now: list[float], per_token: float) -> None:
    """Eight short answers of 32 tokens at ``per_token`` seconds a token: the short pace."""
    for _ in range(8):
        slot = await governor.acquire(lane="short")
        now[0] += 32 * per_token
        slot.work = 32
        slot.release()
    now[0] += 2.0  # no call about any more: the batch's long items may borrow


async def _look(governor: Governor) -> None:
    """Let the governor look at its waiters (as a release does), and the admitted ones run."""
    governor.set_limit(governor.limit, batch=governor._batch)
    await anyio.wait_all_tasks_blocked()


def _growing(seats: int, blocks: int) -> tuple[Governor, list[float]]:
    now = [100.0]
    governor = Governor(seats, clock=lambda: now[0])
    governor.set_limit(seats, batch=seats)
    governor.set_kv(blocks * 128, block=128)
    return governor, now


LONG = {"lane": "long", "batch": True, "tokens": 640, "prompt_tokens": 100}  # 5 blocks at its end


@pytest.mark.parametrize("prompt_known", [True, False])
async def test_a_batchs_long_items_are_counted_as_they_grow(prompt_known: bool) -> None:
    """23 blocks, a batch of 8: three long items of 5 blocks at their end, started together,
    and the batch's short items filling the other 4 sequences (a block each) reach 15 + 4
    blocks; with a fourth, 24: it waits until the three are far enough along that they end
    before it needs its fifth block. Without its prompt the share rules stand: the fourth runs
    at once (and vLLM preempts)."""
    governor, now = _growing(8, 23)
    await _paced(governor, now, 0.01)  # 100 tokens a second
    item = LONG if prompt_known else {**LONG, "prompt_tokens": 0}
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("s0", batch=True, tokens=100)
        for i in range(4):
            await crowd.add(f"L{i}", **item)  # type: ignore[arg-type]
        if not prompt_known:
            assert crowd.admitted == ["s0", "L0", "L1", "L2", "L3"]
            await crowd.release_all()
            return
        assert crowd.admitted == ["s0", "L0", "L1", "L2"]
        assert not governor.held_back  # a higher limit would not run it
        now[0] += 1.2  # the three at 220 of 640 tokens: the fourth would reach 5 blocks first
        await _look(governor)  # at the waiters again
        assert crowd.admitted == ["s0", "L0", "L1", "L2"]
        now[0] += 0.1  # at 230: 410 to go; the fourth is then at 510 tokens, 4 blocks
        await _look(governor)
        assert crowd.admitted == ["s0", "L0", "L1", "L2", "L3"]
        await crowd.release_all()
    assert governor.in_flight == 0 and not governor._ramps


async def test_until_the_pace_is_known_a_batchs_long_items_count_whole() -> None:
    governor, now = _growing(8, 23)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("s0", batch=True, tokens=100)
        for i in range(4):
            await crowd.add(f"L{i}", **LONG)  # type: ignore[arg-type]
        now[0] += 100.0
        await _look(governor)
        assert crowd.admitted == ["s0", "L0", "L1", "L2"]  # 3 x 5 + 4 x 1 blocks; a 4th: 24
        await crowd.release("L0")
        assert crowd.admitted == ["s0", "L0", "L1", "L2", "L3"]
        await crowd.release_all()


@pytest.mark.parametrize("short_running", [True, False])
async def test_a_batchs_long_items_start_apart_while_its_short_items_run(
    short_running: bool,
) -> None:
    """A batch of 4 on 15 blocks: the third long item fits as they grow 1.28 s after the first
    two (they end before it needs its fifth block), but long items start a long call's time
    (5.4 s) over 3 apart while the batch's short items run (their answers dispatch it)."""
    governor, now = _growing(4, 15)
    await _paced(governor, now, 0.01)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("s0", batch=True, tokens=100)
        for i in range(3):
            await crowd.add(f"L{i}", **LONG)  # type: ignore[arg-type]
        assert crowd.admitted == ["s0", "L0", "L1"]
        now[0] += 1.5
        if short_running:
            await _look(governor)
        else:
            await crowd.release("s0")  # its answer dispatches; no short item runs any more
        assert ("L2" in crowd.admitted) is not short_running
        now[0] += 0.35  # 1.85 s: 5.4 / 3 apart
        await _look(governor)
        assert "L2" in crowd.admitted
        await crowd.release_all()


async def test_the_batchs_own_answers_bound_how_long_its_long_items_grow() -> None:
    """Once 4 long answers are in, a long item is expected to end at the longest of them:
    answers of 100 tokens (1-2 blocks) let the fourth start at once."""
    governor, now = _growing(8, 23)
    await _paced(governor, now, 0.01)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(4):
            await crowd.add(f"A{i}", **LONG)  # type: ignore[arg-type]
        for name in ("A0", "A1", "A2"):
            crowd.slots[name].work = 100
        await crowd.release("A0", "A1", "A2")
        crowd.slots["A3"].work = 100
        await crowd.release("A3")
        for i in range(4):
            await crowd.add(f"L{i}", **LONG)  # type: ignore[arg-type]
        assert [n for n in crowd.admitted if n[0] == "L"] == ["L0", "L1", "L2", "L3"]
        await crowd.release_all()


async def test_a_batch_of_long_items_alone_leaves_no_room_for_short_ones() -> None:
    """With no short item in the batch, nothing fills the other sequences: 4 long items of 5
    blocks run in 23 (as the share rules ran them), and a fifth waits for room; their own
    answers then give the pace."""
    governor, _now = _growing(8, 23)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        for i in range(5):
            await crowd.add(f"L{i}", **LONG)  # type: ignore[arg-type]
        assert crowd.admitted == ["L0", "L1", "L2", "L3"]
        assert governor._long_pace.latest is None
        await crowd.release_all()


async def test_a_batchs_short_items_take_the_limit_while_its_long_ones_wait_for_the_cache() -> None:
    """Held to the server's batch while a long item waits, the short items left vLLM with no
    call queued each time a sequence ended; a long item that waits for the cache takes no slot
    that frees, so the short items fill the limit, and the limit may grow for them."""
    governor, now = _growing(8, 23)
    governor.set_limit(12, batch=8)
    await _paced(governor, now, 0.01)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("s0", batch=True, tokens=100)
        for i in range(4):
            await crowd.add(f"L{i}", **LONG)  # type: ignore[arg-type]
        assert "L3" not in crowd.admitted  # the cache holds it back
        for i in range(1, 10):
            await crowd.add(f"s{i}", batch=True, tokens=100)
        assert governor.in_flight == 12  # the limit, not the server's batch of 8
        assert governor.held_back
        await crowd.release_all()


async def test_a_batchs_short_items_wait_beside_its_long_ones_where_only_the_batch_is_known() -> (
    None
):
    """A server that tells its batch (vLLM's dev mode) but not its KV cache: growth is not
    counted (it needs the cache), so a batch's long item with a known prompt that waits for
    the limit beside a short one takes the next slot by the share rules, and the short one
    the slot after."""
    governor = Governor(12)
    governor.set_limit(12, batch=8)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("L0", **LONG)  # type: ignore[arg-type]
        for i in range(11):
            await crowd.add(f"s{i}", batch=True, tokens=100)
        await crowd.add("L1", **LONG)  # type: ignore[arg-type]
        await crowd.add("s11", batch=True, tokens=100)
        assert governor.in_flight == 12
        await crowd.release("s0")
        assert crowd.admitted[-1] == "L1"  # the long item first, within its share
        assert "s11" not in crowd.admitted
        await crowd.release("s1")
        assert crowd.admitted[-1] == "s11"
        await crowd.release_all()


async def test_once_the_batchs_long_calls_give_their_own_pace_their_growth_follows_it() -> None:
    """Short answers at 0.01 s a token, the batch's long ones at 0.005 (a short call's time
    includes its prompt and its queue): three long items started together are at 230 of 640
    tokens after 0.65 s on their own pace, where the fourth fits as they grow (after 1.3 s on
    the shorts' pace, the test above)."""
    governor, now = _growing(8, 23)
    await _paced(governor, now, 0.01)
    for _ in range(8):  # eight long answers of 540 tokens at 0.005 s a token
        slot = await governor.acquire(**LONG)  # type: ignore[arg-type]
        now[0] += 540 * 0.005
        slot.work = 540
        slot.release()
    assert governor._long_pace.latest == pytest.approx(0.005)
    async with anyio.create_task_group() as tg:
        crowd = Crowd(governor, tg)
        await crowd.add("s0", batch=True, tokens=100)
        for i in range(4):
            await crowd.add(f"L{i}", **LONG)  # type: ignore[arg-type]
        assert crowd.admitted == ["s0", "L0", "L1", "L2"]
        now[0] += 0.6  # at 220 tokens on their own pace: not yet
        await _look(governor)
        assert crowd.admitted == ["s0", "L0", "L1", "L2"]
        now[0] += 0.05  # at 230
        await _look(governor)
        assert crowd.admitted == ["s0", "L0", "L1", "L2", "L3"]
        await crowd.release_all()

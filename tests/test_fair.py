"""Tests for dsclient.governor._fair (VTC) and the governor's order among tenants (groups)."""

from __future__ import annotations

import heapq
import random

import anyio
import pytest

from dsclient.governor._fair import OUTPUT_WEIGHT, Fair, check_weights
from dsclient.governor._governor import Governor, Slot

pytestmark = pytest.mark.anyio


# -- the policy alone -----------------------------------------------------------------------------
def test_charge_at_admission_and_correction_from_usage() -> None:
    fair = Fair({"chat": 2})
    chat = fair.arrive("chat")
    charged = fair.charge(chat, 100, 50)
    assert charged == 100 + OUTPUT_WEIGHT * 50  # no answer yet: all of max_tokens expected
    assert fair.counter("chat") == pytest.approx(charged / 2)
    fair.settle(chat, charged, 100, 10, 50, ok=True, latency=0.5)
    assert fair.counter("chat") == pytest.approx((100 + OUTPUT_WEIGHT * 10) / 2)
    stats = fair.stats()["chat"]
    assert (stats.input_tokens, stats.output_tokens, stats.done, stats.in_flight) == (100, 10, 1, 0)
    # The next call of the tenant is expected to use what its answers used (an EWMA of it).
    assert fair.expected(chat, 100, 50) < charged


def test_failed_call_keeps_its_charge_and_cancelled_one_is_refunded() -> None:
    fair = Fair()
    t = fair.arrive("a")
    charged = fair.charge(t, 10, 10)
    fair.settle(t, charged, 10, None, 10, ok=False, latency=1.0)
    assert fair.counter("a") == charged
    assert fair.stats()["a"].failed == 1
    t = fair.arrive("a")
    second = fair.charge(t, 10, 10)
    fair.refund(t, second)
    assert fair.counter("a") == pytest.approx(charged)


def test_unknown_tokens_count_one_unit_per_call() -> None:
    fair = Fair()
    t = fair.arrive(None)
    assert fair.charge(t, 0, 0) == 1.0


def test_idle_tenant_is_lifted_to_the_lowest_active_counter() -> None:
    fair = Fair()
    a = fair.arrive("a")
    for _ in range(10):
        fair.charge(a, 100, 0)
    b = fair.arrive("b")  # never seen: starts at the active minimum, not at 0
    assert fair.counter("b") == fair.counter("a") == 1000
    fair.charge(b, 50, 0)
    fair.leave(b)  # b goes idle at 1050
    for _ in range(5):
        fair.charge(a, 100, 0)
    fair.arrive("b")  # back while a is active at 1500: lifted, no banked credit
    assert fair.counter("b") == 1500


def test_lifted_to_where_the_last_active_tenant_left() -> None:
    fair = Fair()
    a = fair.arrive("a")
    fair.charge(a, 700, 0)
    fair.leave(a)
    fair.arrive("b")  # nobody active: the level a left at
    assert fair.counter("b") == 700


def test_a_tenant_active_in_another_process_is_not_lifted_here() -> None:
    fair = Fair()
    a = fair.arrive("a")
    fair.charge(a, 500, 0)
    fair.take_pending()
    fair.absorb({"a": 500.0, "b": 100.0}, active_elsewhere=["b"])
    fair.arrive("b")
    assert fair.counter("b") == 100.0


def test_held_while_a_tenant_waiting_elsewhere_is_further_behind_than_one_call() -> None:
    fair = Fair()
    a = fair.arrive("a")
    fair.charge(a, 100, 0)  # largest call: 100 units
    fair.take_pending()  # a sync sends it, and reads everyone's back
    fair.absorb({"a": 100.0, "b": 50.0}, waiting_elsewhere=["b"])
    assert not fair.held(a)  # 100 <= 50 + 100
    fair.charge(a, 100, 0)
    assert fair.held(a)  # 200 > 150
    fair.take_pending()
    fair.absorb({"a": 200.0, "b": 150.0}, waiting_elsewhere=["b"])
    assert not fair.held(a)
    fair.forget_remote()
    fair.charge(a, 1000, 0)
    assert not fair.held(a)


def test_pending_changes_are_taken_once_and_kept_over_a_read() -> None:
    fair = Fair()
    a = fair.arrive("a")
    fair.charge(a, 30, 0)
    assert fair.take_pending() == {"a": 30.0}
    fair.charge(a, 5, 0)  # during the sync's round trip
    fair.absorb({"a": 130.0})  # others added 100
    assert fair.counter("a") == 135.0
    assert fair.take_pending() == {"a": 5.0}


def test_weights_are_checked() -> None:
    assert check_weights({"a": 3}) == {"a": 3.0}
    with pytest.raises(ValueError, match=r"group_weights\['a'\]"):
        check_weights({"a": 0})
    with pytest.raises(ValueError, match="finite"):
        check_weights({"a": float("inf")})
    with pytest.raises(TypeError):
        check_weights({"a": "3"})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        check_weights({"": 1})


# -- VTC's bound, on a simulated server with a fake clock ------------------------------------------
def _simulate(
    weights: dict[str, float], *, seats: int, horizon: float, seed: int
) -> tuple[list[tuple[float, dict[str, float]]], float]:
    """A server of ``seats`` sequences serving tenants that are always backlogged, each call
    taking time in proportion to its tokens; returns, at every admission, the service each
    tenant was given so far (charged at admission, in tokens), and the largest call's cost."""
    rng = random.Random(seed)
    fair = Fair(weights)
    tenants = {name: fair.arrive(name) for name in weights}
    for t in tenants.values():
        fair.arrive(t.name)  # a deep backlog: always a call waiting
    served = dict.fromkeys(weights, 0.0)
    now = 0.0
    ends: list[float] = []
    trace: list[tuple[float, dict[str, float]]] = []
    largest = 0.0
    while now < horizon:
        while len(ends) < seats:
            name = min(tenants, key=lambda n: (tenants[n].counter, n))
            # Tenants differ wildly: one sends long prompts, the others short ones.
            prompt = rng.randint(800, 1200) if name == "flood" else rng.randint(20, 200)
            output = rng.randint(1, 64)
            cost = fair.charge(tenants[name], prompt, output)  # no answer yet: max_tokens
            fair.settle(tenants[name], cost, prompt, output, output, ok=True, latency=0.0)
            served[name] += cost
            largest = max(largest, cost)
            heapq.heappush(ends, now + cost / 1000)
            trace.append((now, dict(served)))
        now = heapq.heappop(ends)
    return trace, largest


@pytest.mark.parametrize("seed", range(5))
def test_vtc_bound_two_backlogged_tenants(seed: int) -> None:
    """Sheng et al. (Theorem 4.3): over any interval in which two tenants stay backlogged, the
    service they receive differs by at most 2U, U the largest call's cost."""
    trace, largest = _simulate({"flood": 1.0, "short": 1.0}, seats=8, horizon=60.0, seed=seed)
    assert len(trace) > 1000
    worst = 0.0
    # Every interval between two admissions (a quadratic walk over a sample of starts).
    for i in range(0, len(trace), 7):
        _, start = trace[i]
        for _, end in trace[i + 1 :]:
            gap = (end["flood"] - start["flood"]) - (end["short"] - start["short"])
            worst = max(worst, abs(gap))
    assert worst <= 2 * largest
    assert worst > 0  # the check can fail: the tenants were not served in lockstep


def test_vtc_weights_share_service_in_their_proportion() -> None:
    trace, largest = _simulate(
        {"flood": 3.0, "short": 1.0, "third": 1.0}, seats=8, horizon=60.0, seed=7
    )
    _, end = trace[-1]
    # Weighted service differs by at most 2U over the whole run (the bound, weighted).
    assert abs(end["flood"] / 3 - end["short"]) <= 2 * largest
    assert abs(end["short"] - end["third"]) <= 2 * largest
    assert end["flood"] / end["short"] == pytest.approx(3.0, rel=0.05)


def test_without_lifting_a_returning_tenant_would_take_the_server() -> None:
    """What the lift prevents: a tenant idle while another was served 10,000 tokens comes back
    level with it, not 10,000 tokens ahead."""
    fair = Fair()
    a = fair.arrive("a")
    for _ in range(100):
        fair.charge(a, 100, 0)
    fair.arrive("b")
    assert fair.counter("b") >= fair.counter("a")


# -- in the governor -------------------------------------------------------------------------------
class Holders:
    """Tasks that each hold a governor slot until released; records the order of admission."""

    def __init__(self, governor: Governor, tg: anyio.abc.TaskGroup) -> None:
        self.governor = governor
        self.tg = tg
        self.admitted: list[str] = []
        self.slots: dict[str, Slot] = {}
        self._release: dict[str, anyio.Event] = {}

    async def add(
        self,
        name: str,
        group: str | None,
        *,
        input_tokens: int = 0,
        max_tokens: int = 0,
        urgency: int = 0,
        lane: str = "short",
    ) -> None:
        self._release[name] = anyio.Event()

        async def run() -> None:
            async with self.governor.slot(
                lane=lane,  # type: ignore[arg-type]
                group=group,
                urgency=urgency,
                input_tokens=input_tokens,
                max_tokens=max_tokens,
            ) as slot:
                self.admitted.append(name)
                self.slots[name] = slot
                await self._release[name].wait()
                slot.work = float(max_tokens)

        self.tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()

    async def release(self, name: str) -> None:
        self._release[name].set()
        await anyio.wait_all_tasks_blocked()


async def test_lowest_counter_goes_next_not_arrival_order() -> None:
    governor = Governor(1)
    async with anyio.create_task_group() as tg:
        h = Holders(governor, tg)
        await h.add("A0", "a", input_tokens=1000)
        for i in range(1, 4):
            await h.add(f"A{i}", "a", input_tokens=1000)
        for i in range(3):
            await h.add(f"B{i}", "b", input_tokens=100)
        for _ in range(7):
            await h.release(h.admitted[-1])
    # a was charged 1000 at A0, b was lifted to a's counter when it arrived (no credit for
    # having sent nothing). At the tie arrival decides (A1); then b's calls of 100 go until b
    # has caught up with a's 2000, before a's older calls.
    assert h.admitted == ["A0", "A1", "B0", "B1", "B2", "A2", "A3"]


async def test_a_tenant_alone_gets_every_slot() -> None:
    governor = Governor(4, group_weights={"b": 10})
    async with anyio.create_task_group() as tg:
        h = Holders(governor, tg)
        for i in range(6):
            await h.add(f"A{i}", "a", input_tokens=1000)
        assert (governor.in_flight, governor.waiting) == (4, 2)
        for name in list(h.admitted):
            await h.release(name)
        for name in list(h.admitted[4:]):
            await h.release(name)
    assert governor.stats().tenants["a"].done == 6


async def test_urgency_keeps_its_meaning_inside_a_tenant() -> None:
    governor = Governor(1)
    async with anyio.create_task_group() as tg:
        h = Holders(governor, tg)
        await h.add("hold", "a", input_tokens=10)
        await h.add("a-low", "a", input_tokens=10)
        await h.add("a-high", "a", input_tokens=10, urgency=5)
        await h.add("b", "b", input_tokens=10)
        for _ in range(4):
            await h.release(h.admitted[-1])
    # b is lifted to a's counter (10) and ties with a's; at a tie urgency decides across
    # tenants too, then arrival. Inside a, urgency first.
    assert h.admitted == ["hold", "a-high", "b", "a-low"]


async def test_weights_give_service_in_proportion() -> None:
    governor = Governor(1, group_weights={"chat": 3})
    async with anyio.create_task_group() as tg:
        h = Holders(governor, tg)
        await h.add("hold", None)
        for i in range(12):
            await h.add(f"c{i}", "chat", input_tokens=100)
            await h.add(f"x{i}", "batch", input_tokens=100)
        for _ in range(16):
            await h.release(h.admitted[-1])
        chat = sum(name.startswith("c") for name in h.admitted[1:17])
        assert 11 <= chat <= 13  # 3 to 1: 12 of chat for 4 of batch, give or take a tie
        while governor.in_flight:
            await h.release(h.admitted[-1])


async def test_stats_count_per_tenant() -> None:
    governor = Governor(1)
    async with anyio.create_task_group() as tg:
        h = Holders(governor, tg)
        await h.add("hold", "a", input_tokens=50, max_tokens=10)
        await h.add("b", "b", input_tokens=100)
        stats = governor.stats().tenants
        assert stats["b"].waiting == 1 and stats["a"].in_flight == 1
        await h.release("hold")
        await h.release("b")
    stats = governor.stats().tenants
    assert stats["a"].done == 1 and stats["a"].input_tokens == 50
    assert stats["a"].output_tokens == 10 and stats["a"].in_flight == 0
    assert stats["b"].p99 is not None and stats["b"].waiting == 0
    assert stats["a"].counter == pytest.approx(50 + OUTPUT_WEIGHT * 10)


async def test_granted_then_cancelled_is_refunded() -> None:
    import asyncio

    governor = Governor(1)
    first = await governor.acquire(group="a", input_tokens=50)
    task = asyncio.ensure_future(governor.acquire(group="b", input_tokens=100))
    await asyncio.sleep(0)
    assert governor.waiting == 1
    lifted = governor.fair.counter("b")
    first.release()  # grants b's slot: b is charged
    assert governor.fair.counter("b") == lifted + 100
    task.cancel()  # before b ran
    with pytest.raises(asyncio.CancelledError):
        await task
    assert governor.fair.counter("b") == lifted
    assert governor.in_flight == 0 and governor.stats().tenants["b"].in_flight == 0


async def test_a_held_tenant_waits_and_another_goes_meanwhile() -> None:
    governor = Governor(2)
    remote = {"waiting_elsewhere": ["remote"], "active_elsewhere": ["remote"]}
    async with anyio.create_task_group() as tg:
        h = Holders(governor, tg)
        await h.add("A0", "a", input_tokens=100)
        governor.sync_fair({"a": 1000.0, "remote": 0.0}, **remote)
        await h.add("A1", "a", input_tokens=100)  # a free slot, but a is far ahead of remote
        assert h.admitted == ["A0"] and governor.held_by_fairness == 1
        await h.add("C0", "c", input_tokens=100)  # c is not: the free slot is not left idle
        assert h.admitted == ["A0", "C0"]
        await h.release("C0")
        assert "A1" not in h.admitted
        governor.sync_fair({"a": 1000.0, "remote": 1000.0}, **remote)  # remote caught up
        await anyio.wait_all_tasks_blocked()
        assert h.admitted[-1] == "A1" and governor.held_by_fairness == 0
        await h.release("A0")
        await h.release("A1")


# -- through the client ----------------------------------------------------------------------------
async def test_client_charges_each_group_its_tokens_and_reports_them() -> None:
    import random as _random

    from dsclient import AsyncClient
    from dsclient._http import httpx

    from .fakes import FakeServer, RecordedSleep, completion_body

    fake = FakeServer(script=[httpx.Response(200, json=completion_body("x", "length", 4, 3))])
    async with AsyncClient(
        "http://127.0.0.1:8000",
        transport=fake.transport,
        sleep=RecordedSleep(),
        rng=_random.Random(0),
        group_weights={"chat": 3},
    ) as client:
        await client.generate("hello there", max_tokens=3, group="chat")
        await client.map(["a", "b"], max_tokens=3, group="batch")
        tenants = client.stats().tenants
    assert tenants["chat"].weight == 3.0 and tenants["batch"].weight == 1.0
    assert (tenants["chat"].done, tenants["batch"].done) == (1, 2)
    assert tenants["chat"].output_tokens == 3 and tenants["batch"].output_tokens == 6
    assert tenants["chat"].input_tokens > 0
    with pytest.raises(ValueError, match=r"group_weights\['x'\]"):
        AsyncClient("http://127.0.0.1:8000", transport=fake.transport, group_weights={"x": -1})


async def test_a_call_refused_by_max_queue_leaves_its_tenant_idle() -> None:
    from dsclient._exceptions import Overloaded

    governor = Governor(1, max_queue=0)
    slot = await governor.acquire(group="a", input_tokens=10)
    with pytest.raises(Overloaded):
        await governor.acquire(group="b", input_tokens=10)
    slot.release()
    assert governor.fair.active_names() == []

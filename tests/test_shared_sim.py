"""Four clients on one server WITH a shared budget, simulated (pure; the simulated server of
``tests/test_control.py``).

Without one, four clients each run their own loop on the same queue and hold it at 5-8x the
target: ``test_control.py::test_four_clients_hold_the_server_queue_near_the_target`` stays a
strict xfail that documents it (each grows by half the room it sees, and each sees all of it).
With the budget there is one controller (the leader's), fed the server's gauges and the TOTAL in
flight, and each client's limit is its block: its fair share (:func:`dsclient.governor._shared.fair_shares`),
grown only into leases nobody holds and never under its own in flight, as the lease script does.
"""

from __future__ import annotations

import statistics
from collections import deque

import pytest

from dsclient.governor._control import LimitController, target_waiting
from dsclient.governor._shared import fair_shares
from tests.test_control import (
    PERIOD,
    PERIODS,
    SIM_SHARE,
    WARM_UP,
    SimClient,
    SimServer,
    _p90,
)


class Block:
    """A client's view of the shared limit: ``limit`` is the leases it holds; outcomes go to
    the leader's controller."""

    def __init__(self, leader: LimitController) -> None:
        self.leader = leader
        self.limit = 1  # what the governor admits up to
        self.held = 1  # leases held

    def on_outcome(self, now: float, outcome: str, service_s: float | None) -> bool:
        return self.leader.on_outcome(now, outcome, service_s)  # type: ignore[arg-type]


def grant(blocks: list[Block], clients: list[SimClient], i: int, limit: int) -> int:
    """What the lease script grants client ``i`` (see ``SYNC_SCRIPT``): the leases it holds
    (``Block.held``); its governor admits up to ``min(held, share)`` (``Block.limit``)."""
    shares = fair_shares(limit, [c.in_flight + 10**6 for c in clients])  # unlimited demand
    mine = blocks[i].held
    others = sum(b.held for j, b in enumerate(blocks) if j != i)
    want = max(shares[i], clients[i].in_flight, 1)
    held = want if want <= mine else max(mine, min(want, limit - others), clients[i].in_flight)
    blocks[i].held = held
    return min(held, shares[i])


def simulate_shared(
    server: SimServer, n: int, leader: LimitController, periods: int, lag: int = 0
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The loop of ``test_control.simulate`` with one shared controller; returns per period the
    server's waiting and running, the shared limit, the total in flight after the server's step
    and the leases held (the sum of the blocks) after the syncs."""
    blocks = [Block(leader) for _ in range(n)]
    clients = [SimClient(i, blocks[i], transit=2) for i in range(n)]  # type: ignore[arg-type]
    waiting, running, limits, in_flight, held = [], [], [], [], []
    gauges: deque[tuple[int, int]] = deque([(0, 0)] * (lag + 1), maxlen=lag + 1)
    for period in range(periods):
        order = clients[period % n :] + clients[: period % n]
        for client in order:
            client.admit(period)
        for client in order:
            while client.on_the_way and client.on_the_way[0] <= period:
                client.on_the_way.popleft()
                server.arrive(client, period)
        for owner in server.step():
            clients[owner].in_flight -= 1
        gauges.append((len(server.running), len(server.waiting)))
        seen_running, seen_waiting = gauges[0]
        total = sum(c.in_flight for c in clients)
        leader.on_load(
            period * PERIOD,
            running=seen_running,
            waiting=seen_waiting,
            in_flight=total,
            demand=True,
        )
        for i in range(n):  # one sync each per period, in turn
            blocks[i].limit = grant(blocks, clients, i, leader.limit)
        waiting.append(len(server.waiting))
        running.append(len(server.running))
        limits.append(leader.limit)
        in_flight.append(total)
        held.append(sum(b.held for b in blocks))
    return waiting, running, limits, in_flight, held


@pytest.mark.parametrize("lag", [0, 1], ids=["fresh-gauges", "gauges-a-period-old"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("capacity", [24, 32])
def test_clients_sharing_a_budget_hold_the_queue_p90_at_the_single_client_target(
    capacity: int, n: int, lag: int
) -> None:
    leader = LimitController(start=5, mode="metrics", capacity=capacity)
    waiting, running, limits, in_flight, held = simulate_shared(
        SimServer(capacity), n, leader, PERIODS, lag=lag
    )
    target = target_waiting(capacity, SIM_SHARE, capacity)
    assert _p90(waiting[WARM_UP:]) <= target
    assert statistics.mean(running[WARM_UP:]) >= 0.95 * capacity
    # Nobody sends past its block, and the blocks together grow only into the shared limit:
    # above it they only shrink, as the requests in flight when it fell end.
    for t in range(1, len(limits)):
        assert in_flight[t] <= held[t - 1]
        assert held[t] <= max(limits[t], held[t - 1])


def test_four_uncoordinated_clients_for_comparison_overshoot() -> None:
    """What the shared budget fixes (the strict xfail in test_control.py): the same four clients
    each with its own controller hold the queue far above the target. Kept as a passing
    measurement here so that a change which closes the gap shows in both places."""
    from tests.test_control import simulate

    capacity = 32
    clients = [
        SimClient(i, LimitController(start=5, mode="metrics", capacity=capacity), transit=2)
        for i in range(4)
    ]
    trace = simulate(SimServer(capacity), clients, PERIODS)
    target = target_waiting(capacity, SIM_SHARE, capacity)
    from tests.test_control import _p90

    assert _p90(trace.waiting[WARM_UP:]) > 2 * target  # 4-6x (its mean, 1.7-2.5x)

"""Tests for dsclient.governor._control: the limit controller's rules and the capacity learner.

Pure: every signal is scripted and ``now`` is driven by hand. The closed-loop tests run the
controller against a small simulated server (a batch of ``C`` sequences, a first-come queue,
requests that spend ``k`` periods in transit before they reach it).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

import pytest

from dsclient.governor import _control
from dsclient.governor._control import (
    CEILING_FLOOR,
    OVERLOAD_CUT,
    CapacityLearner,
    ControlStats,
    LimitController,
    target_waiting,
)

PERIOD = 0.25  # the controller's default period; scripted scrapes come this far apart


#: The simulated loops below run with the client's default target share.
SIM_SHARE = 0.5


def metrics(start: int, capacity: int | None = 8, **kwargs: object) -> LimitController:
    kwargs.setdefault("queue_share", 0.25)  # the numbers below were worked out for a quarter
    kwargs.setdefault("slow_start", 1.5)  # ... and for x1.5
    return LimitController(start=start, mode="metrics", capacity=capacity, **kwargs)  # type: ignore[arg-type]


# --- target_waiting -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "share", "running", "expected"),
    [
        (8, 0.25, 3, 2),  # the docstring's examples
        (32, 0.25, 30, 8),
        (None, 0.25, 12, 3),
        (256, 0.25, 0, 64),
        (1, 0.25, 0, 1),  # never below one
        (None, 0.25, 0, 1),  # unknown capacity, idle server: the batch as seen is 1
        (8, 1.0, 8, 8),
        (10, 0.3, 0, 3),  # 0.3 * 10 is 3.0000000000000004: no extra request from rounding
        (100, 0.07, 0, 7),  # 7.000000000000001 likewise
        (9, 0.25, 0, 3),  # 2.25 rounds up
    ],
)
def test_target_waiting(capacity: int | None, share: float, running: int, expected: int) -> None:
    assert target_waiting(capacity, share, running) == expected


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": 0}, "start must be an int >= 1, got 0"),
        ({"start": True}, "start must be an int >= 1, got True"),
        ({"start": 2.0}, "start must be an int >= 1"),
        ({"mode": "auto"}, "mode must be 'metrics', 'throughput' or 'fixed', got 'auto'"),
        ({"queue_share": 0.0}, r"queue_share must be in \(0, 1\], got 0.0"),
        ({"queue_share": 1.5}, r"queue_share must be in \(0, 1\]"),
        ({"queue_share": math.nan}, r"queue_share must be in \(0, 1\]"),
        ({"latency_target": 0.0}, "latency_target must be > 0 seconds or None, got 0.0"),
        ({"period": 0.0}, "period must be > 0 and cooldown >= 0"),
        ({"cooldown": -1.0}, "period must be > 0 and cooldown >= 0"),
        ({"ceiling": 10.5}, "ceiling must be an int or None, got 10.5"),
        ({"ceiling": True}, "ceiling must be an int or None"),
    ],
)
def test_controller_rejects_bad_config(kwargs: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {"start": 4, "mode": "metrics", **kwargs}
    with pytest.raises(ValueError, match=match):
        LimitController(**arguments)  # type: ignore[arg-type]


def test_ceilings_by_mode() -> None:
    assert metrics(5, capacity=8).ceiling == CEILING_FLOOR  # max(64, 4 x 8)
    assert metrics(5, capacity=32).ceiling == 128
    assert metrics(5, capacity=None).ceiling == CEILING_FLOOR
    assert metrics(500, capacity=32).ceiling == 500  # never below the start
    assert metrics(5, capacity=32, ceiling=40).ceiling == 40
    assert metrics(50, capacity=32, ceiling=40).ceiling == 50
    assert LimitController(start=5, mode="throughput", capacity=8).ceiling == 1024
    assert LimitController(start=5, mode="throughput", capacity=None).ceiling == 1024
    assert LimitController(start=5, mode="fixed", capacity=256).ceiling == 5


def test_metrics_ceiling_follows_the_running_count_seen() -> None:
    control = metrics(5, capacity=None)
    control.on_load(0.0, running=100, waiting=0, in_flight=5, demand=False)
    assert control.ceiling == 400


def test_metrics_ceiling_never_falls_under_the_limit_when_the_batch_shrinks() -> None:
    control = metrics(5, capacity=None)
    control.on_load(0.0, running=17, waiting=0, in_flight=5, demand=False)
    assert control.ceiling == 68
    control.on_load(PERIOD, running=12, waiting=0, in_flight=5, demand=False)
    assert control.ceiling == 68  # was 48: a limit grown to 68 would have been above it


def test_set_capacity_ignores_nonsense() -> None:
    control = metrics(5, capacity=None)
    control.set_capacity(None)
    control.set_capacity(0)
    control.set_capacity(-3)
    assert control.capacity is None
    control.set_capacity(24)
    assert control.capacity == 24


def test_stats_snapshot() -> None:
    control = metrics(5, capacity=8, latency_target=2.0)
    stats = control.stats()
    assert stats == ControlStats(
        mode="metrics",
        limit=5,
        floor=1,
        ceiling=64,
        start=5,
        reason="start",
        changes=0,
        server_running=None,
        server_waiting=None,
        target_waiting=None,
        learned_max_num_seqs=None,
        latency_target_s=2.0,
        service_p99_s=None,
        signal="/metrics",
    )
    control.on_load(0.0, running=3, waiting=0, in_flight=5, demand=True)
    control.on_outcome(0.0, "ok", 0.5)
    stats = control.stats(learned=8)
    assert (stats.limit, stats.changes, stats.server_running, stats.server_waiting) == (8, 1, 3, 0)
    assert (stats.target_waiting, stats.learned_max_num_seqs, stats.service_p99_s) == (2, 8, 0.5)
    assert "room" in stats.reason


# --- metrics mode: growth ---------------------------------------------------------------------


def test_slow_start_multiplies_by_one_and_a_half_up_to_the_ceiling() -> None:
    control = metrics(4, capacity=None)
    seen = []
    for step in range(12):
        # The server shows all that is in flight: each period may grow.
        control.on_load(step * PERIOD, running=4, waiting=0, in_flight=4, demand=True)
        seen.append(control.limit)
    assert seen == [6, 9, 14, 21, 32, 48, 64, 64, 64, 64, 64, 64]
    assert control.ceiling == 64
    assert control.changes == 7


def test_slow_start_waits_for_requests_in_transit_to_land() -> None:
    control = metrics(8, capacity=32)
    wait = _control._SLOW_START_WAIT * PERIOD
    # The server shows less than half of what is in flight: the rest is still in transit.
    assert control.on_load(0.0, running=2, waiting=0, in_flight=8, demand=True)
    assert control.limit == 12
    now = PERIOD
    while now < wait:
        assert not control.on_load(now, running=2, waiting=0, in_flight=12, demand=True)
        now += PERIOD
    assert control.on_load(wait, running=2, waiting=0, in_flight=12, demand=True)
    assert control.limit == 18
    # Half of it landed: grows at the next period.
    assert control.on_load(wait + PERIOD, running=6, waiting=3, in_flight=18, demand=True)
    assert control.limit == 27


def test_slow_start_never_passes_a_full_batch_and_the_target_queue() -> None:
    """A known batch of 24 (target 12): slow start stops at 36 whatever the factor, while the
    server shows room; past it, growth is by the room shown. (Four processes sharing a limit
    doubled it from 32 to 64 while the server showed 20 of 24, the rest a sync behind.)"""
    control = LimitController(start=32, mode="metrics", capacity=24)  # queue_share 0.5
    assert control.on_load(0.0, running=20, waiting=0, in_flight=32, demand=True)
    assert control.limit == 36
    assert "has room" in control.reason  # that was slow start
    # Past it, growth is additive, by the room the server shows (here half of 12), not x2.
    assert control.on_load(0.5, running=20, waiting=0, in_flight=36, demand=True)
    assert control.limit == 42 and "aim" in control.reason


def test_slow_start_stops_once_the_batch_is_full() -> None:
    control = metrics(10, capacity=8)
    # running == capacity, no queue yet: additive, by half the room (target 2 - waiting 0).
    assert control.on_load(0.0, running=8, waiting=0, in_flight=10, demand=True)
    assert control.limit == 11


def test_growth_after_the_first_queue_is_additive_by_half_the_room() -> None:
    control = metrics(40, capacity=32, cooldown=1.0)  # target 8
    # A queue above target: cut, and slow start is over for good.
    control.on_load(0.0, running=32, waiting=20, in_flight=40, demand=True)
    assert control.limit == 31  # ceil(40 * (32 + 8) / (32 + 20)) = ceil(30.8)
    # No growth for a cooldown after the cut: it needs a round trip to show in the queue.
    for now in (0.25, 0.5, 0.75):
        assert not control.on_load(now, running=32, waiting=2, in_flight=31, demand=True)
    assert control.limit == 31
    steps = [
        # (running, waiting, expected growth): room = target - waiting, plus the batch's free
        # seats (capacity - running) only while the queue is empty
        (32, 2, 3),  # room 6
        (20, 0, 10),  # room 8 + 12
        (32, 8, 1),  # room 0: still one
        (20, 3, 3),  # room 5: a queue means the batch is full, whatever the running count
    ]
    # After the queue stood over the target at 40, growth stays under 40 for a while (tested
    # below): these steps come after that memory.
    now = _control._OVER_MEMORY_S
    for running, waiting, growth in steps:
        now += PERIOD
        before = control.limit
        # Everything in flight shows in the gauges (in transit: see the transit tests below).
        in_flight = running + waiting
        assert control.on_load(
            now, running=running, waiting=waiting, in_flight=in_flight, demand=True
        )
        assert control.limit == before + growth, (running, waiting)


def test_growth_stays_under_the_limit_the_queue_stood_over_at_for_a_while() -> None:
    control = metrics(40, capacity=32, cooldown=1.0)  # target 8
    control.on_load(0.0, running=32, waiting=20, in_flight=40, demand=True)  # over at 40: cut
    assert control.limit == 31
    now = 1.0
    while now < _control._OVER_MEMORY_S - PERIOD:
        now += PERIOD
        control.on_load(now, running=32, waiting=0, in_flight=control.limit, demand=True)
        assert control.limit <= 39  # room enough to grow past 40, but not there yet
    assert control.limit == 39
    now = _control._OVER_MEMORY_S + PERIOD
    assert control.on_load(now, running=32, waiting=0, in_flight=39, demand=True)
    assert control.limit > 39  # the memory ran out: it may probe again


def test_the_over_memory_is_dropped_when_the_batch_runs_dry() -> None:
    control = metrics(40, capacity=32, cooldown=1.0)  # target 8
    control.on_load(0.0, running=32, waiting=20, in_flight=40, demand=True)  # over at 40
    control.on_load(1.0, running=32, waiting=0, in_flight=31, demand=True)
    assert control.limit == 35  # room 8: + 4
    # The batch shows free seats with an empty queue for a second: the cap held it short.
    for now in (1.25, 1.5, 1.75):
        control.on_load(now, running=20, waiting=0, in_flight=20, demand=False)
        assert control.limit == 35
    control.on_load(2.0, running=20, waiting=0, in_flight=20, demand=True)
    assert control.limit == 45  # room 8 + 12 seats: + 10, past the 39 it was held under


def test_the_aim_falls_while_the_queue_is_over_the_target_in_more_than_a_tenth() -> None:
    control = metrics(40, capacity=32, cooldown=1.0)  # target 8
    control.on_load(0.0, running=32, waiting=4, in_flight=36, demand=True)
    assert (control.target, control.aim) == (8, 8)
    now = 0.0
    for _ in range(12):  # over in every scrape: each lowers the aim by 0.45
        now += PERIOD
        control.on_load(now, running=32, waiting=12, in_flight=control.limit, demand=True)
    assert control.aim == 4  # never under half the target
    for _ in range(40):  # at or under: each raises it by 0.05
        now += PERIOD
        control.on_load(now, running=32, waiting=2, in_flight=control.limit, demand=True)
    assert control.aim == 6
    for _ in range(100):  # without demand the queue is not this client's doing: no change
        now += PERIOD
        control.on_load(now, running=32, waiting=12, in_flight=control.limit, demand=False)
    assert control.aim == 6


def test_growth_with_unknown_capacity_uses_the_batch_as_seen() -> None:
    control = metrics(20, capacity=None, cooldown=1.0)
    control.on_load(0.0, running=12, waiting=9, in_flight=20, demand=True)  # target 3: cut
    assert control.limit == 15  # ceil(20 * 15 / 21)
    control.on_load(1.0, running=12, waiting=0, in_flight=12, demand=True)  # all of it landed
    assert control.limit == 17  # room = target 3 - waiting 0 = 3: + ceil(1.5)


def test_growth_counts_what_is_still_on_its_way_to_the_server() -> None:
    """Issue 15: the last step's requests, sent but not yet in the gauges, fill the room the
    gauges show; growing on that room again each period overshot the target (queue p90 14-15
    against 12 on a real batch of 24)."""
    control = metrics(44, capacity=24, queue_share=0.5, cooldown=1.0)  # target 12
    control.on_load(0.0, running=24, waiting=20, in_flight=44, demand=True)  # a cut: saturated
    assert control.limit == 36
    # Everything landed: room 12 - 4 = 8, grows by half of it.
    assert control.on_load(1.0, running=24, waiting=4, in_flight=28, demand=True)
    assert control.limit == 40
    # The client sent those 12; the gauges do not show them yet: no room left to fill.
    for now in (1.25, 1.5):
        assert not control.on_load(now, running=24, waiting=4, in_flight=40, demand=True)
    # Half of them landed: 6 still on the way, against a room of 12 - 10 = 2.
    assert not control.on_load(1.75, running=24, waiting=10, in_flight=40, demand=True)
    assert control.limit == 40
    # All landed, and the batch took some from the queue: room 12 - 8 = 4.
    assert control.on_load(2.0, running=24, waiting=8, in_flight=32, demand=True)
    assert control.limit == 42


def test_a_steady_share_in_transit_does_not_stop_growth() -> None:
    """Requests always on their way (to the server or back) at any limit are not room taken:
    only what is unseen beyond the least seen in the last two seconds counts."""
    control = metrics(44, capacity=24, queue_share=0.5, cooldown=1.0)  # target 12
    control.on_load(0.0, running=24, waiting=20, in_flight=44, demand=True)  # a cut to 36
    now = 0.0
    while now < 1.0 + _control._UNSEEN_WINDOW_S:  # no demand: it only watches, 10 unseen
        now += PERIOD
        control.on_load(now, running=24, waiting=2, in_flight=36, demand=False)
    assert control.limit == 36
    assert control.on_load(now + PERIOD, running=24, waiting=2, in_flight=36, demand=True)
    assert control.limit == 41  # room 12 - 2 = 10: + 5, the 10 in transit notwithstanding


def test_no_growth_for_a_cooldown_after_any_cut() -> None:
    for cut in ("overloaded", "preempted"):
        control = metrics(20, capacity=8, cooldown=1.0)
        control.on_load(0.0, running=4, waiting=0, in_flight=20, demand=False, preemptions=0)
        if cut == "overloaded":
            control.on_outcome(0.0, "overloaded", None)
        else:
            control.on_load(0.0, running=4, waiting=0, in_flight=20, demand=False, preemptions=1)
        assert control.limit == 14
        for now in (0.25, 0.5, 0.75, 0.999):
            assert not control.on_load(now, running=4, waiting=0, in_flight=8, demand=True)
        assert control.on_load(1.0, running=4, waiting=0, in_flight=8, demand=True), cut
        # After either cut growth is additive (room: target 2 + free seats 4, halved): the
        # server has shown its limit.
        assert control.limit == 17


def test_no_growth_without_demand() -> None:
    control = metrics(5, capacity=8)
    for step in range(10):
        assert not control.on_load(step * PERIOD, running=3, waiting=0, in_flight=3, demand=False)
    assert (control.limit, control.changes, control.reason) == (5, 0, "start")


def test_growth_at_most_once_per_period() -> None:
    control = metrics(4, capacity=None, period=1.0)
    assert control.on_load(0.0, running=4, waiting=0, in_flight=4, demand=True)
    for now in (0.1, 0.5, 0.999):
        assert not control.on_load(now, running=4, waiting=0, in_flight=6, demand=True)
    assert control.limit == 6
    assert control.on_load(1.0, running=4, waiting=0, in_flight=6, demand=True)
    assert control.limit == 9


def test_growth_never_passes_the_explicit_ceiling() -> None:
    control = metrics(5, capacity=None, ceiling=12)  # unknown: slow start is not bounded
    for step in range(20):
        control.on_load(step * PERIOD, running=5, waiting=0, in_flight=control.limit, demand=True)
        assert control.limit <= 12
    assert control.limit == 12


# --- metrics mode: the queue rule ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_flight", "running", "waiting", "expected"),
    [
        (20, 8, 12, 10),  # factor (8 + 2) / 20 = 0.5
        (20, 8, 4, 17),  # factor 10 / 12: ceil(16.67)
        (40, 8, 100, 20),  # factor 10 / 108, but never more than halving in-flight in one step
        (3, 8, 30, 2),  # ceil(1.5)
        (1, 8, 30, 1),  # the floor
        (0, 8, 30, 1),  # nothing in flight: still the floor, never zero
    ],
)
def test_queue_above_target_cuts_in_proportion(
    in_flight: int, running: int, waiting: int, expected: int
) -> None:
    control = metrics(40, capacity=8)  # target 2
    control.on_load(0.0, running=running, waiting=waiting, in_flight=in_flight, demand=True)
    assert control.limit == expected
    assert control.target == 2
    assert control.reason == f"server queue {waiting} > target 2 (running {running})"


def test_queue_at_target_does_not_cut() -> None:
    control = metrics(12, capacity=8)
    assert not control.on_load(0.0, running=8, waiting=2, in_flight=12, demand=False)
    assert control.limit == 12


def test_queue_rule_never_raises_the_limit() -> None:
    control = metrics(10, capacity=8)
    # In flight above the limit (long requests borrowing): the proportional value (25) is
    # above the limit, which stays.
    assert not control.on_load(0.0, running=8, waiting=4, in_flight=30, demand=True)
    assert control.limit == 10


def test_queue_cut_settles_at_running_plus_target_while_one_client_drains() -> None:
    """One client's requests drain from the server's queue after a cut: the limit ends at
    running + target (the batch plus the target queue), never below it, never at the floor."""
    control = metrics(40, capacity=8)  # target 2
    control.on_load(0.0, running=8, waiting=32, in_flight=40, demand=True)
    assert control.limit == 20
    limits = []
    for step, in_flight in enumerate(range(38, 11, -2), start=1):
        # The client admits nobody (in flight above the limit); 2 of its requests finish a
        # period and the server takes 2 from its queue: in flight = running + waiting.
        control.on_load(
            step * PERIOD, running=8, waiting=in_flight - 8, in_flight=in_flight, demand=True
        )
        limits.append(control.limit)
    assert min(limits) == 10
    assert control.limit == 10


def test_one_queue_cut_per_round_trip() -> None:
    """In-flight drains within a period of a cut, while the queue shows the cut only a round
    trip later: a second cut on the same lagging queue took the limit under the batch + target
    + transit, the batch ran dry and the regrowth overshot."""
    control = metrics(60, capacity=24, queue_share=0.5)  # target 12
    assert control.on_load(0.0, running=24, waiting=24, in_flight=60, demand=True)
    assert control.limit == 45  # ceil(60 * 36 / 48)
    # One period on: in-flight is under the new limit, the queue not yet down to the target.
    assert not control.on_load(PERIOD, running=24, waiting=20, in_flight=44, demand=True)
    assert control.limit == 45
    # Two periods on, the queue still over: the next cut.
    assert control.on_load(2 * PERIOD, running=24, waiting=18, in_flight=42, demand=True)
    assert control.limit == 36  # ceil(42 * 36 / 42)


def test_queue_cut_does_not_keep_cutting_while_in_flight_drains() -> None:
    control = metrics(40, capacity=8)  # target 2
    control.on_load(0.0, running=8, waiting=32, in_flight=40, demand=True)
    assert control.limit == 20
    # The server's queue drains slowly (others' requests, a slow batch); this client's own
    # in-flight falls towards the new limit, the governor admitting nobody meanwhile.
    script = [(36, 31), (32, 30), (28, 29), (24, 28), (22, 27)]
    limits = []
    for step, (in_flight, waiting) in enumerate(script, start=1):
        control.on_load(step * PERIOD, running=8, waiting=waiting, in_flight=in_flight, demand=True)
        limits.append(control.limit)
    # Today: [18, 16, 14, 12, 11], on its way to the floor.
    assert limits == [20] * len(script)


# --- metrics mode: overload and preemption ------------------------------------------------------


def test_overload_cuts_by_0_7_at_most_once_per_cooldown() -> None:
    control = metrics(20, capacity=8, cooldown=1.0)
    assert control.on_outcome(10.0, "overloaded", 0.2)
    assert control.limit == 14 == math.floor(20 * OVERLOAD_CUT)
    assert control.reason == "the server refused for load"
    for now in (10.0, 10.5, 10.999):
        assert not control.on_outcome(now, "overloaded", 0.2)
    assert control.limit == 14
    assert control.on_outcome(11.0, "overloaded", 0.2)
    assert control.limit == 9  # floor(9.8)


def test_overload_never_cuts_below_one() -> None:
    control = metrics(2, capacity=8, cooldown=0.0)
    for step in range(5):
        control.on_outcome(float(step), "overloaded", None)
    assert control.limit == 1


def test_overload_ends_slow_start() -> None:
    control = metrics(10, capacity=None)
    control.on_outcome(0.0, "overloaded", None)
    assert control.limit == 7
    control.on_load(1.0, running=4, waiting=0, in_flight=7, demand=True)
    assert control.limit == 8  # additive (room = target 1), not x1.5


def test_errors_and_cancellations_do_not_cut() -> None:
    control = metrics(10, capacity=8)
    for outcome in ("error", "cancelled", "ok"):
        assert not control.on_outcome(0.0, outcome, 0.1)
    assert control.limit == 10


def test_a_rising_preemption_counter_cuts() -> None:
    control = metrics(40, capacity=8, cooldown=1.0)
    # The first reading is only a baseline, however large.
    assert not control.on_load(0.0, running=8, waiting=0, in_flight=10, demand=False, preemptions=7)
    assert not control.on_load(
        PERIOD, running=8, waiting=0, in_flight=10, demand=False, preemptions=7
    )
    assert control.on_load(0.5, running=8, waiting=0, in_flight=10, demand=False, preemptions=9)
    assert control.limit == 28
    assert control.reason == "the server preempted sequences"
    # Within the cooldown another increase does not cut again.
    assert not control.on_load(
        0.75, running=8, waiting=0, in_flight=10, demand=False, preemptions=12
    )
    assert control.limit == 28
    # A counter that goes down (a restarted server) is a new baseline, not a preemption.
    assert not control.on_load(2.0, running=8, waiting=0, in_flight=10, demand=False, preemptions=0)
    assert control.on_load(2.25, running=8, waiting=0, in_flight=10, demand=False, preemptions=1)
    assert control.limit == 19


def test_preemption_in_cooldown_does_not_mask_the_queue_rule() -> None:
    control = metrics(40, capacity=8, cooldown=1.0)
    control.on_load(0.0, running=8, waiting=0, in_flight=30, demand=False, preemptions=0)
    control.on_load(PERIOD, running=8, waiting=0, in_flight=30, demand=False, preemptions=1)
    assert control.limit == 28
    control.on_load(0.5, running=8, waiting=40, in_flight=28, demand=True, preemptions=2)
    assert control.limit == 14  # the queue rule: ceil(28 * 0.5)


# --- throughput mode (the knee finder itself: tests/test_knee.py) ----------------------------


def test_throughput_mode_does_not_grow_without_answers() -> None:
    control = LimitController(start=5, mode="throughput", capacity=None)
    for step in range(30):
        control.on_idle_period(step * PERIOD, demand=True, in_flight=5)
    assert control.limit == 5  # nothing measured yet: nothing to decide on


def test_throughput_mode_cuts_on_overload() -> None:
    control = LimitController(start=8, mode="throughput", capacity=8, cooldown=1.0)
    assert control.on_outcome(0.3, "overloaded", 0.1)
    assert control.limit == 5
    assert not control.on_outcome(0.4, "overloaded", 0.1)  # once per cooldown
    assert control.on_outcome(5.0, "overloaded", 0.1)
    assert control.limit == 3  # floor(5 x 0.7)


def test_throughput_mode_ignores_queue_signals() -> None:
    control = LimitController(start=5, mode="throughput", capacity=8)
    assert not control.on_load(0.0, running=8, waiting=50, in_flight=5, demand=True)
    assert not control.on_load(PERIOD, running=1, waiting=0, in_flight=5, demand=True)
    assert control.limit == 5
    assert (control.server_running, control.server_waiting) == (1, 0)


def test_throughput_mode_floor_is_one() -> None:
    control = LimitController(start=2, mode="throughput", capacity=8, cooldown=0.0)
    for step in range(4):
        control.on_outcome(float(step), "overloaded", None)
    assert control.limit == 1


# --- latency_target -----------------------------------------------------------------------------


def test_latency_target_halves_when_p99_is_above_120_percent() -> None:
    control = metrics(20, capacity=8, latency_target=1.0)
    for _ in range(19):
        assert not control.on_outcome(0.0, "ok", 2.0)  # fewer than 20 samples: no judgement
    assert control.on_outcome(0.0, "ok", 2.0)
    assert control.limit == 10
    assert control.reason == "p99 service time 2.00 s > 120% of the target 1 s"
    assert control.service_p99() is None  # the new limit is judged on its own samples


def test_latency_target_tolerates_up_to_120_percent() -> None:
    control = metrics(20, capacity=8, latency_target=1.0)
    for _ in range(40):
        assert not control.on_outcome(0.0, "ok", 1.2)
    assert control.limit == 20


def test_latency_target_blocks_growth_while_p99_is_over_the_target() -> None:
    control = metrics(6, capacity=8, latency_target=1.0)
    for _ in range(5):
        control.on_outcome(0.0, "ok", 1.1)  # over the target, under 120% of it
    assert not control.on_load(0.0, running=3, waiting=0, in_flight=6, demand=True)
    assert control.limit == 6
    for _ in range(200):  # the window forgets the slow ones
        control.on_outcome(0.0, "ok", 0.5)
    assert control.on_load(PERIOD, running=3, waiting=0, in_flight=6, demand=True)
    assert control.limit == 9


def test_latency_target_ignores_failed_attempts() -> None:
    control = metrics(20, capacity=8, latency_target=1.0)
    for _ in range(40):
        control.on_outcome(0.0, "error", 30.0)
        control.on_outcome(0.0, "cancelled", 30.0)
    assert control.service_p99() is None
    assert control.limit == 20


def test_latency_target_in_throughput_mode() -> None:
    control = LimitController(start=8, mode="throughput", capacity=8, latency_target=1.0)
    for _ in range(20):
        assert not control.on_outcome(0.0, "ok", 1.1)  # judged at the 20th: within 120%
    for _ in range(5):
        assert not control.on_outcome(0.1, "ok", 3.0)  # judged at most once a period
    assert control.limit == 8
    assert control.on_idle_period(0.3, demand=True)  # the period's judgement: p99 3.0 s
    assert control.limit == 4
    for _ in range(5):
        control.on_outcome(0.4, "ok", 1.1)
    for step in range(6):
        control.on_idle_period(1.0 + step * PERIOD, demand=True)
    assert control.limit == 4  # p99 over the target: no growth


# --- fixed mode ---------------------------------------------------------------------------------


def test_fixed_mode_never_moves() -> None:
    control = LimitController(start=6, mode="fixed", capacity=8, latency_target=0.1, cooldown=0.0)
    now = 0.0
    for _ in range(10):
        now += PERIOD
        assert not control.on_load(
            now, running=8, waiting=50, in_flight=6, demand=True, preemptions=now
        )
        assert not control.on_load(now, running=1, waiting=0, in_flight=6, demand=True)
        assert not control.on_outcome(now, "overloaded", 5.0)
        assert not control.on_outcome(now, "ok", 5.0)
        assert not control.on_idle_period(now, demand=True)
    assert (control.limit, control.ceiling, control.changes, control.reason) == (6, 6, 0, "start")


# --- CapacityLearner ----------------------------------------------------------------------------


def test_learner_needs_two_scrapes_with_a_queue_and_takes_the_most_running() -> None:
    learner = CapacityLearner()
    assert not learner.observe(running=8, waiting=0)
    assert not learner.observe(running=6, waiting=2)
    assert learner.value is None
    assert learner.observe(running=5, waiting=1)
    assert learner.value == 6  # the most seen running while others waited
    assert learner.max_running_seen == 8


def test_learner_only_rises() -> None:
    learner = CapacityLearner()
    learner.observe(running=8, waiting=3)
    learner.observe(running=8, waiting=1)
    assert learner.value == 8
    assert not learner.observe(running=4, waiting=10)
    assert learner.value == 8
    assert learner.observe(running=12, waiting=1)
    assert learner.value == 12
    assert not learner.observe(running=12, waiting=1)


def test_learner_ignores_negative_and_zero() -> None:
    learner = CapacityLearner()
    for running, waiting in [(-1, 5), (5, -1), (0, 5), (0, 9), (7, 0)]:
        assert not learner.observe(running=running, waiting=waiting)
    assert learner.value is None
    assert learner.max_running_seen == 7


def test_learner_is_bounded_by_the_kv_cache() -> None:
    learner = CapacityLearner()
    learner.bound_by_kv(kv_cache_size_tokens=1024, block_size=128)  # 8 blocks
    learner.observe(running=12, waiting=3)
    assert learner.observe(running=12, waiting=3)
    assert learner.value == 8
    learner = CapacityLearner()
    learner.bound_by_kv(kv_cache_size_tokens=100_000, block_size=16)
    learner.observe(running=12, waiting=3)
    learner.observe(running=12, waiting=3)
    assert learner.value == 12  # a loose bound does not bind


@pytest.mark.parametrize(
    ("size", "block"), [(None, 16), (1024, None), (0, 16), (1024, 0), (-5, 16), (1024, -1)]
)
def test_learner_kv_bound_ignores_missing_or_nonsense(size: int | None, block: int | None) -> None:
    learner = CapacityLearner()
    learner.bound_by_kv(kv_cache_size_tokens=size, block_size=block)
    learner.observe(running=12, waiting=3)
    learner.observe(running=12, waiting=3)
    assert learner.value == 12


def test_learner_kv_bound_is_at_least_one() -> None:
    learner = CapacityLearner()
    learner.bound_by_kv(kv_cache_size_tokens=10, block_size=16)
    learner.observe(running=4, waiting=1)
    learner.observe(running=4, waiting=1)
    assert learner.value == 1


def test_learner_needs_the_two_queued_scrapes_in_a_row() -> None:
    learner = CapacityLearner()
    learner.observe(running=2, waiting=1)  # a request that just arrived, not yet scheduled
    for _ in range(1000):
        learner.observe(running=2, waiting=0)
    learner.observe(running=3, waiting=1)  # another one, much later
    assert learner.value is None
    assert learner.observe(running=3, waiting=2)
    assert learner.value == 3  # the most running among the queued scrapes so far


# --- closed loop ----------------------------------------------------------------------------------


@dataclass
class SimClient:
    """A client with unlimited demand: it keeps ``limit`` requests in flight."""

    name: int
    control: LimitController
    transit: int
    learner: CapacityLearner | None = None
    in_flight: int = 0
    on_the_way: deque[int] = field(default_factory=deque)  # the period each one arrives

    def admit(self, period: int) -> None:
        room = max(0, self.control.limit - self.in_flight)
        self.on_the_way.extend([period + self.transit] * room)
        self.in_flight += room


class SimServer:
    """A batch of ``capacity`` sequences fed from one first-come queue; each sequence runs a
    seeded random number of periods (2 to 6, 4 on average)."""

    def __init__(self, capacity: int, seed: int = 1, admission: int | None = None) -> None:
        self.capacity = capacity
        self.admission = admission  # vLLM's --max-num-queued-reqs: refuse past this queue
        self.rng = random.Random(seed)
        self.running: list[tuple[int, int]] = []  # (client, periods left)
        self.waiting: deque[int] = deque()
        self.refused: list[int] = []  # the period of each refusal

    def arrive(self, client: SimClient, period: int) -> None:
        if self.admission is not None and len(self.waiting) >= self.admission:
            self.refused.append(period)
            client.in_flight -= 1  # answered 503 at once; demand is unlimited, so it comes back
            client.control.on_outcome(period * PERIOD, "overloaded", None)
        else:
            self.waiting.append(client.name)

    def step(self) -> list[int]:
        done = [owner for owner, left in self.running if left <= 1]
        self.running = [(owner, left - 1) for owner, left in self.running if left > 1]
        while self.waiting and len(self.running) < self.capacity:
            self.running.append((self.waiting.popleft(), self.rng.randint(2, 6)))
        return done


@dataclass
class Trace:
    limits: list[list[int]]
    running: list[int]
    waiting: list[int]
    target: list[int]


def simulate(server: SimServer, clients: list[SimClient], periods: int, lag: int = 0) -> Trace:
    """Run the loop; the clients' scrapes show the server as it was ``lag`` periods before (a
    scrape is up to a period old when the controller reads it); the trace has it as it is."""
    trace = Trace([[] for _ in clients], [], [], [])
    gauges: deque[tuple[int, int]] = deque([(0, 0)] * (lag + 1), maxlen=lag + 1)
    for period in range(periods):
        # Alternate who goes first, so the queue's order favours nobody.
        order = clients[period % len(clients) :] + clients[: period % len(clients)]
        for client in order:
            client.admit(period)
        for client in order:
            while client.on_the_way and client.on_the_way[0] <= period:
                client.on_the_way.popleft()
                server.arrive(client, period)
        for owner in server.step():
            clients[owner].in_flight -= 1
        gauges.append((len(server.running), len(server.waiting)))
        running, waiting = gauges[0]
        for client in clients:
            if client.learner is not None and client.learner.observe(
                running=running, waiting=waiting
            ):
                client.control.set_capacity(client.learner.value)
            client.control.on_load(
                period * PERIOD,
                running=running,
                waiting=waiting,
                in_flight=client.in_flight,
                demand=True,
            )
            trace.limits[client.name].append(client.control.limit)
            assert 1 <= client.control.limit <= client.control.ceiling
        trace.running.append(len(server.running))
        trace.waiting.append(len(server.waiting))
        trace.target.append(clients[0].control.target or 1)
    return trace


WARM_UP = 150
PERIODS = 400


@pytest.mark.parametrize("learned", [False, True], ids=["capacity-known", "capacity-learned"])
@pytest.mark.parametrize("start", ["low", "high"])
@pytest.mark.parametrize("capacity", [8, 32, 256])
def test_closed_loop_converges_into_a_band(capacity: int, start: str, learned: bool) -> None:
    """One client, unlimited demand, requests 2 periods in transit: from a start of 5 or of 10x
    the batch, the limit settles between the batch and 3x (batch + target queue), the server's
    queue averages under the target but is not emptied, and its batch is full most of the time.
    (The queue's p90 is held at the target, so its mean sits well under it, 0.2-0.6x of it,
    while the batch stays 93-99% full: what the queue is for is the batch.)"""
    first = 5 if start == "low" else 10 * capacity
    control = LimitController(start=first, mode="metrics", capacity=None if learned else capacity)
    client = SimClient(0, control, transit=2, learner=CapacityLearner() if learned else None)
    trace = simulate(SimServer(capacity), [client], PERIODS)

    target = target_waiting(capacity, SIM_SHARE, capacity)
    assert trace.target[-1] == target
    if learned:
        assert client.learner is not None and client.learner.value == capacity
    for half in (slice(WARM_UP, 275), slice(275, PERIODS)):  # it stays there
        limits, running, waiting = trace.limits[0][half], trace.running[half], trace.waiting[half]
        assert capacity <= min(limits)
        assert max(limits) <= 3 * (capacity + target)
        assert max(running) == capacity
        assert statistics.mean(running) >= 0.85 * capacity
        assert 0.15 * target <= statistics.mean(waiting) <= target


def _p90(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[max(1, (90 * len(ordered) + 99) // 100) - 1]


@pytest.mark.parametrize("lag", [0, 1], ids=["fresh-gauges", "gauges-a-period-old"])
@pytest.mark.parametrize("learned", [False, True], ids=["capacity-known", "capacity-learned"])
@pytest.mark.parametrize("capacity", [24, 32, 256])
def test_closed_loop_holds_the_queue_p90_at_the_target(
    capacity: int, learned: bool, lag: int
) -> None:
    """Issue 15: one client, requests 2 periods in transit, gauges fresh or a period old. The
    server's queue p90 stays at or under the target (it was 1.4-1.7x: growth counted room its
    last steps were already filling, and cuts repeated on a lagging queue; then 1.0-1.1x: the
    loop grew right up to the target and cut just above it), and the batch stays full."""
    control = LimitController(start=5, mode="metrics", capacity=None if learned else capacity)
    client = SimClient(0, control, transit=2, learner=CapacityLearner() if learned else None)
    trace = simulate(SimServer(capacity), [client], PERIODS, lag=lag)
    target = target_waiting(capacity, SIM_SHARE, capacity)
    assert trace.target[-1] == target
    assert _p90(trace.waiting[WARM_UP:]) <= target
    assert statistics.mean(trace.running[WARM_UP:]) >= 0.95 * capacity


class WaveServer(SimServer):
    """Every sequence runs exactly ``length`` periods (``ignore_eos``, as in the benchmarks): the
    batch empties and refills in waves, and the queue swings with them."""

    def __init__(self, capacity: int, length: int) -> None:
        super().__init__(capacity)
        self.length = length

    def step(self) -> list[int]:
        done = [owner for owner, left in self.running if left <= 1]
        self.running = [(owner, left - 1) for owner, left in self.running if left > 1]
        while self.waiting and len(self.running) < self.capacity:
            self.running.append((self.waiting.popleft(), self.length))
        return done


@pytest.mark.parametrize("transit", [1, 2])
@pytest.mark.parametrize("length", [4, 8])
@pytest.mark.parametrize("capacity", [24, 32])
def test_closed_loop_holds_the_queue_p90_at_the_target_when_the_batch_refills_in_waves(
    capacity: int, length: int, transit: int
) -> None:
    """Answers of one length finish together: growing by one in the wave's trough and cutting
    by one on its crest held the queue over the target one scrape in eight (p90 1.1-1.4x).
    Growth now stays under the limit the queue stood over at, and aims lower while more than a
    tenth of the scrapes are over."""
    control = LimitController(start=5, mode="metrics", capacity=capacity)
    client = SimClient(0, control, transit=transit)
    trace = simulate(WaveServer(capacity, length), [client], PERIODS)
    target = target_waiting(capacity, SIM_SHARE, capacity)
    assert _p90(trace.waiting[WARM_UP:]) <= target
    assert statistics.mean(trace.running[WARM_UP:]) >= 0.95 * capacity


def test_closed_loop_keeps_the_batch_full_with_requests_in_transit() -> None:
    capacity = 32
    client = SimClient(0, LimitController(start=5, mode="metrics", capacity=capacity), transit=2)
    trace = simulate(SimServer(capacity), [client], PERIODS)
    assert statistics.mean(trace.running[WARM_UP:]) >= 0.95 * capacity


def test_closed_loop_fixed_limit_reference() -> None:
    """The reference for the xfail above: a fixed limit of batch + target + transit."""
    capacity = 32
    client = SimClient(0, LimitController(start=32 + 8 + 16, mode="fixed"), transit=2)
    trace = simulate(SimServer(capacity), [client], PERIODS)
    assert statistics.mean(trace.running[WARM_UP:]) >= 0.95 * capacity
    assert statistics.mean(trace.waiting[WARM_UP:]) <= 8


@pytest.mark.parametrize("starts", ["low-high", "high-low"])
@pytest.mark.parametrize("capacity", [8, 32, 256])
def test_two_clients_converge_to_fair_shares(capacity: int, starts: str) -> None:
    first, second = (1, 8 * capacity) if starts == "low-high" else (2 * capacity, 2)
    clients = [
        SimClient(0, LimitController(start=first, mode="metrics", capacity=capacity), transit=2),
        SimClient(1, LimitController(start=second, mode="metrics", capacity=capacity), transit=2),
    ]
    trace = simulate(SimServer(capacity), clients, PERIODS)
    target = target_waiting(capacity, SIM_SHARE, capacity)
    for half in (slice(200, 300), slice(300, PERIODS)):
        a = statistics.mean(trace.limits[0][half])
        b = statistics.mean(trace.limits[1][half])
        # A batch of 256 takes longer: its additive steps are small against limits of ~300.
        assert max(a, b) <= (1.3 if capacity == 256 else 1.25) * min(a, b), (a, b)
        totals = [x + y for x, y in zip(trace.limits[0][half], trace.limits[1][half])]
        assert max(totals) <= 4 * (capacity + target)
        assert statistics.mean(trace.running[half]) >= 0.85 * capacity
        assert statistics.mean(trace.waiting[half]) <= 4 * target


@pytest.mark.xfail(
    strict=True,
    reason=(
        "BUG (design): each client grows by half of the room it sees, and every client sees "
        "the whole server's room, so n clients together add n/2 x the room per period. With a "
        "known capacity the server's queue p90 is about 4-6x the target with 4 clients and "
        "8-14x with 8 (mean 1.7-2.5x and 4-6x), against at most 1x with one. A shared budget "
        "(dsclient.governor._shared) is the fix"
    ),
)
def test_four_clients_hold_the_server_queue_near_the_target() -> None:
    capacity = 32
    clients = [
        SimClient(n, LimitController(start=5, mode="metrics", capacity=capacity), transit=2)
        for n in range(4)
    ]
    trace = simulate(SimServer(capacity), clients, PERIODS)
    assert _p90(trace.waiting[WARM_UP:]) <= target_waiting(capacity, SIM_SHARE, capacity)


def test_no_additive_growth_while_what_was_sent_has_not_reached_the_server() -> None:
    # A busy API server falls behind: 60 in flight, the server shows 14. Growing on the room
    # it seems to have reached 128 in flight against a batch of 32 (a real run).
    control = metrics(60, capacity=32)
    control.on_load(0.0, running=32, waiting=20, in_flight=60, demand=True)  # saturated: a cut
    limit = control.limit
    for step in range(1, 20):
        now = 2.0 + step * PERIOD
        assert not control.on_load(now, running=10, waiting=4, in_flight=limit, demand=True)
    assert control.limit == limit
    assert control.on_load(8.0, running=30, waiting=0, in_flight=limit, demand=True)  # landed


def test_growth_stays_under_where_the_server_refused_for_a_while() -> None:
    # Told the batch is 32 (it is 12, with an admission queue of 4): the queue never passes the
    # target, so only 503s say no. After one, growth stops just under that limit for 10 s.
    control = metrics(22, capacity=32, cooldown=1.0)
    assert control.on_outcome(0.0, "overloaded", None)
    assert control.limit == 15  # floor(22 x 0.7)
    now = 1.0
    while now < 9.9:
        control.on_load(now, running=12, waiting=0, in_flight=control.limit, demand=True)
        now += PERIOD
    assert control.limit == 21  # grew back, but not to 22
    for _ in range(8):  # after 10 s it may probe again
        now += PERIOD
        control.on_load(now, running=12, waiting=0, in_flight=control.limit, demand=True)
    assert control.limit > 21


def test_a_refusal_caps_the_target_at_half_the_queue_seen() -> None:
    # Told the batch is 96 (it is 12, with an admission queue of 32): the target of 48 is past
    # where the server refuses. The 503 came with a queue of 31 in view: aim at 15 from then on.
    control = metrics(67, capacity=96, queue_share=0.5)
    control.on_load(0.0, running=12, waiting=31, in_flight=67, demand=True)
    assert control.target == 48 and control.queue_cap is None
    control.on_load(0.25, running=12, waiting=28, in_flight=67, demand=True)
    assert control.on_outcome(0.5, "overloaded", None)
    assert control.queue_cap == 15 and control.target == 15
    # A queue of 20 is now over the target: the queue rule cuts (it did not at 48).
    limit = control.limit
    assert control.on_load(3.0, running=12, waiting=20, in_flight=limit, demand=True)
    assert control.limit < limit and control.stats().target_waiting == 15


def test_a_refusal_with_no_queue_in_view_caps_nothing() -> None:
    # TGI refuses past max_concurrent_requests with an empty queue; a queue seen long ago is
    # not where this refusal came from.
    control = metrics(20, capacity=32, queue_share=0.5)
    control.on_load(0.0, running=12, waiting=30, in_flight=20, demand=True)
    control.on_load(5.0, running=12, waiting=0, in_flight=20, demand=True)
    control.on_outcome(5.1, "overloaded", None)
    assert control.queue_cap is None and control.target == 16


def test_the_refused_queue_cap_only_rises() -> None:
    # Every queue seen is at most the admission queue, and gauges lag: the longest queue seen
    # near any refusal is the best lower bound on it.
    control = metrics(40, capacity=96, queue_share=0.5)
    control.on_load(0.0, running=12, waiting=10, in_flight=40, demand=True)
    control.on_outcome(0.1, "overloaded", None)
    assert control.queue_cap == 5
    control.on_load(2.0, running=12, waiting=30, in_flight=20, demand=True)
    control.on_outcome(2.1, "overloaded", None)
    assert control.queue_cap == 15
    control.on_load(5.0, running=12, waiting=4, in_flight=20, demand=True)
    control.on_outcome(5.1, "overloaded", None)
    assert control.queue_cap == 15 and control.target == 15


def test_throughput_mode_learns_no_queue_cap() -> None:
    control = LimitController(start=8, mode="throughput", capacity=12)
    control.on_load(0.0, running=12, waiting=30, in_flight=8, demand=True)
    control.on_outcome(0.1, "overloaded", None)
    assert control.queue_cap is None


@pytest.mark.parametrize("admission", [16, 32])
@pytest.mark.parametrize("told", [96, None], ids=["told-too-big", "unknown"])
def test_closed_loop_stops_hitting_an_admission_queue(told: int | None, admission: int) -> None:
    """A server with a batch of 12 that refuses past a queue of 32 (or 16), a client that
    believes the batch is 96 (target 48) or does not know it. Refusals come early; after the
    warm-up none come against a queue of 32, and against 16 a rare one (the limit probes again
    10 s after a refusal; in 20 seeds at most 12 in 250 periods, about 750 requests). The batch
    stays full."""
    capacity = 12
    control = LimitController(start=67 if told else 5, mode="metrics", capacity=told)
    client = SimClient(0, control, transit=2, learner=None if told else CapacityLearner())
    server = SimServer(capacity, admission=admission)
    trace = simulate(server, [client], PERIODS)
    assert server.refused, "the start was meant to hit the admission queue"
    late = [p for p in server.refused if p >= WARM_UP]
    assert len(late) <= (0 if admission == 32 else 16), late
    assert statistics.mean(trace.running[WARM_UP:]) >= 0.9 * capacity
    assert control.queue_cap is not None and control.queue_cap <= admission // 2


def test_room_in_the_batch_is_at_most_the_batch_seen_while_queued() -> None:
    # Told 96, the server queued with 12 running: a dip to 8 running is room for 4, not 88.
    control = metrics(20, capacity=96, queue_share=0.5, period=1.0)
    control.on_load(0.0, running=12, waiting=3, in_flight=20, demand=True)  # slow start
    assert control.limit == 30
    control.on_load(0.5, running=12, waiting=2, in_flight=30, demand=True)  # queued twice
    assert control.limit == 30  # slow start is over: the server has queued
    assert control.on_load(2.0, running=8, waiting=0, in_flight=14, demand=True)
    target = control.target
    assert target == 48
    assert control.limit == 30 + math.ceil(0.5 * (target + 12 - 8))


# --- a server that reports only its queue (vLLM's load header on each answer) ---------------------


class FrontedServer:
    """An engine behind an API server: admitted requests wait ``transit`` periods, then pass the
    API server at most ``rate`` a period (tokenizing: a flood piles up there, where no gauge
    shows it), then queue for a batch of ``capacity``; each runs 2-6 periods. The client reads
    only the engine's queue, on the answers (none in a period without answers)."""

    def __init__(self, capacity: int, *, rate: int, transit: int = 1, seed: int = 1) -> None:
        self.capacity, self.rate, self.transit = capacity, rate, transit
        self.rng = random.Random(seed)
        self.front: deque[tuple[int, int]] = deque()  # (admitted, reaches the API server)
        self.waiting: deque[int] = deque()  # admitted period of each
        self.running: list[tuple[int, int]] = []  # (admitted, periods left)

    def step(self, period: int) -> list[int]:
        """One period; the admitted periods of the requests answered in it."""
        passed = 0
        while self.front and self.front[0][1] <= period and passed < self.rate:
            self.waiting.append(self.front.popleft()[0])
            passed += 1
        done = [admitted for admitted, left in self.running if left <= 1]
        self.running = [(admitted, left - 1) for admitted, left in self.running if left > 1]
        while self.waiting and len(self.running) < self.capacity:
            self.running.append((self.waiting.popleft(), self.rng.randint(2, 6)))
        return done


def simulate_queue_only(
    server: FrontedServer, control: LimitController, periods: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """One client with unlimited demand; returns per period its limit, the batch running, the
    engine's queue and the requests answered."""
    limits: list[int] = []
    running: list[int] = []
    waiting: list[int] = []
    answered: list[int] = []
    in_flight = 0
    for period in range(periods):
        now = period * PERIOD
        room = max(0, control.limit - in_flight)
        server.front.extend([(period, period + server.transit)] * room)
        in_flight += room
        done = server.step(period)
        in_flight -= len(done)
        for admitted in done:
            control.on_outcome(now, "ok", (period - admitted + 1) * PERIOD)
        if done:
            kv = len(server.running) / 4096  # each running call holds some of the cache
            control.on_load(
                now,
                running=None,
                waiting=len(server.waiting),
                in_flight=in_flight,
                demand=True,
                kv_usage=kv,
            )
        else:
            control.on_idle_period(now, demand=True, in_flight=in_flight)
        limits.append(control.limit)
        running.append(len(server.running))
        waiting.append(len(server.waiting))
        answered.append(len(done))
        assert 1 <= control.limit <= control.ceiling
    return limits, running, waiting, answered


@pytest.mark.parametrize("rate", [1000, 6], ids=["fast-api-server", "slow-api-server"])
@pytest.mark.parametrize("capacity", [8, 32, 256])
def test_queue_only_keeps_the_batch_full_and_the_limit_near_it(capacity: int, rate: int) -> None:
    """With only the engine's queue in view, the batch stays full, the queue's p90 at the
    target and the limit under twice batch + target: behind nginx, a vLLM with a batch of 32
    had its limit run to 1280 while requests piled up in its API server (the estimated batch
    was everything in flight, the target half of it). Measured: the batch 95-100% full, the
    queue's p90 at most 1.03x the target, the limit at most 1.4x batch + target."""
    server = FrontedServer(capacity, rate=max(rate, capacity // 2))
    control = LimitController(start=5, mode="metrics", capacity=None)
    limits, running, waiting, _ = simulate_queue_only(server, control, PERIODS + 200)
    settled = slice(WARM_UP + 100, None)
    assert statistics.mean(running[settled]) >= 0.85 * capacity
    target = target_waiting(capacity, SIM_SHARE, capacity)
    assert max(limits[settled]) <= 2 * (capacity + target)
    assert _p90(waiting[settled]) <= 1.1 * target


def test_queue_only_batch_is_the_smallest_bound_while_queued() -> None:
    batch = _control.QueueOnlyBatch()
    assert batch.running(0.0, in_flight=60, waiting=10) == 50  # one queued reading: no bound
    assert batch.value is None
    assert batch.running(0.25, in_flight=60, waiting=12) == 48
    assert batch.value == 48
    assert batch.running(0.5, in_flight=90, waiting=20) == 48  # the rest is in transit
    assert batch.running(0.75, in_flight=45, waiting=5) == 40  # a smaller bound
    assert batch.value == 40
    assert batch.running(1.0, in_flight=30, waiting=0) == 30  # no queue: room, bound kept
    assert batch.value == 40


def test_queue_only_batch_forgets_old_bounds_and_skips_others_queues() -> None:
    batch = _control.QueueOnlyBatch()
    batch.running(0.0, in_flight=20, waiting=4)
    batch.running(0.25, in_flight=20, waiting=4)
    assert batch.value == 16
    batch.running(40.0, in_flight=50, waiting=10)
    batch.running(40.25, in_flight=50, waiting=10)
    assert batch.value == 40  # the bound of 16 is older than the window
    batch.running(41.0, in_flight=5, waiting=30)  # other clients' queue: says nothing
    batch.running(41.25, in_flight=5, waiting=30)
    assert batch.value == 40


def test_queue_only_holds_the_limit_where_an_api_server_is_the_bottleneck() -> None:
    """An API server that passes 3 requests a period in front of a batch of 32 (that could do
    8): the engine's queue never stands, so only the answers' latency can stop the growth.
    Growing on the estimated batch (everything in flight), every period, took the limit past
    a thousand. A step whose answers slow down as much as it adds calls is undone; growth
    rests 30 s, then probes one step again (and undoes it again). Judged twice before it is
    undone, the second time on both windows together (on the second alone one pass in two
    walked the limit up to 160 here)."""
    server = FrontedServer(32, rate=3)
    control = LimitController(start=5, mode="metrics", capacity=None)
    limits, _, waiting, answered = simulate_queue_only(server, control, PERIODS)
    settled = limits[WARM_UP:]
    assert max(waiting) <= 1
    assert max(limits) <= 160
    assert statistics.median(settled) <= 40  # 3 a period x at most 6 periods each get through
    assert max(settled) <= 80  # a probe one step up at most: it never walks on
    assert statistics.mean(answered[WARM_UP:]) >= 0.9 * 3


def test_queue_only_growth_follows_throughput_not_latency() -> None:
    """A batching server's answers slow down while its throughput still rises: a batch of 256
    with an API server that passes everything. Growth held where answers took twice the
    quickest time stopped at a fraction of the batch (through nginx, a CPU vLLM with a batch
    of 32 held at 20); judged by throughput, the batch is full."""
    server = FrontedServer(256, rate=1000)
    control = LimitController(start=5, mode="metrics", capacity=None)
    _, running, _, _ = simulate_queue_only(server, control, PERIODS)
    assert statistics.mean(running[WARM_UP:]) >= 0.95 * 256


def test_a_step_that_bought_no_throughput_is_undone() -> None:
    control = LimitController(start=20, mode="metrics", capacity=None)
    for k in range(16):  # 20 in flight, 1 s a call
        control.on_outcome(0.1 * k, "ok", 1.0)
    assert control.on_load(2.0, running=None, waiting=0, in_flight=20, demand=True)
    stepped = control.limit
    assert stepped > 20
    for k in range(stepped):  # admitted after the step, each as much slower as the step added
        control.on_outcome(5.0 + 0.01 * k, "ok", stepped / 20)
    assert not control.on_load(6.0, running=None, waiting=0, in_flight=stepped, demand=True)
    assert control.limit == stepped  # found wanting once: judged again on twice the answers
    for k in range(stepped):
        control.on_outcome(7.0 + 0.01 * k, "ok", stepped / 20)
    assert control.on_load(8.0, running=None, waiting=0, in_flight=stepped, demand=True)
    assert control.limit == 20 and "bought no throughput" in control.reason
    assert not control.on_load(12.0, running=None, waiting=0, in_flight=20, demand=True)  # rests


def test_queue_only_growth_waits_for_an_answer_admitted_after_the_last_step() -> None:
    control = LimitController(start=8, mode="metrics", capacity=None)
    control.on_load(0.0, running=None, waiting=0, in_flight=8, demand=True)
    grown = control.limit
    assert grown > 8  # the first step: nothing sent yet to wait for
    for k in range(1, 8):  # answers of calls admitted before the step: no growth
        control.on_outcome(k * PERIOD, "ok", k * PERIOD + 0.1)
        assert not control.on_load(
            k * PERIOD, running=None, waiting=0, in_flight=grown, demand=True
        )
    control.on_outcome(2.0, "ok", 0.5)  # admitted at 1.5, after the step at 0
    assert control.on_load(2.0, running=None, waiting=0, in_flight=grown, demand=True)
    assert control.limit > grown


def test_small_steps_are_judged_once_they_add_up() -> None:
    """A step of a few calls changes the answers' times less than their noise: growth is judged
    once it adds up to 1.25x the last judged limit, against the answers under that limit."""
    control = LimitController(start=40, mode="metrics", capacity=None)
    control._step_from = (40, 1.0)  # as after a judged step to 40: 1 s a unit of work
    control.limit = 44
    for k in range(110):  # slower answers, but 44 / 40 is not worth judging
        control.on_outcome(1.0 + 0.005 * k, "ok", 1.5)
    assert control._step_verdict(2.0) == "grow"
    control.limit = 52  # 1.3x: judged, and 1.5x slower for 1.3x the calls bought nothing
    assert control._step_verdict(2.0) == "undo"


def test_a_step_the_engine_took_is_kept_though_its_answers_slowed() -> None:
    """Answers twice as slow per call after a doubling say it bought nothing; but where the
    engine's KV usage doubled with it, the calls run there (a CPU engine whose steps grow
    with the batch), they do not wait in front of it: the step stays."""
    control = LimitController(start=10, mode="metrics", capacity=None)
    for k in range(16):
        control.on_outcome(0.1 * k, "ok", 1.0)
    control.on_load(2.0, running=None, waiting=0, in_flight=10, demand=True, kv_usage=0.10)
    stepped = control.limit
    assert stepped == 20  # slow start: the header shows no queue
    for k in range(2 * stepped):  # each as much slower as the step added calls
        control.on_outcome(5.0 + 0.01 * k, "ok", stepped / 10)
    control.on_load(6.0, running=None, waiting=0, in_flight=stepped, demand=True, kv_usage=0.19)
    assert control.limit >= stepped and "bought no throughput" not in control.reason

"""The knee finder (dsclient/governor/_knee.py) and the throughput mode of the limit controller,
on a fake clock and on simulated servers of several shapes (tests/sim_blackbox.py)."""

from __future__ import annotations

import math

import pytest

from dsclient.governor._control import THROUGHPUT_CEILING, LimitController
from dsclient.governor._guard import QueueGuard
from dsclient.governor._knee import Epoch, KneeFinder, elasticity

from .sim_blackbox import CPU, GPU, NOISY, REFUSING, Shape, best_fixed, run


def test_elasticity_is_the_log_log_slope_of_throughput_in_the_limit() -> None:
    assert elasticity(Epoch(8, 100.0, 1.0, 16), Epoch(16, 200.0, 1.0, 16)) == pytest.approx(1.0)
    assert elasticity(Epoch(8, 100.0, 1.0, 16), Epoch(16, 100.0, 2.0, 16)) == 0.0
    assert elasticity(Epoch(8, 100.0, 1.0, 16), Epoch(32, 200.0, 1.0, 16)) == pytest.approx(0.5)
    assert elasticity(Epoch(8, 100.0, 1.0, 16), Epoch(8, 300.0, 1.0, 16)) == 0.0


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="start"):
        KneeFinder(start=0, ceiling=8)
    with pytest.raises(ValueError, match="ceiling"):
        KneeFinder(start=8, ceiling=4)
    with pytest.raises(ValueError, match="elasticity"):
        KneeFinder(start=1, ceiling=8, elasticity=1.5)


def _feed(knee: KneeFinder, now: float, limit: int, latency: float, work: float = 10.0) -> None:
    """Completions of requests admitted after ``now - latency`` at this limit."""
    for _ in range(limit):
        knee.on_completion(now, service_s=latency, work=work)


def _epoch(knee: KneeFinder, t: float, latency: float, old: int = 0) -> tuple[float, int | None]:
    """Hold the knee's limit for one epoch: ticks with demand, completions, until it decides.
    ``old``: requests admitted before the epoch, which come back first (in the hold phase the
    epoch counts only after they have)."""
    began = t
    wanted = knee.on_tick(t, demand=True, in_flight=knee.limit)  # drained, if it was not
    for _ in range(old):
        knee.on_completion(t + 0.01, service_s=latency, work=10.0)
    while wanted is None and t < began + 100:
        t += 0.25
        if t - began >= latency:
            _feed(knee, t, max(1, knee.limit // 4), latency)
        wanted = knee.on_tick(t, demand=True, in_flight=knee.limit)
    return t, wanted


def test_slow_start_grows_while_throughput_scales_and_holds_past_the_knee() -> None:
    # Latency flat up to 64 in flight (throughput in proportion), then rising with the limit.
    knee = KneeFinder(start=4, ceiling=1024)
    t = 0.0
    seen = []
    for _ in range(6):
        latency = 1.0 * max(1.0, knee.limit / 64)
        t, wanted = _epoch(knee, t, latency)
        assert wanted is not None
        seen.append(wanted)
        if knee.phase == "hold":
            break
    # x3 an epoch while throughput scales in proportion (e = 1), no further than 2.5x what
    # was in flight (no unqueued time yet), then 2.5x what the server is seen to run
    assert seen[:2] == [10, 25]
    assert knee.phase == "hold"
    assert 64 <= knee.limit <= 96, seen  # past 64 only latency grows: near the knee


def test_an_epoch_without_demand_measures_nothing() -> None:
    knee = KneeFinder(start=8, ceiling=64)
    t = 0.0
    for _ in range(40):
        t += 0.25
        _feed(knee, t, 2, 0.5)
        assert knee.on_tick(t, demand=False, in_flight=2) is None
    assert knee.limit == 8 and knee.last is None


def test_calls_admitted_before_the_window_do_not_count() -> None:
    knee = KneeFinder(start=8, ceiling=64)
    assert knee.on_tick(1.0, demand=True, in_flight=8) is None  # the window opens at 1.0
    knee.on_release(1.1, admitted_at=0.5, service_s=0.6, work=10)  # admitted before it
    assert knee._returned == 0 and knee._latencies == []
    knee.on_release(1.2, admitted_at=1.05, service_s=0.15, work=10)  # admitted in it
    assert knee._returned == 1 and len(knee._latencies) == 1


def test_an_epoch_waits_for_the_last_call_of_its_cohort() -> None:
    """The quickest answers come back first; closing the epoch on them read a flat server as
    elastic. The epoch ends only when every call admitted in its window has come back."""
    knee = KneeFinder(start=8, ceiling=64)
    knee.on_tick(0.0, demand=True, in_flight=8)  # window opens
    # 8 calls admitted in the window (8 released and replaced: still 8 in flight)
    for i in range(8):
        knee.on_release(0.1 + i / 100, admitted_at=-1.0, service_s=1.1, work=10)
    assert knee.on_tick(0.25, demand=True, in_flight=8) is None  # window closes: cohort of 8
    assert knee._cohort == 8
    for i in range(7):  # seven quick ones come back
        knee.on_release(0.5, admitted_at=0.1 + i / 100, service_s=0.4, work=10)
    assert knee.on_tick(0.75, demand=True, in_flight=8) is None and knee.last is None
    knee.on_release(3.0, admitted_at=0.17, service_s=2.83, work=10)  # the slow one
    knee.on_tick(3.25, demand=True, in_flight=8)
    assert knee.last is not None and knee.last.samples == 8
    # Little's law over the whole cohort: 8 in flight x 80 work / (7 x 0.4 + 2.83) s
    assert knee.last.throughput == pytest.approx(8 * 80 / (7 * 0.4 + 2.83))


def test_after_a_cut_counting_waits_for_the_drain() -> None:
    knee = KneeFinder(start=16, ceiling=64)
    knee.restart(0.0, 8, "the server refused for load")
    assert knee.phase == "hold"
    assert knee.on_tick(0.25, demand=True, in_flight=16) is None
    knee.on_release(0.5, admitted_at=0.3, service_s=0.2, work=10)
    assert knee._stage == "drain" and knee._returned == 0  # still 16 in flight against 8
    knee.on_tick(2.25, demand=True, in_flight=8)  # drained: the window opens here
    assert knee._stage == "open" and knee._a == 2.25


def test_hold_keeps_a_step_up_that_buys_throughput_and_drops_one_that_does_not() -> None:
    # A queue guard that aims at a whole batch of queue: this test is about the knee's own
    # probes, which the guard would otherwise hold to 40 + 16 on answers this even.
    knee = KneeFinder(start=40, ceiling=1024, guard=QueueGuard(queue_share=1.0))
    knee.restart(0.0, 40, "start in hold")
    t, wanted = _epoch(knee, 0.0, 1.0, old=40)  # base at 40
    assert wanted == 60
    t, wanted = _epoch(knee, t, 1.0, old=40)  # 60 at the same latency: 1.5x the throughput
    assert wanted == 90 and "bought throughput" in knee.reason
    t, wanted = _epoch(knee, t, 90 / 60, old=60)  # 90 only queues: latency grows with it
    assert wanted == 40  # one step below the base of 60
    t, wanted = _epoch(knee, t, 1.0, old=40)  # 40 loses throughput against 60: back to 60
    assert wanted == 60 and "held at 60" in knee.reason


@pytest.mark.parametrize(
    ("shape", "n", "low", "high", "most_refused"),
    [
        (GPU, 3000, 200, 800, 0),  # throughput rises to a batch of 256
        (CPU, 600, 6, 40, 0),  # flat past 8 sequences
        # 503 past 40 waiting + running: probes may pass it, and a refusal cuts back
        (REFUSING, 1500, 10, 48, 80),
        (NOISY, 3000, 200, 800, 0),
    ],
    ids=["gpu-like", "cpu-like", "refusing", "noisy"],
)
def test_simulated_servers_end_near_their_knee_at_full_speed(
    shape: object, n: int, low: int, high: int, most_refused: int
) -> None:
    control = LimitController(start=5, mode="throughput")
    outcome = run(control, shape, n=n)  # type: ignore[arg-type]
    assert outcome.done == n
    assert low <= control.limit <= high, outcome.limits
    assert outcome.refused <= most_refused
    # Where the unbounded client is at its best (the simulated queue costs nothing), the
    # governed client is not far behind: the ramp from 5 is what it costs. It is slower than
    # it was (1.4x): slow start grows at most 2.5x what the server is seen to run an epoch,
    # and each epoch waits for the last call of its cohort (see dsclient/governor/_knee.py).
    unbounded = best_fixed(shape, n=n)  # type: ignore[arg-type]
    assert outcome.makespan <= 1.6 * unbounded, (outcome.makespan, unbounded)


def test_a_cpu_like_server_keeps_a_short_queue_once_the_knee_is_found() -> None:
    control = LimitController(start=5, mode="throughput")
    outcome = run(control, CPU, n=1200)
    late = [limit for t, limit in outcome.limits if t > outcome.makespan / 2]
    # Batch 8: late on the limit sits under twice that; a probe up that noise made look worth
    # it may reach three times, once, and comes back.
    assert late and late[-1] <= 16, outcome.limits  # where it settles
    assert max(late) <= 24 and sum(limit > 16 for limit in late) <= 3, outcome.limits


def test_slow_start_recounts_when_a_rise_makes_the_server_queue() -> None:
    """A server whose throughput falls past a batch of 32 (each waiting request slows every
    step): counting the first answers of a rise's requests, which had only the old limit ahead
    of them at the server, read 80 -> 160 as a gain (makespan 1.45-1.97x the best fixed
    limit's); recounting from the first slow answer holds it near 32 (1.19-1.25x)."""
    shape = Shape(batch=32, step_s=lambda b: 0.02 + 0.0005 * b, queue_cost=0.0005)
    control = LimitController(start=5, mode="throughput")
    outcome = run(control, shape, n=1000)
    # x3 steps while throughput scales in proportion: at most three batches in flight (two
    # waiting), from 30 (a batch of 32 not yet full) to 90.
    assert max(limit for _, limit in outcome.limits) <= 96, outcome.limits
    best = run(LimitController(start=32, mode="fixed"), shape, n=1000).makespan
    # 1.35x, not 1.3x: the epoch at 90 now waits for the last call of its cohort (about 17 s
    # on this slow server) before the guard cuts it.
    assert outcome.makespan <= 1.35 * best, (outcome.makespan, best)


def test_throughput_mode_bounds_and_stats() -> None:
    control = LimitController(start=5, mode="throughput", capacity=8)
    assert control.ceiling == THROUGHPUT_CEILING
    assert LimitController(start=5, mode="throughput", capacity=512).ceiling == 2048
    assert LimitController(start=5, mode="throughput", ceiling=64).ceiling == 64
    stats = control.stats()
    assert stats.mode == "throughput" and stats.signal == "throughput"
    assert stats.knee_phase == "slow start" and stats.throughput is None
    assert LimitController(start=5, mode="fixed").stats().signal == "fixed"


def test_a_refusal_cuts_and_the_knee_measures_from_the_cut() -> None:
    control = LimitController(start=20, mode="throughput", cooldown=1.0)
    assert control.on_outcome(1.0, "overloaded", 0.1)
    assert control.limit == math.floor(20 * 0.7)
    knee = control.knee
    assert knee is not None and knee.phase == "hold" and knee.limit == control.limit


def test_growth_waits_for_the_cooldown_after_a_cut_and_stays_under_the_refused_limit() -> None:
    control = LimitController(start=20, mode="throughput", cooldown=1.0)
    control.on_outcome(0.0, "overloaded", 0.1)  # 20 -> 14, refused at 20
    knee = control.knee
    assert knee is not None
    t = 0.0
    for _ in range(200):
        t += 0.25
        for _ in range(4):
            control.on_outcome(t, "ok", 0.2, work=10)
        control.on_idle_period(t, demand=True, in_flight=control.limit)
        assert control.limit <= 19 or t >= 10.0  # under the refused limit for 10 s


#: A server whose calls slow as its batch fills, as transformers' server does on a CPU (measured
#: on this project's machine: x1.3 throughput from 4 to 8 in flight, x1.2 from 8 to 16, each call
#: 2.1x as long at 8 as at 2): here elasticity 0.5 from 2 to 4, 0.35 to 8, 0.2 to 16.
SLOWING = Shape(batch=64, step_s=lambda b: 0.03 + 0.01 * b)


def test_a_server_whose_calls_slow_as_its_batch_fills_is_not_cut_under_what_steps_bought() -> None:
    """Where each call takes longer the fuller the batch, the limit ends near the best fixed
    limit's makespan: the guard does not cut under what the steps up showed the server runs."""
    control = LimitController(start=1, mode="throughput")
    outcome = run(control, SLOWING, n=1000, tokens=16)
    fixed = {
        limit: run(LimitController(start=limit, mode="fixed"), SLOWING, n=1000, tokens=16).makespan
        for limit in (8, 16, 32)
    }
    late = [limit for t, limit in outcome.limits if t > outcome.makespan / 2]
    assert late and min(late) >= 8, outcome.limits
    assert outcome.makespan <= 1.2 * min(fixed.values()), (outcome.makespan, fixed)


#: transformers' server on this project's machine, fitted to a sweep of fixed concurrency (the
#: client on one core, the server on the other; 16 tokens a call): throughput x1.7 from 1 to 2
#: in flight, x3-4 at 8, x4.4-5.2 at 16, the most at 16-24, and less past 32 (each step of
#: the batch costs 17% more a sequence, and more again beyond).
TRANSFORMERS = Shape(
    batch=1024, step_s=lambda b: 0.0035 * (1 + 0.17 * (b - 1) + 0.002 * (b - 1) ** 2)
)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_a_server_whose_best_is_far_past_littles_count_is_reached_within_the_batch(
    noise: float,
) -> None:
    """On the shape of transformers' server, Little's count (the unqueued time at 1 in flight)
    reads 8 running as 5, 12 as 7. Slow start ended at 6 there (a step of one more call, too
    small to judge), and the first probe past the guard waited 30 s: 1.34x the best fixed
    limit without noise (1.26x on average with noisy steps). Steps an epoch can judge, x2
    after a step that bought in proportion, and the first probe past the guard after the
    rest bring it to 1.14x (1.17x on average with noise): the issue's goal is 1.1x."""
    shape = Shape(batch=1024, step_s=TRANSFORMERS.step_s, noise=noise)
    best = min(
        run(LimitController(start=limit, mode="fixed"), shape, n=1000, tokens=16).makespan
        for limit in (8, 12, 16, 24, 32)
    )
    ratios = [
        run(
            LimitController(start=1, mode="throughput"), shape, n=1000, tokens=16, seed=seed
        ).makespan
        / best
        for seed in range(1, 7)
    ]
    assert max(ratios) <= (1.2 if noise == 0 else 1.3), ratios
    assert sum(ratios) / len(ratios) <= 1.2, ratios


def test_a_probe_down_from_a_stated_batch_comes_back_and_never_ratchets_down() -> None:
    """A server of 8 seats that states its batch: where the guard's cap leaves no room to probe
    up (batch plus target queue), the knee probes down; a step down that lost throughput goes
    back to its base, though the cap counted at the lower limit (all running, a small target)
    is under it. That cap once held each return, and the limit fell 12 -> 8 -> 5 -> 3 -> 1."""
    seats = Shape(batch=8, step_s=lambda b: 0.01)
    control = LimitController(start=5, mode="throughput", capacity=8)
    outcome = run(control, seats, n=3000, tokens=16)
    late = [limit for t, limit in outcome.limits if t > outcome.makespan / 4]
    assert late and min(late) >= 5 and late[-1] >= 8, outcome.limits
    # The batch plus half of it, but for a probe past it each 30 s or more (replicas behind
    # one URL would show there).
    assert sum(limit > 12 for limit in late) <= 2, outcome.limits
    assert outcome.makespan <= 1.1 * best_fixed(seats, n=3000, tokens=16), outcome.limits


def test_a_probe_down_that_lost_throughput_returns_to_its_base_past_the_lower_cap() -> None:
    """The cap counted at the lower limit (8 running, a target of 4, aimed at 3: 11) is under
    the base (12, the stated batch plus its target): the return goes to the base all the same."""
    knee = KneeFinder(start=8, ceiling=64, guard=QueueGuard(batch=8))
    knee.phase = "hold"
    base = Epoch(12, 800.0, 0.16, 24, per_work=0.016, in_flight=12.0)
    knee._pending = ("down", base)
    _, wanted = _epoch(knee, 0.0, latency=0.16)  # 8 in flight: 500 tokens/s, e = 1.16
    assert knee.guard.cap(room=False) == 11
    assert wanted == 12 and knee.limit == 12, knee.reason
    assert knee.reason.startswith("held at 12")


def test_a_probe_down_that_loses_nothing_takes_back_what_a_step_proved() -> None:
    guard = QueueGuard()
    guard.disprove(8.0)
    assert guard.proven is None  # nothing proved: nothing to take back
    guard.observe(limit=8, in_flight=8.0, throughput=80.0, per_work=0.1)
    guard.observe(limit=12, in_flight=12.0, throughput=110.0, per_work=0.1, step_from=(8.0, 80.0))
    assert guard.proven == pytest.approx(11.0)
    guard.disprove(9.0)
    assert guard.proven == pytest.approx(9.0)
    guard.disprove(10.0)
    assert guard.proven == pytest.approx(9.0)  # never raised by a take-back


def test_the_first_epoch_does_not_wait_for_a_long_call_of_its_cohort() -> None:
    """Slow start's first epoch decides nothing by its figure (x3, or what the server states):
    it closes once enough of its cohort came back. Waiting for the last one held a batch of
    8- and 300-token items at 0.7 x a stated batch of 16 for 7.8 s, behind one long call."""
    knee = KneeFinder(start=11, ceiling=64, guard=QueueGuard(batch=16))
    assert knee.on_tick(0.0, demand=True, in_flight=11) is None  # the window opens
    for _ in range(10):  # calls admitted before the window: counted as released, not measured
        knee.on_release(0.2, admitted_at=-1.0, service_s=1.2, work=8)
    assert knee.on_tick(0.5, demand=True, in_flight=11) is None  # a cohort of 10 admitted
    for _ in range(9):  # nine of them are short; the tenth asks 300 tokens and is still out
        knee.on_release(0.6, admitted_at=0.3, service_s=0.3, work=8)
    assert knee.on_tick(0.75, demand=True, in_flight=11) == 24  # the batch plus its target
    assert knee.reason == "slow start ends at what the server states: limit -> 24"
    # Later epochs wait for the whole cohort, as before (see the module docstring).
    later = KneeFinder(start=11, ceiling=64, guard=QueueGuard(batch=16))
    later.last = Epoch(4, 100.0, 0.3, 8)
    later.on_tick(0.0, demand=True, in_flight=11)
    for _ in range(10):
        later.on_release(0.2, admitted_at=-1.0, service_s=1.2, work=8)
    later.on_tick(0.5, demand=True, in_flight=11)
    for _ in range(9):
        later.on_release(0.6, admitted_at=0.3, service_s=0.3, work=8)
    assert later.on_tick(0.75, demand=True, in_flight=11) is None


def test_the_first_epoch_under_a_stated_batch_closes_on_its_first_answer() -> None:
    """Where slow start's next limit is the batch the server states anyway (0.7 x 16 = 11, and
    x3 passes 16 + its target), the first epoch only shows that the server answers: one answer
    of its cohort closes it. Waiting for eight held a batch's long items at 11 of 16 seats for
    1.3 s (3.5% of its makespan). Elsewhere the first epoch counts as many as before."""

    def first_epoch(knee: KneeFinder) -> int | None:
        assert knee.on_tick(0.0, demand=True, in_flight=11) is None  # the window opens
        knee.on_release(0.1, admitted_at=-1.0, service_s=0.1, work=8)  # before the window
        assert knee.on_tick(0.12, demand=True, in_flight=11) is None  # one admitted in it
        knee.on_release(0.25, admitted_at=0.11, service_s=0.14, work=8)  # its answer
        return knee.on_tick(0.27, demand=True, in_flight=11)

    stated = KneeFinder(start=11, ceiling=64, guard=QueueGuard(batch=16))
    assert first_epoch(stated) == 24
    assert stated.reason == "slow start ends at what the server states: limit -> 24"
    unknown = KneeFinder(start=11, ceiling=64)  # nothing stated: x3 is judged later
    assert first_epoch(unknown) is None and unknown.limit == 11
    large = KneeFinder(start=11, ceiling=64, guard=QueueGuard(batch=64))  # x3 stays under it
    assert first_epoch(large) is None and large.limit == 11


def _held(
    knee: KneeFinder, t: float, latency: float, until: float = 30.0
) -> tuple[float, int | None]:
    """The knee's limit held full, ``knee.limit / latency`` answers a second, till it decides
    (or ``until`` seconds passed): epochs of many answers, as on a real server."""
    began = t
    wanted = knee.on_tick(t, demand=True, in_flight=knee.limit)
    while wanted is None and t < began + until:
        for _ in range(round(0.25 * knee.limit / latency)):
            knee.on_completion(t + 0.25, service_s=latency, work=10.0)
        t += 0.25
        wanted = knee.on_tick(t, demand=True, in_flight=knee.limit)
    return t, wanted


def test_a_strong_step_from_one_call_does_not_double_past_what_the_server_is_seen_to_run() -> None:
    """One call at a time leaves the server idle for each round trip: any server gains from a
    second call. llama.cpp's server of one seat, with the client's cores busy, read 1 -> 2 as
    x1.45 (e 0.54), and slow start's x2 after a step in proportion went to 4: three calls
    waiting behind one, for the rest of a short batch. From 2 it goes no further than 2.5x
    what Little's count sees running (1.45 of 2): 3."""
    knee = KneeFinder(start=1, ceiling=1024)
    t, wanted = _held(knee, 0.0, latency=0.05)
    assert wanted == 2, knee.reason
    t, wanted = _held(knee, t, latency=0.069)  # 2 in flight: x1.45 the throughput at 1
    assert knee.reason.startswith("slow start: throughput x1.45"), knee.reason
    assert knee.guard.seen_running() == pytest.approx(1.45, abs=0.01)
    assert wanted == 3, knee.reason


def test_the_first_epoch_after_a_rise_of_hundreds_of_calls_is_measured_again() -> None:
    """A rise of hundreds of calls opens as many connections, and the calls admitted meanwhile
    on the connections answers freed reach the server first: their cohort read 282 -> 553 on
    a server of 256 seats as x1.96, and the limit stood at 553 for half a batch. The first
    epoch after such a rise decides nothing; the second, its queue steady, does."""
    knee = KneeFinder(start=140, ceiling=1024)
    t, wanted = _held(knee, 0.0, latency=0.5)  # the server runs all 140
    assert wanted == 280 and knee.phase == "slow start", knee.reason
    t, wanted = _held(knee, t, latency=0.5, until=1.0)  # x2: what the first cohort reads
    assert wanted is None and knee.limit == 280, knee.reason
    assert knee.reason == "measuring 280 again: the first epoch after a rise"
    t, wanted = _held(knee, t, latency=1.0)  # the steady queue: flat, the server runs 140
    assert knee.phase == "hold" and wanted is not None and wanted < 280, knee.reason
    assert knee.last is not None and knee.last.throughput == pytest.approx(2800, rel=0.05)


def test_the_guard_cuts_no_limit_the_client_left_part_empty_with_no_queue_over_target() -> None:
    """An epoch whose client kept 6 of a limit of 9 in flight, all running: its cap (6 running,
    a target of 3, aimed at 2: 8) is under the limit, but the queue at the limit (9 - 6 = 3) is
    within the target. No cut: cut after cut, a stated batch of 8 fell to 2 in the simulation."""
    knee = KneeFinder(start=9, ceiling=64)
    knee.guard.observe(limit=1, in_flight=1.0, throughput=10 / 0.6, per_work=0.06)  # s0
    knee.phase, knee._rest = "hold", 5
    assert knee.on_tick(0.0, demand=True, in_flight=6) is None  # the window opens
    for _ in range(16):  # admitted before the window
        knee.on_release(0.1, admitted_at=-1.0, service_s=0.6, work=10)
    assert knee.on_tick(0.25, demand=True, in_flight=6) is None
    for _ in range(16):  # the cohort: 100 tokens/s at 6 in flight, as 6 unqueued calls make
        knee.on_release(0.7, admitted_at=0.1, service_s=0.6, work=10)
    assert knee.on_tick(0.75, demand=True, in_flight=6) is None
    assert knee.guard.cap(room=False) == 8 and knee.limit == 9, knee.reason

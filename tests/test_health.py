"""Reachability: calls wait while a server does not answer; one of them probes."""

from __future__ import annotations

import logging
import random

import anyio
import pytest

import dsclient
from dsclient.governor._health import Reachability

pytestmark = pytest.mark.anyio


class Script:
    """A probe that answers from a list (the last answer repeats) and counts its calls."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = answers
        self.calls = 0

    async def __call__(self) -> bool:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        await anyio.sleep(0)
        return answer


def reach(probe, **kw) -> tuple[Reachability, list[float]]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await anyio.sleep(0)

    return Reachability(probe, sleep=sleep, rng=random.Random(0), **kw), slept


async def test_up_costs_nothing():
    probe = Script([True])
    r, slept = reach(probe)
    await r.wait_up()
    assert probe.calls == 0 and slept == [] and r.outages == 0


async def test_down_probes_with_jittered_doubling_backoff_until_it_answers():
    probe = Script([False] * 6 + [True])
    r, slept = reach(probe, first=0.25, cap=2.0)
    r.mark_down("connection refused")
    await r.wait_up()
    assert not r.down and probe.calls == 7 and r.probes == 7
    ceilings = [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert len(slept) == 6
    assert all(c / 2 <= s <= c for s, c in zip(slept, ceilings)), slept


async def test_many_waiters_one_prober():
    probe = Script([False] * 3 + [True])
    r, _ = reach(probe)
    r.mark_down("refused")
    through: list[int] = []

    async def call(i: int) -> None:
        await r.wait_up()
        through.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(call, i)
    assert sorted(through) == list(range(20))
    assert probe.calls == 4  # not 20 x 4


async def test_a_success_elsewhere_lets_the_waiters_through():
    never = Script([False])
    r, _ = reach(never)
    r.mark_down("refused")
    through: list[int] = []

    async def call(i: int) -> None:
        await r.wait_up()
        through.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(call, i)
        for _ in range(10):
            await anyio.sleep(0)
        assert through == []
        r.mark_up()  # an attempt got an answer
    assert sorted(through) == [0, 1, 2]


async def test_a_cancelled_prober_hands_over_to_the_next_waiter():
    probe = Script([False] * 5 + [True])
    r, _ = reach(probe)
    r.mark_down("refused")
    results: list[str] = []

    async def impatient() -> None:
        with anyio.move_on_after(0) as scope:  # cancelled at its first checkpoint
            await r.wait_up()
        results.append("cancelled" if scope.cancelled_caught else "through")

    async def patient() -> None:
        await r.wait_up()
        results.append("through")

    async with anyio.create_task_group() as tg:
        tg.start_soon(impatient)
        tg.start_soon(patient)
    assert sorted(results) == ["cancelled", "through"]
    assert not r.down


async def test_outages_are_counted_timed_and_logged(caplog):
    caplog.set_level(logging.WARNING, logger="dsclient")
    now = [100.0]
    r = Reachability(Script([True]), clock=lambda: now[0], label="http://srv")
    r.mark_down("connection refused")
    r.mark_down("again")  # already down: one outage
    now[0] = 142.5
    await r.wait_up()
    assert r.outages == 1 and r.last_outage_s == 42.5 and "up" in repr(r)
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("http://srv does not answer (connection refused)" in m for m in messages)
    assert any("answers again after 42.5 s" in m for m in messages)


def test_bad_backoff_is_refused():
    with pytest.raises(ValueError, match="first <= cap"):
        Reachability(Script([True]), first=3.0, cap=2.0)


def test_construction_needs_no_event_loop():
    r = Reachability(Script([True]))
    r.mark_down("x")
    assert r.down


async def test_past_max_wait_waiting_calls_fail_and_later_ones_probe_once():
    probe = Script([False])
    r, slept = reach(probe, first=1.0, cap=2.0, max_wait=10.0)
    r.mark_down("refused")
    errors: list[str] = []

    async def call() -> None:
        try:
            await r.wait_up()
        except Exception as exc:
            errors.append(type(exc).__name__ + ": " + str(exc))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(call)
    assert len(errors) == 3 and all(e.startswith("ConnectionError") for e in errors)
    assert "has not answered for" in errors[0] and r.given_up
    assert 10.0 <= sum(slept) < 12.0
    calls = probe.calls
    await call()  # a later call: one probe, then fails at once
    assert probe.calls == calls + 1 and len(errors) == 4
    probe.answers = [True]
    await r.wait_up()  # the server is back: the next call's probe finds it
    assert not r.down and not r.given_up


def test_max_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_wait"):
        Reachability(Script([True]), max_wait=0)


# --- a server that never answered (issue 45: a typo'd port waited 301 s) ----------------------
async def test_a_server_that_never_answered_fails_after_first_wait_with_what_was_wrong():
    probe = Script([False])
    r, slept = reach(probe, first=0.25, cap=2.0, max_wait=300.0, first_wait=5.0)
    r.unreachable("nothing listens on 127.0.0.1:8001 (connection refused)")
    r.mark_down("could not talk to the server (ConnectError)")
    with pytest.raises(ConnectionError) as info:
        await r.wait_up()
    message = str(info.value)
    assert "has not answered since the client started" in message
    assert "nothing listens on 127.0.0.1:8001 (connection refused)" in message
    assert 5.0 <= sum(slept) < 7.0  # seconds, not max_wait's five minutes
    assert isinstance(info.value, dsclient.ConnectionError)


async def test_a_server_that_answered_before_is_waited_for_through_an_outage():
    probe = Script([False] * 12 + [True])
    r, slept = reach(probe, first=0.25, cap=2.0, max_wait=300.0, first_wait=5.0)
    r.answered()  # discovery, or a call, got an answer
    r.mark_down("connection refused")
    await r.wait_up()
    assert not r.down and sum(slept) > 5.0  # past first_wait, within max_wait


async def test_an_answer_turns_first_wait_into_max_wait():
    probe = Script([False] * 3 + [True] + [False] * 12 + [True])
    r, slept = reach(probe, first=0.25, cap=2.0, max_wait=300.0, first_wait=5.0)
    r.mark_down("refused")
    await r.wait_up()  # the server came up within first_wait: it has answered now
    assert r.has_answered
    slept.clear()
    r.mark_down("refused")
    await r.wait_up()
    assert not r.down and sum(slept) > 5.0


def test_first_wait_must_be_positive():
    with pytest.raises(ValueError, match="first_wait"):
        Reachability(Script([True]), first_wait=0)

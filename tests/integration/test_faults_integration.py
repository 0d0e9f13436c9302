"""generate, chat, stream and map through a fault-injecting proxy in front of the real vLLM.

Every call ends in a result or in its typed dsclient error within its timeout, the governor gets
every slot back (in flight and waiting back to 0), the limit is left where it was (or, after a
burst of 503s, grows back off the cut), and ``map(output=...)`` writes every item exactly once,
its failures completed by a resume once the fault is gone.

The proxy (tests/integration/faultproxy.py) faults only the generation endpoints, so discovery
and the /metrics poller see the server as it is. Calls ask for a handful of tokens, and stalls
run against short per-call timeouts, so the file stays well under two minutes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import dsclient
from dsclient import (
    AsyncClient,
    ChatResult,
    CompletionResult,
    ConnectionError,
    MalformedResponse,
    Overloaded,
    Retry,
    TimeoutError,
)
from tests.integration.faultproxy import (
    Drop,
    FaultProxy,
    Garbage,
    GarbageBody,
    Latency,
    Reset,
    Stall,
    Status,
    Truncate,
)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

#: The server's batch (tests/conftest.py), told to the client: its URL is the proxy's, which no
#: launch record names. The limit starts at floor(0.7 x 8) = 5.
MAX_NUM_SEQS = 8
START_LIMIT = 5
#: Fast retries: the point is where calls end, not how long backoff waits.
FAST = Retry(base=0.05, cap=0.5)
#: Tokens per call: enough for a stream of several events, few enough to be quick on the CPU.
TOKENS = 6
CHAT = [{"role": "user", "content": "Say something"}]
#: A guard against hangs around calls whose own timeout is a few seconds; never a measurement.
GUARD_S = 60


@pytest.fixture
def proxy(vllm_server) -> Iterator[FaultProxy]:
    with FaultProxy(vllm_server.url) as running:
        yield running


def make_client(proxy: FaultProxy, **kwargs: object) -> AsyncClient:
    kwargs.setdefault("retry", FAST)
    kwargs.setdefault("timeout", 30)
    kwargs.setdefault("rng", random.Random(0))
    return AsyncClient(proxy.url, max_num_seqs=MAX_NUM_SEQS, **kwargs)  # type: ignore[arg-type]


def assert_drained(client: AsyncClient) -> None:
    """No capacity leaked: nothing in flight or waiting, in either lane."""
    stats = client.stats()
    assert (stats.in_flight, stats.waiting) == (0, 0), stats
    assert all((lane.in_flight, lane.waiting) == (0, 0) for lane in stats.lanes.values()), stats


async def generate(client: AsyncClient, **kwargs: object) -> CompletionResult:
    with anyio.fail_after(GUARD_S):
        return await client.generate("Once upon a time", max_tokens=TOKENS, **kwargs)  # type: ignore[arg-type]


async def chat(client: AsyncClient, **kwargs: object) -> ChatResult:
    with anyio.fail_after(GUARD_S):
        return await client.chat(CHAT, max_tokens=TOKENS, **kwargs)  # type: ignore[arg-type]


async def stream(client: AsyncClient, deltas: list[str] | None = None, **kwargs: object) -> str:
    """Read a whole stream (``deltas`` collects what came, should it fail); returns its text."""
    got = deltas if deltas is not None else []
    with anyio.fail_after(GUARD_S):
        async with client.stream(
            "Once upon a time",
            max_tokens=TOKENS,
            ignore_eos=True,
            **kwargs,  # type: ignore[arg-type]
        ) as s:
            async for delta in s:
                got.append(delta)
    assert s.finish_reason == "length"
    return s.text


async def still_serves(client: AsyncClient) -> None:
    """The client works as before once the faults are gone, and holds no slot."""
    assert (await generate(client)).attempts == 1
    assert (await chat(client)).attempts == 1
    await stream(client)
    assert_drained(client)


# -- one call at a time, through each fault ------------------------------------------------------
async def test_latency_delays_calls_and_a_longer_one_times_out(proxy):
    async with make_client(proxy) as client:
        proxy.inject(Latency(0.3), times=3)
        assert (await generate(client)).attempts == 1
        assert (await chat(client)).attempts == 1
        await stream(client)
        assert proxy.fired == {"latency": 3}

        proxy.inject(Latency(5.0), times=3)
        with pytest.raises(TimeoutError):
            await generate(client, timeout=1.0)
        with pytest.raises(TimeoutError):
            await chat(client, timeout=1.0)
        with pytest.raises(TimeoutError):
            await stream(client, timeout=1.0)
        assert proxy.pending == 0
        assert_drained(client)
        assert client.limit == START_LIMIT
        await still_serves(client)


async def test_a_call_allowed_longer_than_the_client_timeout_gets_its_time(proxy):
    """A per-call timeout overrides the client's: the client's must not cut each attempt short
    (it did: every attempt of a slow call timed out, and the call failed after its retries)."""
    async with make_client(proxy, timeout=0.5) as client:
        proxy.inject(Latency(1.0), times=3)
        assert (await generate(client, timeout=20)).attempts == 1
        assert (await chat(client, timeout=None)).attempts == 1
        await stream(client, timeout=20)
        assert proxy.fired == {"latency": 3}
        assert_drained(client)


@pytest.mark.parametrize(
    "fault",
    [Truncate(), Truncate(after_bytes=0), Drop(), Drop(after_bytes=3), Reset(), Garbage()],
    ids=["truncate-half", "truncate-headers-only", "drop-half", "drop-early", "reset", "garbage"],
)
async def test_a_broken_answer_is_retried(proxy, fault):
    """A body cut short, a reset or bytes that are not HTTP: a ConnectionError, retried, so the
    call succeeds on its second attempt; a stream that failed before its first byte likewise.
    A reset before any byte on a *reused* connection is what a server's keep-alive close looks
    like: the wire sends the request again at once on a fresh connection, outside the retry
    budget (issue 42), so that call succeeds on its first attempt."""
    # A reset reaches the retry loop only where its connection was a fresh one.
    attempts = {1, 2} if isinstance(fault, Reset) else {2}
    async with make_client(proxy) as client:
        proxy.inject(fault)
        assert (await generate(client)).attempts in attempts
        proxy.inject(fault)
        assert (await chat(client)).attempts in attempts
        assert proxy.fired == {fault.name: 2}
        if isinstance(fault, (Reset, Garbage)):
            proxy.inject(fault)  # nothing of the stream arrives: it is retried too
            await stream(client)
            assert proxy.fired == {fault.name: 3}
        assert_drained(client)
        assert client.limit == START_LIMIT
        await still_serves(client)


async def test_a_broken_answer_that_persists_is_a_connection_error(proxy):
    retry = Retry(attempts=3, base=0.05, cap=0.5)
    async with make_client(proxy, retry=retry) as client:
        proxy.inject(Drop(), times=None)
        with pytest.raises(ConnectionError) as info:
            await generate(client)
        assert info.value.attempts == 3
        with pytest.raises(ConnectionError):
            await chat(client)
        proxy.clear()
        assert proxy.fired == {"drop": 6}
        assert_drained(client)
        assert client.limit == START_LIMIT
        await still_serves(client)


@pytest.mark.parametrize(
    "fault",
    [Truncate(), Truncate(after_bytes=0), Truncate(after_bytes=10), Drop()],
    ids=["truncate-after-first-event", "truncate-after-headers", "truncate-mid-chunk", "drop"],
)
async def test_a_stream_cut_mid_body_is_a_connection_error(proxy, fault):
    """Once a stream has received bytes it is not retried: the caller sees a ConnectionError
    after the deltas that came, and the slot goes back."""
    async with make_client(proxy) as client:
        proxy.inject(fault)
        deltas: list[str] = []
        with pytest.raises(ConnectionError):
            await stream(client, deltas)
        assert proxy.fired == {fault.name: 1}
        assert len(deltas) <= 1
        assert_drained(client)
        assert client.limit == START_LIMIT
        await still_serves(client)


@pytest.mark.parametrize(
    "fault",
    [Stall(before_headers=True), Stall(), Stall(after_bytes=None), Stall(trickle=0.05)],
    ids=["before-headers", "after-headers", "after-half-or-first-event", "trickle"],
)
async def test_a_stalled_answer_times_out_within_the_call_timeout(proxy, fault):
    """The server goes silent, or trickles a byte at a time: each kind of call ends in
    TimeoutError within its own timeout, however far the answer got, on a client that has no
    timeout of its own (nothing else would end the call)."""
    async with make_client(proxy, timeout=None) as client:
        proxy.inject(fault, times=3)
        with pytest.raises(TimeoutError):
            await generate(client, timeout=1.5)
        with pytest.raises(TimeoutError):
            await chat(client, timeout=1.5)
        with pytest.raises(TimeoutError):
            await stream(client, timeout=1.5)
        assert proxy.fired == {"stall": 3}
        assert_drained(client)
        assert client.limit == START_LIMIT
        await still_serves(client)


async def test_an_answer_that_is_not_json_is_malformed_and_not_retried(proxy):
    async with make_client(proxy) as client:
        proxy.inject(GarbageBody(), times=3)
        with pytest.raises(MalformedResponse) as info:
            await generate(client)
        assert info.value.attempts == 1
        with pytest.raises(MalformedResponse):
            await chat(client)
        with pytest.raises(MalformedResponse, match="not JSON"):
            await stream(client)
        assert proxy.fired == {"garbage_body": 3}
        assert_drained(client)
        assert client.limit == START_LIMIT
        await still_serves(client)


class RecordingSleep:
    """Sleeps for real and records each wait."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await anyio.sleep(seconds)


async def test_bursts_of_503_and_429_are_waited_out(proxy):
    """503s without Retry-After back off with jitter; 429s with Retry-After wait what they say;
    a refusal cuts the limit, and a burst longer than the tries allowed ends in Overloaded."""
    sleep = RecordingSleep()
    async with make_client(proxy, sleep=sleep) as client:
        proxy.inject(Status(503), times=3)
        assert (await generate(client)).attempts == 4
        assert all(0 <= d <= FAST.cap for d in sleep.delays) and len(sleep.delays) == 3
        assert client.limit < START_LIMIT  # the refusals cut it

        sleep.delays.clear()
        proxy.inject(Status(429, retry_after=0.2), times=2)
        assert (await chat(client)).attempts == 3
        assert sleep.delays == [0.2, 0.2]

        proxy.inject(Status(503, retry_after_ms=100), times=2)
        await stream(client)

        proxy.inject(Status(503), times=None)
        with pytest.raises(Overloaded) as info:
            await generate(client)
        assert info.value.status == 503 and info.value.attempts == FAST.load_attempts
        proxy.clear()
        assert proxy.fired == {"status": 7 + FAST.load_attempts}
        assert_drained(client)
        await still_serves(client)


# -- map() -------------------------------------------------------------------------------------
def read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def prompts(n: int, tag: str) -> list[dict[str, object]]:
    return [
        {"prompt": f"{tag} {i}: once upon a time", "max_tokens": TOKENS, "ignore_eos": True}
        for i in range(n)
    ]


async def test_map_writes_every_item_once_and_a_resume_completes_the_failures(proxy, tmp_path):
    """Without retries each fault fails one item: the output file still has every index exactly
    once, the failures with their typed errors; a resume without the faults completes them."""
    out = tmp_path / "out.jsonl"
    items = prompts(24, "Item")
    faults = [
        Latency(0.3),
        Truncate(),
        Drop(after_bytes=3),
        Reset(),
        Garbage(),
        GarbageBody(),
        Stall(before_headers=True),
        Stall(after_bytes=None),
        Status(503),
        Status(429, retry_after=0.1),
    ]
    async with make_client(proxy, retry=Retry(attempts=1)) as client:
        for fault in faults:
            proxy.inject(fault)
        with anyio.fail_after(GUARD_S):
            first = await client.map(items, output=out, timeout=2.0, progress=False)
        assert proxy.pending == 0
        assert sum(proxy.fired.values()) == len(faults)
        assert_drained(client)
        errors = Counter(type(f.error).__name__ for f in first.failures)
        assert errors == {
            "ConnectionError": 4,
            "MalformedResponse": 1,
            "TimeoutError": 2,
            "Overloaded": 2,
        }
        lines = read_lines(out)
        assert sorted(line["index"] for line in lines) == list(range(24))
        assert {line["index"] for line in lines if not line["ok"]} == {
            f.index for f in first.failures
        }

        with anyio.fail_after(GUARD_S):
            second = await client.map(items, output=out, resume=True, progress=False)
        assert_drained(client)
    assert not second.failures and second.resumed == 24 - 9
    assert [r.index for r in second] == list(range(24))
    successes = Counter(line["id"] for line in read_lines(out) if line["ok"])
    assert len(successes) == 24 and set(successes.values()) == {1}
    assert len(read_lines(out)) == 24 + 9


async def test_map_rides_out_transient_faults(proxy, tmp_path):
    """With retries, a batch through refusals and broken answers fails and loses nothing: every
    faulted request costs its item one more attempt (a reset on a reused connection may cost
    none: the wire resends it at once, issue 42), and the file has every index once."""
    out = tmp_path / "out.jsonl"
    proxy.inject(Status(503), times=5)
    for fault in (Truncate(), Truncate(), Drop(), Reset(), Garbage()):
        proxy.inject(fault)
    retry = Retry(attempts=8, base=0.05, cap=0.5)
    async with make_client(proxy, retry=retry) as client:
        with anyio.fail_after(GUARD_S):
            results = await client.map(prompts(40, "Batch"), output=out, progress=False)
        assert_drained(client)
    assert proxy.pending == 0
    assert not results.failures
    assert sum(r.attempts - 1 for r in results) in (9, 10)
    lines = read_lines(out)
    assert sorted(line["index"] for line in lines) == list(range(40))
    assert all(line["ok"] for line in lines)


async def test_the_limit_grows_back_after_a_burst_of_refusals(proxy, caplog):
    """A server that refuses everything for a while cuts the limit (and every call of that
    batch ends in Overloaded); once it answers again, the limit leaves the cut and climbs back
    to where it started, rather than staying near the floor."""
    caplog.set_level(logging.INFO, logger="dsclient")
    proxy.inject(Status(503), times=None)
    async with make_client(proxy) as client:
        with anyio.fail_after(GUARD_S):
            refused = await client.map(prompts(10, "Refused"), progress=False)
        assert {type(f.error) for f in refused.failures} == {Overloaded}
        assert len(refused.failures) == 10
        assert_drained(client)
        assert client.limit < START_LIMIT
        assert any("the server refused for load" in r.getMessage() for r in caplog.records)

        proxy.clear()
        batches = 0
        with anyio.fail_after(GUARD_S):  # the refusal is remembered for 10 s, then it grows
            while client.limit < START_LIMIT:
                again = await client.map(prompts(24, f"After {batches}"), progress=False)
                assert not again.failures
                batches += 1
        assert_drained(client)
    assert batches >= 1


async def test_map_cancelled_while_calls_stall_gives_every_slot_back(proxy, tmp_path):
    """Cancelling a batch whose calls all hang leaks no slot, and a resume completes it."""
    out = tmp_path / "out.jsonl"
    items = prompts(12, "Stalled")
    proxy.inject(Stall(before_headers=True), times=None)
    async with make_client(proxy) as client:
        with anyio.move_on_after(2.0) as scope:
            await client.map(items, output=out, progress=False)
        assert scope.cancelled_caught
        assert proxy.fired["stall"] >= 1
        assert_drained(client)
        proxy.clear()
        with anyio.fail_after(GUARD_S):
            resumed = await client.map(items, output=out, resume=True, progress=False)
        assert_drained(client)
    assert not resumed.failures and [r.index for r in resumed] == list(range(12))
    successes = Counter(line["id"] for line in read_lines(out) if line["ok"])
    assert len(successes) == 12 and set(successes.values()) == {1}


async def test_imap_closed_early_while_calls_stall_gives_every_slot_back(proxy):
    """A consumer that takes one outcome and leaves: the calls still stalled are cancelled,
    and their slots come back."""
    proxy.inject(Latency(0.3))
    proxy.inject(Stall(before_headers=True), times=None)
    async with make_client(proxy) as client:
        with anyio.fail_after(GUARD_S):
            async with contextlib.aclosing(client.imap(prompts(12, "Early"))) as outcomes:
                async for index, first in outcomes:
                    break
        assert isinstance(first, CompletionResult) and first.index == index
        assert proxy.fired["stall"] >= 1
        assert_drained(client)
        proxy.clear()
        await still_serves(client)


async def test_map_on_error_raise_stops_at_the_fault_and_gives_every_slot_back(proxy):
    proxy.inject(Latency(0.5), times=4)
    proxy.inject(GarbageBody())
    async with make_client(proxy) as client:
        with anyio.fail_after(GUARD_S), pytest.raises(MalformedResponse):
            await client.map(prompts(30, "Raise"), on_error="raise", progress=False)
        assert proxy.fired["garbage_body"] == 1
        assert_drained(client)
        await still_serves(client)


@pytest.mark.parametrize(
    "fault",
    [GarbageBody(), Garbage(), Truncate(), Reset(), Status(503), Stall(trickle=0.05)],
    ids=["garbage-body", "garbage", "truncate", "reset", "503", "trickle"],
)
async def test_faults_on_the_metrics_scrape_never_reach_the_calls(proxy, fault):
    """The poller scrapes /metrics through the same proxy: whatever that scrape meets, calls
    go on (a poller that raised would cancel the client's task group, and the calls in it)."""
    async with make_client(proxy) as client:
        assert client.stats().control.mode == "metrics"
        proxy.inject(fault, times=None, paths=["/metrics"])
        with anyio.fail_after(GUARD_S):
            results = await client.map(prompts(30, "Scraped"), progress=False)
            while not proxy.fired[fault.name]:  # a scrape met the fault while calls ran
                results += await client.map(prompts(10, "More"), progress=False)
        assert not results.failures
        assert_drained(client)


def test_the_sync_client_through_faults(proxy):
    with dsclient.Client(proxy.url, max_num_seqs=MAX_NUM_SEQS, retry=FAST, timeout=30) as client:
        proxy.inject(Truncate())
        assert client.generate("Hello", max_tokens=TOKENS).attempts == 2
        proxy.inject(Stall(after_bytes=None))
        with pytest.raises(TimeoutError):
            with client.stream("Hello", max_tokens=TOKENS, ignore_eos=True, timeout=1.5) as s:
                for _ in s:
                    pass
        proxy.inject(Drop())
        results = client.map(["one", "two", "three"], max_tokens=TOKENS, progress=False)
        assert not results.failures
        assert sorted(r.attempts for r in results) == [1, 1, 2]
        assert proxy.fired == {"truncate": 1, "stall": 1, "drop": 1}
        stats = client.stats()
        assert (stats.in_flight, stats.waiting, client.limit) == (0, 0, START_LIMIT)

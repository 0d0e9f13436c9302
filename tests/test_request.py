"""dsclient/client/_request.py: the calls' deadlines on one timer (Deadlines), as asyncio.timeout
behaves: the block's task cancelled at its deadline and that turned into TimeoutError, another
cancellation left as it is, nothing kept once the calls are done."""

from __future__ import annotations

import asyncio
import sys

import pytest

from dsclient.client._request import Deadlines

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is 3.11+")


async def _sleeps(deadlines: Deadlines, seconds: float | None, sleep: float) -> str:
    async with deadlines.after(seconds):
        await asyncio.sleep(sleep)
    return "done"


@pytest.mark.anyio
async def test_a_block_past_its_deadline_raises_timeout_error_and_others_finish():
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    start = loop.time()
    results = await asyncio.gather(
        _sleeps(deadlines, 0.05, 10),
        _sleeps(deadlines, 0.05, 0),
        _sleeps(deadlines, 10, 0.1),
        _sleeps(deadlines, None, 0.1),
        return_exceptions=True,
    )
    assert isinstance(results[0], TimeoutError)
    assert results[1:] == ["done", "done", "done"]
    assert loop.time() - start < 1


@pytest.mark.anyio
async def test_lines_of_different_seconds_expire_each_on_time():
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    ended: dict[float, float] = {}

    async def one(seconds: float) -> None:
        start = loop.time()
        with pytest.raises(TimeoutError):
            await _sleeps(deadlines, seconds, 10)
        ended[seconds] = loop.time() - start

    # the longer line starts first: the timer must still fire for the shorter one
    await asyncio.gather(one(0.3), one(0.05), one(0.15))
    assert 0.05 <= ended[0.05] < 0.15 <= ended[0.15] < 0.3 <= ended[0.3] < 1


@pytest.mark.anyio
async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    deadlines = Deadlines()
    task = asyncio.ensure_future(_sleeps(deadlines, 10, 10))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.anyio
async def test_an_inner_deadline_inside_an_outer_one():
    deadlines = Deadlines()

    async def nested() -> str:
        async with deadlines.after(10):
            with pytest.raises(TimeoutError):
                await _sleeps(deadlines, 0.05, 10)
            return "outer goes on"

    assert await nested() == "outer goes on"
    with pytest.raises(TimeoutError):
        async with deadlines.after(0.05):
            await _sleeps(deadlines, 10, 10)


@pytest.mark.anyio
async def test_finished_calls_leave_nothing_behind_a_long_one():
    deadlines = Deadlines()
    release = asyncio.Event()

    async def long() -> None:
        async with deadlines.after(30):
            await release.wait()

    task = asyncio.ensure_future(long())
    await asyncio.sleep(0)
    # thousands of short calls finish while the long one holds the head of their line
    for _ in range(20):
        await asyncio.gather(*(_sleeps(deadlines, 30, 0) for _ in range(500)))
    line = deadlines._lines[30]
    assert line.live == 1 and len(line.queue) <= 2 * line.live + 64 + 1
    release.set()
    await task
    assert line.live == 0 and not line.queue


@pytest.mark.anyio
async def test_more_distinct_timeouts_than_lines_fall_back_to_asyncio_timeout():
    deadlines = Deadlines()
    results = await asyncio.gather(
        *(_sleeps(deadlines, 5 + i / 100, 0) for i in range(20)),
        _sleeps(deadlines, 0.05 + 1 / 1000, 10),
        return_exceptions=True,
    )
    assert results[:20] == ["done"] * 20
    assert isinstance(results[20], TimeoutError)
    assert len(deadlines._lines) == 8
    # once their calls are done, lines make room for other numbers of seconds
    assert await _sleeps(deadlines, 7.5, 0) == "done"
    assert 7.5 in deadlines._lines


def test_a_client_on_a_new_loop_starts_afresh():
    deadlines = Deadlines()
    assert asyncio.run(_sleeps(deadlines, 5, 0)) == "done"
    with pytest.raises(TimeoutError):
        asyncio.run(_sleeps(deadlines, 0.05, 10))
    assert asyncio.run(_sleeps(deadlines, 5, 0)) == "done"

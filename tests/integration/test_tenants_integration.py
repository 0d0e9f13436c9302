"""Tenants (token-fair order among groups) against the real vLLM server, in one process and in two
clients sharing a real redis-server."""

from __future__ import annotations

import time

import anyio
import pytest

from dsclient import AsyncClient

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

#: ~350 tokens: in the short lane with the light calls (a quarter of the 2048 context is the
#: long threshold), so the order between them is the tenants' alone, not the lanes'.
LONG = "Summarise the following report in one line. " + "the quick brown fox " * 25


async def _race(client: AsyncClient, other: AsyncClient | None = None) -> dict[str, list[float]]:
    """40 long calls of "flood" sent first, then 8 short calls of "light"; when each ended."""
    ends: dict[str, list[float]] = {"flood": [], "light": []}
    start = time.monotonic()

    async def one(c: AsyncClient, group: str, prompt: str) -> None:
        result = await c.generate(prompt, max_tokens=16, ignore_eos=True, group=group)
        assert result.usage.completion_tokens == 16 and result.lane == "short"
        ends[group].append(time.monotonic() - start)

    async with anyio.create_task_group() as tg:
        for _ in range(40):
            tg.start_soon(one, client, "flood", LONG)
        await anyio.sleep(0.2)  # the flood is queued in the client before the light calls come
        for i in range(8):
            tg.start_soon(one, other or client, "light", f"Question {i}?")
    return ends


async def test_light_tenant_is_not_queued_behind_a_flood(vllm_server: str) -> None:
    # A fixed limit of 2: the flood waits in the client, where the order is the client's.
    async with AsyncClient(vllm_server, limit=2, adaptive=False) as client:
        ends = await _race(client)
        tenants = client.stats().tenants
    # FIFO would end the light calls after the 40 long ones; VTC lifts "light" to the flood's
    # counter and its short calls go next, each time a slot frees.
    assert max(ends["light"]) < sorted(ends["flood"])[20], ends
    assert tenants["flood"].done == 40 and tenants["light"].done == 8
    assert tenants["flood"].input_tokens > 5 * tenants["light"].input_tokens
    assert tenants["light"].output_tokens == 8 * 16


async def test_two_clients_sharing_redis_share_the_counters(
    vllm_server: str, redis_url: str
) -> None:
    options = {"limit": 2, "adaptive": False, "shared": redis_url, "shared_key": "tenants"}
    async with (
        AsyncClient(vllm_server, **options) as flood,  # type: ignore[arg-type]
        AsyncClient(vllm_server, **options) as light,  # type: ignore[arg-type]
    ):
        ends = await _race(flood, light)
        await anyio.sleep(0.5)  # a sync or two after the last call
        seen_by_light = light.stats().tenants["flood"].counter
        own = flood.stats().tenants["flood"].counter
    # The light client, which never sent a flood call, knows the flood's counter from Redis.
    assert seen_by_light == pytest.approx(own, rel=0.05)
    # The light client's calls were not held behind the flood's 40.
    assert max(ends["light"]) < max(ends["flood"])

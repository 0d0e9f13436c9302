"""The server's own priority (dsclient/client/_priority.py): the mapping, and the field on the
wire where the server takes it."""

from __future__ import annotations

import random

import pytest

from dsclient import AsyncClient
from dsclient._http import httpx
from dsclient.client._priority import server_priority, weight_ranks, with_priority

from .fakes import FakeServer, RecordedSleep

pytestmark = pytest.mark.anyio


def test_lower_first_puts_urgency_before_the_lane_and_short_before_long() -> None:
    order = "lower-first"
    ranks = {
        (lane, urgency): server_priority(lane, urgency, order)
        for lane in ("short", "long")
        for urgency in (-1, 0, 1)
    }
    assert ranks[("short", 0)] == 0 and ranks[("long", 0)] == 1
    assert ranks[("short", 1)] < ranks[("long", 1)] < ranks[("short", 0)] < ranks[("long", 0)]
    assert ranks[("long", 0)] < ranks[("short", -1)]


def test_higher_first_is_the_same_order_negated() -> None:
    for lane in ("short", "long"):
        for urgency in (-2, 0, 3):
            assert server_priority(lane, urgency, "higher-first") == -server_priority(
                lane, urgency, "lower-first"
            )


def test_with_priority_keeps_the_callers_and_sends_nothing_without_an_order() -> None:
    body = {"prompt": "x"}
    assert with_priority(body, "long", 0, None) is body
    assert with_priority({"priority": 7}, "long", 0, "lower-first") == {"priority": 7}
    sent = with_priority(body, "long", 0, "lower-first")
    assert sent == {"prompt": "x", "priority": 1} and body == {"prompt": "x"}


def _client(fake: FakeServer, **kwargs: object) -> AsyncClient:
    return AsyncClient(
        "http://127.0.0.1:8000",
        transport=fake.transport,
        sleep=RecordedSleep(),
        rng=random.Random(0),
        **kwargs,  # type: ignore[arg-type]
    )


async def test_a_server_said_to_honour_priority_gets_each_calls_place() -> None:
    fake = FakeServer()
    async with _client(fake, server_priority=True, long_threshold=64) as client:
        assert (client.server.priority, client.server.priority_honoured) == ("lower-first", True)
        await client.generate("hi", max_tokens=2)
        await client.generate("hi", max_tokens=2, urgency=1)
        await client.generate("hi", max_tokens=100)  # over the long threshold: the long lane
        await client.generate("hi", max_tokens=2, priority=9)  # the caller's own wins
    assert [b.get("priority") for b in fake.bodies] == [0, -2, 1, 9]


async def test_no_priority_where_the_server_is_not_known_to_take_it() -> None:
    fake = FakeServer()  # /v1/models only: a vLLM behind a gateway, version unknown
    async with _client(fake) as client:
        assert client.server.priority is None
        await client.generate("hi", max_tokens=2, urgency=1)
    assert "priority" not in fake.bodies[0]


async def test_vllm_v1_gets_priority_and_the_chat_path_too() -> None:
    fake = FakeServer()
    version = httpx.Response(200, json={"version": "0.32.0"})

    def handler(request: httpx.Request) -> httpx.Response:
        return version if request.url.path == "/version" else fake(request)

    async with AsyncClient(
        "http://127.0.0.1:8000", transport=httpx.MockTransport(handler), sleep=RecordedSleep()
    ) as client:
        assert client.server.priority == "lower-first" and client.server.priority_honoured is None
        await client.chat([{"role": "user", "content": "hi"}], max_tokens=2)
    assert fake.bodies[0]["priority"] == 0


def test_weight_ranks_put_the_heaviest_first_and_unnamed_groups_at_weight_one() -> None:
    ranks = weight_ranks({"chat": 3, "batch": 0.5, "api": 3})
    assert ranks == {"chat": 0, "api": 0, "batch": 2, None: 1}
    assert server_priority("long", 1, "lower-first", ranks["chat"]) < server_priority(
        "short", 0, "lower-first", ranks[None]
    )


async def test_group_priority_sends_the_tenants_rank_only_when_asked() -> None:
    fake = FakeServer()
    weights = {"chat": 3.0, "batch": 1.0}
    async with _client(fake, server_priority=True, group_weights=weights) as client:
        await client.generate("hi", max_tokens=2, group="batch")
    async with _client(
        fake, server_priority=True, group_weights=weights, group_priority=True
    ) as client:
        await client.generate("hi", max_tokens=2, group="batch")
        await client.generate("hi", max_tokens=2, group="chat")
        await client.generate("hi", max_tokens=2)  # no group: weight 1, batch's rank
    assert [b.get("priority") for b in fake.bodies] == [0, 1000, 0, 1000]


async def test_the_tenant_goes_to_a_gateway_as_the_fairness_id() -> None:
    fake = FakeServer()
    async with _client(fake) as client:
        await client.generate("hi", max_tokens=2, group="chat")
        await client.generate("hi", max_tokens=2)
        async with client.stream("hi", max_tokens=2, group="stream") as s:
            async for _ in s:
                pass
        sdk = client.openai(group="sdk")
        await sdk.completions.create(model="tiny", prompt="hi", max_tokens=2)
    sent = [r.headers.get("x-gateway-inference-fairness-id") for r in fake.requests]
    assert sent == ["chat", None, "stream", "sdk"]

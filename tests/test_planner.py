"""The planner built alone (dsclient/client/_planner.py): discovery, counts and plans over a
``httpx.MockTransport``, without an ``AsyncClient``."""

from __future__ import annotations

import random

import pytest

from dsclient._http import httpx
from dsclient.client._discovery import ServerInfo
from dsclient.client._planner import Planner
from dsclient.client._tokens import TokenCounter
from dsclient.governor._backend import SingleServer
from dsclient.governor._endpoint import ControlOptions, Endpoint

from .fakes import FakeServer

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:8000"


def planner_over(server: FakeServer, **options: object) -> tuple[Planner, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=server.transport)

    async def probe(url: str) -> bool:
        return True

    backend = SingleServer(
        Endpoint(URL, ControlOptions(adaptive=False), {}, start=4),
        probe=probe,
        rng=random.Random(0),
    )
    return Planner(http, backend, TokenCounter(None), **options), http  # type: ignore[arg-type]


async def test_a_planner_alone_discovers_once_and_plans_a_short_call() -> None:
    server = FakeServer(max_model_len=2048)
    planner, http = planner_over(server)
    async with http:
        assert planner.info() is None and planner.model is None
        plan = await planner.plan("completion", "Once upon a time", 16, {"temperature": 0})
        assert planner.model == "tiny"  # the server's only model
        assert plan.body == {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": 16,
            "temperature": 0,
        }
        assert (plan.kind, plan.lane, plan.max_tokens) == ("completion", "short", 16)
        info = planner.info()
        assert info is not None and info.max_model_len == 2048
        chat = await planner.plan("chat", [{"role": "user", "content": "Hi"}], None, {})
        assert chat.body["messages"] == [{"role": "user", "content": "Hi"}]
        assert chat.max_tokens == 256  # the default
        assert planner.info() is info  # discovered once


async def test_a_planner_cuts_max_tokens_to_the_context_and_takes_the_long_lane() -> None:
    planner, http = planner_over(FakeServer(max_model_len=256), default_max_tokens=64)
    async with http:
        plan = await planner.plan("completion", "word " * 150, 500, {})
    assert plan.lane == "long"
    assert plan.max_tokens < 256 - 150
    assert plan.body["max_tokens"] == plan.max_tokens
    # A call degraded to a model of a smaller context keeps to its room.
    assert planner.refit(plan, 200) <= 200 - plan.prompt_tokens


async def test_a_planner_counts_exactly_with_the_servers_tokenize() -> None:
    server = FakeServer(tokenize=lambda body: 42)
    planner, http = planner_over(server)
    async with http:
        assert await planner.count_tokens("anything at all") == 42
        assert await planner.count_tokens("anything at all", exact=False) > 0


async def test_a_planners_readiness_is_injected_and_awaited_before_each_plan() -> None:
    calls: list[str] = []
    planner, http = planner_over(FakeServer(), model="tiny")

    async def ready() -> ServerInfo:
        calls.append("ready")
        return await planner.discovered()

    planner.ready = ready
    async with http:
        await planner.plan("completion", "Hi", 4, {})
        await planner.count_tokens("Hi", exact=False)
    assert calls == ["ready", "ready"]


async def test_without_a_context_a_call_is_long_beside_the_calls_sent_before_it() -> None:
    # A server that does not say its context (transformers' server): the quarter-of-context
    # rule has nothing to take a quarter of, and its fallback (1024 tokens) let 900-token
    # prompts run in the short lane beside 60-token questions. Long is relative there.
    server = FakeServer(max_model_len=None)
    planner, http = planner_over(server)
    question = "What is the capital of the country north of here, and why? " * 2
    document = "word " * 600  # ~3000 bytes: ~750 tokens by its bytes, far below 1024 + 16
    async with http:
        first = await planner.plan("completion", document, 16, {})
        assert first.lane == "short"  # nothing seen yet: the fallback
        for _ in range(4):
            assert (await planner.plan("completion", question, 16, {})).lane == "short"
        assert planner.sizes.threshold == 256  # 4 x ~47, raised to the floor
        assert (await planner.plan("completion", document, 16, {})).lane == "long"
    # Said by the caller, the threshold is the caller's.
    planner, http = planner_over(FakeServer(max_model_len=None), long_threshold=1024)
    async with http:
        for _ in range(8):
            await planner.plan("completion", question, 16, {})
        assert (await planner.plan("completion", document, 16, {})).lane == "short"
    # A known context keeps its quarter (512 of 2048): the same document is long there anyway,
    # and a 400-token one is not, however small the calls before it.
    planner, http = planner_over(FakeServer(max_model_len=2048))
    async with http:
        for _ in range(8):
            await planner.plan("completion", question, 16, {})
        assert (await planner.plan("completion", "word " * 300, 16, {})).lane == "short"

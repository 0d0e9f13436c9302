"""The caller built alone (dsclient/client/_caller.py): one call from a plan to its result and
record, with a fake planner and a ``httpx.MockTransport``, without an ``AsyncClient``."""

from __future__ import annotations

import random
from typing import Any, Literal

import pytest

from dsclient import Degrade, RequestRefused
from dsclient._http import httpx
from dsclient._observe import CallRecord
from dsclient.client._caller import Caller
from dsclient.client._discovery import ServerInfo
from dsclient.client._pipeline import RequestPath
from dsclient.client._request import USE_DEFAULT, Plan, Prompt
from dsclient.client._retry import Retry, RetryBudget
from dsclient.governor._backend import SingleServer
from dsclient.governor._endpoint import ControlOptions, Endpoint

from .fakes import FakeServer, RecordedSleep, completion_body

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:8000"


class FakePlanner:
    """Plans every call as asked, in the short lane; counts the plans."""

    model = "tiny"

    def __init__(self) -> None:
        self.plans = 0

    async def plan(
        self,
        kind: Literal["completion", "chat"],
        prompt: Prompt,
        max_tokens: int | None,
        sampling: dict[str, Any],
    ) -> Plan:
        self.plans += 1
        send = max_tokens or 8
        field = "prompt" if kind == "completion" else "messages"
        return Plan(kind, {"model": "tiny", field: prompt, "max_tokens": send}, "short", send, 3)

    def refit(self, plan: Plan, max_model_len: int) -> int:
        return min(plan.max_tokens, max_model_len - plan.prompt_tokens)


def caller_over(server: FakeServer, **options: Any) -> tuple[Caller, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=server.transport)
    endpoint = Endpoint(URL, ControlOptions(adaptive=False), {}, start=4)
    endpoint.seed(ServerInfo(url=URL, kind="vllm", model="tiny", models=("tiny",)), None)
    sleep = RecordedSleep()

    async def probe(url: str) -> bool:
        return True

    backend = SingleServer(endpoint, probe=probe, sleep=sleep, rng=random.Random(0))
    retry = Retry(attempts=2)
    budget = RetryBudget(
        ratio=retry.budget_ratio, floor=retry.budget_floor, window=retry.budget_window
    )
    path = RequestPath(http, backend, retry, budget, sleep=sleep, rng=random.Random(0))
    return Caller(path, FakePlanner(), url=URL, **options), http


async def test_a_caller_alone_runs_a_call_and_records_it() -> None:
    server = FakeServer(script=[httpx.Response(200, json=completion_body("Paris"))])
    caller, http = caller_over(server, timeout=30.0)
    records: list[CallRecord] = []
    caller.observers.append(records.append)
    async with http:
        result = await caller.request("completion", "The capital", 4, 0, "g", USE_DEFAULT, {})
    assert result.text == "Paris" and result.server == URL and result.max_tokens == 4
    assert server.bodies == [{"model": "tiny", "prompt": "The capital", "max_tokens": 4}]
    [record] = records
    assert (record.kind, record.server, record.group, record.error) == (
        "completion",
        URL,
        "g",
        None,
    )
    assert record.attempts == 1 and record.completion_tokens == 2


async def test_a_callers_failure_is_recorded_with_its_status_and_server() -> None:
    server = FakeServer(script=[httpx.Response(400, json={"error": "no"})])
    caller, http = caller_over(server)
    records: list[CallRecord] = []
    caller.observers.append(records.append)
    async with http:
        with pytest.raises(RequestRefused):
            await caller.request("completion", "Hi", 4, 0, None, None, {})
    [record] = records
    assert (record.error, record.status, record.server, record.lane) == (
        "RequestRefused",
        400,
        URL,
        "short",
    )


def test_the_record_builder_fills_what_the_error_knows() -> None:
    server = FakeServer()
    caller, _ = caller_over(server)
    records: list[CallRecord] = []
    caller.observers.append(records.append)

    def broken(record: CallRecord) -> None:
        raise RuntimeError("an observer's bug")

    caller.observers.append(broken)  # logged and ignored
    failure = RequestRefused(503)
    failure.server, failure.attempts = "http://b:8000", 3
    caller.record("chat", lane=None, group=None, latency_s=1.0, error=failure)
    caller.record("embedding", lane="short", group=None, latency_s=0.5, error="ContextOverflow")
    first, second = records
    assert (first.error, first.status, first.server, first.attempts) == (
        "RequestRefused",
        503,
        "http://b:8000",
        3,
    )
    assert (second.error, second.status, second.server, second.attempts) == (
        "ContextOverflow",
        None,
        URL,  # reached no server: the first one stands in
        1,
    )


def test_a_callers_timeout_is_its_default_or_the_calls_own() -> None:
    caller, _ = caller_over(FakeServer(), timeout=9.0)
    assert caller.timeout_of(USE_DEFAULT) == 9.0
    assert caller.timeout_of(None) is None
    assert caller.timeout_of(2) == 2.0
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        caller.timeout_of(0)


def test_a_caller_degrades_a_plan_as_the_option_says() -> None:
    caller, _ = caller_over(FakeServer())
    plan = Plan("completion", {"model": "tiny", "prompt": "Hi", "max_tokens": 64}, "short", 64, 3)
    degraded, why = caller.degraded(plan, Degrade(max_tokens=16), "late")
    assert degraded.max_tokens == 16 and degraded.body["max_tokens"] == 16
    assert why == "max_tokens 64 -> 16: late"
    assert plan.body["max_tokens"] == 64  # the plan given is left as it was

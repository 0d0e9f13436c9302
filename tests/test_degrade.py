"""Degradation on deadline: a call with ``degrade=`` gives up a model or tokens rather than miss its
timeout, and its result says so. Scripted servers answer in 10 ms per requested token."""

from __future__ import annotations

import json

import anyio
import pytest

import dsclient
from dsclient._http import httpx
from dsclient.client._degrade import MIN_SAMPLES, Degrade, Pace, predict_s
from tests.fakes import completion_body

pytestmark = pytest.mark.anyio

S_PER_TOKEN = 0.01


def transport(models: dict[str, str], sent: list[dict[str, object]]) -> httpx.MockTransport:
    """Hosts ``models`` (host -> served model); answers take 10 ms per ``max_tokens``."""

    async def handler(request: httpx.Request) -> httpx.Response:
        model = models[request.url.host]
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": model, "max_model_len": 4096}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404)
        body = json.loads(request.content)
        sent.append({"host": request.url.host, **body})
        await anyio.sleep(S_PER_TOKEN * body["max_tokens"])
        usage = body["max_tokens"]
        return httpx.Response(200, json=completion_body(text=model, completion_tokens=usage))

    return httpx.MockTransport(handler)


def test_degrade_says_what_to_give_up() -> None:
    with pytest.raises(ValueError, match="model= or max_tokens="):
        Degrade()
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        Degrade(max_tokens=0)
    with pytest.raises(TypeError, match="degrade must be a Degrade"):
        dsclient.AsyncClient("http://a:1", degrade="small")  # type: ignore[arg-type]


def test_pace_is_trusted_after_a_few_answers_and_follows_them() -> None:
    pace = Pace(weight=0.5)
    for _ in range(MIN_SAMPLES - 1):
        pace.observe("m", 1.0, 100)
    assert pace.per_token("m") is None
    assert predict_s(None, 500, timeout=10.0) == pytest.approx(2.0)  # a fifth of the timeout
    pace.observe("m", 1.0, 100)
    assert pace.per_token("m") == pytest.approx(0.01)
    pace.observe("m", 3.0, 100)
    assert pace.per_token("m") == pytest.approx(0.02)  # halfway to 0.03
    pace.observe("m", 1.0, 0)  # no tokens: nothing learned
    assert pace.per_token("m") == pytest.approx(0.02) and pace.per_token("other") is None


async def test_a_call_that_cannot_finish_in_time_sends_a_smaller_max_tokens() -> None:
    sent: list[dict[str, object]] = []
    async with dsclient.AsyncClient(
        "http://a:1", transport=transport({"a": "tiny"}, sent), max_num_seqs=4
    ) as client:
        for _ in range(MIN_SAMPLES):
            await client.generate("warm up", max_tokens=10)  # 0.1 s each: 10 ms a token
        result = await client.generate(
            "long answer", max_tokens=500, timeout=1.0, degrade=Degrade(max_tokens=20)
        )
        plain = await client.generate("no degrade", max_tokens=30, timeout=1.0)
    assert result.degraded is not None and result.degraded.startswith("max_tokens 500 -> 20")
    assert "needed" in result.degraded and result.max_tokens == 20
    assert sent[MIN_SAMPLES]["max_tokens"] == 20
    assert plain.degraded is None and plain.max_tokens == 30


async def test_a_call_waiting_too_long_for_a_slot_goes_to_another_model() -> None:
    sent: list[dict[str, object]] = []
    async with dsclient.AsyncClient(
        ["http://a:1", "http://b:1"],
        model="big",
        transport=transport({"a": "big", "b": "small"}, sent),
        limit=1,
        degrade=Degrade(model="small"),
    ) as client:
        results: list[dsclient.CompletionResult] = []

        async def long_call() -> None:
            results.append(await client.generate("hold", max_tokens=150, degrade=None))

        async with anyio.create_task_group() as group:
            group.start_soon(long_call)  # holds a's only slot for 1.5 s
            await anyio.sleep(0.05)
            quick = await client.generate("quick", max_tokens=5, timeout=1.0)
        assert client.servers[1].info is not None
    assert quick.degraded is not None
    assert quick.degraded.startswith("model 'big' -> 'small'") and "waited" in quick.degraded
    assert quick.text == "small" and quick.server == "http://b:1"
    assert results[0].degraded is None and results[0].text == "big"


async def test_degrading_to_a_model_nobody_serves_is_a_clear_error() -> None:
    sent: list[dict[str, object]] = []
    async with dsclient.AsyncClient(
        "http://a:1", transport=transport({"a": "tiny"}, sent), limit=1
    ) as client:
        async def hold() -> None:
            await client.generate("hold", max_tokens=100)  # the slot for 1 s

        async with anyio.create_task_group() as group:
            group.start_soon(hold)
            await anyio.sleep(0.05)
            with pytest.raises(dsclient.NoServerError, match="'nope'"):
                await client.generate(
                    "x", max_tokens=5, timeout=0.8, degrade=Degrade(model="nope")
                )

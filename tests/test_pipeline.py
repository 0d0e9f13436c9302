"""The per-attempt request path: a slot per attempt, sleeps outside it, outcomes to the controller,
one retry-budget token per retry that happens."""

from __future__ import annotations

import json
import random

import anyio
import pytest

from dsclient import AsyncClient, MalformedResponse, Overloaded, RequestRefused, Retry
from dsclient._http import httpx

from .fakes import FakeServer, completion_body

pytestmark = pytest.mark.anyio


def make_client(fake: FakeServer, sleep, **kwargs) -> AsyncClient:
    kwargs.setdefault("rng", random.Random(0))
    return AsyncClient("http://127.0.0.1:8000", transport=fake.transport, sleep=sleep, **kwargs)


class SlotWatchingSleep:
    """Records each backoff and how many slots the client held while it slept."""

    def __init__(self) -> None:
        self.client: AsyncClient | None = None
        self.held: list[int] = []

    async def __call__(self, seconds: float) -> None:
        assert self.client is not None
        self.held.append(self.client.in_flight)


async def test_a_retry_spends_one_budget_token():
    # Before: the retry predicate spent a token and the retry loop's stop check came after it, so one
    # retry could cost two. With a floor of 2 and no ratio, two calls must each get their retry.
    fake = FakeServer(script=[httpx.Response(500, text="boom")])
    sleep = SlotWatchingSleep()
    retry = Retry(attempts=2, budget_ratio=0.0, budget_floor=2)
    async with make_client(fake, sleep, retry=retry) as client:
        sleep.client = client
        for _ in range(2):
            with pytest.raises(RequestRefused) as info:
                await client.generate("x", max_tokens=1)
            assert info.value.attempts == 2
        assert len(fake.requests) == 4
        assert len(client._budget._retries) == 2
        # The budget is now spent: the third call fails after its first attempt.
        with pytest.raises(RequestRefused) as info:
            await client.generate("x", max_tokens=1)
        assert info.value.attempts == 1
        assert len(fake.requests) == 5


async def test_three_attempts_spend_two_tokens():
    fake = FakeServer(script=[httpx.Response(502, text="bad gateway")])
    sleep = SlotWatchingSleep()
    retry = Retry(attempts=3, budget_ratio=0.0, budget_floor=10)
    async with make_client(fake, sleep, retry=retry) as client:
        sleep.client = client
        with pytest.raises(RequestRefused):
            await client.generate("x", max_tokens=1)
        assert len(fake.requests) == 3
        assert len(client._budget._retries) == 2


async def test_backoff_sleeps_hold_no_slot():
    fake = FakeServer(
        script=[
            httpx.Response(503, text="busy"),
            httpx.Response(500, text="boom"),
            httpx.Response(200, json=completion_body()),
        ]
    )
    sleep = SlotWatchingSleep()
    async with make_client(fake, sleep, max_num_seqs=1, headroom=1.0) as client:
        sleep.client = client
        result = await client.generate("x", max_tokens=1)
    assert result.attempts == 3
    assert sleep.held == [0, 0]


async def test_another_call_runs_while_one_backs_off():
    # One slot. The first call fails and sleeps for real; the second must get the slot then.
    order: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = request.read().decode()
        if '"first"' in prompt and "first-failed" not in order:
            order.append("first-failed")
            return httpx.Response(503, text="busy")
        order.append("first" if '"first"' in prompt else "second")
        return httpx.Response(200, json=completion_body())

    fake = FakeServer(script=[handler])

    async def slow_sleep(seconds: float) -> None:
        await anyio.sleep(0.2)

    async with make_client(fake, slow_sleep, max_num_seqs=1, headroom=1.0) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: client.generate("first", max_tokens=1))
            await anyio.sleep(0.05)  # the first call is sleeping now
            tg.start_soon(lambda: client.generate("second", max_tokens=1))
    assert order == ["first-failed", "second", "first"]


async def test_overload_reaches_the_controller_and_cuts_the_limit():
    fake = FakeServer(
        script=[httpx.Response(503, text="busy"), httpx.Response(200, json=completion_body())]
    )
    sleep = SlotWatchingSleep()
    async with make_client(fake, sleep, max_num_seqs=8) as client:
        sleep.client = client
        assert client.limit == 5
        result = await client.generate("x", max_tokens=1)
        assert result.attempts == 2
        assert client.limit == 3  # floor(5 x 0.7)
        control = client.stats().control
        assert control is not None and "refused" in control.reason
        lanes = client.stats().lanes
        assert lanes["short"].failed == 1 and lanes["short"].done == 1


async def test_the_clients_own_full_queue_is_not_an_overload():
    fake = FakeServer()
    gate = anyio.Event()
    sleep = SlotWatchingSleep()
    async with make_client(fake, sleep, max_num_seqs=1, headroom=1.0, max_queue=1) as client:
        async with anyio.create_task_group() as tg:

            async def hold() -> None:
                async with client._endpoint.governor.slot(lane="short"):
                    await gate.wait()

            tg.start_soon(hold)
            await anyio.sleep(0.01)
            tg.start_soon(lambda: client.generate("waits", max_tokens=1))
            await anyio.sleep(0.01)
            with pytest.raises(Overloaded) as info:
                await client.generate("x", max_tokens=1)
            assert info.value.status == 0
            gate.set()
        assert client.limit == 1
        assert client.stats().control.reason == "start"


async def test_stream_attempts_take_their_own_slots():
    fake = FakeServer(
        script=[
            httpx.Response(503, text="busy"),
            httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                text='data: {"choices": [{"text": "hi", "finish_reason": "length"}]}\n\n'
                "data: [DONE]\n\n",
            ),
        ]
    )
    sleep = SlotWatchingSleep()
    async with make_client(fake, sleep, max_num_seqs=8) as client:
        sleep.client = client
        async with client.stream("x", max_tokens=2) as s:
            assert client.in_flight == 1
            text = "".join([d async for d in s])
        assert text == "hi" and s.attempts == 2
        assert sleep.held == [0]
        assert client.in_flight == 0
        assert client.limit == 3  # the 503 reached the controller


@pytest.mark.parametrize(("adaptive", "tokens"), [(True, 0), (False, 2)])
async def test_load_refusals_are_not_charged_to_the_budget_under_an_adaptive_limit(
    adaptive, tokens
):
    fake = FakeServer(
        script=[
            httpx.Response(503, text="busy"),
            httpx.Response(429, text="slow down"),
            httpx.Response(200, json=completion_body()),
        ]
    )
    sleep = SlotWatchingSleep()
    retry = Retry(attempts=4, budget_ratio=0.0, budget_floor=5)
    # A stated batch of 8 (a black box would start at 1, where a cut leaves nothing to see).
    async with make_client(fake, sleep, retry=retry, adaptive=adaptive, max_num_seqs=8) as client:
        sleep.client = client
        result = await client.generate("x", max_tokens=1)
        assert result.attempts == 3
        assert len(client._budget._retries) == tokens
        assert client.limit == (3 if adaptive else 5)  # one cut per cooldown (1 s)


# --- hostile answers (each found by tests/test_fuzz.py) ------------------------------------------
@pytest.mark.parametrize(
    ("response", "match"),
    [
        # httpx.DecodingError, not a TransportError, went through untyped.
        (
            lambda: httpx.Response(
                200, headers={"content-encoding": "gzip"}, stream=httpx.ByteStream(b"{}")
            ),
            "could not be decoded",
        ),
        # json.loads raised RecursionError, not ValueError, on 50 000 "[".
        (lambda: httpx.Response(200, content=b"[" * 50_000), "not JSON"),
        # MalformedResponse(body=response.text) raised TypeError for charset=rot13.
        (
            lambda: httpx.Response(
                200, content=b"oops", headers={"content-type": "text/plain; charset=rot13"}
            ),
            "not JSON",
        ),
    ],
    ids=["bad-gzip", "deep-json", "rot13-charset"],
)
async def test_an_answer_that_cannot_be_read_is_malformed_and_not_retried(response, match):
    fake = FakeServer(script=[lambda _: response()])
    async with make_client(fake, SlotWatchingSleep()) as client:
        with pytest.raises(MalformedResponse, match=match) as info:
            await client.generate("x", max_tokens=1)
        assert info.value.attempts == 1 and len(fake.requests) == 1
        assert client.in_flight == 0


async def test_an_error_body_in_an_odd_charset_is_still_a_refusal():
    # Found: error_from_response read response.text, which raised AssertionError for charset=hex.
    fake = FakeServer(
        script=[
            httpx.Response(
                400, content=b'{"error": {"message": "no"}}', headers={"content-type": "text/x; charset=hex"}
            )
        ]
    )
    async with make_client(fake, SlotWatchingSleep()) as client:
        with pytest.raises(RequestRefused, match="HTTP 400: no"):
            await client.generate("x", max_tokens=1)


@pytest.mark.parametrize(
    "event",
    [
        {"choices": 5},  # TypeError: 'int' object is not subscriptable
        {"choices": ["x"]},  # AttributeError: 'str' object has no attribute 'get'
        {"choices": [{"delta": "x"}]},  # AttributeError on the delta
        {"choices": [{"text": "a", "finish_reason": []}]},  # a finish reason that is no string
        {"choices": [{"text": 5}]},  # str(5) was passed off as text
    ],
)
async def test_a_stream_chunk_of_the_wrong_shape_is_malformed(event):
    fake = FakeServer(
        script=[
            httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                text=f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n",
            )
        ]
    )
    async with make_client(fake, SlotWatchingSleep()) as client:
        with pytest.raises(MalformedResponse, match="stream event"):
            async with client.stream("x", max_tokens=2) as s:
                async for _ in s:
                    pass
        assert client.in_flight == 0


async def test_a_stream_event_nested_past_the_recursion_limit_is_malformed():
    # Found: RecursionError out of the stream's JSON decoding.
    fake = FakeServer(script=[httpx.Response(200, text="data: " + "[" * 50_000 + "\n\n")])
    async with make_client(fake, SlotWatchingSleep()) as client:
        with pytest.raises(MalformedResponse, match="not JSON"):
            async with client.stream("x", max_tokens=2) as s:
                async for _ in s:
                    pass


def test_completion_tokens_from_usage_else_from_the_text() -> None:
    from dsclient.client._pipeline import completion_tokens

    assert completion_tokens({"usage": {"completion_tokens": 64}}) == 64.0
    # transformers' server reports 0 tokens: the text's length stands in.
    zero = {"usage": {"completion_tokens": 0}, "choices": [{"text": "x" * 40}]}
    assert completion_tokens(zero) == 10.0
    chat = {"choices": [{"message": {"content": "ab"}}]}
    assert completion_tokens(chat) == 1.0
    assert completion_tokens({"usage": {"completion_tokens": True}}) is None
    assert completion_tokens([]) is None


async def test_tenacity_is_built_only_after_a_first_failure(monkeypatch):
    # A call that succeeds at once pays for no retry machinery; one that fails enters
    # tenacity with its first attempt counted, and a cancellation inside it leaves as it came.
    from dsclient.client import _pipeline

    built: list[object] = []
    real = _pipeline.AsyncRetrying

    def spy(*args, **kwargs):
        built.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(_pipeline, "AsyncRetrying", spy)
    fake = FakeServer(
        script=[httpx.Response(500, text="boom"), httpx.Response(200, json=completion_body())]
    )
    sleep = SlotWatchingSleep()
    async with make_client(fake, sleep) as client:
        sleep.client = client
        result = await client.generate("x", max_tokens=1)
        assert result.attempts == 2 and len(built) == 1
        assert sleep.held == [0]  # one backoff, outside any slot
        result = await client.generate("x", max_tokens=1)
        assert result.attempts == 1 and len(built) == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_cancellation_in_a_retry_leaves_through_tenacity(anyio_backend):
    # tenacity's attempt swallows what its block raises and re-raises it after asking
    # ``retry``: a deadline that cuts the second attempt in flight still cancels the call,
    # and its slot comes back.
    async def hang(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(3600)
        raise AssertionError("not reached")

    fake = FakeServer(script=[httpx.Response(500, text="boom"), hang])
    sleep = SlotWatchingSleep()
    async with make_client(fake, sleep) as client:
        sleep.client = client
        with anyio.move_on_after(0.2) as scope:
            await client.generate("x", max_tokens=1)
        assert scope.cancelled_caught
        assert client.in_flight == 0 and len(fake.requests) == 2


async def test_the_body_encoder_writes_what_httpx_would_and_refuses_what_json_refuses():
    from json import JSONEncoder

    from dsclient.client._pipeline import body_encoder

    encode = body_encoder()
    plain = JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
    bodies = [
        {"model": "tiny", "prompt": "Écris une phrase \u2603", "max_tokens": 16},
        {"messages": [{"role": "user", "content": "Hi"}], "stop": ["\n"], "temperature": 0.5},
        {"a": {"b": [1, 2.5, None, True, {"c": "d"}]}, "e": []},
    ]
    for body in bodies:
        assert encode(body) == plain(body)

    shared = {"x": 1}
    looped: dict[str, object] = {"inner": shared}
    shared["back"] = looped
    with pytest.raises(ValueError, match="Circular reference"):
        encode(looped)
    del shared["back"]
    with pytest.raises(ValueError, match="Out of range float"):
        encode({"kept": shared, "temperature": float("nan")})
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode({"kept": [shared], "bad": object()})
    # What the failures left part way is gone: the same containers encode again, and twice.
    again = {"kept": shared, "again": [shared], "looped": looped}
    assert encode(again) == plain(again)

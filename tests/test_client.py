"""AsyncClient against httpx.MockTransport: endpoints, retries, errors, bad input, secrets."""

from __future__ import annotations

import json
import logging
import random

import anyio
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

import dsclient
from dsclient import (
    AsyncClient,
    ConnectionError,
    ContextOverflow,
    MalformedResponse,
    Overloaded,
    RequestRefused,
    Retry,
    TimeoutError,
)
from dsclient._http import httpx
from dsclient.client._tokens import CALIBRATION_TEXT

from .fakes import FakeServer, RecordedSleep, chat_body, completion_body

pytestmark = pytest.mark.anyio

SECRET = "sk-test-very-secret-key-123"


def make_client(fake: FakeServer, **kwargs) -> AsyncClient:
    kwargs.setdefault("sleep", RecordedSleep())
    kwargs.setdefault("rng", random.Random(0))
    return AsyncClient("http://127.0.0.1:8000", transport=fake.transport, **kwargs)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_generate_returns_a_typed_result(anyio_backend):
    fake = FakeServer(script=[httpx.Response(200, json=completion_body("world", "stop", 4, 1))])
    async with make_client(fake) as client:
        result = await client.generate("hello", max_tokens=5, temperature=0.0, ignore_eos=True)
    assert result.text == "world"
    assert result.finish_reason == "stop"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (4, 1)
    assert result.attempts == 1
    assert result.latency_s >= 0
    assert isinstance(result.raw, Completion)
    assert result.raw.choices[0].text == "world"
    body = fake.bodies[0]
    assert body == {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 5,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    assert fake.requests[0].url.path == "/v1/completions"


async def test_chat_returns_a_typed_result():
    fake = FakeServer(script=[httpx.Response(200, json=chat_body("hey", "stop"))])
    messages = [{"role": "user", "content": "hi"}]
    async with make_client(fake) as client:
        result = await client.chat(messages, max_tokens=8, top_k=5)
    assert result.text == "hey"
    assert isinstance(result.raw, ChatCompletion)
    assert fake.bodies[0]["messages"] == messages
    assert fake.bodies[0]["top_k"] == 5
    assert fake.requests[0].url.path == "/v1/chat/completions"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1:8000/v1/",
    ],
)
async def test_base_url_with_or_without_v1(url):
    fake = FakeServer()
    async with AsyncClient(url, transport=fake.transport) as client:
        await client.generate("x", max_tokens=1)
    assert str(fake.requests[0].url) == "http://127.0.0.1:8000/v1/completions"


async def test_model_defaults_to_the_only_one():
    fake = FakeServer(models=["only-model"])
    async with make_client(fake) as client:
        assert client.model == "only-model"


async def test_several_models_and_none_chosen_lists_them():
    fake = FakeServer(models=["a", "b"])
    client = make_client(fake)
    with pytest.raises(ValueError, match="a.*b"):
        await client.generate("x")
    await client.aclose()
    async with make_client(fake, model="b") as client:
        await client.generate("x", max_tokens=1)
    assert fake.bodies[0]["model"] == "b"


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
@pytest.mark.parametrize("retry_after", [None, "2"])
async def test_retryable_statuses_are_retried(status, retry_after):
    headers = {"Retry-After": retry_after} if retry_after else {}
    fake = FakeServer(
        script=[
            httpx.Response(status, headers=headers, text="nope"),
            httpx.Response(status, headers=headers, text="nope"),
            httpx.Response(200, json=completion_body()),
        ]
    )
    sleep = RecordedSleep()
    async with make_client(fake, sleep=sleep, retry=Retry(attempts=4, base=0.5, cap=8.0)) as client:
        result = await client.generate("x", max_tokens=1)
    assert result.attempts == 3
    assert len(sleep.delays) == 2
    if retry_after:
        assert sleep.delays == [2.0, 2.0]
    else:
        assert 0 <= sleep.delays[0] <= 0.5 and 0 <= sleep.delays[1] <= 1.0


async def test_retry_after_ms_header_is_honoured():
    fake = FakeServer(
        script=[
            httpx.Response(429, headers={"retry-after-ms": "150"}),
            httpx.Response(200, json=completion_body()),
        ]
    )
    sleep = RecordedSleep()
    async with make_client(fake, sleep=sleep) as client:
        await client.generate("x", max_tokens=1)
    assert sleep.delays == [0.15]


async def test_retries_stop_after_the_attempts_and_raise_the_last_error():
    fake = FakeServer(script=[httpx.Response(502, text="bad gateway")])
    sleep = RecordedSleep()
    async with make_client(fake, sleep=sleep, retry=Retry(attempts=3)) as client:
        with pytest.raises(RequestRefused) as info:
            await client.generate("x", max_tokens=1)
    assert info.value.status == 502
    assert len(fake.requests) == 3
    assert len(sleep.delays) == 2


@pytest.mark.parametrize("status", [429, 503])
async def test_a_load_refusal_under_an_adaptive_limit_gets_the_overload_attempts(status):
    # Congestion, not failure: retried up to overload_attempts, each retry under the cut limit.
    fake = FakeServer(script=[httpx.Response(status, text="busy")])
    sleep = RecordedSleep()
    retry = Retry(attempts=3, overload_attempts=7, budget_ratio=0.0, budget_floor=0)
    async with make_client(fake, sleep=sleep, retry=retry) as client:
        with pytest.raises(Overloaded) as info:
            await client.generate("x", max_tokens=1)
    assert info.value.status == status
    assert info.value.attempts == 7
    assert len(fake.requests) == 7 and len(sleep.delays) == 6  # and no budget was needed


async def test_a_load_refusal_under_a_fixed_limit_is_an_ordinary_failure():
    fake = FakeServer(script=[httpx.Response(503, text="busy")])
    async with make_client(fake, retry=Retry(attempts=3), limit=4) as client:
        with pytest.raises(Overloaded) as info:
            await client.generate("x", max_tokens=1)
    assert info.value.attempts == 3 and len(fake.requests) == 3


async def test_a_load_refusal_then_an_error_stops_at_the_attempts():
    # The bound follows the last failure: after a 502 the ordinary attempts apply again.
    fake = FakeServer(
        script=[httpx.Response(503, text="busy")] * 4 + [httpx.Response(502, text="bad gateway")]
    )
    async with make_client(fake, retry=Retry(attempts=3, overload_attempts=9)) as client:
        with pytest.raises(RequestRefused) as info:
            await client.generate("x", max_tokens=1)
    assert info.value.status == 502 and len(fake.requests) == 5


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_other_4xx_are_never_retried(status):
    fake = FakeServer(script=[httpx.Response(status, json={"error": {"message": "no"}})])
    sleep = RecordedSleep()
    async with make_client(fake, sleep=sleep) as client:
        with pytest.raises(RequestRefused) as info:
            await client.generate("x", max_tokens=1)
    assert info.value.status == status
    assert info.value.body
    assert len(fake.requests) == 1 and sleep.delays == []


async def test_server_context_overflow_is_raised_with_counts():
    msg = (
        "This model's maximum context length is 2048 tokens. However, your prompt contains at "
        "least 2049 input tokens, which exceeds this limit even without any output tokens."
    )
    fake = FakeServer(script=[httpx.Response(400, json={"error": {"message": msg, "code": 400}})])
    async with make_client(fake) as client:
        with pytest.raises(ContextOverflow) as info:
            await client.generate("x", max_tokens=1)
    assert (info.value.prompt_tokens, info.value.context_length) == (2049, 2048)


async def test_malformed_json_body():
    fake = FakeServer(script=[httpx.Response(200, text="{not json")])
    async with make_client(fake) as client:
        with pytest.raises(MalformedResponse, match="not JSON"):
            await client.generate("x", max_tokens=1)


async def test_json_without_choices_is_malformed():
    fake = FakeServer(script=[httpx.Response(200, json={"object": "text_completion"})])
    async with make_client(fake) as client:
        with pytest.raises(MalformedResponse, match="lacks the fields"):
            await client.generate("x", max_tokens=1)


class _DroppingStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'{"choices": [{"te'
        raise httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body"
        )


async def test_connection_dropped_mid_body_is_a_connection_error_and_retried():
    fake = FakeServer(script=[lambda req: httpx.Response(200, stream=_DroppingStream())])
    sleep = RecordedSleep()
    async with make_client(fake, sleep=sleep, retry=Retry(attempts=2)) as client:
        with pytest.raises(ConnectionError, match="dropped"):
            await client.generate("x", max_tokens=1)
    assert len(fake.requests) == 2


async def test_connect_error_is_translated_keeping_the_cause():
    fake = FakeServer(script=[httpx.ConnectError("refused")])
    async with make_client(fake, retry=Retry(attempts=1)) as client:
        with pytest.raises(ConnectionError) as info:
            await client.generate("x", max_tokens=1)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


async def test_httpx_timeout_is_translated():
    fake = FakeServer(script=[httpx.ReadTimeout("slow")])
    async with make_client(fake, retry=Retry(attempts=1)) as client:
        with pytest.raises(TimeoutError):
            await client.generate("x", max_tokens=1)


async def test_retry_budget_stops_hammering_a_failing_server():
    fake = FakeServer(script=[httpx.Response(500, text="boom")])
    retry = Retry(attempts=4, budget_ratio=0.0, budget_floor=2)
    async with make_client(fake, retry=retry) as client:
        for _ in range(5):
            with pytest.raises(RequestRefused):
                await client.generate("x", max_tokens=1)
    # 5 first attempts + only the 2 retries the budget allows
    assert len(fake.requests) == 7


async def test_cancelling_a_waiting_call_frees_everything():
    gate = anyio.Event()

    async def slow_handler_response():
        await gate.wait()

    fake = FakeServer()
    async with make_client(fake, max_num_seqs=1, headroom=1.0) as client:
        # hold the only slot with a call that never finishes until cancelled
        async with anyio.create_task_group() as tg:

            async def hold():
                async with client._endpoint.governor.slot(lane="short"):
                    await gate.wait()

            tg.start_soon(hold)
            await anyio.sleep(0.01)
            with anyio.move_on_after(0.05) as scope:
                await client.generate("x", max_tokens=1)
            assert scope.cancelled_caught
            assert client.stats().waiting == 0
            gate.set()
        assert client.in_flight == 0
        result = await client.generate("x", max_tokens=1)
        assert result.text == "hello"


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # both deadline paths
async def test_call_timeout_covers_waiting_for_a_slot(anyio_backend):
    fake = FakeServer()
    async with make_client(fake, max_num_seqs=1, headroom=1.0) as client:
        gate = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def hold():
                async with client._endpoint.governor.slot(lane="short"):
                    await gate.wait()

            tg.start_soon(hold)
            await anyio.sleep(0.01)
            with pytest.raises(TimeoutError, match="timeout"):
                await client.generate("x", max_tokens=1, timeout=0.05)
            gate.set()
        assert client.in_flight == 0


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda c: c.generate(""), ValueError, "prompt is empty"),
        (lambda c: c.generate(123), TypeError, "prompt must be a str"),
        (lambda c: c.generate("x", max_tokens=0), ValueError, "max_tokens must be > 0"),
        (lambda c: c.generate("x", max_tokens=-5), ValueError, "max_tokens must be > 0"),
        (lambda c: c.generate("x", max_tokens=2.5), TypeError, "max_tokens must be an int"),
        (lambda c: c.chat([]), ValueError, "messages is empty"),
        (lambda c: c.chat("hi"), TypeError, "messages must be a list"),
        (lambda c: c.chat([{"content": "no role"}]), TypeError, r"messages\[0\]"),
    ],
)
async def test_bad_input_is_refused_before_sending(call, exc, match):
    fake = FakeServer()
    client = make_client(fake)
    with pytest.raises(exc, match=match):
        await call(client)
    await client.aclose()
    assert fake.requests == []


@pytest.mark.parametrize("url", ["ftp://host", "127.0.0.1:8000", "", "http://"])
def test_base_url_must_be_http(url):
    with pytest.raises(ValueError, match="base_url"):
        AsyncClient(url)


def test_base_url_type_checked():
    with pytest.raises(TypeError, match="base_url"):
        AsyncClient(8000)


async def test_api_key_env_fallbacks(monkeypatch):
    seen = []

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return FakeServer()(request)

    monkeypatch.setenv("OPENAI_API_KEY", "from-openai")
    monkeypatch.setenv("DSCLIENT_API_KEY", "from-dsclient")
    async with AsyncClient("http://h:1", transport=httpx.MockTransport(handler)) as c:
        await c.generate("x", max_tokens=1)
    assert seen[-1] == "Bearer from-dsclient"
    monkeypatch.delenv("DSCLIENT_API_KEY")
    async with AsyncClient("http://h:1", transport=httpx.MockTransport(handler)) as c:
        await c.generate("x", max_tokens=1)
    assert seen[-1] == "Bearer from-openai"
    async with AsyncClient(
        "http://h:1", api_key="explicit", transport=httpx.MockTransport(handler)
    ) as c:
        await c.generate("x", max_tokens=1)
    assert seen[-1] == "Bearer explicit"


async def test_api_key_never_in_repr_logs_or_errors(caplog, monkeypatch):
    monkeypatch.delenv("DSCLIENT_API_KEY", raising=False)
    caplog.set_level(logging.DEBUG)
    fake = FakeServer(
        script=[httpx.Response(503, text="busy"), httpx.Response(401, text="bad key")]
    )
    client = make_client(fake, api_key=SECRET)
    async with client:
        with pytest.raises(RequestRefused) as info:
            await client.generate("x", max_tokens=1)
    texts = [
        repr(client),
        str(client),
        str(info.value),
        repr(info.value),
        caplog.text,
        repr(client.__dict__),
        json.dumps(info.value.body),
    ]
    for t in texts:
        assert SECRET not in t
    sync = dsclient.Client("http://h:1", api_key=SECRET, transport=fake.transport)
    try:
        assert SECRET not in repr(sync)
    finally:
        sync.close()


async def test_stream_yields_deltas_and_records_ttft():
    sse = (
        'data: {"choices": [{"index": 0, "text": "Hel", "finish_reason": null}]}\n\n'
        'data: {"choices": [{"index": 0, "text": "lo", "finish_reason": null}]}\n\n'
        'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
        "data: [DONE]\n\n"
    )
    fake = FakeServer(
        script=[httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})]
    )
    async with make_client(fake) as client:
        async with client.stream("hi", max_tokens=2) as s:
            deltas = [d async for d in s]
        assert client.in_flight == 0
    assert deltas == ["Hel", "lo"]
    assert s.text == "Hello"
    assert s.finish_reason == "length"
    assert s.ttft_s is not None and s.ttft_s >= 0
    assert fake.bodies[0]["stream"] is True


async def test_chat_stream_reads_delta_content():
    sse = (
        'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]}\n\n'
        'data: {"choices": [{"index": 0, "delta": {"content": "Yo"}, "finish_reason": "stop"}]}\n\n'
        "data: [DONE]\n\n"
    )
    fake = FakeServer(script=[httpx.Response(200, text=sse)])
    async with make_client(fake) as client:
        async with client.stream([{"role": "user", "content": "hi"}], max_tokens=2) as s:
            assert [d async for d in s] == ["Yo"]
    assert fake.requests[0].url.path == "/v1/chat/completions"


class _EndlessSSE(httpx.AsyncByteStream):
    def __init__(self):
        self.closed = False

    async def __aiter__(self):
        i = 0
        while True:
            i += 1
            yield f'data: {{"choices": [{{"text": "t{i}", "finish_reason": null}}]}}\n\n'.encode()

    async def aclose(self):
        self.closed = True


async def test_stream_left_half_read_gives_back_connection_and_slot():
    body = _EndlessSSE()
    fake = FakeServer(script=[lambda req: httpx.Response(200, stream=body)])
    async with make_client(fake) as client:
        async with client.stream("hi", max_tokens=100) as s:
            async for _ in s:
                break
        assert body.closed
        assert client.in_flight == 0


async def test_stream_retried_only_before_the_first_byte():
    sse = 'data: {"choices": [{"text": "ok", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    fake = FakeServer(script=[httpx.Response(503), httpx.Response(200, text=sse)])
    sleep = RecordedSleep()
    async with make_client(fake, sleep=sleep) as client, client.stream("hi", max_tokens=2) as s:
        assert [d async for d in s] == ["ok"]
    assert s.attempts == 2 and len(sleep.delays) == 1

    class _DropAfterFirst(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
            raise httpx.RemoteProtocolError("dropped")

    fake = FakeServer(script=[lambda req: httpx.Response(200, stream=_DropAfterFirst())])
    async with make_client(fake) as client:
        with pytest.raises(ConnectionError):
            async with client.stream("hi", max_tokens=2) as s:
                async for _ in s:
                    pass
        assert client.in_flight == 0
    assert len(fake.requests) == 1  # never retried after bytes arrived


async def test_error_event_mid_stream_is_reported():
    sse = 'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    fake = FakeServer(script=[httpx.Response(200, text=sse)])
    async with make_client(fake) as client:
        with pytest.raises(MalformedResponse, match="engine died"):
            async with client.stream("hi", max_tokens=2) as s:
                async for _ in s:
                    pass


async def test_client_is_unusable_after_close():
    fake = FakeServer()
    client = make_client(fake)
    await client.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await client.generate("x", max_tokens=1)


# --- token budget wiring ---------------------------------------------------------------------


def _word_count_tokenize(body):
    # a stand-in for the server's tokenizer: one token per word
    if "prompt" in body:
        return len(body["prompt"].split())
    return sum(len(m["content"].split()) for m in body["messages"]) + 3


async def test_short_prompt_sends_wanted_tokens_without_tokenize():
    calls = []

    def tok(body):
        calls.append(body)
        return _word_count_tokenize(body)

    fake = FakeServer(tokenize=tok)
    async with make_client(fake) as client:
        # Discovery counts its calibration sample once; the call itself counts nothing.
        assert [c["prompt"] for c in calls] == [CALIBRATION_TEXT]
        r = await client.generate("a short prompt", max_tokens=100)
    assert fake.bodies[0]["max_tokens"] == 100 and r.max_tokens == 100
    assert len(calls) == 1
    assert r.lane == "short"


async def test_prompt_near_the_limit_is_counted_exactly_and_max_tokens_cut():
    fake = FakeServer(tokenize=_word_count_tokenize, max_model_len=2048)
    prompt = " ".join(["word"] * 1800)
    async with make_client(fake) as client:
        r = await client.generate(prompt, max_tokens=1000)
    sent = fake.bodies[0]["max_tokens"]
    assert sent == 2048 - 1800 - client._planner.tokens.margin
    assert r.max_tokens == sent
    assert r.lane == "long"


async def test_prompt_that_cannot_fit_raises_before_sending():
    fake = FakeServer(tokenize=_word_count_tokenize, max_model_len=2048)
    prompt = " ".join(["word"] * 2300)
    async with make_client(fake) as client:
        with pytest.raises(ContextOverflow, match="2300") as info:
            await client.generate(prompt)
    assert info.value.prompt_tokens == 2300 and info.value.context_length == 2048
    assert fake.bodies == []


async def test_count_tokens_uses_the_server_when_it_can():
    fake = FakeServer(tokenize=_word_count_tokenize)
    async with make_client(fake) as client:
        assert await client.count_tokens("one two three") == 3
        assert await client.count_tokens("one two three", exact=False) >= 1


async def test_failed_call_reports_its_attempts():
    fake = FakeServer(script=[httpx.Response(502, text="bad gateway")])
    async with make_client(fake, retry=Retry(attempts=3)) as client:
        with pytest.raises(RequestRefused) as info:
            await client.generate("x", max_tokens=1)
        assert info.value.attempts == 3
        results = await client.map(["a"], max_tokens=1, progress=False)
    assert results[0].attempts == 3


async def test_a_launched_server_handle_backs_up_discovery():
    class Handle:  # what dsclient.launcher.Server exposes
        # Not 127.0.0.1:8000: a real server launched there leaves a launch record for it.
        url = "http://fake-launched:8000/v1"
        model = "tiny"
        max_num_seqs = 16
        max_model_len = 4096

    fake = FakeServer(max_model_len=2048)
    async with AsyncClient(Handle(), transport=fake.transport, sleep=RecordedSleep()) as client:
        info = client.server
    assert info.max_num_seqs == 16
    assert info.sources["max_num_seqs"] == "launched Server handle"
    assert info.max_model_len == 2048  # the live server's answer wins over the handle
    assert client.limit == 11
    assert client.url == "http://fake-launched:8000"


def _fine_tokenize(body):
    # A served tokenizer that splits text 3x finer than the local estimate (as the tiny test
    # model's 512-token BPE does against cl100k).
    return 3 * len(body["prompt"].split())


class _NoCalibration(FakeServer):
    """A server whose /tokenize refuses the calibration sample (so the estimate stays raw)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize" and CALIBRATION_TEXT in request.content.decode():
            return httpx.Response(500, text="no")
        return super().__call__(request)


async def test_calibration_puts_a_long_prompt_in_the_long_lane_without_counting_it():
    counted = []

    def tokenize(body):
        counted.append(body["prompt"][:20])
        return _fine_tokenize(body)

    fake = FakeServer(tokenize=tokenize, max_model_len=2048)
    async with make_client(fake, tokenizer=lambda text: len(text.split())) as client:
        assert client._planner.tokens.correction == pytest.approx(3.0)
        # 300 words: 300 locally, 900 served; even the low end of the bound (after a single
        # calibration sample) + 64 out is over the 512 threshold, so no count is needed.
        r = await client.generate(" ".join(["word"] * 300), max_tokens=64)
    assert r.lane == "long"
    assert len(counted) == 1  # the calibration sample only


async def test_an_estimate_straddling_the_lane_threshold_is_counted_exactly():
    counted = []

    def tokenize(body):
        counted.append(body["prompt"])
        return _fine_tokenize(body)

    fake = _NoCalibration(tokenize=tokenize, max_model_len=2048)
    async with make_client(fake, tokenizer=lambda text: len(text.split())) as client:
        assert client._planner.tokens.samples == 0
        # 250 words: estimate 250 +- 133 (+ 256 out) straddles 512; served it is 750 + 256.
        r = await client.generate(" ".join(["word"] * 250), max_tokens=256)
        assert r.lane == "long"
        assert client._planner.tokens.correction == pytest.approx(3.0)  # learned from that count
        # Clearly short prompts are never counted, even before calibration.
        r = await client.generate("a b c", max_tokens=16)
        assert r.lane == "short"
    assert len(counted) == 1 and counted[0].startswith("word")  # the straddler only


async def test_observers_hear_every_call_and_cannot_break_it():
    from dsclient._observe import CallRecord

    fake = FakeServer(
        script=[
            httpx.Response(200, json=completion_body(prompt_tokens=3, completion_tokens=2)),
            httpx.Response(400, json={"error": {"message": "no"}}),
        ]
    )
    records: list[CallRecord] = []

    def broken(record):
        raise RuntimeError("observer bug")

    async with make_client(fake) as client:
        client._caller.observers += [records.append, broken]
        await client.generate("x", max_tokens=2)
        with pytest.raises(RequestRefused):
            await client.generate("y", max_tokens=2)
    ok, failed = records
    assert ok.ok and ok.kind == "completion" and ok.lane == "short" and ok.attempts == 1
    assert (ok.prompt_tokens, ok.completion_tokens) == (3, 2)
    assert not failed.ok and failed.error == "RequestRefused" and failed.status == 400


async def test_public_surface_servers_limit_raise_and_observers() -> None:
    """``client.servers``, ``on_limit_raise`` and ``add_observer``: the surface the batch runner,
    the metrics and the CLI use instead of the client's privates."""
    import dsclient
    from dsclient._http import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 2048}]})
        if request.url.path == "/v1/completions":
            return httpx.Response(
                200,
                json={
                    "choices": [{"text": "ok", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                },
            )
        return httpx.Response(404)

    seen: list[dsclient.CallRecord] = []
    async with dsclient.AsyncClient(
        "http://s:1", transport=httpx.MockTransport(handler), max_num_seqs=10
    ) as client:
        (view,) = client.servers
        assert isinstance(view, dsclient.ServerView)
        assert view.url == "http://s:1" and view.health == "up" and view.limit == client.limit
        assert view.info is not None and view.info.model == "m"
        remove = client.add_observer(seen.append)
        await client.generate("hi", max_tokens=2)
        remove()
        await client.generate("hi", max_tokens=2)
        assert len(seen) == 1 and seen[0].server == "http://s:1"
        raised: list[int] = []
        drop = client.on_limit_raise(lambda: raised.append(client.limit))
        client._endpoint.controller.limit = client.limit + 3  # what a controller move does
        client._endpoint._apply()
        drop()
        assert raised == [view.limit + 3]


async def test_a_server_without_metrics_is_asked_for_its_load_on_each_answer() -> None:
    load = "TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.1"

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=completion_body(), headers={"endpoint-load-metrics": load})

    fake = FakeServer(script=[answer])
    async with make_client(fake) as client:
        assert client.stats().control.mode == "throughput"
        await client.generate("hi", max_tokens=2)
        assert fake.requests[0].headers["endpoint-load-metrics-format"] == "TEXT"
        control = client.stats().control
        assert (control.mode, control.signal) == ("metrics", "endpoint-load-metrics")
        assert control.signal_age_s is not None


async def test_a_server_that_does_not_answer_with_its_load_stays_in_throughput_mode() -> None:
    fake = FakeServer()
    async with make_client(fake) as client:
        for _ in range(3):
            await client.generate("hi", max_tokens=2)
        control = client.stats().control
        assert (control.mode, control.signal) == ("throughput", "throughput")
        # The first call asks for the load header (one a half period asks: test_endpoint).
        assert fake.requests[0].headers.get("endpoint-load-metrics-format") == "TEXT"

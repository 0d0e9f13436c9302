"""The governed transport under the openai SDK and httpx (dsclient/client/_transport.py), against a
stub server behind ``httpx.MockTransport``: the limit holds, streams keep their slot until
closed, the server's errors come back as the SDK's own types, max_tokens that cannot fit is
refused (or cut), and the client's options never reach the server."""

from __future__ import annotations

import json
import random
from typing import Any

import anyio
import openai
import pytest

from dsclient import AsyncClient, Client, Retry
from dsclient._http import httpx
from dsclient.client._sdk_plan import overflow_message, parse_options, usage_of

from .fakes import RecordedSleep, chat_body, completion_body

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:8000"
MSGS = [{"role": "user", "content": "hi"}]
INFERENCE = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


class Stub:
    """An async OpenAI-compatible server: counts requests in flight at once, answers from a
    script, and streams SSE bodies chunk by chunk (``gate`` holds the stream mid-way)."""

    def __init__(self, *, hold: float = 0.0) -> None:
        self.hold = hold
        self.in_flight = 0
        self.peak = 0
        self.requests: list[httpx.Request] = []
        self.bodies: list[dict[str, Any]] = []
        self.script: list[Any] = []
        self.stream_closed = anyio.Event()
        self.gate: anyio.Event | None = None
        self.health_checks = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(
                200, json={
                    "object": "list",
                    "data": [{"id": "tiny", "owned_by": "vllm", "max_model_len": 2048}],
                }
            )
        if path == "/tokenize":
            body = json.loads(request.content)
            text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
            return httpx.Response(200, json={"count": len(text.split())})  # a token a word
        if path == "/health":
            self.health_checks += 1
            return httpx.Response(200)
        if request.method != "POST" or path not in INFERENCE:
            return httpx.Response(404, json={"detail": "Not Found"})
        self.requests.append(request)
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.script:
            step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            if isinstance(step, BaseException):
                raise step
            return step
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=self._sse())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await anyio.sleep(self.hold)
        finally:
            self.in_flight -= 1
        if path == "/v1/embeddings":
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                    "model": "tiny",
                    "usage": {"prompt_tokens": 2, "total_tokens": 2},
                },
            )
        data = chat_body() if path == "/v1/chat/completions" else completion_body()
        return httpx.Response(200, json=data)

    def _sse(self) -> httpx.AsyncByteStream:
        stub = self

        class SSE(httpx.AsyncByteStream):
            async def __aiter__(self):
                for i in range(5):
                    if i == 2 and stub.gate is not None:
                        await stub.gate.wait()
                    chunk = {
                        "id": "c",
                        "object": "chat.completion.chunk",
                        "created": 1,
                        "model": "tiny",
                        "choices": [
                            {"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}
                        ],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            async def aclose(self) -> None:
                stub.stream_closed.set()

        return SSE()

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def make_client(stub: Stub, **kwargs: Any) -> AsyncClient:
    kwargs.setdefault("rng", random.Random(0))
    kwargs.setdefault("sleep", RecordedSleep())
    kwargs.setdefault("adaptive", False)
    return AsyncClient(URL, transport=stub.transport, **kwargs)


# -- options (pure) -------------------------------------------------------------------------------
def test_parse_options_reads_headers_then_the_body_field():
    defaults = {"urgency": 0, "group": None, "overflow": "refuse"}
    headers = httpx.Headers({"X-DSClient-Urgency": " 3 ", "x-dsclient-group": "batch"})
    assert parse_options(headers, None, **defaults) == (3, "batch", "refuse")
    assert parse_options(headers, {"urgency": -1, "overflow": "cut"}, **defaults) == (
        -1,
        "batch",
        "cut",
    )
    assert parse_options({}, None, urgency=2, group="g", overflow="cut") == (2, "g", "cut")


@pytest.mark.parametrize(
    ("headers", "field", "match"),
    [
        ({"x-dsclient-urgency": "high"}, None, "urgency must be an integer"),
        ({}, {"urgency": 1.5}, "urgency must be an integer"),
        ({}, {"group": ""}, "group must be a non-empty string"),
        ({"x-dsclient-overflow": "clip"}, None, "overflow must be 'refuse' or 'cut'"),
        ({}, {"priority": 1}, "unknown keys"),
        ({}, "batch", "must be an object"),
    ],
)
def test_parse_options_refuses_bad_values_by_name(headers, field, match):
    with pytest.raises(ValueError, match=match):
        parse_options(headers, field, urgency=0, group=None, overflow="refuse")


def test_overflow_message_has_the_counts_and_the_way_out():
    text = overflow_message(prompt_tokens=1200, requested=1900, context=2048, field="max_tokens")
    assert "max_tokens=1900" in text and "1200 tokens" in text and "2048" in text
    assert "room for 848" in text and "x-dsclient-overflow: cut" in text


# -- the limit ----------------------------------------------------------------------------------
async def test_the_server_never_sees_more_in_flight_than_the_limit():
    stub = Stub(hold=0.01)
    async with make_client(stub, limit=3) as client:
        sdk = client.openai()

        async def one(i: int) -> None:
            if i % 2:
                r = await sdk.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4)
                assert r.choices[0].message.content == "hi there"
            else:
                c = await sdk.completions.create(model="tiny", prompt="hello", max_tokens=4)
                assert c.choices[0].text == "hello"

        async with anyio.create_task_group() as tg:
            for i in range(30):
                tg.start_soon(one, i)
        assert len(stub.requests) == 30
        assert stub.peak == 3  # reached, never passed
        assert client.in_flight == 0
        assert client.stats().lanes["short"].done == 30


async def test_httpx_client_is_governed_for_inference_only():
    stub = Stub(hold=0.01)
    async with make_client(stub, limit=2) as client:
        http = client.httpx()
        models = await http.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        assert client.stats().lanes["short"].done == 0  # passed through, no slot

        async def one() -> None:
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(one)
        assert stub.peak == 2
        assert client.stats().lanes["short"].done == 10


async def test_groups_and_their_caps_apply_through_the_sdk():
    stub = Stub(hold=0.01)
    async with make_client(stub, limit=4, group_caps={"batch": 0.5}) as client:
        sdk = client.openai(group="batch")

        async def one() -> None:
            await sdk.completions.create(model="tiny", prompt="x", max_tokens=2)

        async with anyio.create_task_group() as tg:
            for _ in range(12):
                tg.start_soon(one)
        assert stub.peak == 2  # half of 4


async def test_options_are_stripped_before_sending_and_the_rest_passes_untouched():
    stub = Stub()
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with make_client(stub) as client:
        sdk = client.openai()
        await sdk.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=4,
            tools=tools,
            response_format=fmt,
            extra_headers={"x-dsclient-urgency": "5", "x-dsclient-group": "ui"},
            extra_body={"dsclient": {"overflow": "cut"}, "top_k": 3},
        )
    sent = stub.bodies[-1]
    assert "dsclient" not in sent
    assert sent["tools"] == tools and sent["response_format"] == fmt and sent["top_k"] == 3
    assert not any(k.lower().startswith("x-dsclient") for k in stub.requests[-1].headers)


async def test_the_request_sent_merges_the_clients_headers_under_the_sdks_as_httpx_would():
    stub = Stub()
    stub.script = [httpx.Response(500, text="boom"), httpx.Response(200, json=completion_body())]
    async with make_client(
        stub, headers={"x-team": "search", "User-Agent": "mine/1"}, retry=Retry(attempts=2)
    ) as client:
        sdk = client.openai(default_headers={"x-team": "ads"})
        await sdk.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_headers={"x-other": "1"}
        )
    first, second = stub.requests  # the retry sends the same request again
    for request in (first, second):
        headers = request.headers
        assert headers["host"] == "127.0.0.1:8000"
        assert headers["x-team"] == "ads"  # the SDK's value wins, as in httpx's own merge
        assert headers["user-agent"].startswith("AsyncOpenAI/")
        assert headers["x-other"] == "1"
        assert headers["content-length"] == str(len(request.content))
        assert headers["authorization"] == "Bearer EMPTY"  # the client has no key of its own
        assert len(headers.get_list("x-team")) == 1
        assert str(request.url) == URL + "/v1/completions"
    assert first.content == second.content
    assert json.loads(first.content) == {"model": "tiny", "prompt": "x", "max_tokens": 2}


async def test_urgency_from_a_header_goes_first():
    stub = Stub(hold=0.05)
    order: list[str] = []
    async with make_client(stub, limit=1) as client:
        sdk = client.openai()

        async def one(name: str, urgency: int) -> None:
            await sdk.completions.create(
                model="tiny",
                prompt=name,
                max_tokens=2,
                extra_headers={"x-dsclient-urgency": str(urgency)},
            )
            order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "first", 0)
            await anyio.sleep(0.01)  # "first" holds the only slot
            tg.start_soon(one, "low", 0)
            await anyio.sleep(0.01)
            tg.start_soon(one, "high", 9)
    assert order == ["first", "high", "low"]


async def test_lanes_come_from_the_body_and_show_in_raw_headers():
    stub = Stub()
    async with make_client(stub) as client:
        sdk = client.openai()
        raw = await sdk.completions.with_raw_response.create(
            model="tiny", prompt="word " * 300, max_tokens=400
        )
        assert raw.headers["x-dsclient-lane"] == "long"
        assert raw.status_code == 200 and raw.parse().choices[0].text == "hello"
        raw = await sdk.chat.completions.with_raw_response.create(
            model="tiny", messages=MSGS, max_tokens=8
        )
        assert raw.headers["x-dsclient-lane"] == "short"
        assert raw.headers["x-dsclient-attempts"] == "1"
        stats = client.stats()
        assert stats.lanes["long"].done == 1 and stats.lanes["short"].done == 1


async def test_embeddings_go_through_the_governor():
    stub = Stub()
    async with make_client(stub) as client:
        sdk = client.openai()
        r = await sdk.embeddings.create(model="tiny", input="hello")
        assert r.data[0].embedding == [0.1, 0.2]
        assert client.stats().lanes["short"].done == 1


# -- streams ------------------------------------------------------------------------------------
async def test_a_stream_holds_its_slot_until_it_ends():
    stub = Stub()
    async with make_client(stub, limit=2) as client:
        sdk = client.openai()
        stream = await sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=8, stream=True
        )
        assert client.in_flight == 1
        texts = [chunk.choices[0].delta.content async for chunk in stream]
        assert texts == ["t0", "t1", "t2", "t3", "t4"]
        assert client.in_flight == 0
        assert client.stats().lanes["short"].done == 1


async def test_closing_a_stream_early_gives_the_slot_back():
    stub = Stub()
    stub.gate = anyio.Event()  # never set: the server stalls after two chunks
    async with make_client(stub, limit=2) as client:
        sdk = client.openai()
        stream = await sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=8, stream=True
        )
        first = await stream.__anext__()
        assert first.choices[0].delta.content == "t0"
        assert client.in_flight == 1
        await stream.close()
        assert client.in_flight == 0
        assert stub.stream_closed.is_set()
        stats = client.stats().lanes["short"]
        assert stats.done == 1 and stats.failed == 0


async def test_a_stream_breaking_off_the_loop_gives_the_slot_back():
    stub = Stub()
    async with make_client(stub, limit=1) as client:
        sdk = client.openai()
        async with await sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=8, stream=True
        ) as stream:
            async for _chunk in stream:
                break
        assert client.in_flight == 0
        # The only slot is free again: the next call gets it.
        await sdk.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)


# -- errors -------------------------------------------------------------------------------------
VLLM_400 = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, your prompt "
        "contains at least 2049 input tokens ...",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}


async def test_a_refusal_comes_back_as_the_sdks_own_error_with_the_servers_body():
    stub = Stub()
    stub.script = [httpx.Response(400, json=VLLM_400, headers={"x-request-id": "r1"})]
    async with make_client(stub) as client:
        sdk = client.openai()
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.status_code == 400
        assert info.value.body == VLLM_400["error"]
        assert info.value.response.headers["x-request-id"] == "r1"
        assert len(stub.requests) == 1  # a 400 is not retried
        stub.script = [httpx.Response(404, json={"detail": "Not Found"})]
        with pytest.raises(openai.NotFoundError):
            await sdk.completions.create(model="nope", prompt="x", max_tokens=2)


async def test_dsclient_retries_once_in_one_place_then_hands_back_the_last_answer():
    stub = Stub()
    stub.script = [httpx.Response(503, json={"error": {"message": "busy", "code": 503}})]
    sleep = RecordedSleep()
    async with make_client(stub, retry=Retry(attempts=3), sleep=sleep) as client:
        sdk = client.openai()
        with pytest.raises(openai.InternalServerError) as info:
            await sdk.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.body == {"message": "busy", "code": 503}
        assert len(stub.requests) == 3  # dsclient's three tries; openai added none
        assert len(sleep.delays) == 2
        assert client.in_flight == 0


async def test_a_retry_that_succeeds_is_one_answer_to_the_sdk():
    stub = Stub()
    stub.script = [httpx.Response(500, text="boom"), httpx.Response(200, json=completion_body())]
    async with make_client(stub, retry=Retry(attempts=3)) as client:
        raw = await client.openai().completions.with_raw_response.create(
            model="tiny", prompt="x", max_tokens=2
        )
        assert raw.headers["x-dsclient-attempts"] == "2"
        assert raw.parse().choices[0].text == "hello"


async def test_a_transport_failure_is_the_sdks_connection_error():
    stub = Stub()
    stub.script = [httpx.ConnectError("refused")]
    async with make_client(stub, retry=Retry(attempts=2), outage_wait=1.0) as client:
        with pytest.raises(openai.APIConnectionError) as info:
            await client.openai().completions.create(model="tiny", prompt="x", max_tokens=2)
        assert isinstance(info.value.__cause__, httpx.ConnectError)
        assert client.in_flight == 0


async def test_the_sdks_timeout_bounds_the_wait_for_a_slot():
    stub = Stub(hold=30.0)
    async with make_client(stub, limit=1) as client:
        sdk = client.openai()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: sdk.completions.create(model="tiny", prompt="x", max_tokens=2))
            await anyio.sleep(0.01)  # the first call holds the only slot
            with pytest.raises(openai.APITimeoutError):
                await sdk.completions.create(model="tiny", prompt="y", max_tokens=2, timeout=0.2)
            assert len(stub.requests) == 1  # the second never reached the server
            tg.cancel_scope.cancel()
        assert client.in_flight == 0


async def test_a_full_client_queue_is_a_rate_limit_error():
    stub = Stub(hold=30.0)
    async with make_client(stub, limit=1, max_queue=1) as client:
        sdk = client.openai()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: sdk.completions.create(model="tiny", prompt="a", max_tokens=2))
            await anyio.sleep(0.01)
            tg.start_soon(lambda: sdk.completions.create(model="tiny", prompt="b", max_tokens=2))
            await anyio.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as info:
                await sdk.completions.create(model="tiny", prompt="c", max_tokens=2)
            assert info.value.response.headers["x-dsclient-refused"] == "queue-full"
            tg.cancel_scope.cancel()


async def test_openai_retries_cannot_be_turned_back_on():
    async with make_client(Stub()) as client:
        with pytest.raises(ValueError, match="max_retries must be 0"):
            client.openai(max_retries=2)
        assert client.openai().max_retries == 0


# -- max_tokens that cannot fit -----------------------------------------------------------------
async def test_max_tokens_that_cannot_fit_is_refused_before_sending():
    stub = Stub()
    prompt = "word " * 1200  # 1200 tokens by the stub's count
    async with make_client(stub) as client:
        sdk = client.openai()
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model="tiny", prompt=prompt, max_tokens=1900)
        assert stub.requests == []
        message = str(info.value)
        assert "max_tokens=1900" in message and "1200 tokens" in message and "2048" in message
        assert info.value.response.headers["x-dsclient-refused"] == "context"
        # The same request fits once max_tokens does (the margin is not held against it).
        await sdk.completions.create(model="tiny", prompt=prompt, max_tokens=848)
        assert stub.bodies[-1]["max_tokens"] == 848


async def test_max_tokens_is_cut_where_the_caller_asks():
    stub = Stub()
    async with make_client(stub) as client:
        sdk = client.openai()
        await sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "word " * 1200}],
            max_completion_tokens=1900,
            extra_headers={"x-dsclient-overflow": "cut"},
        )
        cut = stub.bodies[-1]["max_completion_tokens"]
        assert 0 < cut <= 2048 - 1200
        cutting = client.openai(overflow="cut")
        await cutting.completions.create(model="tiny", prompt="word " * 1200, max_tokens=1900)
        assert 0 < stub.bodies[-1]["max_tokens"] <= 848


async def test_a_prompt_that_cannot_fit_at_all_is_refused():
    stub = Stub()
    async with make_client(stub) as client:
        with pytest.raises(openai.BadRequestError, match="2048"):
            await client.openai().completions.create(model="tiny", prompt="word " * 2100)
        assert stub.requests == []


# -- keys ---------------------------------------------------------------------------------------
async def test_the_clients_key_replaces_the_sdks_and_shows_nowhere():
    stub = Stub()
    key = "sk-secret-123456"
    async with make_client(stub, api_key=key) as client:
        sdk = client.openai()
        assert key not in repr(sdk.api_key) and key not in repr(client._http._transport)
        await sdk.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert stub.requests[-1].headers["authorization"] == f"Bearer {key}"
        stub.script = [httpx.Response(400, text=f"echo: Bearer {key}")]
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert key not in str(info.value) and key not in info.value.response.text


# -- the sync client ----------------------------------------------------------------------------
def test_the_sync_client_gives_openai_and_httpx_clients():
    stub = Stub()
    with Client(URL, transport=stub.transport, adaptive=False) as client:
        records: list[Any] = []
        client._async._caller.observers.append(records.append)
        sdk = client.openai()
        assert isinstance(sdk, openai.OpenAI) and sdk.max_retries == 0
        r = sdk.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4)
        assert r.choices[0].message.content == "hi there"
        with sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=4, stream=True
        ) as stream:
            texts = [c.choices[0].delta.content for c in stream]
        assert texts == ["t0", "t1", "t2", "t3", "t4"]
        assert client.in_flight == 0
        stub.script = [httpx.Response(422, json={"detail": "bad"})]
        with pytest.raises(openai.UnprocessableEntityError):
            sdk.completions.create(model="tiny", prompt="x", max_tokens=2)
        stub.script = []
        http = client.httpx()
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert http.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"]
        assert client.stats().lanes["short"].done == 3
    assert [(r.kind, r.error, r.status) for r in records] == [
        ("chat", None, None),
        ("stream", None, None),
        ("completion", "RequestRefused", 422),
        ("completion", None, None),
    ]


def test_the_sync_stream_closed_early_gives_the_slot_back():
    stub = Stub()
    with Client(URL, transport=stub.transport, adaptive=False) as client:
        sdk = client.openai()
        stream = sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=4, stream=True
        )
        next(iter(stream))
        assert client.in_flight == 1
        stream.close()
        assert client.in_flight == 0


# -- LangChain ----------------------------------------------------------------------------------
async def test_langchain_takes_the_httpx_client():
    from langchain_openai import ChatOpenAI

    stub = Stub(hold=0.01)
    async with make_client(stub, limit=2) as client:
        llm = ChatOpenAI(
            base_url=client.url + "/v1",
            api_key="EMPTY",
            model="tiny",
            max_retries=0,
            max_tokens=4,
            http_async_client=client.httpx(),
        )
        answers = await llm.abatch(["a", "b", "c", "d", "e", "f"])
        assert [a.content for a in answers] == ["hi there"] * 6
        assert stub.peak == 2


# -- observers (dsclient.metrics) ---------------------------------------------------------------
def observed(client: AsyncClient) -> list[Any]:
    records: list[Any] = []
    client._caller.observers.append(records.append)
    return records


async def test_calls_through_the_sdk_reach_the_clients_observers():
    stub = Stub()
    async with make_client(stub, retry=Retry(attempts=3)) as client:
        records = observed(client)
        sdk = client.openai(group="batch")
        await sdk.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4)
        await sdk.embeddings.create(model="tiny", input="hello")
        stub.script = [httpx.Response(503, json={"error": {"message": "busy"}})]
        with pytest.raises(openai.InternalServerError):
            await sdk.completions.create(model="tiny", prompt="x", max_tokens=2)
        stub.script = []
        with pytest.raises(openai.BadRequestError):  # refused before sending
            await sdk.completions.create(model="tiny", prompt="word " * 1200, max_tokens=1900)
        await client.httpx().get("/v1/models")  # not a call: not observed
    chat, embedding, busy, refused = records
    assert (chat.kind, chat.lane, chat.group, chat.error, chat.status) == (
        "chat", "short", "batch", None, None
    )
    assert (chat.prompt_tokens, chat.completion_tokens, chat.attempts) == (5, 3, 1)
    assert chat.queued_s is not None and chat.latency_s >= 0
    assert (embedding.kind, embedding.prompt_tokens, embedding.completion_tokens) == (
        "embedding", 2, None
    )
    assert (busy.error, busy.status, busy.attempts, busy.queued_s) == ("Overloaded", 503, 3, None)
    assert (refused.error, refused.status, refused.lane, refused.attempts) == (
        "ContextOverflow", 400, None, 1
    )


async def test_a_stream_is_observed_when_it_ends_with_the_usage_it_carried():
    stub = Stub()
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    sse = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny",'
        b'"choices":[{"index":0,"delta":{"content":"\\"usage\\": {}"},"finish_reason":null}]}\n\n'
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"tiny",'
        b'"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\ndata: [DONE]\n\n"
    )
    async with make_client(stub) as client:
        records = observed(client)
        sdk = client.openai()
        stream = await sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=8, stream=True
        )
        assert records == []  # not before it ends
        texts = [c.choices[0].delta.content async for c in stream]
        assert texts == ["t0", "t1", "t2", "t3", "t4"]
        stub.script = [
            httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse)
        ]
        stream = await sdk.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        [c async for c in stream]
        stub.script = []
        stub.gate = anyio.Event()  # stalls after two chunks: closed early by the caller
        stream = await sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=8, stream=True
        )
        await stream.__anext__()
        await stream.close()
    plain, counted, closed = records
    assert (plain.kind, plain.error, plain.prompt_tokens, plain.completion_tokens) == (
        "stream", None, None, None
    )
    assert (counted.prompt_tokens, counted.completion_tokens) == (7, 5)
    assert (closed.kind, closed.error) == ("stream", None)


async def test_an_observer_that_raises_does_not_fail_the_call_or_keep_the_slot():
    def broken(record: Any) -> None:
        raise RuntimeError("observer bug")

    stub = Stub()
    async with make_client(stub, limit=1) as client:
        client._caller.observers.append(broken)
        sdk = client.openai()
        await sdk.completions.create(model="tiny", prompt="x", max_tokens=2)
        stream = await sdk.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=8, stream=True
        )
        [c async for c in stream]
        assert client.in_flight == 0


def test_usage_is_found_at_the_end_without_parsing_the_rest():
    body = json.dumps(
        {"choices": [{"text": '"usage": {"prompt_tokens": 99}'}], "usage": {"prompt_tokens": 4}}
    ).encode()
    assert usage_of(body) == (4, None)
    assert usage_of(b'{"usage": null}') == (None, None)
    assert usage_of(b'{"usage": {"prompt_tokens": true, "completion_tokens": 3}}') == (None, 3)
    assert usage_of(b'{"usage": {"prompt_tokens": 1') == (None, None)  # cut off
    assert usage_of(b"no json at all") == (None, None)


# -- timeouts -----------------------------------------------------------------------------------
async def test_the_sdks_timeout_bounds_a_call_the_server_stalls():
    stub = Stub(hold=30.0)
    async with make_client(stub) as client:
        records = observed(client)
        with anyio.fail_after(5):
            with pytest.raises(openai.APITimeoutError):
                await client.openai().completions.create(
                    model="tiny", prompt="x", max_tokens=2, timeout=0.2
                )
        assert client.in_flight == 0
    assert records[0].error == "TimeoutError"


async def test_the_sdks_timeout_bounds_the_retries_and_their_backoff():
    stub = Stub()
    stub.script = [httpx.Response(500, text="boom")]
    # Real sleeps: Retry's backoff (base 2 s) would take longer than the timeout.
    async with make_client(stub, retry=Retry(attempts=5, base=2.0), sleep=anyio.sleep) as client:
        with anyio.fail_after(5):
            with pytest.raises(openai.APITimeoutError):
                await client.openai().completions.create(
                    model="tiny", prompt="x", max_tokens=2, timeout=0.3
                )
        assert client.in_flight == 0
        assert len(stub.requests) < 5


async def test_the_sdks_timeout_bounds_reading_a_stalled_stream():
    stub = Stub()
    stub.gate = anyio.Event()  # never set: the server stalls after two chunks
    async with make_client(stub) as client:
        stream = await client.openai().chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=8, stream=True, timeout=0.3
        )
        with anyio.fail_after(5):
            with pytest.raises((httpx.ReadTimeout, openai.APITimeoutError)):
                [c async for c in stream]
        assert client.in_flight == 0


async def test_a_stream_the_server_refuses_is_the_sdks_own_error():
    stub = Stub()
    stub.script = [httpx.Response(429, json={"error": {"message": "slow down"}})]
    async with make_client(stub, retry=Retry(attempts=1)) as client:
        with pytest.raises(openai.RateLimitError) as info:
            await client.openai().chat.completions.create(
                model="tiny", messages=MSGS, max_tokens=8, stream=True
            )
        assert info.value.status_code == 429
        assert client.in_flight == 0

"""The real openai and langchain-openai packages over client.openai() / client.httpx(), against
the real tiny vLLM started by dsclient's launcher (max_num_seqs 8, context 2048)."""

from __future__ import annotations

import random

import anyio
import openai
import pytest

from dsclient import AsyncClient, Client
from dsclient._observe import CallRecord

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

WORDS = (
    "the a server batch token lane queue model request answer time fast slow river stone light "
    "paper window garden music number letter yellow purple mountain ocean"
).split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


class PeakWatch:
    """Samples the client's in-flight count while a block runs (the governor's own gauge; the
    server's /metrics lag by a scrape)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.peak = 0
        self.samples = 0

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, self.client.in_flight)
            self.samples += 1
            await anyio.sleep(0.002)


async def test_openai_chat_completions_stream_and_raw(vllm_server):
    async with AsyncClient(vllm_server) as client:
        records: list[CallRecord] = []  # what dsclient.metrics counts
        client._caller.observers.append(records.append)
        sdk = client.openai()
        chat = await sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 6
        assert chat.choices[0].message.role == "assistant"
        done = await sdk.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert done.usage is not None and done.usage.completion_tokens == 5
        raw = await sdk.completions.with_raw_response.create(
            model="tiny", prompt=words(700, 1), max_tokens=64
        )
        assert raw.status_code == 200 and raw.headers["x-dsclient-lane"] == "long"
        assert raw.parse().choices[0].text is not None

        stream = await sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me"}],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert client.in_flight == 1  # the slot is held while the stream is open
        seen = 0
        async for _chunk in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        assert client.in_flight == 0
        stream = await sdk.completions.create(
            model="tiny",
            prompt="Count",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
        assert client.in_flight == 0
        stats = client.stats()
        assert stats.lanes["short"].done == 4 and stats.lanes["long"].done == 1
    kinds = ["chat", "completion", "completion", "stream", "stream"]
    assert [r.kind for r in records] == kinds
    assert [r.lane for r in records] == ["short", "short", "long", "short", "short"]
    assert all(r.error is None and r.attempts == 1 and r.latency_s > 0 for r in records)
    # Tokens from the answers' usage; a stream's from its last chunk, when it asked for one.
    counted = [r.completion_tokens for r in records]
    assert counted[:2] == [6, 5] and counted[3:] == [None, 12]
    assert counted[2] is not None and 1 <= counted[2] <= 64  # no ignore_eos: may stop early
    assert all(r.prompt_tokens for i, r in enumerate(records) if i != 3)


async def test_openai_errors_are_its_own_with_the_servers_status(vllm_server):
    async with AsyncClient(vllm_server) as client:
        sdk = client.openai()
        with pytest.raises(openai.NotFoundError) as info:
            await sdk.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        assert info.value.status_code == 404
        assert "no-such-model" in str(info.value.body)
        # A prompt longer than the context: vLLM's own 400, through dsclient's pre-check.
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model="tiny", prompt=words(3000, 2), max_tokens=4)
        assert "2048" in str(info.value)
        # max_tokens that cannot fit: refused before sending (vLLM 0.32 would clamp it).
        prompt = words(400, 3)
        n = await client.count_tokens(prompt)
        assert 600 < n < 2048
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model="tiny", prompt=prompt, max_tokens=2048 - n + 50)
        assert info.value.response.headers["x-dsclient-refused"] == "context"
        assert f"{n} tokens" in str(info.value)
        assert client.stats().lanes["long"].done + client.stats().lanes["short"].done == 0
        # ... or cut, when asked.
        cut = await sdk.completions.with_raw_response.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2048 - n + 50,
            extra_headers={"x-dsclient-overflow": "cut"},
            extra_body={"ignore_eos": True},
        )
        usage = cut.parse().usage
        assert usage is not None and usage.prompt_tokens + usage.completion_tokens <= 2048


async def test_openai_under_load_never_passes_the_limit(vllm_server):
    async with AsyncClient(vllm_server, adaptive=False) as client:
        sdk = client.openai()
        watch = PeakWatch(client)

        async def one(i: int) -> None:
            r = await sdk.completions.create(
                model="tiny", prompt=words(20, i), max_tokens=8, extra_body={"ignore_eos": True}
            )
            assert r.usage is not None and r.usage.completion_tokens == 8

        async with anyio.create_task_group() as outer:
            outer.start_soon(watch.run)
            async with anyio.create_task_group() as tg:
                for i in range(60):
                    tg.start_soon(one, i)
            outer.cancel_scope.cancel()
        assert watch.samples > 10
        assert watch.peak == client.limit == 5  # floor(0.7 x 8): reached, never passed
        assert client.stats().lanes["short"].done == 60


def test_sync_openai_client(vllm_server):
    with Client(vllm_server) as client:
        sdk = client.openai()
        r = sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert r.choices[0].message.role == "assistant"
        with sdk.completions.create(
            model="tiny",
            prompt="Once",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ) as stream:
            chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        assert client.in_flight == 0
        models = client.httpx().get("/v1/models").json()
        assert models["data"][0]["id"] == "tiny"


async def test_langchain_ainvoke_and_abatch_of_hundreds(vllm_server):
    from langchain_openai import ChatOpenAI

    async with AsyncClient(vllm_server, adaptive=False) as client:
        llm = ChatOpenAI(
            base_url=client.url + "/v1",
            api_key="EMPTY",
            model="tiny",
            max_tokens=4,
            max_retries=0,
            http_async_client=client.httpx(),
        )
        one = await llm.ainvoke("Hello there")
        assert isinstance(one.content, str)
        assert client.stats().lanes["short"].done == 1

        watch = PeakWatch(client)
        prompts = [f"Say something about {words(6, i)}" for i in range(300)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.run)
            answers = await llm.abatch(prompts)  # no max_concurrency: all 300 at once
            tg.cancel_scope.cancel()
        assert len(answers) == 300 and all(isinstance(a.content, str) for a in answers)
        assert watch.peak == client.limit == 5
        stats = client.stats().lanes["short"]
        assert stats.done == 301 and stats.failed == 0

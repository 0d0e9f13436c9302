"""The closed loop against real vLLM servers: behaviour, not timings.

The launched server (``vllm_server``: max_num_seqs 8, known from the launch record) and a plain
one started by hand (``plain_vllm_server``: max_num_seqs 12 unknown to the client,
``--max-num-queued-reqs 32``).
"""

from __future__ import annotations

import logging
import re

import anyio
import httpx
import pytest

import dsclient
from dsclient import AsyncClient
from tests.conftest import PLAIN_MAX_NUM_SEQS
from tests.integration.test_client_integration import words

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def _gauge(text: str, name: str) -> float:
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    )


class Watch:
    """Samples the client's limit / in-flight and the server's running / waiting while it runs."""

    def __init__(self, client: AsyncClient, url: str) -> None:
        self.client, self.url = client, url
        self.rows: list[tuple[int, int, float, float]] = []

    async def run(self, done: anyio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            while not done.is_set():
                text = (await http.get("/metrics")).text
                self.rows.append(
                    (
                        self.client.limit,
                        self.client.in_flight,
                        _gauge(text, "vllm:num_requests_running"),
                        _gauge(text, "vllm:num_requests_waiting"),
                    )
                )
                await anyio.sleep(0.05)


async def _map_watched(
    client: AsyncClient, url: str, prompts: list[str], max_tokens: int = 32
) -> tuple[Watch, list]:
    watch = Watch(client, url)
    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch.run, done)
        results = await client.map(prompts, max_tokens=max_tokens, ignore_eos=True, progress=False)
        done.set()
    return watch, list(results)


async def test_the_limit_starts_at_the_rule_of_thumb_then_keeps_the_server_queue_short(
    vllm_server,
):
    async with AsyncClient(vllm_server.url) as client:
        assert client.limit == 5  # floor(0.7 x 8), right after discovery
        control = client.stats().control
        assert control is not None and control.mode == "metrics" and control.reason == "start"
        prompts = [words(20, i) for i in range(160)]
        watch, results = await _map_watched(client, vllm_server.url, prompts)
        control = client.stats().control
    assert all(isinstance(r, dsclient.Result) for r in results)
    limits = [row[0] for row in watch.rows]
    assert max(limits) > 5  # it grew to fill the batch ...
    assert max(row[2] for row in watch.rows) == 8  # ... and the engine ran a full batch
    # The excess waited here, not in the server's first-come queue: 160 requests went in, the
    # server never held more than a few of them waiting (unbounded: ~150).
    assert max(row[3] for row in watch.rows) <= 3 * 8
    assert control.changes >= 1 and control.reason != "start"
    assert control.server_running is not None and control.target_waiting == 4
    assert client.in_flight == 0


async def test_a_fixed_limit_never_moves(vllm_server):
    async with AsyncClient(vllm_server.url, adaptive=False) as client:
        assert client.limit == 5
        watch, results = await _map_watched(
            client, vllm_server.url, [words(20, i) for i in range(60)]
        )
        assert client.stats().control.mode == "fixed"
    assert all(isinstance(r, dsclient.Result) for r in results)
    assert {row[0] for row in watch.rows} == {5}
    assert max(row[1] for row in watch.rows) <= 5
    assert max(row[2] for row in watch.rows) <= 5


async def _prompt_of(client: AsyncClient, tokens: int, seed: int) -> str:
    """A prompt of about ``tokens`` tokens of the served model (counted with /tokenize)."""
    per_word = await client.count_tokens(words(400, seed)) / 400
    n = round(tokens / per_word)
    for _ in range(20):
        prompt = words(n, seed)
        counted = await client.count_tokens(prompt)
        if abs(counted - tokens) <= tokens // 50:
            return prompt
        n += round((tokens - counted) / per_word) or (1 if counted < tokens else -1)
    raise AssertionError("could not build the prompt")


@pytest.mark.parametrize("how", ["url", "handle"])
async def test_a_fresh_client_sends_a_long_prompt_down_the_long_lane(vllm_server, how):
    # The tiny model's 512-token BPE splits these words about 3x finer than cl100k: before the
    # calibration, a 740-token prompt was estimated at ~240 and took the short lane.
    async with AsyncClient(vllm_server.url) as helper:
        prompt = await _prompt_of(helper, 740, seed=5)
    target = vllm_server.url if how == "url" else vllm_server
    async with AsyncClient(target) as client:
        if how == "url":
            assert client._planner.tokens.backend.startswith("tiktoken")
            assert client._planner.tokens.samples == 1  # the calibration sample
            assert client._planner.tokens.correction > 1.5
        else:
            assert client._planner.tokens.backend.startswith("tokenizers:")  # the model's own
        first = await client.generate(prompt, max_tokens=256, ignore_eos=True)
        short = await client.generate("hello there", max_tokens=16)
    assert first.lane == "long"
    assert 700 <= first.usage.prompt_tokens <= 780
    assert short.lane == "short"


async def test_max_num_seqs_is_learned_from_a_plain_servers_metrics(plain_vllm_server):
    # headroom 2 starts at 16 in flight (2 x the default guess of 8) against a batch of 12, so
    # the server queues at once: this hand-started server's gauges lag by a second or more when
    # the machine is busy, and a slow ramp could end the batch before two queued scrapes.
    async with AsyncClient(plain_vllm_server, headroom=2.0) as client:
        info = client.server
        assert info.sources["max_num_seqs"] == "default"  # nothing told it: no record, no dev
        assert client.limit == 16
        assert client.stats().control.mode == "metrics"
        # Long enough that the server is seen queueing in two scrapes in a row, even on this
        # hand-started server whose API process starves (its gauges lag by a second or more).
        prompts = [words(20, 1000 + i) for i in range(240)]
        watch, results = await _map_watched(client, plain_vllm_server, prompts, max_tokens=64)
        info = client.server
        control = client.stats().control
    assert all(isinstance(r, dsclient.Result) for r in results)
    assert info.max_num_seqs == PLAIN_MAX_NUM_SEQS
    assert "metrics" in info.sources["max_num_seqs"]
    assert control.learned_max_num_seqs == PLAIN_MAX_NUM_SEQS
    assert max(row[2] for row in watch.rows) == PLAIN_MAX_NUM_SEQS


async def test_admission_503s_are_congestion_and_lose_nothing(plain_vllm_server, caplog):
    caplog.set_level(logging.DEBUG, logger="dsclient")
    # The server really refuses: 80 raw requests at once against an admission cap of 44.
    async with httpx.AsyncClient(base_url=plain_vllm_server, timeout=120) as http:

        async def raw(i: int) -> httpx.Response:
            return await http.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": words(20, i), "max_tokens": 32},
            )

        statuses: list[int] = []
        async with anyio.create_task_group() as tg:
            for i in range(80):
                tg.start_soon(lambda i=i: _append_status(statuses, raw(i)))
    assert statuses.count(503) >= 1, statuses

    # A client told the server is bigger than it is starts at 67 in flight, over the admission
    # cap: the 503s cut its limit, and every request still comes back.
    async with AsyncClient(plain_vllm_server, max_num_seqs=96) as client:
        assert client.limit == 67
        prompts = [words(20, 2000 + i) for i in range(200)]
        _, results = await _map_watched(client, plain_vllm_server, prompts)
        control = client.stats().control
    failures = [r for r in results if isinstance(r, dsclient.Failure)]
    assert failures == []
    assert any(r.attempts > 1 for r in results)  # the 503 path was taken
    # The refusals cut the limit (it may have grown first: told 96, the server seems to have
    # room while it runs 12). Every change is logged at DEBUG with its reason.
    cuts = [r.getMessage() for r in caplog.records if "refused for load" in r.getMessage()]
    assert cuts, [r.getMessage() for r in caplog.records if " limit " in r.getMessage()]
    assert control.changes >= 1


async def _append_status(statuses: list[int], response) -> None:
    statuses.append((await response).status_code)

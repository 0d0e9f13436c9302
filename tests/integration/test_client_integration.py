"""AsyncClient and the governor against the real tiny vLLM started by dsclient's launcher."""

from __future__ import annotations

import random
import re

import httpx
import pytest

import dsclient
from dsclient import AsyncClient, ContextOverflow
from dsclient._exceptions import error_from_response

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

WORDS = (
    "the a server batch token lane queue model request answer time fast slow river stone light "
    "paper window garden music number letter yellow purple mountain ocean"
).split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def test_discovery_reports_the_launched_server(vllm_server):
    async with AsyncClient(vllm_server.url) as client:
        info = client.server
        assert info is not None
        assert info.kind == "vllm"
        assert info.model == "tiny"
        assert info.max_model_len == 2048
        assert info.max_num_seqs == 8
        assert info.sources["max_num_seqs"] == "launcher record"
        assert info.has_tokenize
        assert client.limit == 5  # floor(0.7 * 8)


async def test_generate_chat_and_stream(vllm_server):
    async with AsyncClient(vllm_server) as client:
        r = await client.generate("Hello there", max_tokens=8, ignore_eos=True, temperature=0.0)
        assert r.usage.completion_tokens == 8
        assert r.finish_reason == "length"
        assert r.raw.usage is not None and r.raw.usage.completion_tokens == 8
        assert r.latency_s > 0 and r.attempts == 1

        c = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=6, ignore_eos=True)
        assert c.usage.completion_tokens == 6
        assert c.raw.choices[0].message.role == "assistant"

        async with client.stream("Once upon a time", max_tokens=12, ignore_eos=True) as s:
            deltas = [d async for d in s]
        assert deltas and "".join(deltas) == s.text
        assert s.finish_reason == "length"
        assert s.ttft_s is not None and 0 < s.ttft_s < 30
        assert client.in_flight == 0


async def test_half_read_stream_returns_its_slot(vllm_server):
    async with AsyncClient(vllm_server) as client:
        async with client.stream("Tell me", max_tokens=200, ignore_eos=True) as s:
            async for _ in s:
                break
        assert client.in_flight == 0
        r = await client.generate("still works", max_tokens=2)
        assert r.usage.completion_tokens >= 1


async def test_too_long_prompt_is_refused_before_sending(vllm_server):
    async with AsyncClient(vllm_server) as client:
        prompt = words(3000, seed=1)
        n = await client.count_tokens(prompt)
        assert n > 2048
        with pytest.raises(ContextOverflow) as info:
            await client.generate(prompt, max_tokens=10)
        assert info.value.context_length == 2048
        assert info.value.prompt_tokens is not None and info.value.prompt_tokens > 2048
        assert "2048" in str(info.value)
        assert client.stats().lanes["short"].done + client.stats().lanes["long"].done == 0


async def test_the_real_servers_overflow_wordings_are_parsed(vllm_server):
    """What vLLM itself answers (bypassing dsclient's pre-check) is recognised."""
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as http:
        resp = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": words(2500, 2), "max_tokens": 5}
        )
        err = error_from_response(resp)
        assert isinstance(err, ContextOverflow), resp.text
        assert err.context_length == 2048 and err.prompt_tokens is not None
        resp = await http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x" * 18000, "max_tokens": 5}
        )
        err = error_from_response(resp)
        assert isinstance(err, ContextOverflow), resp.text
        assert err.context_length == 2048


async def _running(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_max_tokens_always_fits_the_context(vllm_server):
    """200 prompts spread up to the limit, each asking for far too many tokens: every request
    the server ran had usage.prompt_tokens + max_tokens sent <= max_model_len (vLLM 0.32 clamps
    silently, so the arithmetic is checked, not only the absence of 400s)."""
    rng = random.Random(7)
    async with AsyncClient(vllm_server, timeout=600) as client:
        per_word = await client.count_tokens(words(400, 99)) / 400
        top = int(2060 / per_word)
        prompts = [words(rng.randint(int(top * 0.55), top), seed=1000 + i) for i in range(200)]
        results = await client.map(
            [{"prompt": p, "max_tokens": 4000, "temperature": 1.0} for p in prompts],
            progress=False,
        )
    overflowed = 0
    for r in results:
        if isinstance(r, dsclient.Failure):
            # only prompts that truly cannot fit may fail, and only before sending
            assert isinstance(r.error, ContextOverflow), r
            assert r.error.prompt_tokens is not None and r.error.prompt_tokens > 2048 - 5
            overflowed += 1
            continue
        assert r.max_tokens is not None
        assert r.usage.prompt_tokens + r.max_tokens <= 2048, r
        assert r.usage.completion_tokens <= r.max_tokens
    assert overflowed < 40  # most prompts fit; the test is about the ones close to the edge
    fits = [r for r in results if not isinstance(r, dsclient.Failure)]
    assert sum(r.usage.prompt_tokens > 1800 for r in fits) >= 20  # many were near the limit


def test_cli_probe_reports_the_launched_server(vllm_server, capsys):
    import json

    from dsclient.cli import main

    assert main(["probe", vllm_server.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "vllm"
    assert out["max_num_seqs"] == 8 and out["max_model_len"] == 2048
    assert out["sources"]["max_num_seqs"] == "launcher record"
    assert out["dsclient_limit"] == 5

"""map()'s start order against a real vLLM whose KV cache cannot hold every prefix of the batch.

A shuffled batch of 16 system prompts x 5 questions, sent by ``map()`` with ``order="shape"``
(prefix groups, longest first) and with ``order="input"``: vLLM's own prefix-cache counters
(``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, in tokens) must show
more hits when the groups are started together. The server is this module's own: 32 KV blocks
(``--num-gpu-blocks-override``, 4096 tokens at vLLM's CPU block of 128), about five of the
~800-token prefixes, so input order keeps evicting them.

Starts its own server; run it under the machine's vLLM lock:
``flock /tmp/dsclient-vllm.lock pytest -m integration
tests/integration/test_batch_shape_integration.py``.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator

import anyio
import httpx
import pytest

from dsclient import AsyncClient
from dsclient.launcher import LaunchError, launch, make_tiny_model, resolve_server_python

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

PREFIXES = 16
QUESTIONS = 5
KV_BLOCKS = 32
WORDS = "alpha river stone cloud music table green quiet north paper light sugar".split()


def _progress(message: str) -> None:
    print(f"[batch-shape] {message}", file=sys.__stderr__, flush=True)


@pytest.fixture(scope="module")
def small_kv_server() -> Iterator[str]:
    """A tiny vLLM with prefix caching on and a KV cache of :data:`KV_BLOCKS` blocks."""
    try:
        install = resolve_server_python()
    except LaunchError as exc:
        pytest.fail(f"the integration tests need the vLLM server venv: {exc}", pytrace=False)
    model = make_tiny_model(python=install.python)
    server = launch(
        model,
        python=install.python,
        max_num_seqs=4,
        max_model_len=2048,
        served_model_name="tiny",
        dtype="float32",
        extra_args=["--num-gpu-blocks-override", str(KV_BLOCKS), "--enable-prefix-caching"],
        progress=_progress,
    )
    with server:
        yield server.url


def batch(salt: str) -> list[str]:
    """The shuffled prefix-heavy batch; ``salt`` keeps one leg's prefixes out of the other's."""
    rng = random.Random(27)
    systems = [
        f"System prompt {salt}-{p}: " + " ".join(rng.choice(WORDS) for _ in range(250))
        for p in range(PREFIXES)
    ]
    prompts = [f"{s}\nQuestion {q}: which word comes first?" for s in systems for q in range(5)]
    rng.shuffle(prompts)
    return prompts


def counter(metrics: str, name: str) -> float:
    """The sum of a counter's samples (one per engine) in a ``/metrics`` text."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def leg(url: str, order: str) -> float:
    """The prefix-cache hit rate of one map() of the batch in ``order``."""
    async with httpx.AsyncClient(timeout=30.0) as http:

        async def counters() -> tuple[float, float]:
            text = (await http.get(url + "/metrics")).text
            return (
                counter(text, "vllm:prefix_cache_hits_total"),
                counter(text, "vllm:prefix_cache_queries_total"),
            )

        hits0, queries0 = await counters()
        async with AsyncClient(url) as client:
            prompts = batch(order)
            results = await client.map(
                prompts, max_tokens=2, temperature=0.0, progress=False, order=order
            )
        assert not results.failures, results.failures[:3]
        assert [r.index for r in results] == list(range(len(prompts)))
        assert all(r.text is not None for r in results)
        hits1, queries1 = await counters()
    rate = (hits1 - hits0) / (queries1 - queries0)
    _progress(
        f"order={order}: {hits1 - hits0:.0f} of {queries1 - queries0:.0f} prompt tokens hit"
        f" ({rate:.1%}), {results.elapsed_s:.1f} s"
    )
    return rate


async def test_grouping_prefixes_raises_vllms_prefix_cache_hit_rate(small_kv_server):
    async with httpx.AsyncClient(timeout=30.0) as http:
        info = (await http.get(small_kv_server + "/metrics")).text
    config = [line for line in info.splitlines() if line.startswith("vllm:cache_config_info{")]
    _progress(config[0] if config else "no vllm:cache_config_info")
    grouped = await leg(small_kv_server, "shape")
    as_read = await leg(small_kv_server, "input")
    # Grouped, each prefix is computed about once (~4 of its 5 prompts hit); as read, a prefix
    # is mostly evicted before it comes back.
    assert grouped > 0.5
    assert grouped >= 1.5 * as_read, (grouped, as_read)


async def test_vllms_kv_cache_reaches_the_governor_and_the_calls_count_against_it(small_kv_server):
    """The cache the governor lends long calls from is vLLM's own (``cache_config_info``: 32
    blocks of 128 tokens here, of which vLLM keeps one back for itself), and each call in flight holds its prompt + ``max_tokens`` of it
    in whole blocks until it is answered (the policy itself: ``tests/test_governor.py``)."""
    async with AsyncClient(small_kv_server, long_threshold=300) as client:
        await client.discover()
        assert client.stats().kv_tokens == (KV_BLOCKS - 1) * 128
        seen: list[tuple[int, int]] = []

        async def watch() -> None:
            while True:
                stats = client.stats()
                seen.append((stats.in_flight, stats.kv_tokens_in_flight))
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            prompts = [f"Long item {i}: " + " ".join(WORDS) for i in range(4)]
            results = await client.map(
                prompts, max_tokens=400, temperature=0.0, ignore_eos=True, progress=False
            )
            tg.cancel_scope.cancel()
        assert not results.failures, results.failures[:3]
        assert all(r.lane == "long" for r in results)
        # Each call: a prompt of about 30 tokens + 400 out, 4 blocks of 128.
        busy = [(n, tokens) for n, tokens in seen if n]
        assert busy, seen
        assert all(tokens == n * 4 * 128 for n, tokens in busy), busy
        assert client.stats().kv_tokens_in_flight == 0

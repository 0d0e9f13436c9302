"""The governor on servers that publish nothing about their load: behaviour, not timings.

* ``nginx_vllm``: the shared vLLM behind nginx passing only ``/v1/*`` (the usual gateway): no
  ``/metrics``, no ``/tokenize``; vLLM's ``endpoint-load-metrics`` answer header still passes.
* ``transformers_server``: transformers' own server (``transformers serve
  --continuous-batching``), which has no load signal anywhere: the limit must find the knee from
  throughput alone.
  It lists only the models in its Hugging Face cache and loads others on demand: a model the
  caller names that it does not list must still be tried.
* ``llama_cpp_server``: llama-cpp-python's server on llama.cpp (the tiny model as GGUF): no
  ``/metrics``, no ``/slots``, one request at a time.

Servers from tests/integration/blackbox.py, started once per session (tests/conftest.py).
"""

from __future__ import annotations

import logging

import anyio
import httpx
import pytest

import dsclient
from dsclient import AsyncClient
from dsclient._percentile import nearest_rank
from tests.integration.blackbox import HUB_MODEL, LLAMA_CPP_MODEL
from tests.integration.test_client_integration import words

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

#: A map of a few hundred short requests: long enough for the limit to move, short enough for CI.
BATCH = 300
MAX_TOKENS = 8
#: Behind nginx, long enough for a steady state to judge the server's queue in (issue 41).
QUEUE_BATCH = 1500
#: llama.cpp's server answers 300 calls in 3-4 s, six epochs: the second half of that was still
#: the limit finding the server (a CI run judged its p90 on 2 s). 600 leave a steady half.
LLAMA_CPP_BATCH = 600


async def _map_sampled(
    client: AsyncClient, n: int, **sampling: object
) -> tuple[dsclient.BatchResults, list[int]]:
    """``client.map()`` of ``n`` prompts, sampling ``client.limit`` every 0.1 s meanwhile."""
    limits = [client.limit]
    done = anyio.Event()

    async def sample() -> None:
        while not done.is_set():
            limits.append(client.limit)
            await anyio.sleep(0.1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        results = await client.map(
            [words(12, i) for i in range(n)], max_tokens=MAX_TOKENS, progress=False, **sampling
        )
        done.set()
    limits.append(client.limit)
    return results, limits


async def _vllm_queue(url: str, done: anyio.Event, seen: list[int]) -> None:
    """The engine's own queue (``vllm:num_requests_waiting`` on ``/metrics``, behind the
    gateway's back), every 0.1 s until ``done``: for the report and the queue goal only."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while not done.is_set():
            text = (await http.get("/metrics")).text
            waiting = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:num_requests_waiting{")
            )
            seen.append(round(waiting))
            await anyio.sleep(0.1)


def _queue_goal(seen: list[int], seats: int) -> dict[str, int]:
    """Issue 41's queue goal, judged as the seats tests judge it: the server's queue p90 over the
    second half of the samples (once the limit has found the server) at most
    ``max(2, seats // 2)``, and its peak over the whole run at most two batches. Returns the
    figures for the report, the whole run's p90 beside them."""
    assert seen, "no sample of the server's queue"

    def p90(values: list[int]) -> int:
        return int(nearest_rank(sorted(values), 90))

    figures = {"p90": p90(seen), "p90_steady": p90(seen[len(seen) // 2 :]), "peak": max(seen)}
    print(f"server queue: {figures} over {len(seen)} samples, {seats} seats")
    assert figures["p90_steady"] <= max(2, seats // 2), figures
    assert figures["peak"] <= 2 * seats, figures
    return figures


def _assert_every_item_once(results: dsclient.BatchResults, n: int) -> None:
    failures = results.failures
    assert not failures, f"{len(failures)} of {n} failed, e.g. {failures[0].error!r}"
    assert [r.index for r in results.ok] == list(range(n))
    retried = [r.index for r in results.ok if r.attempts != 1]
    assert not retried, f"items sent more than once: {retried[:10]}"


def _assert_limit_moved(control: object, limits: list[int]) -> None:
    assert control is not None
    moved = control.changes > 0 or control.limit != control.start  # type: ignore[attr-defined]
    assert moved, f"the limit never left its start: {control!r}; sampled {sorted(set(limits))}"


async def test_the_gateway_passes_only_v1_and_the_load_header(nginx_vllm):
    async with httpx.AsyncClient(base_url=nginx_vllm, timeout=60) as http:
        assert (await http.get("/v1/models")).status_code == 200
        for path in ("/metrics", "/health", "/load", "/server_info"):
            assert (await http.get(path)).status_code == 404, path
        tokenize = await http.post("/tokenize", json={"model": "tiny", "prompt": "a b c"})
        assert tokenize.status_code == 404
        answer = await http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "a b c", "max_tokens": 2},
            headers={"endpoint-load-metrics-format": "TEXT"},
        )
    assert answer.status_code == 200
    assert "num_requests_waiting" in answer.headers.get("endpoint-load-metrics", "")


async def test_vllm_behind_nginx_map_every_item_once_and_the_limit_moves(
    nginx_vllm, vllm_server
):
    seen: list[int] = []
    async with AsyncClient(nginx_vllm) as client:
        assert client.server is not None and client.server.model == "tiny"
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_vllm_queue, vllm_server.url, done, seen)
            results, limits = await _map_sampled(client, QUEUE_BATCH, ignore_eos=True)
            done.set()
        control = client.stats().control
    # Behind the gateway the batch is not stated: the client takes it as what is in flight
    # less the queue (transit included) and aims at half of that. Measured with 1500 items
    # (about 7 s): queue p90 4 and 3 over the whole run, 4 and 2 over its second half, peak
    # 12 and 11, against a batch of 8; makespan 7.8 s and 6.9 s, where a fixed limit of 16 took
    # 8.4 s and 7.9 s (queue p90 8) and one of 8 took 13.2 s and 11.4 s. Over the 300 items of
    # the other maps (2-3 s) the ramp is the whole run: p90 5-12.
    _queue_goal(seen, vllm_server.max_num_seqs)
    _assert_every_item_once(results, QUEUE_BATCH)
    _assert_limit_moved(control, limits)
    # The gateway hides /metrics; vLLM's answer header is what drives the limit.
    assert control.signal == "endpoint-load-metrics", control
    assert control.signal_age_s is not None
    assert control.mode == "metrics", control


async def test_transformers_serve_map_every_item_once_and_the_limit_finds_more_than_its_start(
    transformers_server,
):
    async with httpx.AsyncClient(base_url=transformers_server, timeout=30) as http:
        assert (await http.get("/metrics")).status_code == 404  # nothing to scrape
        listed = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
    assert listed == [HUB_MODEL]
    async with AsyncClient(transformers_server) as client:
        assert client.server is not None and client.server.model == HUB_MODEL
        start = client.limit
        results, limits = await _map_sampled(client, BATCH)
        control = client.stats().control
    _assert_every_item_once(results, BATCH)
    _assert_limit_moved(control, limits)
    assert control.mode == "throughput", control
    assert control.signal == "throughput", control
    # No signal but throughput: the default batch size is where it starts, not a ceiling.
    assert max(limits) > start, (start, sorted(set(limits)))
    assert all(r.usage.completion_tokens == MAX_TOKENS for r in results.ok)


async def test_a_model_the_server_does_not_list_is_tried_with_a_warning(
    transformers_server, transformers_model, caplog
):
    unlisted = str(transformers_model)  # a folder's path: loaded on demand, never listed
    async with httpx.AsyncClient(base_url=transformers_server, timeout=30) as http:
        listed = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
    assert unlisted not in listed
    with caplog.at_level(logging.WARNING, logger="dsclient"):
        async with AsyncClient(transformers_server, model=unlisted) as client:
            result = await client.generate("Once upon a time", max_tokens=4)
    assert result.usage.completion_tokens == 4
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(unlisted in message for message in warned), warned


async def test_llama_cpp_server_map_every_item_once_and_the_limit_moves(llama_cpp_server):
    async with httpx.AsyncClient(base_url=llama_cpp_server, timeout=30) as http:
        for route in ("/metrics", "/slots"):  # llama.cpp's C++ server has them; this one not
            assert (await http.get(route)).status_code == 404, route
    seen: list[int] = []
    async with AsyncClient(llama_cpp_server) as client:
        assert client.server is not None and client.server.model == LLAMA_CPP_MODEL
        done = anyio.Event()

        async def queue() -> None:
            # One request at a time and no count of its own: the fixture's count is what this
            # client has in flight beyond the one the server runs.
            while not done.is_set():
                seen.append(max(0, client.servers[0].in_flight - 1))
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(queue)
            results, limits = await _map_sampled(client, LLAMA_CPP_BATCH)
            done.set()
        control = client.stats().control
    _queue_goal(seen, 1)
    _assert_every_item_once(results, LLAMA_CPP_BATCH)
    _assert_limit_moved(control, limits)
    assert (control.mode, control.signal) == ("throughput", "throughput"), control

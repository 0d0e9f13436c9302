"""dsclient.ray on a local Ray instance against the real tiny vLLM (and a real redis-server).

One Ray instance for the module (``ray.init(num_cpus=2)``, no dashboard), shut down at the end.
What is checked at the server, not just in the rows: every row that came back answered was
answered once by vLLM (its ``vllm:request_success_total`` counter moves by exactly that many), and
two actors sharing a Redis budget never had more requests at vLLM than the budget.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import ray

from dsclient.ray import map_dataset

pytestmark = pytest.mark.integration

#: Words the tiny model's tokenizer knows: a prompt costs about a token per word.
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


def _prompt(i: int, n_words: int = 12) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words))


def _counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10.0).text


class _AtServer:
    """Polls vLLM's running + waiting gauges while a block runs: the most it ever held."""

    def __init__(self, url: str, every: float = 0.02) -> None:
        self.url, self.every = url, every
        self.peak = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=5.0) as http:
            while not self._stop.is_set():
                try:
                    text = http.get(self.url + "/metrics").text
                except httpx.HTTPError:
                    continue
                held = _counter(text, "vllm:num_requests_running") + _counter(
                    text, "vllm:num_requests_waiting"
                )
                self.peak = max(self.peak, held)
                self.samples += 1
                self._stop.wait(self.every)

    def __enter__(self) -> _AtServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
    assert not ray.is_initialized()


def test_every_row_once_and_overlong_prompts_as_error_rows(vllm_server, local_ray) -> None:
    n, overlong = 300, {17, 150, 299}
    too_long = " ".join(WORDS[k % len(WORDS)] for k in range(3000))  # > 2048 tokens
    items = [{"id": i, "prompt": too_long if i in overlong else _prompt(i)} for i in range(n)]
    ds = ray.data.from_items(items)
    before = _counter(_metrics(vllm_server.url), "vllm:request_success_total")
    started = time.monotonic()
    rows = map_dataset(
        ds, vllm_server.url, actors=2, batch_size=25, max_tokens=8, temperature=0.0, ignore_eos=True
    ).take_all()
    elapsed = time.monotonic() - started
    answered = _counter(_metrics(vllm_server.url), "vllm:request_success_total") - before

    ids = Counter(row["id"] for row in rows)
    assert sorted(ids) == list(range(n)) and set(ids.values()) == {1}, "a row lost or doubled"
    failed = {row["id"]: row["error"] for row in rows if row["error"] is not None}
    assert set(failed) == overlong, failed
    assert all(error.startswith("ContextOverflow: ") for error in failed.values()), failed
    ok = [row for row in rows if row["error"] is None]
    assert all(row["answer"] is not None and row["completion_tokens"] == 8 for row in ok)
    assert all(row["finish_reason"] == "length" and row["latency_s"] > 0 for row in ok)
    assert all(
        row["answer"] is None and row["prompt_tokens"] is None
        for row in rows
        if row["id"] in overlong
    )
    # Each answered row was answered by vLLM exactly once: no retry or duplicate reached it.
    assert answered == len(ok) == n - len(overlong), (answered, len(ok))
    assert sum(row["attempts"] for row in ok) == len(ok)
    print(f"[ray] {n} rows through 2 actors in {elapsed:.1f} s")


def _job(url: str, n: int, **options: object) -> tuple[list[dict[str, object]], float]:
    ds = ray.data.from_items([{"prompt": _prompt(i, 8)} for i in range(n)])
    with _AtServer(url) as at_server:
        rows = map_dataset(
            ds,
            url,
            actors=2,
            batch_size=20,
            max_tokens=24,
            ignore_eos=True,
            **options,  # type: ignore[arg-type]
        ).take_all()
    assert at_server.samples > 20, "the /metrics sampler did not keep up"
    assert len(rows) == n and all(row["error"] is None for row in rows), [
        row["error"] for row in rows if row["error"] is not None
    ][:3]
    return rows, at_server.peak


def test_two_actors_share_one_redis_budget(vllm_server, local_ray, redis_url) -> None:
    """A fixed limit of 3 shared in Redis holds both actors together to 3 at the server; the
    same job without the shared budget (each actor its own 3) goes past it, so the check can
    fail."""
    limit = 3
    _, alone = _job(vllm_server.url, 120, client_options={"limit": limit})
    _, shared = _job(
        vllm_server.url,
        120,
        shared=redis_url,
        shared_key="ray-test",
        client_options={"limit": limit},
    )
    print(f"[ray] peak at vLLM: {alone:.0f} without the shared budget, {shared:.0f} with it")
    assert alone > limit, f"two actors of limit {limit} each never held more than {alone}"
    assert 0 < shared <= limit, f"the shared budget of {limit} let {shared} reach vLLM"

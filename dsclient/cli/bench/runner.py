"""The I/O of ``dsclient bench``: one request, one step, the governor phase, the server first."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import anyio

from ..._http import httpx
from ...governor._load import Load
from .goodput import Slo
from .policy import (
    DEFAULT_TOKENS_PER_WORD,
    Knee,
    Mode,
    RequestSample,
    StepResult,
    _load_text,
    _round,
    governor_workers,
    percentile,
    stop_reason,
    summarize_step,
)
from .workload import BenchRequest, prompt_of


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class Bench:
    """Runs the steps against one server over one httpx client; keeps what it measured.

    Parameters:
        http: the client (its transport is the tests' seam); its pool must not bound concurrency.
        url: the server's root URL.
        model: the model to ask for.
        requests: the workload, endless.
        step_seconds: how long each step sends.
        clock, rng: injectable (the rng draws the open loop's arrival gaps).
        progress: where the live line goes (``None``: nowhere).
        slo: objectives for goodput (``--goodput``); ``None``: no goodput.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        *,
        model: str,
        requests: Iterator[BenchRequest],
        step_seconds: float,
        clock: Callable[[], float] = time.perf_counter,
        rng: random.Random | None = None,
        progress: IO[str] | None = None,
        slo: Slo | None = None,
    ) -> None:
        self.http = http
        self.url = url
        self.model = model
        self.requests = requests
        self.step_seconds = step_seconds
        self.clock = clock
        self.rng = rng or random.Random(0)
        self.progress = progress
        self.slo = slo
        self.live = bool(progress is not None and getattr(progress, "isatty", lambda: False)())
        self.has_metrics: bool | None = None
        self.steps: list[StepResult] = []

    async def request(self, request: BenchRequest) -> RequestSample:
        """Send one streamed request and time it."""
        from ..._exceptions import MalformedResponse
        from ..._streaming import delta_of, sse_events

        body = {
            **request.body,
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        clock = self.clock
        start = clock()
        ttft: float | None = None
        last = start
        gaps: list[float] = []
        chunks = 0
        usage_tokens: int | None = None

        def failed(error: str, detail: str | None = None) -> RequestSample:
            return RequestSample(
                ok=False, latency_s=clock() - start, ttft_s=ttft, error=error, detail=detail
            )

        try:
            async with self.http.stream("POST", self.url + request.path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    return failed(f"HTTP {response.status_code}", _one_line(text))
                async for event in sse_events(response):
                    now = clock()
                    text, _ = delta_of(event)
                    if text:
                        if ttft is None:
                            ttft = now - start
                        else:
                            gaps.append(now - last)
                        last = now
                        chunks += 1
                    usage = event.get("usage")
                    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        usage_tokens = usage["completion_tokens"]
        except httpx.TimeoutException as exc:
            return failed("timeout", _one_line(repr(exc)))
        except httpx.HTTPError as exc:
            return failed(type(exc).__name__, _one_line(str(exc)))
        except MalformedResponse as exc:
            return failed("stream error", _one_line(str(exc)))
        return RequestSample(
            ok=True,
            latency_s=clock() - start,
            ttft_s=ttft,
            output_tokens=usage_tokens if usage_tokens is not None else chunks,
            itl_s=tuple(gaps),
        )

    async def _scrape(self, loads: list[Load]) -> None:
        """Scrape ``/metrics`` a few times a second until cancelled; once if there is none."""
        from ...governor._endpoint import fetch_load

        if self.has_metrics is False:
            return
        every = min(1.0, max(0.2, self.step_seconds / 20))
        while True:
            began = self.clock()
            load = await fetch_load(self.http, self.url, model=self.model, timeout=2.0)
            if load is None:
                if self.has_metrics is None:
                    self.has_metrics = False
                    return
            else:
                self.has_metrics = True
                loads.append(load)
            await anyio.sleep(max(0.0, every - (self.clock() - began)))

    async def _ticker(self, label: str, samples: list[RequestSample], start: float) -> None:
        if not self.live or self.progress is None:
            return
        while True:
            await anyio.sleep(0.5)
            bad = sum(not s.ok for s in samples)
            elapsed = self.clock() - start
            print(
                f"\r\x1b[K{label}: {elapsed:4.1f}/{self.step_seconds:g} s, {len(samples)} done,"
                f" {bad} failed",
                end="",
                file=self.progress,
                flush=True,
            )

    async def step(
        self, *, concurrency: int | None = None, rate: float | None = None
    ) -> StepResult:
        """Run one step: ``concurrency`` workers (closed loop) or Poisson arrivals at ``rate``."""
        index = len(self.steps)
        samples: list[RequestSample] = []
        loads: list[Load] = []
        start = self.clock()
        deadline = start + self.step_seconds

        async def worker() -> None:
            while self.clock() < deadline:
                samples.append(await self.request(next(self.requests)))

        async def one(request: BenchRequest) -> None:
            samples.append(await self.request(request))

        label = (
            f"step {index + 1}: concurrency {concurrency}"
            if rate is None
            else f"step {index + 1}: {rate:g} req/s"
        )
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._scrape, loads)
            outer.start_soon(self._ticker, label, samples, start)
            async with anyio.create_task_group() as senders:
                if rate is None:
                    for _ in range(concurrency or 1):
                        senders.start_soon(worker)
                else:
                    due = start
                    while True:
                        due += self.rng.expovariate(rate)
                        if due >= deadline:
                            break
                        await anyio.sleep(max(0.0, due - self.clock()))
                        senders.start_soon(one, next(self.requests))
            outer.cancel_scope.cancel()
        result = summarize_step(
            samples,
            index=index,
            duration_s=self.clock() - start,
            concurrency=concurrency,
            rate_rps=rate,
            loads=loads,
            slo=self.slo,
        )
        self.steps.append(result)
        if self.progress is not None:
            clear = "\r\x1b[K" if self.live else ""
            print(clear + step_line(result), file=self.progress, flush=True)
        return result

    async def sweep(
        self,
        *,
        mode: Mode,
        loads: Sequence[float],
    ) -> tuple[str, str]:
        """Run the steps in turn until :func:`stop_reason` says stop; returns why it stopped."""
        for load in loads:
            if mode == "closed":
                await self.step(concurrency=int(load))
            else:
                await self.step(rate=load)
            if self.steps[-1].requests == 0 and len(self.steps) == 1:
                return "errors", f"every request failed ({self.steps[-1].first_error})"
            reason = stop_reason(self.steps)
            if reason is not None:
                return reason
        return "bound", "ran every step"

    async def governor(
        self, knee: Knee, max_concurrency: int, transport: httpx.AsyncBaseTransport | None
    ) -> dict[str, Any]:
        """Drive the workload through ``AsyncClient`` for one step; where its limit ended."""
        from ..._exceptions import DSClientError
        from ...client._client import AsyncClient

        latencies: list[float] = []
        service: list[float] = []
        kinds: Counter[str] = Counter()
        tokens = 0
        limits: list[int] = []
        try:
            async with AsyncClient(self.url, model=self.model, transport=transport) as client:
                # Loads the local tokenizer (a fraction of a second, once) outside the timing.
                await client.count_tokens("warm up", exact=False)
                started_at = client.limit
                known = client.server.max_num_seqs if client.server is not None else None
                workers = governor_workers(
                    self.steps, knee, max_concurrency, limit=started_at, max_num_seqs=known
                )
                if self.progress is not None:
                    print(
                        f"governor phase: {workers} callers through dsclient.AsyncClient for"
                        f" {self.step_seconds:g} s (limit starts at {started_at}) ...",
                        file=self.progress,
                        flush=True,
                    )
                start = self.clock()
                deadline = start + self.step_seconds

                async def worker() -> None:
                    nonlocal tokens
                    while self.clock() < deadline:
                        request = next(self.requests)
                        body = dict(request.body)
                        max_tokens = body.pop("max_tokens", None)
                        began = self.clock()
                        try:
                            if "messages" in body:
                                messages = body.pop("messages")
                                result: Any = await client.chat(
                                    messages, max_tokens=max_tokens, **body
                                )
                            else:
                                prompt = body.pop("prompt")
                                result = await client.generate(
                                    prompt, max_tokens=max_tokens, **body
                                )
                        except DSClientError as exc:
                            kinds[type(exc).__name__] += 1
                            continue
                        latencies.append(self.clock() - began)
                        service.append(result.latency_s - result.queued_s)
                        tokens += result.usage.completion_tokens

                async def watch() -> None:
                    while True:
                        limits.append(client.limit)
                        await anyio.sleep(0.25)

                async with anyio.create_task_group() as outer:
                    outer.start_soon(watch)
                    async with anyio.create_task_group() as senders:
                        for _ in range(workers):
                            senders.start_soon(worker)
                    outer.cancel_scope.cancel()
                duration = max(self.clock() - start, 1e-9)
                control = client.stats().control
                server = client.server
                limit = client.limit
        except DSClientError as exc:
            return {"error": f"{type(exc).__name__}: {_one_line(str(exc))}"}
        limits.append(limit)
        errors = sum(kinds.values())
        return {
            "limit": limit,
            "limit_start": started_at,
            "limit_min": min(limits),
            "limit_max": max(limits),
            "limit_mean": round(sum(limits) / len(limits), 2),
            "workers": workers,
            "duration_s": round(duration, 3),
            "requests": len(latencies),
            "errors": errors,
            "error_kinds": dict(sorted(kinds.items())),
            "throughput_rps": round(len(latencies) / duration, 4),
            "output_tokens_per_s": round(tokens / duration, 2),
            "p50_s": _round(percentile(latencies, 50)),
            "p99_s": _round(percentile(latencies, 99)),
            "service_p99_s": _round(percentile(service, 99)),
            "max_num_seqs": None if server is None else server.max_num_seqs,
            "max_num_seqs_source": None if server is None else server.sources.get("max_num_seqs"),
            "control": None if control is None else dataclasses.asdict(control),
        }


def step_line(step: StepResult) -> str:
    """The progress line of a finished step."""

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    parts = [
        f"step {step.index + 1} ({_load_text(step)}): {step.throughput_rps:.3g} req/s,"
        f" {step.output_tokens_per_s:.0f} tok/s, TTFT p50 {s(step.ttft_p50_s)} p99"
        f" {s(step.ttft_p99_s)} s, TPOT {s(step.tpot_p50_s)} s, latency p50 {s(step.p50_s)}"
        f" p99 {s(step.p99_s)} s, {step.errors} errors"
    ]
    if step.goodput_rps is not None:
        parts.append(f", goodput {step.goodput_rps:.3g} req/s ({step.good_requests} good)")
    server = step.server
    if server:
        kv = server.get("kv_usage_mean")
        parts.append(
            f"; server running {s(server.get('running_mean'))}, waiting"
            f" {s(server.get('waiting_mean'))}" + ("" if kv is None else f", KV {kv:.0%}")
        )
    return "".join(parts)


# -- the server, before the run --------------------------------------------------------------------


class Unreachable(Exception):
    """The server cannot be benchmarked: the one-line reason (exit status 2)."""


async def _find_model(
    http: httpx.AsyncClient, url: str, model: str | None
) -> tuple[str, int | None]:
    """The model to ask for and its context, from ``/v1/models``; :class:`Unreachable` if none."""
    try:
        response = await http.get(url + "/v1/models", timeout=10.0)
    except httpx.HTTPError as exc:
        raise Unreachable(
            f"cannot reach {url}: {_one_line(str(exc)) or type(exc).__name__}"
        ) from exc
    data: list[Any] = []
    if response.status_code == 200:
        try:
            payload = response.json()
            data = [m for m in payload.get("data") or [] if isinstance(m, dict)]
        except (ValueError, AttributeError):
            data = []
    elif model is None:
        raise Unreachable(
            f"{url}/v1/models answered HTTP {response.status_code}: is this an OpenAI-compatible"
            " server? (pass --model to skip the lookup)"
        )
    ids = [str(m.get("id")) for m in data if m.get("id")]
    if model is None:
        if not ids:
            raise Unreachable(f"{url} lists no model; pass --model")
        if len(ids) > 1:
            raise Unreachable(f"{url} serves {len(ids)} models ({', '.join(ids)}); pass --model")
        model = ids[0]
    length = next((m.get("max_model_len") for m in data if m.get("id") == model), None)
    return model, length if isinstance(length, int) else None


async def _tokens_per_word(http: httpx.AsyncClient, url: str, model: str) -> tuple[float, str]:
    """Tokens per word of :data:`_WORDS` text, from the server's ``/tokenize`` if it has one."""
    sample = prompt_of(random.Random(1), 400, 1.0)
    try:
        response = await http.post(
            url + "/tokenize", json={"model": model, "prompt": sample}, timeout=10.0
        )
        count = response.json().get("count") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        count = None
    if isinstance(count, int) and count > 0:
        return count / len(sample.split()), "/tokenize"
    return DEFAULT_TOKENS_PER_WORD, "default"

"""``dsclient bench``: a stepped load test of a server, its knee, and where dsclient's limit ends.

    dsclient bench http://127.0.0.1:8000 -o bench-out        # closed loop at 1, 2, 3, 4, 5, 6 ...
    dsclient bench http://127.0.0.1:8000 --slo-p99 2 --max-steps 12 --json
    dsclient bench http://127.0.0.1:8000 --rates 1,2,4,8,16  # open loop, Poisson arrivals

Closed loop: each step runs a fixed number of workers (the step's concurrency) for
``--step-seconds``, each sending one streamed request after another straight to the server (bare
httpx, no governor); the concurrency grows by ``--factor`` a step, at least by one. Open loop
(``--rates``): requests arrive as a Poisson process at each rate in turn, however many are in
flight. Then one more phase of ``--step-seconds`` drives the same workload through
``dsclient.AsyncClient`` and reports the limit its governor ended at.

Metrics are those of ``vllm bench serve``, so the numbers compare:

* TTFT: from sending the request to the first streamed chunk that carries text.
* TPOT: ``(latency - TTFT) / (output tokens - 1)``, per request, for requests of 2+ tokens.
* ITL: the gaps between successive text chunks, pooled over the step's requests.
* output tokens: the server's ``usage.completion_tokens`` (``stream_options.include_usage``),
  else the number of text chunks.
* throughput: successful requests (and their output tokens) over the step's wall time, from its
  start until its last request finished (requests started before the end are waited for, as
  ``vllm bench serve`` does).
* percentiles: linear interpolation between the two nearest ranks (numpy's default, which
  ``vllm bench serve`` uses).

The policy is pure and tested on its own: :func:`concurrency_schedule` (the steps),
:func:`stop_reason` (when to stop early), :func:`find_knee` (the knee), :func:`percentile`,
:func:`summarize_step` (one step's figures from its requests) and :func:`governor_workers`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import random
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import anyio
import httpx

from ._load import Load

__all__ = [
    "DEFAULT_TOKENS_PER_WORD",
    "KNEE_FRACTION",
    "BenchRequest",
    "Knee",
    "RequestSample",
    "StepResult",
    "SyntheticMix",
    "add_bench_parser",
    "concurrency_schedule",
    "find_knee",
    "governor_workers",
    "load_workload_file",
    "main",
    "next_concurrency",
    "percentile",
    "prompt_of",
    "run",
    "stop_reason",
    "summarize_load",
    "summarize_step",
]

#: Tokens a plain English word costs when the server cannot count them (``/tokenize`` absent).
DEFAULT_TOKENS_PER_WORD = 1.3

#: The marginal rule's knee: the last step beyond which one more request in flight buys less than
#: this share of the throughput the first step bought per request in flight.
KNEE_FRACTION = 0.25

#: A step whose share of failed requests passes this stops the run and is no knee candidate.
MAX_ERROR_SHARE = 0.05

#: Throughput counts as flat when it beats the best step so far by less than this share.
FLAT_RISE = 0.05

Mode = Literal["closed", "open"]

# -- policy: percentiles, steps, stop rule, knee ---------------------------------------------------


def percentile(values: Sequence[float], percent: float) -> float | None:
    """The ``percent`` percentile of ``values`` by linear interpolation; ``None`` for none.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5

    Numpy's default method (what ``vllm bench serve`` reports): the rank ``(n - 1) x p / 100``
    interpolated between its two neighbours.
    """
    if not values:
        return None
    if not 0 <= percent <= 100:
        raise ValueError(f"percent must be between 0 and 100, got {percent!r}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * percent / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def next_concurrency(current: int, factor: float) -> int:
    """The next step's concurrency: ``round(current x factor)``, at least ``current + 1``.

    >>> [next_concurrency(c, 1.2) for c in (1, 5, 6, 10, 100)]
    [2, 6, 7, 12, 120]
    """
    return max(current + 1, round(current * factor))


def concurrency_schedule(
    start: int, factor: float, max_concurrency: int, max_steps: int | None = None
) -> list[int]:
    """Every step's concurrency, from ``start`` growing by ``factor``, ending at the bounds.

    >>> concurrency_schedule(1, 1.5, 10)
    [1, 2, 3, 4, 6, 9, 10]

    The last step is ``max_concurrency`` itself when the growth would jump past it; at most
    ``max_steps`` steps (``None``: no bound but the concurrency).
    """
    if start < 1 or max_concurrency < start:
        raise ValueError(f"need 1 <= start <= max_concurrency, got {start} and {max_concurrency}")
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    steps: list[int] = []
    current = start
    while max_steps is None or len(steps) < max_steps:
        steps.append(current)
        if current >= max_concurrency:
            break
        current = min(max_concurrency, next_concurrency(current, factor))
    return steps


@dataclass(frozen=True, kw_only=True)
class RequestSample:
    """One request of a step, timed on the client.

    ``RequestSample(ok=True, latency_s=0.4, ttft_s=0.05, output_tokens=64, itl_s=(...))``.

    Parameters:
        ok: a 200 whose stream ended without an error event.
        latency_s: from sending to the end of the stream (or the failure).
        ttft_s: to the first chunk with text; ``None`` when none came.
        output_tokens: the server's ``completion_tokens``, else the number of text chunks.
        itl_s: the gaps between successive text chunks.
        error: what went wrong (``"HTTP 503"``, ``"timeout"``, ...) when not ``ok``.
        detail: the first part of the error's body or message, for the report.
    """

    ok: bool
    latency_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    itl_s: tuple[float, ...] = ()
    error: str | None = None
    detail: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """``(latency - TTFT) / (output tokens - 1)``, as ``vllm bench serve`` defines it."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def summarize_load(loads: Sequence[Load]) -> dict[str, Any] | None:
    """Mean and max of the server's running, waiting and KV usage over a step's scrapes.

    ``None`` without scrapes; a gauge the server lacks is ``None`` in the summary.
    """
    if not loads:
        return None

    def spread(values: list[float]) -> tuple[float | None, float | None]:
        if not values:
            return None, None
        return round(sum(values) / len(values), 3), max(values)

    running = spread([x.running for x in loads if x.running is not None])
    waiting = spread([x.waiting for x in loads if x.waiting is not None])
    kv = spread([x.kv_usage for x in loads if x.kv_usage is not None])
    return {
        "source": loads[-1].source,
        "samples": len(loads),
        "running_mean": running[0],
        "running_max": running[1],
        "waiting_mean": waiting[0],
        "waiting_max": waiting[1],
        "kv_usage_mean": kv[0],
        "kv_usage_max": kv[1],
    }


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The figures of one step (one item of ``bench.json``'s ``"steps"``).

    Times are seconds, rates per second; a percentile without samples is ``None``.
    ``concurrency`` is the step's number of workers (closed loop), or the mean number of requests
    in flight (open loop, by Little's law: the requests' summed latency over the step's time).
    ``server`` is :func:`summarize_load` of the step's ``/metrics`` scrapes.
    """

    index: int
    concurrency: float
    rate_rps: float | None
    duration_s: float
    requests: int
    errors: int
    error_share: float
    error_kinds: Mapping[str, int]
    first_error: str | None
    throughput_rps: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    itl_p50_s: float | None
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    mean_latency_s: float | None
    server: Mapping[str, Any] | None = None

    @property
    def load(self) -> float:
        """What the step set: the offered rate (open loop) or the concurrency (closed loop)."""
        return self.rate_rps if self.rate_rps is not None else self.concurrency

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize_step(
    samples: Sequence[RequestSample],
    *,
    index: int,
    duration_s: float,
    concurrency: int | None = None,
    rate_rps: float | None = None,
    loads: Sequence[Load] = (),
) -> StepResult:
    """A :class:`StepResult` from a step's requests, its wall time and its ``/metrics`` scrapes.

    ``concurrency`` ``None`` (open loop) takes the mean in flight over the step.
    """
    duration = max(duration_s, 1e-9)
    good = [s for s in samples if s.ok]
    errors = len(samples) - len(good)
    latencies = [s.latency_s for s in good]
    ttfts = [s.ttft_s for s in good if s.ttft_s is not None]
    tpots = [t for s in good if (t := s.tpot_s) is not None]
    itls = [gap for s in good for gap in s.itl_s]
    kinds = Counter(s.error or "error" for s in samples if not s.ok)
    first = next((s for s in samples if not s.ok), None)
    if concurrency is None:
        in_flight = round(sum(s.latency_s for s in samples) / duration, 2)
    else:
        in_flight = concurrency
    first_error = None
    if first is not None:
        first_error = first.error or "error"
        if first.detail:
            first_error += f": {first.detail}"
    return StepResult(
        index=index,
        concurrency=in_flight,
        rate_rps=rate_rps,
        duration_s=round(duration_s, 3),
        requests=len(good),
        errors=errors,
        error_share=round(errors / len(samples), 4) if samples else 0.0,
        error_kinds=dict(sorted(kinds.items())),
        first_error=first_error,
        throughput_rps=round(len(good) / duration, 4),
        output_tokens_per_s=round(sum(s.output_tokens for s in good) / duration, 2),
        ttft_p50_s=_round(percentile(ttfts, 50)),
        ttft_p99_s=_round(percentile(ttfts, 99)),
        tpot_p50_s=_round(percentile(tpots, 50), 5),
        itl_p50_s=_round(percentile(itls, 50), 5),
        p50_s=_round(percentile(latencies, 50)),
        p95_s=_round(percentile(latencies, 95)),
        p99_s=_round(percentile(latencies, 99)),
        mean_latency_s=_round(sum(latencies) / len(latencies)) if latencies else None,
        server=summarize_load(loads),
    )


def _flat(steps: Sequence[StepResult], rise: float) -> bool:
    """The last of ``steps`` beat the best before it by less than ``rise``, at a higher p99."""
    last, previous = steps[-1], steps[-2]
    best = max(s.throughput_rps for s in steps[:-1])
    if last.throughput_rps >= best * (1 + rise):
        return False
    if last.p99_s is None or previous.p99_s is None:
        return True
    return last.p99_s > previous.p99_s


def stop_reason(
    steps: Sequence[StepResult],
    *,
    rise: float = FLAT_RISE,
    max_error_share: float = MAX_ERROR_SHARE,
) -> tuple[str, str] | None:
    """Why to stop after the last of ``steps`` (``(reason, detail)``), or ``None`` to go on.

    * ``"errors"``: more than ``max_error_share`` of the last step's requests failed.
    * ``"plateau"``: two steps in a row each beat the best throughput before them by less than
      ``rise`` (5%) while their p99 latency rose over the step before.
    """
    if not steps:
        return None
    last = steps[-1]
    if last.error_share > max_error_share:
        total = last.requests + last.errors
        return (
            "errors",
            f"{last.errors} of {total} requests failed at {_load_text(last)} ({last.first_error})",
        )
    if len(steps) >= 3 and _flat(steps, rise) and _flat(steps[:-1], rise):
        return (
            "plateau",
            f"throughput rose less than {rise:.0%} over two steps while p99 climbed"
            f" (to {last.p99_s} s at {_load_text(last)})",
        )
    return None


def _load_text(step: StepResult) -> str:
    if step.rate_rps is not None:
        return f"{step.rate_rps:g} req/s offered"
    return f"concurrency {step.concurrency:g}"


@dataclass(frozen=True, kw_only=True)
class Knee:
    """The step a server is best run at (``bench.json``'s ``"knee"``).

    Parameters:
        rule: ``"slo"`` (the best throughput whose p99 met ``--slo-p99``) or ``"marginal"``
            (where one more request in flight buys less than :data:`KNEE_FRACTION` of what the
            first one bought).
        found: ``False`` when no step met the SLO, or throughput still rose at the last step
            (the knee is then beyond the run; the fields describe the best step seen).
        step: the step's index in ``"steps"``; ``None`` when no step qualifies.
        detail: one sentence saying why.
    """

    rule: Literal["slo", "marginal"]
    found: bool
    step: int | None
    concurrency: float | None
    rate_rps: float | None
    throughput_rps: float | None
    p99_s: float | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _knee_at(
    step: StepResult | None, rule: Literal["slo", "marginal"], found: bool, detail: str
) -> Knee:
    return Knee(
        rule=rule,
        found=found,
        step=None if step is None else step.index,
        concurrency=None if step is None else step.concurrency,
        rate_rps=None if step is None else step.rate_rps,
        throughput_rps=None if step is None else step.throughput_rps,
        p99_s=None if step is None else step.p99_s,
        detail=detail,
    )


def find_knee(
    steps: Sequence[StepResult],
    *,
    slo_p99: float | None = None,
    fraction: float = KNEE_FRACTION,
    max_error_share: float = MAX_ERROR_SHARE,
) -> Knee:
    """The knee of a run. Steps with more than ``max_error_share`` failed never qualify.

    With ``slo_p99``: the step of highest throughput whose p99 latency is at most ``slo_p99``
    (the lower load on a tie).

    Without: let ``r0`` be the first step's throughput per unit of load (requests/s per request in
    flight, or per request/s offered). For each step ``k``, the gain ahead is the best
    ``(throughput_j - throughput_k) / (load_j - load_k)`` over the later steps ``j``: the most
    that more load beyond ``k`` bought. The knee is the first step whose gain ahead is below
    ``fraction x r0``. Taking the best later step, not the next one, keeps one noisy step from
    ending the rise early. If every step's gain ahead stays above, the knee is not found and the
    best step is reported.
    """
    usable = [s for s in steps if s.error_share <= max_error_share and s.requests > 0]
    if slo_p99 is not None:
        meeting = [s for s in usable if s.p99_s is not None and s.p99_s <= slo_p99]
        if not meeting:
            return _knee_at(None, "slo", False, f"no step had p99 <= {slo_p99:g} s")
        best = max(meeting, key=lambda s: (s.throughput_rps, -s.load))
        return _knee_at(
            best,
            "slo",
            True,
            f"the highest throughput ({best.throughput_rps:g} req/s) with p99 <= {slo_p99:g} s",
        )
    if not usable:
        return _knee_at(None, "marginal", False, "no step succeeded")
    first = usable[0]
    reference = first.throughput_rps / first.load if first.load > 0 else 0.0
    for k, step in enumerate(usable[:-1]):
        gains = [
            (later.throughput_rps - step.throughput_rps) / (later.load - step.load)
            for later in usable[k + 1 :]
            if later.load > step.load
        ]
        if gains and max(gains) < fraction * reference:
            unit = "request in flight" if step.rate_rps is None else "req/s offered"
            return _knee_at(
                step,
                "marginal",
                True,
                f"beyond {_load_text(step)}, each added {unit} bought at most"
                f" {max(max(gains), 0.0):.3g} req/s, under {fraction:.0%} of the"
                f" {reference:.3g} req/s per {unit} of the first step",
            )
    best = max(usable, key=lambda s: (s.throughput_rps, -s.load))
    return _knee_at(
        best,
        "marginal",
        False,
        f"throughput still rose at the last step ({_load_text(usable[-1])}): the knee lies beyond"
        " it; raise --max-concurrency or --max-steps",
    )


def governor_workers(
    steps: Sequence[StepResult],
    knee: Knee,
    max_concurrency: int,
    *,
    limit: int | None = None,
    max_num_seqs: int | None = None,
) -> int:
    """Callers for the governor phase: more than the limit could want, so that it moves freely.

    The most the sweep ran, and at least twice each of the knee, the client's starting
    ``limit`` and the server's ``max_num_seqs`` (when known); at most ``max_concurrency``.
    """
    most = max((math.ceil(s.concurrency) for s in steps), default=1)
    for floor in (knee.concurrency, limit, max_num_seqs):
        if floor is not None:
            most = max(most, 2 * math.ceil(floor))
    return max(1, min(most, max_concurrency))


# -- workloads -------------------------------------------------------------------------------------

# Plain words (most cost one or two tokens in any English BPE vocabulary).
_WORD_TEXT = (
    "the a an one two three many few some every this that these those model server token "
    "request batch queue limit client engine cache memory prompt answer cat dog bird fish tree "
    "river stone cloud light night day morning evening winter summer run walk read write send "
    "wait start stop count measure build serve listen think fast slow small large quiet busy "
    "careful simple random tiny open closed early late and or but so because while when if "
    "then after before under over near far with without is are was were will can may must "
    "should could would has have had do does did user hello thanks please yes no maybe number "
    "time place world word"
)
_WORDS = _WORD_TEXT.split()


def prompt_of(rng: random.Random, tokens: int, tokens_per_word: float) -> str:
    """Random plain words costing about ``tokens`` tokens at ``tokens_per_word``."""
    count = max(1, round(tokens / max(tokens_per_word, 0.1)))
    return " ".join(rng.choice(_WORDS) for _ in range(count))


@dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """One request of a workload: the endpoint and the body (no ``model``, no ``stream``)."""

    path: str
    body: Mapping[str, Any]
    kind: str = "file"


@dataclass(frozen=True, kw_only=True)
class SyntheticMix:
    """A mix of short and long completions: ``short_ratio`` of them short.

    ``SyntheticMix(short_ratio=0.75, short_prompt_tokens=64, long_prompt_tokens=1000,
    short_output=64, long_output=256)`` is the default.
    """

    short_ratio: float = 0.75
    short_prompt_tokens: int = 64
    long_prompt_tokens: int = 1000
    short_output: int = 64
    long_output: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.short_ratio <= 1:
            raise ValueError(f"short_ratio must be between 0 and 1, got {self.short_ratio!r}")
        for name in ("short_prompt_tokens", "long_prompt_tokens", "short_output", "long_output"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    def requests(
        self, rng: random.Random, tokens_per_word: float, *, ignore_eos: bool
    ) -> Iterator[BenchRequest]:
        """An endless stream of requests, fresh random words each (no prefix-cache hits)."""
        extra = {"ignore_eos": True} if ignore_eos else {}
        while True:
            short = rng.random() < self.short_ratio
            tokens = self.short_prompt_tokens if short else self.long_prompt_tokens
            body = {
                "prompt": prompt_of(rng, tokens, tokens_per_word),
                "max_tokens": self.short_output if short else self.long_output,
                **extra,
            }
            yield BenchRequest(path="/v1/completions", body=body, kind="short" if short else "long")


def load_workload_file(path: str, *, default_max_tokens: int) -> list[BenchRequest]:
    """The requests of a JSONL file: plain ``{"prompt"|"messages": ...}`` dicts or OpenAI batch
    lines (as ``dsclient map`` reads). ``model`` and ``stream`` in them are ignored; lines without
    ``max_tokens`` get ``default_max_tokens``. Raises ``ValueError`` naming a bad line."""
    from ._cli_map import request_of

    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if isinstance(obj, dict):
                    for holder in (obj, obj.get("body")):
                        if isinstance(holder, dict):
                            holder.pop("stream", None)
                            holder.pop("stream_options", None)
                body = request_of(obj, drop_model=True)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path} line {lineno}: {exc}") from exc
            body.pop("custom_id", None)
            body.setdefault("max_tokens", default_max_tokens)
            chat = "messages" in body
            requests.append(
                BenchRequest(path="/v1/chat/completions" if chat else "/v1/completions", body=body)
            )
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def _cycle(items: Sequence[BenchRequest]) -> Iterator[BenchRequest]:
    while True:
        yield from items


# -- I/O: one request, one step, the governor phase -----------------------------------------------


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
    ) -> None:
        self.http = http
        self.url = url
        self.model = model
        self.requests = requests
        self.step_seconds = step_seconds
        self.clock = clock
        self.rng = rng or random.Random(0)
        self.progress = progress
        self.live = bool(progress is not None and getattr(progress, "isatty", lambda: False)())
        self.has_metrics: bool | None = None
        self.steps: list[StepResult] = []

    async def request(self, request: BenchRequest) -> RequestSample:
        """Send one streamed request and time it."""
        from ._exceptions import MalformedResponse
        from ._streaming import delta_of, sse_events

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
        from ._endpoint import fetch_load

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
        from ._client import AsyncClient
        from ._exceptions import DSClientError

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


# -- report ----------------------------------------------------------------------------------------


def _table(steps: Sequence[StepResult], mode: Mode) -> str:
    head = "rate" if mode == "open" else "conc"
    columns = (
        f"{head:>6} {'req/s':>7} {'tok/s':>7} {'ttft50':>7} {'ttft99':>7} {'tpot50':>7}"
        f" {'itl50':>7} {'p50':>7} {'p95':>7} {'p99':>7} {'err':>5} {'run':>5} {'wait':>5}"
        f" {'kv':>5}"
    )

    def f(value: float | None, width: int = 7) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.3g}"

    lines = [columns]
    for s in steps:
        server = s.server or {}
        kv = server.get("kv_usage_mean")
        lines.append(
            f"{f(s.load, 6)} {f(s.throughput_rps)} {s.output_tokens_per_s:>7.0f}"
            f" {f(s.ttft_p50_s)} {f(s.ttft_p99_s)} {f(s.tpot_p50_s)} {f(s.itl_p50_s)}"
            f" {f(s.p50_s)} {f(s.p95_s)} {f(s.p99_s)} {s.errors:>5}"
            f" {f(server.get('running_mean'), 5)} {f(server.get('waiting_mean'), 5)}"
            f" {'-' if kv is None else format(kv, '.0%'):>5}"
        )
    return "\n".join(lines)


def summary_text(report: Mapping[str, Any]) -> str:
    """What ``dsclient bench`` prints on stdout (without ``--json``)."""
    steps = [StepResult(**s) for s in report["steps"]]
    lines = [_table(steps, report["mode"])]
    stop = report["stop"]
    lines.append(f"stopped: {stop['reason']}: {stop['detail']}")
    knee = report["knee"]
    if knee["step"] is None:
        lines.append(f"knee: none ({knee['detail']})")
    else:
        where = (
            f"{knee['rate_rps']:g} req/s offered (mean in flight {knee['concurrency']:g})"
            if knee["rate_rps"] is not None
            else f"concurrency {knee['concurrency']:g}"
        )
        verdict = "" if knee["found"] else " (not reached; best seen)"
        lines.append(
            f"knee{verdict}: {where}: {knee['throughput_rps']:g} req/s, p99 {knee['p99_s']} s"
            f" -- {knee['detail']}"
        )
    governor = report.get("governor")
    if governor is None:
        pass
    elif "error" in governor:
        lines.append(f"governor: could not run: {governor['error']}")
    else:
        control = governor.get("control") or {}
        lines.append(
            f"dsclient's governor: limit {governor['limit']} after {governor['duration_s']:g} s"
            f" with {governor['workers']} callers (started at {governor['limit_start']}, range"
            f" {governor['limit_min']}-{governor['limit_max']}, mode {control.get('mode')}):"
            f" {governor['throughput_rps']:g} req/s, p99 {governor['p99_s']} s from the call"
            f" (server's share {governor['service_p99_s']} s), {governor['errors']} errors"
        )
    return "\n".join(lines)


def write_outputs(report: dict[str, Any], folder: Path) -> list[str]:
    """Write ``bench.json`` and, when matplotlib is importable, ``bench.png``; returns notes."""
    folder.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    try:
        from ._bench_plot import plot_bench

        png = plot_bench(report, folder / "bench.png")
        report["plots"] = [png.name]
    except ImportError:
        report["plots"] = []
        notes.append("no plots: matplotlib is not installed (pip install 'dsclient[bench]')")
    path = folder / "bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    written = [str(path)] + [str(folder / p) for p in report["plots"]]
    notes.insert(0, "wrote " + ", ".join(written))
    return notes


def _bound_reason(
    mode: Mode, loads: Sequence[float], max_concurrency: int, max_steps: int | None
) -> tuple[str, str]:
    """Which bound ended a run that went through every planned step."""
    if mode == "closed" and loads and loads[-1] >= max_concurrency:
        return "max-concurrency", f"reached --max-concurrency {max_concurrency}"
    if max_steps is not None and len(loads) == max_steps:
        return "max-steps", f"ran --max-steps {max_steps}"
    return "rates", "ran every rate"


# -- the command -----------------------------------------------------------------------------------

_DESCRIPTION = textwrap.fill(
    "Load-test the server at URL in steps: closed loop from --start workers, times --factor each"
    " step (at least +1), or open loop at the Poisson --rates. Each step reports requests and"
    " output tokens per second, TTFT / TPOT / ITL (as vllm bench serve defines them), latency"
    " percentiles, errors, and the server's running / waiting / KV usage from /metrics. It stops"
    " when throughput stops rising while p99 climbs, on errors, or at a bound; then reports the"
    " knee and the limit dsclient's governor settles at against the same workload.",
    width=78,
)
_EPILOG = (
    "examples:\n"
    "  dsclient bench http://127.0.0.1:8000 -o bench-out\n"
    "  dsclient bench http://127.0.0.1:8000 --slo-p99 1.5 --max-steps 10 --step-seconds 5\n"
    "  dsclient bench http://127.0.0.1:8000 --rates 1,2,4,8 --workload requests.jsonl --json\n"
    "knee without --slo-p99: the last step beyond which one more request in flight buys less\n"
    f"than {KNEE_FRACTION:.0%} of the throughput the first step bought per request in flight.\n"
    "exit status: 0 done, 1 every request failed, 2 bad arguments or server unreachable,\n"
    "130 interrupted (what was measured is still written)"
)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _rates(text: str) -> list[float]:
    rates = [_positive_float(part) for part in text.split(",") if part.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("give at least one rate, e.g. 1,2,4")
    return rates


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` to an ``argparse`` subparsers object; sets ``func=run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="load-test a server in steps; report its knee and dsclient's limit",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server's URL, with or without /v1")
    parser.add_argument("--model", help="the model to ask for (default: the server's only one)")
    steps = parser.add_argument_group("steps")
    steps.add_argument("--start", type=_positive_int, default=1, help="first concurrency (1)")
    steps.add_argument(
        "--factor", type=_positive_float, default=1.2, help="concurrency growth per step (1.2)"
    )
    steps.add_argument(
        "--max-concurrency", type=_positive_int, default=256, help="last concurrency (256)"
    )
    steps.add_argument(
        "--step-seconds", type=_positive_float, default=10.0, help="seconds per step (10)"
    )
    steps.add_argument("--max-steps", type=_positive_int, default=None, help="at most N steps")
    steps.add_argument(
        "--rates",
        type=_rates,
        default=None,
        metavar="R1,R2,...",
        help="open loop: Poisson arrivals at these requests/s, one step each",
    )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload",
        default="synthetic",
        metavar="synthetic|FILE.jsonl",
        help="the synthetic short/long mix (default), or a JSONL file of requests",
    )
    work.add_argument("--short-ratio", type=float, default=0.75, help="share of short requests")
    work.add_argument("--short-prompt-tokens", type=_positive_int, default=64)
    work.add_argument("--long-prompt-tokens", type=_positive_int, default=1000)
    work.add_argument("--short-output", type=_positive_int, default=64, help="max_tokens, short")
    work.add_argument("--long-output", type=_positive_int, default=256, help="max_tokens, long")
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send vLLM's ignore_eos (outputs may then end early)",
    )
    work.add_argument("--seed", type=int, default=0, help="random seed of prompts and arrivals")
    report = parser.add_argument_group("report")
    report.add_argument(
        "--slo-p99", type=_positive_float, default=None, help="knee: best throughput with p99 <= S"
    )
    report.add_argument(
        "--knee-fraction",
        type=_positive_float,
        default=KNEE_FRACTION,
        help=f"knee without an SLO: marginal share of the first step's gain ({KNEE_FRACTION})",
    )
    report.add_argument("--timeout", type=_positive_float, default=600.0, help="per request (s)")
    report.add_argument(
        "--no-governor", dest="governor", action="store_false", help="skip the governor phase"
    )
    report.add_argument("-o", "--output", metavar="DIR", help="write bench.json and bench.png here")
    report.add_argument("--json", action="store_true", help="print bench.json instead of a table")


def run(
    args: argparse.Namespace,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``dsclient bench``; see the module's docstring for the exit statuses."""
    from ._client import _root_url

    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr

    def fail(message: str, code: int = 2) -> int:
        print(f"dsclient bench: {message}", file=err, flush=True)
        return code

    try:
        url = _root_url(args.url)
        if args.factor <= 1:
            raise ValueError(f"--factor must be > 1, got {args.factor:g}")
        if args.max_concurrency < args.start:
            raise ValueError(
                f"--max-concurrency ({args.max_concurrency}) is below --start ({args.start})"
            )
        mix = SyntheticMix(
            short_ratio=args.short_ratio,
            short_prompt_tokens=args.short_prompt_tokens,
            long_prompt_tokens=args.long_prompt_tokens,
            short_output=args.short_output,
            long_output=args.long_output,
        )
        file_requests = None
        if args.workload != "synthetic":
            file_requests = load_workload_file(args.workload, default_max_tokens=args.long_output)
    except (ValueError, TypeError) as exc:
        return fail(_one_line(str(exc)))
    except OSError as exc:
        return fail(f"cannot read {args.workload}: {exc.strerror}")
    if args.output:  # before the run, not after minutes of it
        try:
            Path(args.output).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return fail(f"cannot create {args.output}: {exc.strerror}")
    mode: Mode = "open" if args.rates else "closed"
    loads: list[float]
    if args.rates:
        loads = list(args.rates[: args.max_steps] if args.max_steps else args.rates)
    else:
        loads = [
            float(c)
            for c in concurrency_schedule(
                args.start, args.factor, args.max_concurrency, args.max_steps
            )
        ]
    report: dict[str, Any] = {
        "url": url,
        "model": args.model,
        "mode": mode,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            key: value
            for key, value in vars(args).items()
            if key not in ("func", "extra_args", "verbose", "url") and not callable(value)
        },
        "workload": {"kind": "synthetic", **dataclasses.asdict(mix)}
        if file_requests is None
        else {"kind": "file", "path": args.workload, "requests": len(file_requests)},
        "steps": [],
        "stop": None,
        "knee": None,
        "governor": None,
    }
    state: dict[str, Any] = {}

    async def main_async() -> None:
        http = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(args.timeout, connect=min(args.timeout, 10.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            headers={"User-Agent": "dsclient-bench/0.1"},
        )
        async with http:
            model, max_model_len = await _find_model(http, url, args.model)
            report["model"] = model
            report["max_model_len"] = max_model_len
            rng = random.Random(args.seed)
            if file_requests is None:
                per_word, source = await _tokens_per_word(http, url, model)
                report["workload"].update(
                    tokens_per_word=round(per_word, 3), tokens_per_word_source=source
                )
                requests = mix.requests(rng, per_word, ignore_eos=args.ignore_eos)
            else:
                requests = _cycle(file_requests)
            bench = Bench(
                http,
                url,
                model=model,
                requests=requests,
                step_seconds=args.step_seconds,
                rng=random.Random(args.seed + 1),
                progress=err,
            )
            state["bench"] = bench
            what = "closed loop" if mode == "closed" else "open loop"
            print(
                f"dsclient bench: {url} model {model}, {what}, {len(loads)} steps at most of"
                f" {args.step_seconds:g} s",
                file=err,
                flush=True,
            )
            stop = await bench.sweep(mode=mode, loads=loads)
            if stop[0] == "bound":
                stop = _bound_reason(mode, loads, args.max_concurrency, args.max_steps)
            state["stop"] = stop
            knee = find_knee(bench.steps, slo_p99=args.slo_p99, fraction=args.knee_fraction)
            state["knee"] = knee
            if args.governor and bench.steps and bench.steps[0].requests:
                state["governor"] = await bench.governor(knee, args.max_concurrency, transport)

    code = 0
    try:
        anyio.run(main_async)
    except Unreachable as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        state.setdefault("stop", ("interrupted", "Ctrl-C (during the sweep)"))
        if "knee" in state:
            print("dsclient bench: governor phase interrupted", file=err, flush=True)
        code = 130
    bench_done: Bench | None = state.get("bench")
    steps = bench_done.steps if bench_done is not None else []
    if not steps:
        return fail("interrupted before the first step ended", code or 1)
    report["steps"] = [s.to_dict() for s in steps]
    reason, detail = state.get("stop", ("interrupted", "Ctrl-C"))
    report["stop"] = {"reason": reason, "detail": detail}
    knee = state.get("knee") or find_knee(steps, slo_p99=args.slo_p99, fraction=args.knee_fraction)
    report["knee"] = knee.to_dict()
    report["governor"] = state.get("governor")
    notes: list[str] = []
    if args.output:
        try:
            notes = write_outputs(report, Path(args.output))
        except OSError as exc:
            return fail(f"cannot write {args.output}: {exc.strerror}", 1)
    if args.json:
        print(json.dumps(report, indent=2), file=out, flush=True)
    else:
        print(summary_text(report), file=out, flush=True)
    for note in notes:
        print(f"dsclient bench: {note}", file=err, flush=True)
    if code == 0 and all(s.requests == 0 for s in steps):
        return fail(f"every request failed ({steps[0].first_error})", 1)
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m dsclient._cli_bench URL ...``: the command on its own."""
    parser = argparse.ArgumentParser(
        prog="dsclient bench",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

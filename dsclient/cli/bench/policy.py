"""The pure policy of ``dsclient bench``: percentiles, steps, the stop rule, the knee."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...governor._load import Load
from .goodput import Slo, goodput_rps

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
    ``server`` is :func:`summarize_load` of the step's ``/metrics`` scrapes. ``good_requests``
    and ``goodput_rps`` are ``None`` unless objectives were given (:mod:`.goodput`).
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
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    tpot_p99_s: float | None = None
    good_requests: int | None = None  # with ``--goodput``: requests that met every objective
    goodput_rps: float | None = None

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
    slo: Slo | None = None,
) -> StepResult:
    """A :class:`StepResult` from a step's requests, its wall time and its ``/metrics`` scrapes.

    ``concurrency`` ``None`` (open loop) takes the mean in flight over the step; ``slo`` adds
    goodput over the step's duration, as ``vllm bench serve --goodput`` counts it.
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
        ttft_p95_s=_round(percentile(ttfts, 95)),
        tpot_p95_s=_round(percentile(tpots, 95), 5),
        tpot_p99_s=_round(percentile(tpots, 99), 5),
        **_goodput(samples, slo, duration),
    )


def _goodput(samples: Sequence[RequestSample], slo: Slo | None, duration: float) -> dict[str, Any]:
    if slo is None:
        return {}
    good, rate = goodput_rps(
        ((s.ok, s.ttft_s, s.latency_s, s.output_tokens) for s in samples), slo, duration
    )
    return {"good_requests": good, "goodput_rps": rate}


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

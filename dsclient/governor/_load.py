"""Server load from a Prometheus ``/metrics`` scrape: how full the batch, queue and KV cache are.

Pure: no network, no I/O. The client fetches ``/metrics`` and hands the text to :func:`parse_load`,
which recognises the server's dialect and returns a :class:`Load` for the concurrency controller.
:func:`parse_prometheus` is the generic text-exposition parser underneath.

Metric names, by dialect, and where each was confirmed:

* vLLM: ``vllm/v1/metrics/loggers.py`` of vLLM 0.32.0 (``PrometheusStatLogger``: every series has
  ``model_name`` and ``engine`` labels, one series per data-parallel engine) and
  ``vllm/config/cache.py`` (``CacheConfig.metrics_info``, the labels of ``vllm:cache_config_info``,
  every value ``str()``-ed, hence ``"None"``). ``vllm:gpu_cache_usage_perc`` is the name older
  (V0) releases gave the KV usage gauge.
* SGLang: ``python/sglang/srt/metrics/collector.py`` (``SchedulerMetricsCollector``) and
  ``docs/references/production_metrics.md``. ``sglang:max_running_requests`` is in the 2024
  releases of that file only.
* llama.cpp: the ``/metrics`` handler of ``tools/server/server.cpp`` (formerly
  ``examples/server/server.cpp``) and the server README. Recent builds dropped
  ``llamacpp:kv_cache_usage_ratio``, so ``kv_usage`` is ``None`` for them.
* vLLM's load on every answer (:func:`parse_load_header`): ``vllm/entrypoints/serve/utils/
  orca_metrics.py`` of 0.32.0, the ORCA ``endpoint-load-metrics`` header, sent on a
  non-streaming completion or chat answer when the request asks for it with
  ``endpoint-load-metrics-format: TEXT`` (or ``JSON``): ``num_requests_waiting`` and
  ``kv_cache_usage_perc``, no running count.
* SGLang ``GET /v1/loads`` and llama.cpp ``GET /slots`` (:func:`parse_sglang_loads`,
  :func:`parse_llamacpp_slots`): the routes those servers have when ``/metrics`` is off.
* TGI: ``docs/source/reference/metrics.md`` and the router (``backends/v3/src/lib.rs`` sets
  ``tgi_batch_max_total_tokens`` once at warm-up). TGI has no gauge for ``--max-batch-size``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "LOAD_HEADER",
    "LOAD_HEADER_FORMAT",
    "Load",
    "parse_llamacpp_slots",
    "parse_load",
    "parse_load_header",
    "parse_prometheus",
    "parse_sglang_loads",
]

_Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True, kw_only=True)
class Load:
    """One scrape of a server's load.

    ``Load(source="vllm /metrics", running=3, waiting=0, kv_usage=0.41)``: three sequences in the
    batch, nothing queued, 41% of the KV cache in use. What a server does not report is ``None``.

    Parameters:
        source: the dialect read: ``"vllm /metrics"``, ``"sglang /metrics"``,
            ``"llama.cpp /metrics"`` or ``"tgi /metrics"``.
        running: sequences in the server's batch now, summed over data-parallel engines.
        waiting: requests in the server's own queue now, summed likewise.
        waiting_capacity: of ``waiting``, those held back for lack of room in the batch or KV
            cache (vLLM's ``num_requests_waiting_by_reason{reason="capacity"}``).
        kv_usage: share of the KV cache in use, in ``[0, 1]``: the mean over engines, whose
            caches are the same size.
        preemptions: cumulative count of preempted (vLLM) or retracted (SGLang) requests.
        kv_cache_size_tokens: tokens the KV cache holds for requests, summed over engines
            (vLLM's ``cache_config_info`` less the one block each engine keeps back, SGLang's
            ``max_total_num_tokens``, TGI's ``batch_max_total_tokens``).
        kv_cache_max_concurrency: requests of the full context length that fit in the KV cache
            at once, summed over engines (vLLM's ``cache_config_info``).
        block_size: tokens per KV cache block (vLLM) or page (SGLang).
        max_num_seqs: the batch-size limit, only where a metric states it (SGLang's 2024
            releases); vLLM, llama.cpp and TGI never do.
    """

    source: str
    running: int | None = None
    waiting: int | None = None
    waiting_capacity: int | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None


# One label of `{...}`: a name, `=`, a double-quoted value with `\\`, `\"` and `\n` escapes, and an
# optional comma. Matched at an offset, one label at a time: C speed, and no catastrophic
# backtracking, since the two alternatives inside the value begin with disjoint characters.
_LABEL = re.compile(
    r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,?)[ \t]*'
)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_UNESCAPED = {"\\": "\\", '"': '"', "n": "\n"}


def _unescape(match: re.Match[str]) -> str:
    # An unknown escape stays as written.
    return _UNESCAPED.get(match[1], match[0])


def _parse(text: str, wanted: Container[str] | None) -> _Samples:
    """:func:`parse_prometheus`, skipping names not in ``wanted`` before reading their labels."""
    out: _Samples = {}
    for raw in text.split("\n"):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        match = _NAME.match(line)
        if match is None:
            continue
        name = match[0]
        if wanted is not None and name not in wanted:
            continue
        pos, end = match.end(), len(line)
        while pos < end and line[pos] in " \t":
            pos += 1
        labels: dict[str, str] = {}
        if pos < end and line[pos] == "{":
            pos += 1
            while pos < end and line[pos] != "}":
                label = _LABEL.match(line, pos)
                if label is None:
                    break
                value = label[2]
                labels[label[1]] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
                pos = label.end()
                if not label[3]:  # no comma: the label set must close here
                    break
            if pos >= end or line[pos] != "}":
                continue
            pos += 1
        elif pos == match.end():  # the name runs into something else: `foo-bar 1`
            continue
        # The value, then maybe a timestamp (or an OpenMetrics exemplar): ignored.
        fields = line[pos:].split(None, 1)
        if not fields or "_" in fields[0]:  # float() takes "1_0"; Prometheus does not
            continue
        try:
            number = float(fields[0])
        except ValueError:
            continue
        out.setdefault(name, []).append((labels, number))
    return out


def parse_prometheus(text: str) -> _Samples:
    r"""Parse Prometheus text exposition into ``{metric name: [(labels, value), ...]}``.

    >>> parse_prometheus('# TYPE up gauge\nup{job="a \\"b\\""} 1 1700000000000\n')
    {'up': [({'job': 'a "b"'}, 1.0)]}

    ``#`` lines (``# HELP``, ``# TYPE``, comments) are skipped, label values unescaped (``\\``,
    ``\"``, ``\n``), timestamps dropped; ``NaN``, ``+Inf`` and ``-Inf`` are floats. Histogram and
    summary samples keep their own names (``x_bucket``, ``x_sum``, ``x_count``). A malformed line
    is skipped: this never raises.

    Parameters:
        text: the body of a ``/metrics`` response.
    """
    return _parse(text, None)


@dataclass(frozen=True)
class _Dialect:
    """Which metrics feed which fields of :class:`Load`; of each tuple, the first present wins."""

    source: str
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    kv_cache_size_tokens: tuple[str, ...] = ()
    block_size: tuple[str, ...] = ()
    max_num_seqs: tuple[str, ...] = ()

    @property
    def live(self) -> tuple[str, ...]:
        """The load gauges, any of which in the text says it is this dialect."""
        return self.running + self.waiting + self.kv_usage + self.preemptions


_VLLM = _Dialect(
    source="vllm /metrics",
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # a 0-1 ratio, both
    # prometheus_client exposes the Counter `vllm:num_preemptions` as `..._total`.
    preemptions=("vllm:num_preemptions_total",),
)
_VLLM_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
_VLLM_CACHE_CONFIG = "vllm:cache_config_info"

_DIALECTS = (
    _VLLM,
    _Dialect(
        source="sglang /metrics",
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        # SGLang retracts running requests when its KV cache runs out: its preemptions.
        preemptions=("sglang:num_retracted_requests_total",),
        kv_cache_size_tokens=("sglang:max_total_num_tokens",),
        block_size=("sglang:page_size",),
        max_num_seqs=("sglang:max_running_requests",),
    ),
    _Dialect(
        source="llama.cpp /metrics",
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    ),
    _Dialect(
        source="tgi /metrics",
        running=("tgi_batch_current_size",),
        waiting=("tgi_queue_size",),
        # The batch token budget TGI sizes from free memory at warm-up: its KV cache in tokens.
        kv_cache_size_tokens=("tgi_batch_max_total_tokens",),
    ),
)

_WANTED = frozenset(
    [
        _VLLM_WAITING_BY_REASON,
        _VLLM_CACHE_CONFIG,
        *(
            name
            for d in _DIALECTS
            for name in d.live + d.kv_cache_size_tokens + d.block_size + d.max_num_seqs
        ),
    ]
)


def _series(samples: _Samples, name: str, model: str | None) -> list[tuple[dict[str, str], float]]:
    series = samples.get(name, [])
    if model is None:
        return series
    # A series without a `model_name` label is kept: the filter only drops other models' series.
    return [s for s in series if s[0].get("model_name", model) == model]


def _values(samples: _Samples, names: Iterable[str], model: str | None) -> list[float]:
    """The values of the first of ``names`` with any series left after the model filter."""
    for name in names:
        series = _series(samples, name, model)
        if series:
            return [value for _, value in series]
    return []


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _sum(values: Iterable[float]) -> float | None:
    finite = _finite(values)
    if not finite:
        return None
    try:
        return math.fsum(finite)
    except OverflowError:  # two series of 1e308: "intermediate overflow" (tests/test_fuzz.py)
        return None


def _mean(values: Iterable[float]) -> float | None:
    finite = _finite(values)
    # Each term divided first, so the sum cannot overflow where the mean would not.
    return math.fsum(v / len(finite) for v in finite) if finite else None


def _first(values: Iterable[float]) -> float | None:
    return next(iter(_finite(values)), None)


#: The largest count believed: the largest integer a float holds exactly. A gauge of 1e308
#: running sequences is a broken or hostile server, not a batch size to learn (the limit's
#: ceiling, four times the learned batch, would have become 7e308).
_MOST = 2**53


def _count(value: float | None) -> int | None:
    # Gauges are floats on the wire ("3.0"); a transiently negative one counts as zero.
    if value is None or value > _MOST:
        return None
    return max(0, round(value))


def _ratio(value: float | None) -> float | None:
    return None if value is None else min(1.0, max(0.0, value))


def _label_values(series: Iterable[tuple[Mapping[str, str], float]], key: str) -> list[float]:
    """The numeric values of label ``key``; absent, ``"None"`` and other non-numbers left out."""
    numbers = []
    for labels, _ in series:
        try:
            numbers.append(float(labels.get(key, "")))
        except ValueError:
            continue
    return numbers


def _vllm_fields(
    samples: _Samples, model: str | None
) -> tuple[int | None, int | None, float | None, int | None]:
    """What only vLLM reports: why requests wait, and its cache config (an info metric)."""
    capacity = [
        value
        for labels, value in _series(samples, _VLLM_WAITING_BY_REASON, model)
        if labels.get("reason") == "capacity"
    ]
    # One cache_config_info series per engine, labelled with that engine's own cache (vLLM 0.32
    # keeps these values per engine): summed like running and waiting, to give the server's.
    config = _series(samples, _VLLM_CACHE_CONFIG, model)
    return (
        _count(_sum(capacity)),
        _count(_sum(_usable_tokens(config))),
        _sum(_label_values(config, "kv_cache_max_concurrency")),
        _count(_first(_label_values(config, "block_size"))),
    )


def _usable_tokens(config: Iterable[tuple[Mapping[str, str], float]]) -> list[float]:
    """Each engine's ``kv_cache_size_tokens`` less the one block vLLM keeps back: its block
    pool holds a null block that no request gets (``BlockPool.null_block``; the usage gauge
    also leaves it out). On a cache of 24 blocks a batch counted 24 and vLLM ran 23."""
    usable = []
    for labels, _ in config:
        try:
            tokens = float(labels.get("kv_cache_size_tokens", ""))
        except ValueError:
            continue
        try:
            block = float(labels.get("block_size", ""))
        except ValueError:
            block = 0.0
        if not math.isfinite(block) or not 0 < block < tokens:
            block = 0.0
        usable.append(tokens - block)
    return usable


def parse_load(text: str, *, model: str | None = None) -> Load | None:
    r"""Read a server's load from its ``/metrics`` text; ``None`` if no known dialect is in it.

    >>> parse_load("llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n")
    Load(source='llama.cpp /metrics', running=2, waiting=1, waiting_capacity=None, ...)

    The dialects are tried in turn (vLLM, SGLang, llama.cpp, TGI); the first with one of its load
    gauges in the text wins. Counts are summed over their series (a data-parallel server reports
    one per engine), the KV usage ratio averaged.

    Parameters:
        text: the body of a ``/metrics`` response.
        model: keep only the series whose ``model_name`` label is this (series without that label
            stay). ``None`` if none of the dialect's load gauges is left.
    """
    samples = _parse(text, _WANTED)
    for dialect in _DIALECTS:
        if not any(_series(samples, name, model) for name in dialect.live):
            continue
        if dialect is _VLLM:
            waiting_capacity, size, concurrency, block = _vllm_fields(samples, model)
        else:
            waiting_capacity, concurrency = None, None
            size = _count(_sum(_values(samples, dialect.kv_cache_size_tokens, model)))
            block = _count(_first(_values(samples, dialect.block_size, model)))
        return Load(
            source=dialect.source,
            running=_count(_sum(_values(samples, dialect.running, model))),
            waiting=_count(_sum(_values(samples, dialect.waiting, model))),
            waiting_capacity=waiting_capacity,
            kv_usage=_ratio(_mean(_values(samples, dialect.kv_usage, model))),
            preemptions=_sum(_values(samples, dialect.preemptions, model)),
            kv_cache_size_tokens=size,
            kv_cache_max_concurrency=concurrency,
            block_size=block,
            max_num_seqs=_count(_sum(_values(samples, dialect.max_num_seqs, model))),
        )
    return None


#: The request header that asks vLLM for its load on the answer, and the answer's header.
LOAD_HEADER_FORMAT = "endpoint-load-metrics-format"
LOAD_HEADER = "endpoint-load-metrics"
_ORCA_TEXT = re.compile(r"named_metrics\.([A-Za-z0-9_.:-]+)=([^,\s]+)")
#: The longest header value read; vLLM's is under 100 bytes.
_HEADER_MAX = 4096


def _orca_named(value: str) -> dict[str, float] | None:
    kind, _, rest = value.strip().partition(" ")
    named: dict[str, float] = {}
    if kind.upper() == "TEXT":
        for name, number in _ORCA_TEXT.findall(rest):
            try:
                named[name] = float(number)
            except ValueError:
                continue
        return named
    if kind.upper() == "JSON":
        try:
            obj = json.loads(rest)
        except ValueError:
            return None
        metrics = obj.get("named_metrics") if isinstance(obj, dict) else None
        if not isinstance(metrics, dict):
            return None
        for name, number in metrics.items():
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                named[str(name)] = float(number)
        return named
    return None


def parse_load_header(value: str | None) -> Load | None:
    """vLLM's ``endpoint-load-metrics`` answer header as a :class:`Load` (``running`` unknown).

    >>> parse_load_header("TEXT named_metrics.num_requests_waiting=3.0, "
    ...                   "named_metrics.kv_cache_usage_perc=0.25")
    Load(source='endpoint-load-metrics', running=None, waiting=3, ..., kv_usage=0.25, ...)

    ``None`` for a missing, oversized or unreadable value, or one without a waiting count.
    """
    if not value or len(value) > _HEADER_MAX:
        return None
    named = _orca_named(value)
    if not named:
        return None
    waiting = _count(named.get("num_requests_waiting"))
    if waiting is None:
        return None
    return Load(
        source=LOAD_HEADER,
        waiting=waiting,
        kv_usage=_ratio(named.get("kv_cache_usage_perc")),
    )


def _nonneg(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        return None
    return value


def parse_sglang_loads(obj: object) -> Load | None:
    """SGLang's ``GET /v1/loads`` as a :class:`Load`, summed over data-parallel ranks.

    parse_sglang_loads({"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1}]})
    # Load(source="sglang /v1/loads", running=3, waiting=1)
    """
    entries = obj.get("loads") if isinstance(obj, dict) else obj
    if not isinstance(entries, list):
        return None
    ranks = [e for e in entries if isinstance(e, dict)]
    running = [_nonneg(e.get("num_running_reqs")) for e in ranks]
    waiting = [_nonneg(e.get("num_waiting_reqs")) for e in ranks]
    if not ranks or None in running or None in waiting:
        return None
    return Load(
        source="sglang /v1/loads",
        running=sum(r for r in running if r is not None),
        waiting=sum(w for w in waiting if w is not None),
    )


def parse_llamacpp_slots(obj: object) -> tuple[int, int] | None:
    """llama.cpp's ``GET /slots``: ``(busy, total)`` slots (``is_processing`` per slot).

        parse_llamacpp_slots([{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}])
        # (1, 2)

    The queue behind the slots is not in it: the endpoint counts what this client has in
    flight beyond the busy slots as waiting (see ``Endpoint``).
    """
    if not isinstance(obj, list) or not obj:
        return None
    busy = 0
    for slot in obj:
        if not isinstance(slot, dict) or not isinstance(slot.get("is_processing"), bool):
            return None
        busy += slot["is_processing"]
    return busy, len(obj)

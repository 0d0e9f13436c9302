"""Client metrics for Prometheus and spans for OpenTelemetry, from what the client already knows.

    registry = prometheus_client.CollectorRegistry()
    registry.register(dsclient.metrics.Collector(client))   # or start_http_server(client, 9464)
    remove = dsclient.metrics.trace(client)                  # one span per call

Both are optional (``pip install 'dsclient[metrics]'``). This module imports neither
``prometheus_client`` nor ``opentelemetry`` until one is used, and ``import dsclient`` does not
import this module, so an application that never asks for metrics pays nothing; a client nobody
observes does not even build the per-call record (see :mod:`dsclient._observe`).

Where the numbers come from: counters and histograms are counted by an observer from each
finished call's :class:`~dsclient._observe.CallRecord`; gauges are read from ``client.stats()``
(and the server facts discovery and the poller keep) when Prometheus scrapes. Every family has a
``server`` label, the client's URL without credentials (:func:`dsclient._urls.url_label`).

=======================================  =========  ==============================================
family                                   type       what
=======================================  =========  ==============================================
``dsclient_limit``                       gauge      the in-flight limit now
``dsclient_limit_changes_total``         counter    times the limit controller moved it
``dsclient_in_flight``                   gauge      calls holding a slot
``dsclient_waiting``                     gauge      calls queued in the client for a slot
``dsclient_server_running``              gauge      the server's batch, as last scraped
``dsclient_server_waiting``              gauge      the server's own queue, as last scraped
``dsclient_server_waiting_target``       gauge      the server queue the controller aims at
``dsclient_server_kv_cache_usage``       gauge      share of the server's KV cache in use
``dsclient_server_load_age_seconds``     gauge      age of that scrape (none while idle)
``dsclient_max_num_seqs{source}``        gauge      the server's batch size, and who said so
``dsclient_requests_total``              counter    calls by ``lane``, ``outcome``, ``status``
``dsclient_request_latency_seconds``     histogram  call latency by ``lane`` (retries included)
``dsclient_queue_seconds``               histogram  time waiting for a slot by ``lane``
``dsclient_retries_total``               counter    attempts beyond the first
``dsclient_tokens_total{kind}``          counter    ``prompt`` / ``completion`` tokens
=======================================  =========  ==============================================

``outcome`` is ``"ok"`` or the error's class name (``"RequestRefused"``, ``"Overloaded"``, ...);
``status`` the HTTP status of a refusal, empty when the server sent none (success included);
``lane`` is empty for a call that failed before it was planned. Server gauges are absent while
unknown. For a stream, completion tokens count the text deltas (vLLM sends one a token).
Calls through ``client.openai()`` and ``client.httpx()`` are counted like the client's own; their
tokens come from the answer's ``usage`` (for a stream, only when it asked for one with
``stream_options={"include_usage": true}``).
"""

from __future__ import annotations

import itertools
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

import httpx

from ._observe import CallRecord
from ._urls import url_label

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from ._client import AsyncClient
    from ._sync import Client

__all__ = [
    "LATENCY_BUCKETS",
    "QUEUE_BUCKETS",
    "Collector",
    "MetricsServer",
    "start_http_server",
    "trace",
]

#: Call latency buckets, seconds: LLM calls run from tens of milliseconds (a few tokens on a GPU)
#: to minutes (long outputs on a CPU, or a call queued behind a batch).
LATENCY_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Queue-time buckets, seconds: most calls are admitted at once (0), so the low end is fine.
QUEUE_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_EXTRA_HINT: Final = "pip install 'dsclient[metrics]'"


def _require(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that names the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs the {module.split('.')[0]!r} package: {_EXTRA_HINT}"
        ) from exc


def _async_of(client: AsyncClient | Client) -> AsyncClient:
    """The async client behind a sync ``dsclient.Client`` (or the client itself)."""
    from ._sync import Client

    return client.aclient if isinstance(client, Client) else client


class _Histogram:
    """Bucket counts (not cumulative: one increment a sample) and the sum of the samples."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, which is Prometheus' `le` (value <= bound).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self, formatter: Callable[[float], str]) -> list[tuple[str, float]]:
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts[:-1], strict=True):
            running += count
            buckets.append((formatter(bound), running))
        buckets.append(("+Inf", running + self.counts[-1]))
        return buckets


class _Tally:
    """The counters of one client, fed by its observer (this object, called per record).

    Observers run on the client's event loop and scrapes on the scraper's thread (a sync
    ``Client``'s loop and ``start_http_server`` both use their own), hence the lock; it is never
    contended for long: both sides hold it for a few dictionary operations.
    """

    __slots__ = (
        "client",
        "completion_tokens",
        "latency",
        "latency_bounds",
        "lock",
        "prompt_tokens",
        "queue",
        "queue_bounds",
        "requests",
        "retries",
        "server",
    )

    def __init__(
        self,
        client: AsyncClient,
        latency_bounds: tuple[float, ...],
        queue_bounds: tuple[float, ...],
    ) -> None:
        self.client = client
        self.server = url_label(client.url)
        self.latency_bounds = latency_bounds
        self.queue_bounds = queue_bounds
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = {}
        self.latency: dict[str, _Histogram] = {}
        self.queue: dict[str, _Histogram] = {}
        self.retries = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def __call__(self, record: CallRecord) -> None:
        lane = record.lane or ""
        key = (lane, record.error or "ok", str(record.status) if record.status else "")
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + 1
            latency = self.latency.get(lane)
            if latency is None:
                latency = self.latency[lane] = _Histogram(self.latency_bounds)
            latency.observe(record.latency_s)
            if record.queued_s is not None:
                queue = self.queue.get(lane)
                if queue is None:
                    queue = self.queue[lane] = _Histogram(self.queue_bounds)
                queue.observe(record.queued_s)
            if record.attempts > 1:
                self.retries += record.attempts - 1
            if record.prompt_tokens:
                self.prompt_tokens += record.prompt_tokens
            if record.completion_tokens:
                self.completion_tokens += record.completion_tokens


def _check_bounds(name: str, bounds: Iterable[float]) -> tuple[float, ...]:
    values = tuple(float(b) for b in bounds)
    if not values or any(b != b or b in (float("inf"), float("-inf")) for b in values):
        raise ValueError(f"{name} must be finite numbers (at least one), got {values!r}")
    if any(a >= b for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name} must increase strictly, got {values!r}")
    return values


class Collector:
    """A ``prometheus_client`` collector of one or more clients' metrics (see the module table).

        registry = prometheus_client.CollectorRegistry()
        collector = dsclient.metrics.Collector(client)
        registry.register(collector)
        ...
        registry.unregister(collector); collector.close()   # or `with Collector(client) as c:`

    It observes the clients from construction on (calls before it are not counted) until
    :meth:`close`. Several clients of one process go in one collector (``Collector(a, b)``),
    one ``server`` label each: two collectors on one registry would clash on the family names.

    Parameters:
        client, clients: ``AsyncClient`` or ``Client`` objects, each for a different server URL.
        latency_buckets: upper bounds (seconds) of ``dsclient_request_latency_seconds``;
            default :data:`LATENCY_BUCKETS`.
        queue_buckets: upper bounds (seconds) of ``dsclient_queue_seconds``; default
            :data:`QUEUE_BUCKETS`.
    """

    def __init__(
        self,
        client: AsyncClient | Client,
        *clients: AsyncClient | Client,
        latency_buckets: Sequence[float] = LATENCY_BUCKETS,
        queue_buckets: Sequence[float] = QUEUE_BUCKETS,
    ) -> None:
        core = _require("prometheus_client.core", "dsclient.metrics.Collector")
        self._core = core
        self._format = _require("prometheus_client.utils", "dsclient.metrics.Collector")
        latency = _check_bounds("latency_buckets", latency_buckets)
        queue = _check_bounds("queue_buckets", queue_buckets)
        tallies = [_Tally(_async_of(c), latency, queue) for c in (client, *clients)]
        servers = [t.server for t in tallies]
        if len(set(servers)) != len(servers):
            raise ValueError(f"each client of a Collector needs its own server URL, got {servers}")
        self._tallies = tallies
        for tally in tallies:
            tally.client._observers.append(tally)

    def close(self) -> None:
        """Stop counting calls (idempotent); unregister it from its registry yourself."""
        for tally in self._tallies:
            observers = tally.client._observers
            # By identity: list.remove compares with ==, which an observer may define.
            for i, observer in enumerate(observers):
                if observer is tally:
                    del observers[i]
                    break

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def describe(self) -> Iterator[Metric]:
        """The families without samples: lets a registry refuse a clash at ``register()``."""
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        """The families, read now (called by the registry at every scrape)."""
        return self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        core = self._core
        gauge, counter, histogram = (
            core.GaugeMetricFamily,
            core.CounterMetricFamily,
            core.HistogramMetricFamily,
        )
        server = ["server"]
        limit = gauge("dsclient_limit", "In-flight limit of the client's governor.", labels=server)
        changes = counter(
            "dsclient_limit_changes",
            "Times the limit controller moved the limit (restarts at rediscovery).",
            labels=server,
        )
        in_flight = gauge("dsclient_in_flight", "Calls holding a slot now.", labels=server)
        waiting = gauge(
            "dsclient_waiting", "Calls waiting in the client's queue for a slot.", labels=server
        )
        running = gauge(
            "dsclient_server_running",
            "Sequences in the server's batch, as last scraped from its /metrics.",
            labels=server,
        )
        server_waiting = gauge(
            "dsclient_server_waiting",
            "Requests in the server's own queue, as last scraped from its /metrics.",
            labels=server,
        )
        target = gauge(
            "dsclient_server_waiting_target",
            "The server queue the limit controller aims at.",
            labels=server,
        )
        kv_usage = gauge(
            "dsclient_server_kv_cache_usage",
            "Share of the server's KV cache in use (0-1), as last scraped.",
            labels=server,
        )
        load_age = gauge(
            "dsclient_server_load_age_seconds",
            "Seconds since the server's /metrics were last scraped (scraped only under traffic).",
            labels=server,
        )
        max_num_seqs = gauge(
            "dsclient_max_num_seqs",
            "The server's batch size (max_num_seqs); source: where the client learned it.",
            labels=["server", "source"],
        )
        requests = counter(
            "dsclient_requests",
            "Finished calls; outcome is ok or the error class, status the HTTP status of a "
            "refusal.",
            labels=["server", "lane", "outcome", "status"],
        )
        latency = histogram(
            "dsclient_request_latency_seconds",
            "Call latency, waiting and retries included.",
            labels=["server", "lane"],
        )
        queue = histogram(
            "dsclient_queue_seconds",
            "Time a call waited in the client for a slot (successful calls and streams).",
            labels=["server", "lane"],
        )
        retries = counter(
            "dsclient_retries", "Attempts beyond the first, summed over calls.", labels=server
        )
        tokens = counter(
            "dsclient_tokens",
            "Tokens the server reported (streams: text deltas received).",
            labels=["server", "kind"],
        )
        if with_samples:
            fmt = self._format.floatToGoString
            for tally in self._tallies:
                label = [tally.server]
                client = tally.client
                stats = client.stats()
                limit.add_metric(label, stats.limit)
                in_flight.add_metric(label, stats.in_flight)
                waiting.add_metric(label, stats.waiting)
                control = stats.control
                if control is not None:
                    changes.add_metric(label, control.changes)
                    if control.server_running is not None:
                        running.add_metric(label, control.server_running)
                    if control.server_waiting is not None:
                        server_waiting.add_metric(label, control.server_waiting)
                    if control.target_waiting is not None:
                        target.add_metric(label, control.target_waiting)
                endpoint = client._endpoint
                load, load_at = endpoint.load, endpoint.load_at
                if load is not None and load.kv_usage is not None:
                    kv_usage.add_metric(label, load.kv_usage)
                if load_at is not None:
                    load_age.add_metric(label, max(0.0, client._clock() - load_at))
                info = client.server
                if info is not None:
                    source = info.sources.get("max_num_seqs", "unknown")
                    max_num_seqs.add_metric([tally.server, source], info.max_num_seqs)
                with tally.lock:  # copy under the lock, format outside it
                    counts = list(tally.requests.items())
                    lat = [(k, h.cumulative(fmt), h.total) for k, h in tally.latency.items()]
                    que = [(k, h.cumulative(fmt), h.total) for k, h in tally.queue.items()]
                    totals = (tally.retries, tally.prompt_tokens, tally.completion_tokens)
                for (lane, outcome, status), count in sorted(counts):
                    requests.add_metric([tally.server, lane, outcome, status], count)
                for lane, buckets, total in sorted(lat):
                    latency.add_metric([tally.server, lane], buckets, total)
                for lane, buckets, total in sorted(que):
                    queue.add_metric([tally.server, lane], buckets, total)
                retries.add_metric(label, totals[0])
                tokens.add_metric([tally.server, "prompt"], totals[1])
                tokens.add_metric([tally.server, "completion"], totals[2])
        families = (
            limit,
            changes,
            in_flight,
            waiting,
            running,
            server_waiting,
            target,
            kv_usage,
            load_age,
            max_num_seqs,
            requests,
            latency,
            queue,
            retries,
            tokens,
        )
        for family in families:
            # An unknown server gauge is left out, not reported as 0.
            if family.samples or not with_samples:
                yield family


class MetricsServer:
    """A ``/metrics`` endpoint serving a :class:`Collector` on its own registry and thread.

        server = dsclient.metrics.start_http_server(client, 9464)
        print(server.url)   # http://127.0.0.1:9464/metrics
        server.close()      # or `with start_http_server(client, 9464):`

    Made by :func:`start_http_server`; ``port``, ``host`` and ``url`` say where it listens.
    """

    def __init__(self, httpd: Any, thread: threading.Thread, collector: Collector) -> None:
        self._httpd = httpd
        self._thread = thread
        self.collector = collector
        host, port = httpd.server_address[:2]
        self.port: int = port
        self.host: str = host
        host = f"[{host}]" if ":" in host else host
        self.url = f"http://{host}:{port}/metrics"

    def close(self) -> None:
        """Stop serving, free the port and stop counting calls (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self.collector.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer(url={self.url!r})"


def start_http_server(
    client: AsyncClient | Client, port: int, addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serve ``client``'s metrics (and nothing else) at ``http://addr:port/metrics``.

        with dsclient.metrics.start_http_server(client, 9464) as server:
            await client.map(prompts)         # Prometheus scrapes server.url meanwhile

    For batch jobs that have no web server of their own. It binds to localhost unless told
    otherwise; ``port=0`` takes a free port (read it from ``.port``). Scrapes run on a daemon
    thread.

    Parameters:
        client: an ``AsyncClient`` or ``Client``.
        port: the TCP port, or 0 for any free one.
        addr: the address to bind, ``"0.0.0.0"`` to serve other hosts.
    """
    exposition = _require("prometheus_client.exposition", "dsclient.metrics.start_http_server")
    registry_module = _require("prometheus_client.registry", "dsclient.metrics.start_http_server")
    collector = Collector(client)
    registry: CollectorRegistry = registry_module.CollectorRegistry(auto_describe=True)
    registry.register(collector)
    try:
        httpd, thread = exposition.start_http_server(port, addr=addr, registry=registry)
    except BaseException:
        collector.close()
        raise
    return MetricsServer(httpd, thread, collector)


def trace(client: AsyncClient | Client, tracer: Any = None) -> Callable[[], None]:
    """Emit one OpenTelemetry span per finished call; returns a function that stops it.

        remove = dsclient.metrics.trace(client)    # the global tracer provider's tracer
        ...
        remove()

    The span is ``dsclient.completion``, ``dsclient.chat``, ``dsclient.stream`` or (through
    ``client.openai()`` / ``client.httpx()``) ``dsclient.embedding`` (kind CLIENT),
    from the call's start to its end, a child of whatever span is current in the calling task.
    Attributes: ``dsclient.lane``, ``dsclient.queue_s``, ``dsclient.attempts``,
    ``dsclient.group``, ``server.address``, ``server.port``, ``gen_ai.usage.input_tokens`` /
    ``output_tokens``, and on failure ``dsclient.error`` / ``error.type`` (the error class),
    ``http.response.status_code`` when the server refused, and status ERROR.

    Parameters:
        client: an ``AsyncClient`` or ``Client``.
        tracer: an ``opentelemetry.trace.Tracer``; default the global provider's
            ``get_tracer("dsclient")``.
    """
    otel = _require("opentelemetry.trace", "dsclient.metrics.trace")
    if tracer is None:
        from . import __version__

        tracer = otel.get_tracer("dsclient", __version__)
    inner = _async_of(client)
    url = httpx.URL(inner.url)
    base: dict[str, Any] = {"server.address": url.host}
    port = url.port or (443 if url.scheme == "https" else 80)
    base["server.port"] = port
    client_kind = otel.SpanKind.CLIENT
    error_status = otel.StatusCode.ERROR
    status_of = otel.Status
    start_span = tracer.start_span

    def observer(record: CallRecord) -> None:
        end = time.time_ns()
        attributes = dict(base)
        attributes["dsclient.attempts"] = record.attempts
        if record.lane is not None:
            attributes["dsclient.lane"] = record.lane
        if record.queued_s is not None:
            attributes["dsclient.queue_s"] = record.queued_s
        if record.group is not None:
            attributes["dsclient.group"] = record.group
        if record.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = record.prompt_tokens
        if record.completion_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = record.completion_tokens
        if record.error is not None:
            attributes["dsclient.error"] = record.error
            attributes["error.type"] = record.error
            if record.status is not None:
                attributes["http.response.status_code"] = record.status
        span = start_span(
            "dsclient." + record.kind,
            kind=client_kind,
            attributes=attributes,
            start_time=end - int(record.latency_s * 1e9),
        )
        if record.error is not None:
            span.set_status(status_of(error_status, record.error))
        span.end(end_time=end)

    inner._observers.append(observer)

    def remove() -> None:
        observers = inner._observers
        for i, candidate in enumerate(observers):
            if candidate is observer:
                del observers[i]
                return

    return remove

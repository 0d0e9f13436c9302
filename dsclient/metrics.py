"""Client metrics for Prometheus and spans for OpenTelemetry, from what the client already knows.

    registry = prometheus_client.CollectorRegistry()
    registry.register(dsclient.metrics.Collector(client))   # or start_http_server(client, 9464)
    remove = dsclient.metrics.trace(client)                  # one span per call

Both are optional (``pip install 'dsclient[metrics]'``). This module imports neither
``prometheus_client`` nor ``opentelemetry`` until one is used, and ``import dsclient`` does not
import this module, so an application that never asks for metrics pays nothing; a client nobody
observes does not even build the per-call record (see :mod:`dsclient._observe`).

Where the numbers come from: counters and histograms are counted by an observer from each
finished call's :class:`~dsclient._observe.CallRecord`; gauges are read from ``client.servers``
(each server's limit, slots, load as last scraped and what discovery found) when Prometheus
scrapes. Every family has a ``server`` label: the server's URL without credentials
(:func:`dsclient._urls.url_label`). A client of several servers has one gauge series per server,
and its calls are counted under the server that answered them (``CallRecord.server``).

=======================================  =========  ==============================================
family                                   type       what
=======================================  =========  ==============================================
``dsclient_limit``                       gauge      the in-flight limit now (at that server)
``dsclient_limit_changes_total``         counter    times the limit controller moved it
``dsclient_limit_signal{mode,signal}``   gauge      1: what drives the limit (see below)
``dsclient_limit_signal_age_seconds``    gauge      age of that signal's last reading
``dsclient_in_flight``                   gauge      calls holding a slot
``dsclient_waiting``                     gauge      calls queued in the client for a slot
``dsclient_server_running``              gauge      the server's batch, as last read
``dsclient_server_waiting``              gauge      the server's own queue, as last read
``dsclient_server_waiting_target``       gauge      the server queue the controller aims at
``dsclient_server_kv_cache_usage``       gauge      share of the server's KV cache in use
``dsclient_server_load_age_seconds``     gauge      age of that reading (none while idle)
``dsclient_max_num_seqs{source}``        gauge      the server's batch size, and who said so
``dsclient_requests_total``              counter    calls by ``lane``, ``outcome``, ``status``
``dsclient_request_latency_seconds``     histogram  call latency by ``lane`` (retries included)
``dsclient_queue_seconds``               histogram  time waiting for a slot by ``lane``
``dsclient_retries_total``               counter    attempts beyond the first
``dsclient_tokens_total{kind}``          counter    ``prompt`` / ``completion`` tokens
``dsclient_tenant_tokens_total``         counter    tokens served a tenant, by ``tenant``, ``kind``
``dsclient_tenant_in_flight``            gauge      a tenant's calls holding a slot
``dsclient_tenant_waiting``              gauge      a tenant's calls queued in the client
``dsclient_tenant_latency_p99_seconds``  gauge      p99 of a tenant's latest calls (waiting incl.)
``dsclient_tenant_counter``              gauge      its virtual token counter (lowest goes next)
``dsclient_tenant_weight``               gauge      its weight (``group_weights``)
=======================================  =========  ==============================================

The ``dsclient_tenant_*`` families have a ``tenant`` label: the calls' ``group`` (empty for calls
without one), read from the governor's per-tenant stats (``client.stats().tenants``); tokens are
the input (planner's count) and output (``usage``) tokens of its ended calls. Keep group names to
a small set: each is a label value.

``dsclient_limit_signal`` has one series a server, value 1, whose labels say how the limit is
driven: ``mode`` (``metrics``: the server's queue; ``throughput``: no queue signal, the knee found
from the answers; ``fixed``) and ``signal``, where the reading comes from (``/metrics``,
``endpoint-load-metrics``: vLLM's load header on every answer, ``sglang /v1/loads``,
``llama.cpp /slots``, ``throughput``, ``fixed``); it is absent until the controller has a mode.
``dsclient_limit_signal_age_seconds`` is how old that signal's last reading is (absent before the
first). ``docs/assets/grafana-dsclient.json`` is a Grafana dashboard of these beside vLLM's own
gauges.

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

from ._http import httpx
from ._observe import CallRecord
from ._urls import url_label

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from .client._client import AsyncClient
    from .client._sync import Client

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
    from .client._sync import Client

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
    """The counters of one client, per server, fed by its observer (this object, called per
    record).

    Observers run on the client's event loop and scrapes on the scraper's thread (a sync
    ``Client``'s loop and ``start_http_server`` both use their own), hence the lock; it is never
    contended for long: both sides hold it for a few dictionary operations.
    """

    __slots__ = (
        "client",
        "completion_tokens",
        "labels",
        "latency",
        "latency_bounds",
        "lock",
        "prompt_tokens",
        "queue",
        "queue_bounds",
        "remove",
        "requests",
        "retries",
    )

    def __init__(
        self,
        client: AsyncClient,
        latency_bounds: tuple[float, ...],
        queue_bounds: tuple[float, ...],
    ) -> None:
        self.client = client
        # A record's server URL -> its label (url_label parses; calls repeat a few URLs).
        self.labels: dict[str, str] = {url: url_label(url) for url in self.servers()}
        self.latency_bounds = latency_bounds
        self.queue_bounds = queue_bounds
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str, str, str], int] = {}
        self.latency: dict[tuple[str, str], _Histogram] = {}
        self.queue: dict[tuple[str, str], _Histogram] = {}
        self.retries: dict[str, int] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.completion_tokens: dict[str, int] = {}
        self.remove: Callable[[], None] | None = None

    def servers(self) -> list[str]:
        """The client's server URLs (raw: labels are made from them)."""
        return [view.url for view in self.client.servers]

    def label(self, url: str) -> str:
        """``url``'s label, remembered (under :attr:`lock` once the tally is observing: a
        scrape reads :attr:`labels` from another thread)."""
        label = self.labels.get(url)
        if label is None:
            label = self.labels[url] = url_label(url)
        return label

    def __call__(self, record: CallRecord) -> None:
        lane = record.lane or ""
        with self.lock:
            server = self.label(record.server)
            key = (server, lane, record.error or "ok", str(record.status) if record.status else "")
            self.requests[key] = self.requests.get(key, 0) + 1
            latency = self.latency.get((server, lane))
            if latency is None:
                latency = self.latency[server, lane] = _Histogram(self.latency_bounds)
            latency.observe(record.latency_s)
            if record.queued_s is not None:
                queue = self.queue.get((server, lane))
                if queue is None:
                    queue = self.queue[server, lane] = _Histogram(self.queue_bounds)
                queue.observe(record.queued_s)
            # Every server a call was counted under shows its counters, 0 until one counts.
            self.retries[server] = self.retries.get(server, 0) + max(0, record.attempts - 1)
            self.prompt_tokens[server] = self.prompt_tokens.get(server, 0) + (
                record.prompt_tokens or 0
            )
            self.completion_tokens[server] = self.completion_tokens.get(server, 0) + (
                record.completion_tokens or 0
            )


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
    A client of several servers gives one ``server`` label per server.

    Parameters:
        client, clients: ``AsyncClient`` or ``Client`` objects; no server URL may appear in two
            of them (their series would clash).
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
        servers = [tally.label(url) for tally in tallies for url in tally.servers()]
        if len(set(servers)) != len(servers):
            raise ValueError(f"each client of a Collector needs its own server URL, got {servers}")
        self._tallies = tallies
        for tally in tallies:
            tally.remove = tally.client.add_observer(tally)

    def close(self) -> None:
        """Stop counting calls (idempotent); unregister it from its registry yourself."""
        for tally in self._tallies:
            remove, tally.remove = tally.remove, None
            if remove is not None:
                remove()

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
        signal = gauge(
            "dsclient_limit_signal",
            "1, labelled with what drives the limit: mode (metrics, throughput, fixed) and signal "
            "(/metrics, endpoint-load-metrics, sglang /v1/loads, llama.cpp /slots, throughput, "
            "fixed).",
            labels=["server", "mode", "signal"],
        )
        signal_age = gauge(
            "dsclient_limit_signal_age_seconds",
            "Seconds since the signal that drives the limit was last read.",
            labels=server,
        )
        in_flight = gauge("dsclient_in_flight", "Calls holding a slot now.", labels=server)
        waiting = gauge(
            "dsclient_waiting", "Calls waiting in the client's queue for a slot.", labels=server
        )
        running = gauge(
            "dsclient_server_running",
            "Sequences in the server's batch, as last read (see dsclient_limit_signal).",
            labels=server,
        )
        server_waiting = gauge(
            "dsclient_server_waiting",
            "Requests in the server's own queue, as last read (see dsclient_limit_signal).",
            labels=server,
        )
        target = gauge(
            "dsclient_server_waiting_target",
            "The server queue the limit controller aims at.",
            labels=server,
        )
        kv_usage = gauge(
            "dsclient_server_kv_cache_usage",
            "Share of the server's KV cache in use (0-1), as last read.",
            labels=server,
        )
        load_age = gauge(
            "dsclient_server_load_age_seconds",
            "Seconds since the server's load was last read (read only under traffic).",
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
        tenant_families = _tenant_families(core)
        if with_samples:
            fmt = self._format.floatToGoString
            for tally in self._tallies:
                for view in tally.client.servers:
                    with tally.lock:
                        label = [tally.label(view.url)]
                    limit.add_metric(label, view.limit)
                    in_flight.add_metric(label, view.in_flight)
                    waiting.add_metric(label, view.waiting)
                    control = view.stats.control
                    if control is not None:
                        changes.add_metric(label, control.changes)
                        signal.add_metric([*label, control.mode, control.signal], 1)
                        if control.signal_age_s is not None:
                            signal_age.add_metric(label, control.signal_age_s)
                        if control.server_running is not None:
                            running.add_metric(label, control.server_running)
                        if control.server_waiting is not None:
                            server_waiting.add_metric(label, control.server_waiting)
                        if control.target_waiting is not None:
                            target.add_metric(label, control.target_waiting)
                    load = view.load
                    if load is not None and load.kv_usage is not None:
                        kv_usage.add_metric(label, load.kv_usage)
                    if view.load_age_s is not None:
                        load_age.add_metric(label, view.load_age_s)
                    info = view.info
                    if info is not None:
                        source = info.sources.get("max_num_seqs", "unknown")
                        max_num_seqs.add_metric([*label, source], info.max_num_seqs)
                    _add_tenants(tenant_families, label[0], view.stats.tenants)
                with tally.lock:  # copy under the lock, format outside it
                    counts = list(tally.requests.items())
                    lat = [(k, h.cumulative(fmt), h.total) for k, h in tally.latency.items()]
                    que = [(k, h.cumulative(fmt), h.total) for k, h in tally.queue.items()]
                    # Each server shows its counters from the start, 0 until a call counts.
                    totals = [
                        (
                            name,
                            tally.retries.get(name, 0),
                            tally.prompt_tokens.get(name, 0),
                            tally.completion_tokens.get(name, 0),
                        )
                        for name in sorted({*tally.labels.values(), *tally.retries})
                    ]
                for (name, lane, outcome, status), count in sorted(counts):
                    requests.add_metric([name, lane, outcome, status], count)
                for (name, lane), buckets, total in sorted(lat):
                    latency.add_metric([name, lane], buckets, total)
                for (name, lane), buckets, total in sorted(que):
                    queue.add_metric([name, lane], buckets, total)
                for name, retried, prompt, completion in totals:
                    retries.add_metric([name], retried)
                    tokens.add_metric([name, "prompt"], prompt)
                    tokens.add_metric([name, "completion"], completion)
        families = (
            limit,
            changes,
            signal,
            signal_age,
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
            *tenant_families,
        )
        for family in families:
            # An unknown server gauge is left out, not reported as 0.
            if family.samples or not with_samples:
                yield family


def _tenant_families(core: Any) -> tuple[Any, ...]:
    """The ``dsclient_tenant_*`` families, empty: tokens, in flight, waiting, p99, counter,
    weight (in that order, as :func:`_add_tenants` fills them)."""
    labels = ["server", "tenant"]
    gauge = core.GaugeMetricFamily
    return (
        core.CounterMetricFamily(
            "dsclient_tenant_tokens",
            "Tokens served a tenant (its calls' group): input (the planner's count) and output "
            "(the answers' usage).",
            labels=["server", "tenant", "kind"],
        ),
        gauge("dsclient_tenant_in_flight", "A tenant's calls holding a slot now.", labels=labels),
        gauge("dsclient_tenant_waiting", "A tenant's calls waiting for a slot.", labels=labels),
        gauge(
            "dsclient_tenant_latency_p99_seconds",
            "p99 of a tenant's latest calls, from asking for a slot to the end.",
            labels=labels,
        ),
        gauge(
            "dsclient_tenant_counter",
            "A tenant's virtual token counter: service over weight; the lowest waiting goes next.",
            labels=labels,
        ),
        gauge("dsclient_tenant_weight", "A tenant's weight (group_weights).", labels=labels),
    )


def _add_tenants(families: tuple[Any, ...], server: str, tenants: Any) -> None:
    """One server's tenants into :func:`_tenant_families`' families."""
    tokens, in_flight, waiting, p99, counter, weight = families
    for name, stats in sorted(tenants.items(), key=lambda item: item[0] or ""):
        label = [server, name or ""]
        tokens.add_metric([*label, "input"], stats.input_tokens)
        tokens.add_metric([*label, "output"], stats.output_tokens)
        in_flight.add_metric(label, stats.in_flight)
        waiting.add_metric(label, stats.waiting)
        if stats.p99 is not None:
            p99.add_metric(label, stats.p99)
        counter.add_metric(label, stats.counter)
        weight.add_metric(label, stats.weight)


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
    ``dsclient.group``, ``server.address`` and ``server.port`` (of the server that answered),
    ``gen_ai.usage.input_tokens`` / ``output_tokens``, and on failure ``dsclient.error`` /
    ``error.type`` (the error class),
    ``http.response.status_code`` when the server refused, and status ERROR.

    Parameters:
        client: an ``AsyncClient`` or ``Client``.
        tracer: an ``opentelemetry.trace.Tracer``; default the global provider's
            ``get_tracer("dsclient")``.
    """
    otel = _require("opentelemetry.trace", "dsclient.metrics.trace")
    if tracer is None:
        from ._version import __version__

        tracer = otel.get_tracer("dsclient", __version__)
    inner = _async_of(client)
    # A record's server URL -> its span attributes (calls repeat a few URLs; parse each once).
    bases: dict[str, dict[str, Any]] = {}

    def base_of(server: str) -> dict[str, Any]:
        base = bases.get(server)
        if base is None:
            url = httpx.URL(server)
            port = url.port or (443 if url.scheme == "https" else 80)
            base = bases[server] = {"server.address": url.host, "server.port": port}
        return base

    base_of(inner.url)
    client_kind = otel.SpanKind.CLIENT
    error_status = otel.StatusCode.ERROR
    status_of = otel.Status
    start_span = tracer.start_span

    def observer(record: CallRecord) -> None:
        end = time.time_ns()
        attributes = dict(base_of(record.server))
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

    return inner.add_observer(observer)

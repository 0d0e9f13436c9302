"""dsclient.metrics: the Prometheus collector, its HTTP server, OpenTelemetry spans, import cost."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import textwrap

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import dsclient
import dsclient.metrics
from dsclient import AsyncClient, DSClientError, RequestRefused
from dsclient._http import httpx
from dsclient._observe import CallRecord
from dsclient.governor._load import Load

from .fakes import FakeServer, RecordedSleep, completion_body

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:8000"
SERVER = {"server": URL}


def make_client(fake: FakeServer, url: str = URL, **kwargs) -> AsyncClient:
    kwargs.setdefault("sleep", RecordedSleep())
    kwargs.setdefault("rng", random.Random(0))
    return AsyncClient(url, transport=fake.transport, **kwargs)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``generate_latest``, parsed back: (name, labels) -> value."""
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name, **labels) -> float | None:
    return samples.get((name, frozenset({**SERVER, **labels}.items())))


def names(samples) -> set[str]:
    return {name for name, _ in samples}


def record(**fields) -> CallRecord:
    base = dict(
        kind="completion",
        server=URL,
        lane="short",
        group=None,
        error=None,
        status=None,
        latency_s=1.0,
        queued_s=0.0,
        attempts=1,
        prompt_tokens=None,
        completion_tokens=None,
    )
    return CallRecord(**{**base, **fields})


def three_calls_server() -> FakeServer:
    """An ok call, a 400, then a 503 that a retry turns into an ok."""
    return FakeServer(
        script=[
            httpx.Response(200, json=completion_body(prompt_tokens=3, completion_tokens=2)),
            httpx.Response(400, json={"error": {"message": "bad request"}}),
            httpx.Response(503, text="busy"),
            httpx.Response(200, json=completion_body(prompt_tokens=4, completion_tokens=5)),
        ]
    )


async def three_calls(client: AsyncClient) -> DSClientError:
    await client.generate("x", max_tokens=2)
    with pytest.raises(RequestRefused) as refused:
        await client.generate("y", max_tokens=2)
    retried = await client.generate("z", max_tokens=2)
    assert retried.attempts == 2
    return refused.value


async def test_collector_counts_calls_and_reads_the_governor_at_scrape_time():
    async with make_client(three_calls_server()) as client:
        registry = CollectorRegistry()
        registry.register(dsclient.metrics.Collector(client))
        refused = await three_calls(client)
        samples = scrape(registry)
        limit, info = client.limit, client.server
    outcome = type(refused).__name__
    assert value(samples, "dsclient_requests_total", lane="short", outcome="ok", status="") == 2
    assert (
        value(samples, "dsclient_requests_total", lane="short", outcome=outcome, status="400") == 1
    )
    assert value(samples, "dsclient_retries_total") == 1
    assert value(samples, "dsclient_tokens_total", kind="prompt") == 7
    assert value(samples, "dsclient_tokens_total", kind="completion") == 7
    # Every call has a latency; the failed call has no queue time.
    assert value(samples, "dsclient_request_latency_seconds_count", lane="short") == 3
    assert value(samples, "dsclient_request_latency_seconds_bucket", lane="short", le="+Inf") == 3
    assert value(samples, "dsclient_request_latency_seconds_sum", lane="short") >= 0
    assert value(samples, "dsclient_queue_seconds_count", lane="short") == 2
    # Gauges, read from client.stats() when scraped.
    assert value(samples, "dsclient_limit") == limit
    assert value(samples, "dsclient_in_flight") == 0
    assert value(samples, "dsclient_waiting") == 0
    assert value(samples, "dsclient_limit_changes_total") is not None
    assert info is not None
    source = info.sources["max_num_seqs"]
    assert value(samples, "dsclient_max_num_seqs", source=source) == info.max_num_seqs
    # The fake server has no /metrics: what the server says about itself is absent, not 0.
    assert not names(samples) & {"dsclient_server_running", "dsclient_server_waiting"}
    assert all(dict(labels)["server"] == URL for _, labels in samples)


async def three_calls_through_openai(client: AsyncClient) -> None:
    """:func:`three_calls` through ``client.openai()``."""
    sdk = client.openai()
    await sdk.completions.create(model="tiny", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await sdk.completions.create(model="tiny", prompt="y", max_tokens=2)
    raw = await sdk.completions.with_raw_response.create(model="tiny", prompt="z", max_tokens=2)
    assert raw.headers["x-dsclient-attempts"] == "2"


async def test_calls_through_client_openai_are_counted_as_generate_calls_are():
    heard: dict[str, list[CallRecord]] = {}
    samples = {}
    for name, calls in (("generate", three_calls), ("openai", three_calls_through_openai)):
        async with make_client(three_calls_server()) as client:
            records: list[CallRecord] = []
            client._caller.observers.append(records.append)
            registry = CollectorRegistry()
            registry.register(dsclient.metrics.Collector(client))
            await calls(client)
            samples[name] = scrape(registry)
        # Times differ from run to run; whether a queue time was recorded does not.
        heard[name] = [
            dataclasses.replace(r, latency_s=0.0, queued_s=None if r.queued_s is None else 0.0)
            for r in records
        ]
    assert heard["openai"] == heard["generate"]
    assert len(heard["openai"]) == 3
    ok = value(samples["openai"], "dsclient_requests_total", lane="short", outcome="ok", status="")
    assert ok == 2
    assert value(samples["openai"], "dsclient_retries_total") == 1
    assert value(samples["openai"], "dsclient_tokens_total", kind="prompt") == 7
    assert value(samples["openai"], "dsclient_tokens_total", kind="completion") == 7


async def test_server_gauges_show_the_load_as_last_scraped():
    async with make_client(FakeServer()) as client:
        registry = CollectorRegistry()
        registry.register(dsclient.metrics.Collector(client))
        load = Load(source="vllm /metrics", running=3, waiting=1, kv_usage=0.25)
        client._endpoint.observe_load(load, client._clock())
        samples = scrape(registry)
    assert value(samples, "dsclient_server_running") == 3
    assert value(samples, "dsclient_server_waiting") == 1
    assert value(samples, "dsclient_server_kv_cache_usage") == 0.25
    assert value(samples, "dsclient_server_load_age_seconds") >= 0


async def test_histogram_buckets_follow_prometheus_le_and_are_cumulative():
    client = make_client(FakeServer())
    registry = CollectorRegistry()
    collector = dsclient.metrics.Collector(client, latency_buckets=[1, 2], queue_buckets=[0.5])
    registry.register(collector)
    observe = client._caller.observers[-1]
    for latency in (0.5, 1.0, 1.5, 5.0):  # 1.0 lands in le="1.0": le means <=
        observe(record(latency_s=latency, queued_s=latency / 10))
    observe(record(lane=None, error="ConnectionError", queued_s=None, attempts=3))
    observe(record(kind="stream", lane="long", completion_tokens=4))
    samples = scrape(registry)
    bucket = "dsclient_request_latency_seconds_bucket"
    assert value(samples, bucket, lane="short", le="1.0") == 2
    assert value(samples, bucket, lane="short", le="2.0") == 3
    assert value(samples, bucket, lane="short", le="+Inf") == 4
    assert value(samples, "dsclient_request_latency_seconds_sum", lane="short") == 8.0
    assert value(samples, "dsclient_queue_seconds_bucket", lane="short", le="0.5") == 4
    # A call that failed before planning has no lane; its retries still count.
    assert value(samples, "dsclient_requests_total", lane="", outcome="ConnectionError", status="")
    assert value(samples, "dsclient_retries_total") == 2
    assert value(samples, "dsclient_tokens_total", kind="completion") == 4
    assert value(samples, "dsclient_request_latency_seconds_count", lane="long") == 1
    collector.close()
    await client.aclose()


async def test_close_stops_counting_and_two_collectors_clash_at_register():
    client = make_client(FakeServer())
    before = list(client._caller.observers)
    with dsclient.metrics.Collector(client) as collector:
        assert len(client._caller.observers) == len(before) + 1
        registry = CollectorRegistry()
        registry.register(collector)
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            registry.register(dsclient.metrics.Collector(client))
        client._caller.observers.pop()  # the refused collector's observer
    assert client._caller.observers == before
    collector.close()  # idempotent
    await client.aclose()


async def test_one_collector_for_several_servers_and_no_credentials_in_labels():
    a = make_client(FakeServer(), "http://user:pw@127.0.0.1:8000")
    b = make_client(FakeServer(), "http://127.0.0.1:8001")
    registry = CollectorRegistry()
    registry.register(dsclient.metrics.Collector(a, b))
    text = generate_latest(registry).decode()
    assert 'dsclient_limit{server="http://127.0.0.1:8000"}' in text
    assert 'dsclient_limit{server="http://127.0.0.1:8001"}' in text
    assert "pw" not in text and "user" not in text
    with pytest.raises(ValueError, match="its own server URL"):
        dsclient.metrics.Collector(a, make_client(FakeServer()))
    with pytest.raises(ValueError, match="increase"):
        dsclient.metrics.Collector(a, latency_buckets=[2, 1])
    for c in (a, b):
        await c.aclose()


async def test_calls_are_counted_under_the_server_that_answered():
    client = make_client(FakeServer())
    registry = CollectorRegistry()
    collector = dsclient.metrics.Collector(client)
    registry.register(collector)
    observe = client._caller.observers[-1]
    other = "http://user:pw@10.0.0.2:8000"  # the server of a record, credentials and all
    observe(record(prompt_tokens=3))
    observe(record(server=other, attempts=3, completion_tokens=5))
    samples = scrape(registry)
    collector.close()
    await client.aclose()
    ok = {"lane": "short", "outcome": "ok", "status": ""}
    assert value(samples, "dsclient_requests_total", **ok) == 1
    assert (
        samples[
            ("dsclient_requests_total", frozenset({"server": "http://10.0.0.2:8000", **ok}.items()))
        ]
        == 1
    )
    on_other = frozenset({"server": "http://10.0.0.2:8000"}.items())
    assert samples[("dsclient_retries_total", on_other)] == 2
    assert value(samples, "dsclient_retries_total") == 0
    assert value(samples, "dsclient_tokens_total", kind="prompt") == 3
    assert value(samples, "dsclient_tokens_total", kind="completion") == 0
    # The client's own gauges stay under its one server.
    assert ("dsclient_limit", on_other) not in samples
    assert all(
        "pw" not in labels_text for _, labels in samples for labels_text in dict(labels).values()
    )


async def test_a_client_of_several_servers_has_a_gauge_series_per_server():
    urls = ["http://127.0.0.1:8000", "http://user:pw@127.0.0.1:8001/v1"]
    fake = FakeServer()
    async with make_client(fake, urls) as client:
        registry = CollectorRegistry()
        registry.register(dsclient.metrics.Collector(client))
        for prompt in ("a", "b", "c", "d"):
            await client.generate(prompt, max_tokens=2)
        views = client.servers
        samples = scrape(registry)
        async with make_client(FakeServer(), "http://127.0.0.1:8001") as clash:
            # Its URL is one of the other client's servers: the series would clash.
            with pytest.raises(ValueError, match="its own server URL"):
                dsclient.metrics.Collector(clash, client)
    labels = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    for label, view in zip(labels, views, strict=True):
        assert samples[("dsclient_limit", frozenset({"server": label}.items()))] == view.limit
        assert samples[("dsclient_in_flight", frozenset({"server": label}.items()))] == 0
    ok = {"lane": "short", "outcome": "ok", "status": ""}
    counted = {
        label: samples.get(
            ("dsclient_requests_total", frozenset({"server": label, **ok}.items())), 0
        )
        for label in labels
    }
    assert sum(counted.values()) == 4
    assert "pw" not in generate_latest(registry).decode()


def test_collector_of_a_sync_client():
    fake = FakeServer()
    with dsclient.Client(URL, transport=fake.transport) as client:
        with dsclient.metrics.Collector(client) as collector:
            registry = CollectorRegistry()
            registry.register(collector)
            client.generate("x", max_tokens=2)
            samples = scrape(registry)
    assert value(samples, "dsclient_requests_total", lane="short", outcome="ok", status="") == 1


async def test_start_http_server_serves_the_families_until_closed():
    async with make_client(three_calls_server()) as client:
        server = dsclient.metrics.start_http_server(client, 0)
        with server:
            assert server.url == f"http://127.0.0.1:{server.port}/metrics"
            await three_calls(client)
            async with httpx.AsyncClient() as http:
                response = await http.get(server.url)
            assert response.status_code == 200
            text = response.text
            assert 'dsclient_requests_total{lane="short",outcome="ok",server=' in text
            assert "dsclient_in_flight" in text and "dsclient_limit" in text
            assert "python_gc" not in text  # a fresh registry: dsclient's families only
        assert server.collector._tallies[0] not in client._caller.observers
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(server.url)


async def test_trace_emits_one_span_per_call_with_reconstructed_times():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    async with make_client(three_calls_server()) as client:
        remove = dsclient.metrics.trace(client, tracer=tracer)
        with tracer.start_as_current_span("job") as parent:
            refused = await three_calls(client)
        remove()
        await client.generate("after", max_tokens=2)  # not traced
        remove()  # idempotent
    job, *spans = sorted(exporter.get_finished_spans(), key=lambda s: s.name != "job")
    assert [s.name for s in spans] == ["dsclient.completion"] * 3
    ok, failed, retried = sorted(spans, key=lambda s: s.start_time)
    for span in spans:
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None
        assert span.parent.span_id == parent.get_span_context().span_id
        assert job.start_time <= span.start_time < span.end_time <= job.end_time
        assert span.attributes["server.address"] == "127.0.0.1"
        assert span.attributes["server.port"] == 8000
    assert ok.status.status_code is StatusCode.UNSET
    assert ok.attributes["dsclient.lane"] == "short"
    assert ok.attributes["dsclient.attempts"] == 1
    assert ok.attributes["dsclient.queue_s"] >= 0
    assert ok.attributes["gen_ai.usage.output_tokens"] == 2
    assert "dsclient.error" not in ok.attributes
    assert retried.attributes["dsclient.attempts"] == 2
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["dsclient.error"] == type(refused).__name__
    assert failed.attributes["http.response.status_code"] == 400
    assert "dsclient.queue_s" not in failed.attributes


async def test_missing_packages_fail_only_when_used(monkeypatch):
    client = make_client(FakeServer())
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", None)
    with pytest.raises(ImportError, match=r"pip install 'dsclient\[metrics\]'"):
        dsclient.metrics.Collector(client)
    with pytest.raises(ImportError, match=r"pip install 'dsclient\[metrics\]'"):
        dsclient.metrics.trace(client)
    assert client._caller.observers == []
    await client.aclose()


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_costs_nothing_and_works_without_the_extras():
    out = run_python(
        """
        import sys
        import dsclient
        assert "dsclient.metrics" not in sys.modules
        import dsclient.metrics
        loaded = [m for m in sys.modules if m.startswith(("prometheus_client", "opentelemetry"))]
        print(loaded)
        """
    )
    assert out.strip() == "[]"
    # With neither package importable, the module still imports.
    run_python(
        """
        import sys
        sys.modules["prometheus_client"] = None
        sys.modules["opentelemetry"] = None
        import dsclient.metrics
        """
    )


async def test_tenants_have_their_tokens_in_flight_waiting_p99_counter_and_weight():
    fake = FakeServer(
        script=[httpx.Response(200, json=completion_body(prompt_tokens=3, completion_tokens=2))]
    )
    async with make_client(fake, group_weights={"chat": 3}) as client:
        registry = CollectorRegistry()
        registry.register(dsclient.metrics.Collector(client))
        await client.generate("x", max_tokens=2, group="chat")
        await client.generate("y", max_tokens=2)
        samples = scrape(registry)
        tenants = client.stats().tenants
    tokens = "dsclient_tenant_tokens_total"
    assert value(samples, tokens, tenant="chat", kind="output") == 2
    assert value(samples, tokens, tenant="", kind="output") == 2
    assert value(samples, tokens, tenant="chat", kind="input") == tenants["chat"].input_tokens > 0
    assert value(samples, "dsclient_tenant_weight", tenant="chat") == 3
    assert value(samples, "dsclient_tenant_weight", tenant="") == 1
    assert value(samples, "dsclient_tenant_in_flight", tenant="chat") == 0
    assert value(samples, "dsclient_tenant_waiting", tenant="chat") == 0
    assert value(samples, "dsclient_tenant_latency_p99_seconds", tenant="chat") >= 0
    assert value(samples, "dsclient_tenant_counter", tenant="chat") == tenants["chat"].counter

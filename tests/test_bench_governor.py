"""The governor benchmark's own parsing: strategy names and vLLM's /metrics gauges."""

from __future__ import annotations

import pytest

from benchmarks.bench_governor import DIAGNOSTICS, _gauge, dsclient_options

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_running_total{engine="0",model_name="tiny"} 99.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
"""


def test_gauge_sums_every_label_set_of_exactly_that_name() -> None:
    assert _gauge(METRICS, "vllm:num_requests_running") == 5.0
    assert _gauge(METRICS, "vllm:num_requests_waiting") == 7.0
    assert _gauge(METRICS, "vllm:kv_cache_usage_perc") == 0.0


def test_dsclient_options_reads_names_diagnostics_and_literals() -> None:
    assert dsclient_options("dsclient") == {}
    assert dsclient_options("dsclient-cap8") == DIAGNOSTICS["dsclient-cap8"]
    assert dsclient_options("dsclient[long_share=0.6;short_first=True]") == {
        "long_share": 0.6,
        "short_first": True,
    }
    assert dsclient_options("dsclient[long_idle_borrow=None]") == {"long_idle_borrow": None}
    assert dsclient_options("unbounded") is None
    assert dsclient_options("semaphore8") is None


def test_dsclient_options_rejects_a_value_that_is_not_a_literal() -> None:
    with pytest.raises(ValueError):
        dsclient_options("dsclient[short_first=yes]")

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


def test_the_plain_peers_send_priority_shorts_first_and_semaphores_span_max_num_seqs() -> None:
    from benchmarks.bench_governor import PRIORITY, SERVER_ARGS, STRATEGIES, strategy

    assert SERVER_ARGS == ("--scheduling-policy", "priority")
    assert PRIORITY["short"] < PRIORITY["long"]
    for n in (5, 8, 16):
        assert f"semaphore{n}+priority" in STRATEGIES
    assert "unbounded+priority" in STRATEGIES
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy("semaphoreX", "http://127.0.0.1:1")


def test_governor_rows_render_with_the_tail_their_counts_allow() -> None:
    from benchmarks.bench_governor import render

    rows = [
        {"leg": leg, "run": run, "scenario": "online", "rate": 8.0, "short_n": 120,
         "short_p95_s": 0.5, "short_p99_s": 0.9, "long_n": 40, "long_p95_s": 9.0,
         "makespan_s": 20.0, "errors": 0}
        for run in (1, 2) for leg in ("dsclient", "unbounded+priority")
    ]  # fmt: skip
    record = {"benchmark": "governor", "_file": "f.json", "rows": rows, "code": {}, "host": {},
              "versions": {}, "notes": []}  # fmt: skip
    text = render([record])
    assert "**online** at 8/s" in text and "short p95 s" in text and "long p95 s" in text

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


def _record(rows: list) -> dict:
    return {"benchmark": "governor", "_file": "f.json", "rows": rows, "code": {}, "host": {},
            "versions": {}, "notes": [], "facts": {}}  # fmt: skip


def test_headline_is_dsclient_over_each_peer_per_run_with_the_tail_both_support() -> None:
    from benchmarks.bench_governor import headline

    def row(leg: str, run: int, scenario: str, makespan: float, errors: int = 0) -> dict:
        return {"leg": leg, "run": run, "scenario": scenario,
                "rate": 8.0 if scenario == "online" else None, "makespan_s": makespan,
                "short_n": 120, "short_p95_s": makespan / 10, "short_p99_s": 99.0,
                "long_n": 40, "long_p95_s": makespan, "errors": errors}  # fmt: skip

    rows = [
        row(leg, run, scenario, base * (2 if leg == "semaphore5+priority" else 1),
            errors=3 if leg == "semaphore5+priority" and scenario == "batch" else 0)
        for run in (1, 2, 3) for scenario, base in (("online", 20.0), ("batch", 30.0))
        for leg in ("dsclient", "semaphore5+priority")
    ]  # fmt: skip
    lines = headline([_record(rows)])
    cells = {(v.workload, v.column): v for v in lines}
    assert cells["batch", "makespan"].ratios == (0.5, 0.5, 0.5)
    assert cells["online", "short-request tail"].label == "p95"  # 120 answers: not a p99
    assert cells["online", "long-request tail"].ratios == (0.5, 0.5, 0.5)
    assert cells["batch", "other"].text.startswith("failed, median 0 vs 3")
    assert ("online", "other") not in cells  # nothing failed online
    assert {v.peer for v in lines} == {"semaphore5+priority"}


def test_three_runs_of_every_leg_by_default_every_strategy_described() -> None:
    from benchmarks.bench_governor import ABOUT, STRATEGIES, parse_args

    args = parse_args([])
    assert args.runs == 3  # the issue: at least 3 runs per leg behind a headline figure
    assert args.strategies.split(",") == list(STRATEGIES)
    assert set(ABOUT) == set(STRATEGIES)
    with pytest.raises(SystemExit):
        parse_args(["--strategies", "dsclient,nonesuch"])


def test_kept_rows_are_scalars_with_p95_counts_and_dsclient_limit() -> None:
    from benchmarks.bench_governor import Outcome, kept

    outcomes = [Outcome("short", 0.0, 0.0, latency=0.01 * (i + 1)) for i in range(100)]
    outcomes += [Outcome("long", 0.0, 0.0, latency=5.0), Outcome("long", 0.0, 0.0, error="x")]
    row = {"scenario": "batch", "rate": None, "run": 1, "strategy": "dsclient",
           "makespan_s": 9.0, "lanes": ["long->long"],
           "client": {"limit_samples": {"min": 5, "mean": 11.5, "max": 14},
                      "lanes": {"long": {"limit": 4}}}}  # fmt: skip
    found = kept(row, outcomes)
    assert found["short_n"] == 100 and found["long_n"] == 1  # answered only
    assert found["short_p95_s"] == 0.95
    assert (found["limit_mean"], found["limit_max"], found["long_lane_limit"]) == (11.5, 14, 4)
    assert "client" not in found and "lanes" not in found and "strategy" not in found
    assert kept({**row, "strategy": "unbounded", "client": {}}, outcomes).get("limit_max") is None

"""The closed-loop benchmark's pure parts: arguments, summaries, /metrics gauges, samples."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest

from benchmarks._common import client_facts, engine_summary, gauge, spread
from benchmarks.bench_closed_loop import (
    Done,
    admission_summary,
    compare,
    int_list,
    parse_args,
    plain_strategies,
    plain_summary,
    report,
    runs_table,
    summarize,
    two_process_summary,
    worker_argv,
)

METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 12.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 12.0
vllm:num_requests_running{engine="0",model_name="tiny"} 8.0
vllm:num_requests_running 1.0
"""


def row(strategy: str, run: int, makespan: float, errors: int = 0, **more: object) -> dict:
    return {"strategy": strategy, "run": run, "makespan_s": makespan, "errors": errors, **more}


# -- arguments -----------------------------------------------------------------------------------
def test_defaults_are_the_issue_s() -> None:
    args = parse_args([])
    assert args.scenarios == ["plain", "two-process", "admission"]
    assert (args.runs, args.requests, args.admission_requests) == (2, 240, 320)
    assert args.sweep == [8, 16, 24, 32, 48, 64]
    assert args.max_num_seqs == 32
    assert not args.place and args.url is None and not args.worker


def test_scenarios_sweep_and_place_parse() -> None:
    args = parse_args(["--scenarios", "plain,admission", "--sweep", "8,32", "--place"])
    assert args.scenarios == ["plain", "admission"]
    assert args.sweep == [8, 32]
    assert args.place
    assert plain_strategies(args.sweep) == [
        "dsclient",
        "dsclient-gather",
        "unbounded",
        "sem8",
        "sem32",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--scenarios", "plain,bogus"],
        ["--sweep", "8,0"],
        ["--sweep", "eight"],
        ["--runs", "0"],
        ["--requests", "0"],
        ["--place", "--url", "http://127.0.0.1:8000"],
        ["--worker"],  # a worker needs the server's url
    ],
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_int_list() -> None:
    assert int_list("8, 16,24,") == [8, 16, 24]
    with pytest.raises(Exception, match=">= 1"):
        int_list("4,-1")


def test_a_worker_s_command_line_parses_back() -> None:
    argv = worker_argv("http://127.0.0.1:8011", 120, 7, 1767225600.125)
    assert argv[:3] == [sys.executable, "-m", "benchmarks.bench_closed_loop"]
    args = parse_args(argv[3:])
    assert args.worker and args.url == "http://127.0.0.1:8011"
    assert (args.requests, args.seed, args.start_at) == (120, 7, 1767225600.125)


# -- one run's numbers ---------------------------------------------------------------------------
def test_summarize_counts_only_answers_in_latency_and_rate() -> None:
    done = [Done(float(i), float(i) / 2, status=200) for i in range(1, 11)]
    done += [Done(0.5, None, error="HTTP 503: busy", status=503)] * 3
    done += [Done(2.0, 1.0, attempts=3), Done(None, None, error="Overloaded", attempts=4)]
    found = summarize(done, makespan=4.0)
    assert found["n"] == 15
    assert found["errors"] == 4
    assert found["req_per_s"] == 11 / 4.0
    assert found["p50_s"] == 5.0  # nearest rank over the 11 answers: 1,2,2,3,...,10
    assert found["p99_s"] == 10.0
    assert found["at_server_p99_s"] == 5.0
    assert found["http_503"] == 3
    assert (found["retried"], found["retries"]) == (2, 5)


def test_summarize_without_latencies_says_none() -> None:
    found = summarize([Done(None, None, error="x")], makespan=1.0)
    assert found["p50_s"] is None and found["at_server_p99_s"] is None
    assert found["req_per_s"] == 0.0


# -- summaries -----------------------------------------------------------------------------------
def test_compare_takes_the_best_error_free_baseline_of_each_run() -> None:
    rows = [
        row("dsclient", 1, 11.0),
        row("unbounded", 1, 10.0),
        row("sem32", 1, 12.0),
        row("sem64", 1, 9.0, errors=1),  # faster, but it failed requests: not a baseline
        row("dsclient", 2, 9.0),
        row("unbounded", 2, 12.0),
        row("sem32", 2, 10.0),
    ]
    found = compare(rows, "dsclient", ["sem32", "sem64", "unbounded"], goal=1.1)
    assert [(r["run"], r["best"], r["ratio"]) for r in found["runs"]] == [
        (1, "unbounded", 1.1),
        (2, "sem32", 0.9),
    ]
    assert found["ratio_median"] == pytest.approx(1.0)
    assert found["met"]


def test_compare_without_a_clean_baseline_has_no_ratio_and_does_not_pass() -> None:
    rows = [row("dsclient", 1, 5.0), row("sem16", 1, 4.0, errors=2)]
    found = compare(rows, "dsclient", ["sem16"], goal=1.2)
    assert found["runs"] == [{"run": 1, "best": None, "ratio": None}]
    assert found["ratio_median"] is None and not found["met"]


def test_plain_summary_compares_both_dsclient_variants_and_the_queues() -> None:
    rows = [
        row("dsclient", 1, 6.0, engine_waiting_p90=4.0),
        row("dsclient-gather", 1, 7.0, engine_waiting_p90=5.0),
        row("unbounded", 1, 5.0, engine_waiting_p90=180.0),
        row("sem32", 1, 8.0, engine_waiting_p90=0.0),
    ]
    found = plain_summary(rows)
    assert found["dsclient"]["ratio_median"] == 1.2 and not found["dsclient"]["met"]
    assert found["dsclient-gather"]["ratio_median"] == 1.4
    assert found["queue_p90_median"] == {"dsclient": 4.0, "unbounded": 180.0}
    assert found["queue_target"] == []  # no control stats in these rows


def test_plain_summary_keeps_the_target_dsclient_aimed_at() -> None:
    control = {"target_waiting": 12, "limit": 40}
    rows = [
        {**row("dsclient", 1, 6.0, engine_waiting_p90=11.0), "client": {"control": control}},
        {**row("dsclient", 2, 6.0, engine_waiting_p90=13.0), "client": {"control": "old repr"}},
        {**row("dsclient-gather", 1, 6.0), "client": {"control": control}},
    ]
    assert plain_summary(rows)["queue_target"] == [12]


def test_admission_goal_needs_no_failures_as_well_as_the_ratio() -> None:
    rows = [
        row("dsclient", 1, 11.0, errors=1),
        row("sem16", 1, 10.0),
        row("unbounded", 1, 3.0, errors=300),
    ]
    found = admission_summary(rows)
    assert found["ratio_median"] == 1.1
    assert found["dsclient_failures"] == 1
    assert not found["met"]
    rows[0]["errors"] = 0
    assert admission_summary(rows)["met"]


def test_two_process_summary_spans_both_processes() -> None:
    rounds = [
        {
            "round": 1,
            "single": [{"makespan_s": 10.0, "limit": 22}],
            "two": [
                {"begun": 100.0, "ended": 108.0, "items_per_s": 15.0, "limit": 12},
                {"begun": 100.5, "ended": 112.0, "items_per_s": 10.0, "limit": 9},
            ],
        }
    ]
    (found,) = two_process_summary(rounds)
    assert found["combined_makespan_s"] == 12.0
    assert found["ratio"] == 1.2
    assert found["fairness"] == pytest.approx(0.667)
    assert found["final_limits"] == [12, 9]
    assert found["single_final_limit"] == 22


# -- shared helpers ------------------------------------------------------------------------------
def test_gauge_sums_label_sets_of_exactly_that_name() -> None:
    assert gauge(METRICS, "vllm:num_requests_waiting") == 12.0
    assert gauge(METRICS, "vllm:num_requests_running") == 9.0
    assert gauge(METRICS, "vllm:kv_cache_usage_perc") == 0.0


def test_engine_summary() -> None:
    samples = [(8.0, float(w)) for w in range(10)] + [(4.0, 100.0)]
    found = engine_summary(samples)
    assert found["running_mean"] == round((80 + 4) / 11, 2)
    assert found["waiting_p90"] == 9.0
    assert found["waiting_max"] == 100.0
    assert found["samples"] == 11
    assert engine_summary([]) == {}


def test_spread() -> None:
    assert spread([5, 8, 11, 9]) == {"min": 5, "mean": 8.25, "max": 11, "final": 9, "samples": 4}
    assert spread([]) == {}


@dataclasses.dataclass(frozen=True)
class Control:
    limit: int
    reason: str


def fake_client(control: object = None) -> SimpleNamespace:
    stats = SimpleNamespace(lanes={}) if control is None else SimpleNamespace(control=control)
    return SimpleNamespace(
        limit=22,
        server=SimpleNamespace(max_num_seqs=32, sources={"max_num_seqs": "default"}),
        stats=lambda: stats,
    )


def test_client_facts_reads_control_only_where_it_exists() -> None:
    assert client_facts(fake_client()) == {
        "limit": 22,
        "max_num_seqs": 32,
        "max_num_seqs_source": "default",
    }
    found = client_facts(fake_client(Control(limit=24, reason="queue short")))
    assert found["control"] == {"limit": 24, "reason": "queue short"}


def test_client_facts_before_discovery() -> None:
    client = SimpleNamespace(limit=1, server=None, stats=lambda: SimpleNamespace())
    assert client_facts(client) == {"limit": 1, "max_num_seqs": None, "max_num_seqs_source": None}


# -- output --------------------------------------------------------------------------------------
def test_report_renders_every_scenario() -> None:
    plain_rows = [
        {
            **row("dsclient", 1, 6.0),
            **summarize([Done(1.0, 0.5)], 6.0),
            "client": {"limit_samples": spread([5, 20, 24]), "control": {"target_waiting": 4}},
            "engine_running_mean": 20.5,
            "engine_waiting_mean": 3.0,
            "engine_waiting_p90": 6.0,
            "engine_waiting_max": 9.0,
        },
        {**row("unbounded", 1, 5.0), **summarize([Done(1.0, 1.0, status=200)], 5.0)},
    ]
    admission_rows = [
        {**row("dsclient", 1, 11.0), **summarize([Done(1.0, 0.5, attempts=2)], 11.0)},
        {**row("sem16", 1, 10.0), **summarize([Done(1.0, 0.9, status=200)], 10.0)},
    ]
    rounds = [
        {
            "round": 1,
            "single": [
                {"items": 4, "makespan_s": 2.0, "items_per_s": 2.0, "failed": 0, "late_s": 0.0}
            ],
            "two": [
                {"items": 2, "begun": 0.0, "ended": 2.0, "makespan_s": 2.0, "items_per_s": 1.0,
                 "failed": 0, "late_s": 0.01, "limit": 3},
                {"items": 2, "begun": 0.0, "ended": 2.5, "makespan_s": 2.5, "items_per_s": 0.8,
                 "failed": 0, "late_s": 0.02, "limit": 2},
            ],
        }
    ]  # fmt: skip
    payload = {
        "plain": {"rows": plain_rows, "summary": plain_summary(plain_rows)},
        "two-process": {"rounds": rounds, "summary": two_process_summary(rounds)},
        "admission": {"rows": admission_rows, "summary": admission_summary(admission_rows)},
    }
    text = report(payload)
    assert "## plain" in text and "## two-process" in text and "## admission" in text
    assert "median **1.20**" in text  # dsclient 6.0 / unbounded 5.0
    assert "5 / 16.33 / 24 / 24" in text  # the limit's min / mean / max / final
    assert "dsclient 6 (its target: 4), unbounded" in text
    assert "(**1.25x**)" in text
    assert "dsclient failures 0 (goal 0)" in text
    table = runs_table(admission_rows).splitlines()
    assert table[2].startswith("| dsclient | 1 | 11.00 |")
    assert len({line.count("|") for line in table}) == 1  # every row has every column

"""The headline benchmark's pure parts: ratios to the baseline, the table, the machine's load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks._common import CpuSnapshot, cpu_split, parse_proc_stat, process_cpu_s
from benchmarks.bench_governor import Outcome
from benchmarks.bench_headline import (
    BASELINE,
    CAP,
    TIMES,
    add_ratios,
    batch_row,
    headline_table,
    leg_order,
    litellm_model_list,
    noise_summary,
    online_row,
    ratio,
)


def test_the_cap_is_seven_tenths_of_max_num_seqs_rounded_down() -> None:
    assert CAP == 5


def test_batch_row_counts_failures_and_throughput_of_the_successes() -> None:
    outcomes = [Outcome("short", 0.0, 0.0, latency=1.0) for _ in range(8)]
    outcomes += [Outcome("short", 0.0, 0.0, error="RateLimitError: full") for _ in range(2)]
    assert batch_row(outcomes, 4.0) == {
        "makespan_s": 4.0,
        "requests": 10,
        "failures": 2,
        "ok_per_s": 2.0,
    }
    assert batch_row([], 0.0)["ok_per_s"] is None


def test_online_row_reports_failures_and_percentiles_of_the_successes_only() -> None:
    outcomes = [Outcome("short", 0.0, 0.0, latency=0.1 * i) for i in range(1, 101)] + [
        Outcome("short", 0.0, 0.0, latency=9.0, error="boom")
    ]
    row = online_row(outcomes, 12.0)
    assert row["failures"] == row["errors"] == 1
    assert row["requests"] == 101
    assert row["short_p99_s"] == pytest.approx(9.9)
    assert row["makespan_s"] == 12.0


def test_ratio_is_none_without_a_baseline() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None


def rows() -> list[dict]:
    return [
        {"workload": "batch", "run": 1, "client": BASELINE, "makespan_s": 10.0, "failures": 0},
        {"workload": "batch", "run": 1, "client": "dsclient", "makespan_s": 11.0, "failures": 0},
        {"workload": "batch", "run": 2, "client": BASELINE, "makespan_s": 8.0, "failures": 0},
        {"workload": "batch", "run": 2, "client": "dsclient", "makespan_s": 12.0, "failures": 0},
        {"workload": "batch", "run": 3, "client": "dsclient", "makespan_s": 9.0, "failures": 1},
        {
            "workload": "online",
            "run": 1,
            "client": BASELINE,
            "makespan_s": 16.0,
            "short_p99_s": 6.0,
            "failures": 0,
        },
        {
            "workload": "online",
            "run": 1,
            "client": "dsclient",
            "makespan_s": 16.8,
            "short_p99_s": 0.3,
            "failures": 0,
        },
    ]


def test_add_ratios_divides_by_the_baseline_of_the_same_workload_and_run() -> None:
    got = {(r["workload"], r["run"], r["client"]): r for r in add_ratios(rows())}
    assert got["batch", 1, "dsclient"]["makespan_s_x"] == 1.1
    assert got["batch", 2, "dsclient"]["makespan_s_x"] == 1.5
    assert got["batch", 1, BASELINE]["makespan_s_x"] == 1.0
    assert got["batch", 3, "dsclient"]["makespan_s_x"] is None  # no baseline in that run
    assert got["online", 1, "dsclient"]["short_p99_s_x"] == 0.05
    assert got["online", 1, "dsclient"]["makespan_s_x"] == 1.05
    assert "short_p99_s_x" not in got["batch", 1, "dsclient"]


def test_headline_table_puts_each_runs_figure_side_by_side() -> None:
    X = TIMES
    table = headline_table(add_ratios(rows()), clients=("dsclient", BASELINE, "litellm"))
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, two clients that ran (litellm did not)
    dsclient = lines[2]
    assert dsclient.startswith(
        f"| dsclient | 11.0 / 12.0 / 9.0 | 1.10{X} / 1.50{X} / - | 0 / 0 / 1 |"
    )
    assert f"| 0.30 | 0.05{X} | 1.05{X} | 0 |" in dsclient
    assert lines[3].startswith(f"| {BASELINE} | 10.0 / 8.0 | 1.00{X} / 1.00{X} |")


def test_litellm_is_pointed_at_vllm_as_an_openai_compatible_deployment() -> None:
    (deployment,) = litellm_model_list("http://127.0.0.1:8011", 5)
    assert deployment["model_name"] == "tiny"
    params = deployment["litellm_params"]
    assert params["model"] == "hosted_vllm/tiny"
    assert params["api_base"] == "http://127.0.0.1:8011/v1"
    assert params["max_parallel_requests"] == 5


PROC_STAT = """\
cpu  1000 50 300 8000 100 10 20 5 40 0
cpu0 500 25 150 4000 50 5 10 2 20 0
intr 12345
"""


def test_parse_proc_stat_adds_busy_ticks_of_the_cpu_line_only() -> None:
    # user+nice+system+irq+softirq+steal = 1000+50+300+10+20+5; guest (40) is inside user
    assert parse_proc_stat(PROC_STAT, 100.0) == pytest.approx(13.85)
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1\n", 100.0)


def test_process_cpu_s_reads_utime_and_stime_past_a_comm_with_spaces() -> None:
    stat = "4242 (VLLM::Engine Core) S 1 4242 4242 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 9"
    assert process_cpu_s(stat, 100.0) == pytest.approx(3.0)


def test_cpu_split_gives_others_what_the_machine_used_beyond_us_and_the_server() -> None:
    before = CpuSnapshot(wall=100.0, machine=50.0, own=2.0, server=10.0, loadavg=1.5)
    after = CpuSnapshot(wall=110.0, machine=68.0, own=5.0, server=19.0, loadavg=2.5)
    split = cpu_split(before, after)
    assert split["machine_cores"] == 1.8
    assert split["own_cores"] == 0.3
    assert split["server_cores"] == 0.9
    assert split["others_cores"] == 0.6
    assert split["loadavg_1min_after"] == 2.5
    quiet = CpuSnapshot(wall=110.0, machine=61.0, own=5.0, server=19.0, loadavg=1.0)
    assert cpu_split(before, quiet)["others_cores"] == 0.0  # rounding never goes negative
    assert cpu_split(before, before) == {}


def test_cpu_snapshot_reads_this_machine(tmp_path: Path) -> None:
    from benchmarks._common import cpu_snapshot

    snap = cpu_snapshot(None)
    assert snap.machine > 0 and snap.server == 0.0 and not math.isnan(snap.loadavg)


def test_noise_summary_over_legs() -> None:
    legs = [
        {"cpu": {"others_cores": 0.2, "loadavg_1min_before": 1.0, "loadavg_1min_after": 2.0}},
        {"cpu": {"others_cores": 0.6, "loadavg_1min_before": 2.0, "loadavg_1min_after": 3.5}},
        {"cpu": {}},
    ]
    assert noise_summary(legs) == {
        "others_cores_mean": 0.4,
        "others_cores_max": 0.6,
        "loadavg_1min_min": 1.0,
        "loadavg_1min_max": 3.5,
    }
    assert noise_summary([]) == {}


def test_each_round_starts_one_client_later() -> None:
    names = ["a", "b", "c"]
    assert leg_order(names, 1) == ["a", "b", "c"]
    assert leg_order(names, 2) == ["b", "c", "a"]
    assert leg_order(names, 4) == ["a", "b", "c"]
    assert leg_order([], 2) == []

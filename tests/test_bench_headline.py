"""The headline benchmark's pure parts: ratios to the baseline, the table, the machine's load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks._common import CpuSnapshot, cpu_split, parse_proc_stat, process_cpu_s
from benchmarks.bench_governor import Outcome
from benchmarks.bench_headline import (
    ABOUT,
    CAP,
    ONLINE_ONLY,
    PRIORITY,
    SEMAPHORES,
    SERVER_ARGS,
    STRATEGIES,
    batch_row,
    headline,
    kept_row,
    leg_order,
    litellm_model_list,
    litellm_retry_policy,
    noise_summary,
    online_row,
    render,
)


def test_the_semaphores_are_seven_tenths_once_and_twice_max_num_seqs() -> None:
    assert CAP == 5
    assert SEMAPHORES == (5, 8, 16)
    assert {f"openai+priority+sem{n}" for n in SEMAPHORES} <= set(STRATEGIES)
    assert set(ABOUT) == set(STRATEGIES)
    assert ONLINE_ONLY == ("openai+priority",)


def test_the_server_honours_priority_and_shorts_go_first() -> None:
    assert SERVER_ARGS == ("--scheduling-policy", "priority")
    assert PRIORITY["short"] < PRIORITY["long"]  # vLLM runs lower values first


def test_litellm_retries_what_is_transient_and_never_a_refusal() -> None:
    policy = litellm_retry_policy(3)
    for transient in ("Timeout", "RateLimit", "InternalServer", "ServiceUnavailable"):
        assert policy[f"{transient}ErrorRetries"] == 3
    for refused in ("BadRequest", "Authentication", "NotFound", "ContentPolicyViolation"):
        assert policy[f"{refused}ErrorRetries"] == 0


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


def test_online_row_gives_short_and_long_tails_of_the_successes_only() -> None:
    outcomes = [Outcome("short", 0.0, 0.0, latency=0.1 * i) for i in range(1, 101)] + [
        Outcome("short", 0.0, 0.0, latency=9.0, error="boom")
    ]
    outcomes += [Outcome("long", 0.0, 0.0, latency=float(i)) for i in range(1, 41)]
    row = online_row(outcomes, 12.0)
    assert row["failures"] == 1
    assert row["requests"] == 141
    assert row["short_n"] == 100
    assert row["short_p99_s"] == pytest.approx(9.9)
    assert row["short_p95_s"] == pytest.approx(9.5)
    assert row["short_max_s"] == pytest.approx(10.0)
    assert row["long_n"] == 40
    assert row["long_p95_s"] == 38.0
    assert row["makespan_s"] == 12.0
    assert online_row([], 1.0)["long_p99_s"] is None


def test_the_kept_row_holds_scalars_only_and_where_the_cpu_went() -> None:
    row = {
        "workload": "batch", "run": 2, "client": "dsclient", "makespan_s": 3.0,
        "cpu": {"others_cores": 0.4, "server_cores": 1.0, "own_cores": 0.3, "wall_s": 3.0},
        "details": {"limit_samples": {"min": 5, "max": 8}}, "outcomes": [{"x": 1}],
        "error_samples": ["ReadTimeout: x"], "lanes": ["short->fast"],
    }  # fmt: skip
    kept = kept_row(row)
    assert kept == {
        "workload": "batch", "makespan_s": 3.0, "others_cores": 0.4, "server_cores": 1.0,
        "own_cores": 0.3, "first_error": "ReadTimeout: x", "dsclient_limit_min": 5,
        "dsclient_limit_max": 8,
    }  # fmt: skip


def record(rows: list[dict]) -> dict:
    return {
        "benchmark": "headline", "_file": "x.json", "started_utc": "2026-12-04T18:00:00Z",
        "code": {"commit": "abcdef1234567", "dirty": False, "changed": []},
        "host": {"cores": 2, "python": "3.11.7", "cpu": "cpu"},
        "versions": {"dsclient": "0.1"}, "load_before": [1.0], "load_after": [1.5],
        "rows": rows, "notes": [], "facts": {},
    }  # fmt: skip


def rows() -> list[dict]:
    found = []
    for run, (ours, theirs) in enumerate([(10.0, 20.0), (12.0, 20.0), (9.0, 10.0)], start=1):
        for leg, makespan in (("dsclient", ours), ("httpx", theirs)):
            found.append({"leg": leg, "run": run, "workload": "batch", "makespan_s": makespan,
                          "failures": 0, "load_1min": 1.0})  # fmt: skip
            found.append({"leg": leg, "run": run, "workload": "online", "makespan_s": makespan,
                          "short_n": 120, "short_p95_s": makespan / 10, "short_p99_s": 99.0,
                          "long_n": 40, "long_p95_s": makespan, "failures": 0})  # fmt: skip
    return found


def test_headline_gives_dsclient_over_each_peer_per_run_with_the_tail_the_counts_allow() -> None:
    found = headline([record(rows())])
    lines = {(v.peer, v.workload, v.column): v for v in found}
    assert lines["httpx", "batch", "makespan"].ratios == (0.5, 0.6, 0.9)
    short = lines["httpx", "online", "short-request tail"]
    assert short.ratios == (0.5, 0.6, 0.9) and short.label == "p95"  # 120 samples: not p99
    assert lines["httpx", "online", "long-request tail"].label == "p95"
    assert all(v.peer != "dsclient" for v in found)


def test_render_shows_medians_with_their_range_and_where_they_come_from() -> None:
    text = render([record(rows())])
    assert "short p95 s" in text and "short p99" not in text
    assert "| dsclient: " in text
    assert "| 3 | 10.0 (9.0-12.0) |" in text  # runs, then the batch makespan's median (range)
    assert "commit `abcdef1234`" in text


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


def test_litellm_is_pointed_at_vllm_as_an_openai_compatible_deployment() -> None:
    (capped,) = litellm_model_list("http://127.0.0.1:8011", 5)
    assert capped["model_name"] == "tiny"
    params = capped["litellm_params"]
    assert params["model"] == "hosted_vllm/tiny"
    assert params["api_base"] == "http://127.0.0.1:8011/v1"
    assert params["max_parallel_requests"] == 5
    (uncapped,) = litellm_model_list("http://127.0.0.1:8011", None)
    assert "max_parallel_requests" not in uncapped["litellm_params"]


def test_litellm_scheduler_leg_is_set_up_as_its_docs_say_and_sends_priority() -> None:
    from benchmarks.bench_headline import MAX_NUM_SEQS, litellm_scheduler_settings

    name = f"litellm+scheduler+cap{2 * MAX_NUM_SEQS}"
    assert name in STRATEGIES and "priority" in ABOUT[name]
    assert litellm_scheduler_settings(True) == {
        "polling_interval": 0.03,
        "routing_strategy": "simple-shuffle",
    }
    assert litellm_scheduler_settings(False) == {}


def test_the_client_cpu_counts_the_client_processes_it_waited_for() -> None:
    import subprocess
    import sys

    from benchmarks._common import cpu_snapshot

    before = CpuSnapshot(wall=100.0, machine=50.0, own=2.0, server=10.0, loadavg=1.0, children=1)
    after = CpuSnapshot(wall=110.0, machine=68.0, own=3.0, server=19.0, loadavg=1.0, children=3)
    split = cpu_split(before, after)
    assert split["own_cores"] == 0.3 and split["others_cores"] == 0.6  # 1 s own + 2 s children
    first = cpu_snapshot(None)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)  # a worker, waited for
    assert cpu_snapshot(None).children - first.children >= 0.25

"""The blackbox benchmark's pure parts: workloads, leg order, figures, goals, the report.

The benchmark itself starts real servers and is not run in CI (``python -m benchmarks blackbox``).
"""

from __future__ import annotations

import anyio
import pytest

from benchmarks import _report as report
from benchmarks.bench_blackbox import (
    PLAIN_LEGS,
    PRIORITY_LEGS,
    Outcome,
    Request,
    batch_requests,
    execute,
    goals,
    headline,
    leg_salt,
    online_requests,
    render,
    rotated,
    salted,
    summarize,
)

ONLINE = dict(
    rate=8.0,
    seconds=10.0,
    burst=5,
    burst_at=1.0,
    short_tokens=16,
    long_words=50,
    long_tokens=64,
)


def test_a_batch_is_n_short_requests_at_once_the_same_for_a_seed():
    batch = batch_requests(7, 50, 16)
    assert len(batch) == 50
    assert {(r.kind, r.at, r.max_tokens) for r in batch} == {("short", 0.0, 16)}
    assert batch == batch_requests(7, 50, 16)
    assert batch != batch_requests(8, 50, 16)


def test_online_runs_share_their_arrivals_but_not_their_prompts():
    first, second = online_requests(23001, **ONLINE), online_requests(23002, **ONLINE)
    assert [(r.kind, r.at) for r in first] == [(r.kind, r.at) for r in second]
    assert [r.prompt for r in first] != [r.prompt for r in second]
    longs = [r for r in first if r.kind == "long"]
    assert len(longs) == 5 and {r.at for r in longs} == {1.0}
    assert {r.max_tokens for r in longs} == {64}
    shorts = [r.at for r in first if r.kind == "short"]
    assert shorts == sorted(shorts) and min(shorts) > 0 and max(shorts) < 10.0
    assert 40 <= len(shorts) <= 130  # 80 expected at 8/s over 10 s


def test_legs_rotate_by_one_a_run_so_none_is_always_first():
    firsts = [rotated(PLAIN_LEGS, run)[0] for run in range(1, len(PLAIN_LEGS) + 1)]
    assert sorted(firsts) == sorted(PLAIN_LEGS)
    assert rotated(PRIORITY_LEGS, 1) == list(PRIORITY_LEGS)
    assert rotated(PRIORITY_LEGS, 2) == list(reversed(PRIORITY_LEGS))
    assert sorted(rotated(PLAIN_LEGS, 3)) == sorted(PLAIN_LEGS)


def test_each_leg_salts_its_prompts_so_no_leg_reads_another_legs_prefix_cache():
    requests = batch_requests(7, 20, 16)
    salts = {leg_salt(23, run, leg) for run in (1, 2) for leg in PRIORITY_LEGS}
    assert len(salts) == 4 and leg_salt(23, 1, "dsclient") == leg_salt(23, 1, "dsclient")
    salt = leg_salt(23, 1, "dsclient")
    sent = salted(requests, salt)
    assert [r.prompt for r in sent] == [f"{salt} {r.prompt}" for r in requests]
    assert [(r.kind, r.at, r.max_tokens) for r in sent] == [
        (r.kind, r.at, r.max_tokens) for r in requests
    ]
    other = salted(requests, leg_salt(23, 1, "unbounded + priority"))
    assert all(a.prompt[:20] != b.prompt[:20] for a, b in zip(sent, other, strict=True))


def test_summarize_counts_answers_and_errors_and_takes_tails_per_kind():
    outcomes = [Outcome("short", 0.0, latency=float(i)) for i in range(1, 101)]
    outcomes += [Outcome("long", 0.0, latency=50.0), Outcome("long", 0.0, error="ReadTimeout")]
    figures = summarize(outcomes, makespan=50.5)
    assert figures["makespan_s"] == 50.5
    assert figures["throughput_rps"] == round(101 / 50.5, 2)
    assert figures["errors"] == 1
    assert figures["short_n"] == 100 and figures["long_n"] == 1
    assert figures["short_p50_s"] == 50.0 and figures["short_p99_s"] == 99.0
    assert figures["short_max_s"] == 100.0 and figures["long_p50_s"] == 50.0


@pytest.mark.anyio
async def test_execute_submits_each_request_at_its_time_and_records_failures():
    sent: list[str] = []

    async def call(request: Request) -> None:
        sent.append(request.prompt)
        if request.prompt == "bad":
            raise RuntimeError("refused")

    requests = [Request("short", 0.0, "a", 1), Request("long", 0.0, "bad", 1)]
    with anyio.fail_after(10):
        outcomes, makespan = await execute(call, requests)
    assert sent == ["a", "bad"]
    assert [o.error for o in outcomes] == [None, "RuntimeError: refused"]
    assert makespan >= 0


def row(leg: str, run: int, server: str, workload: str, **figures) -> dict:
    base = {"makespan_s": 10.0, "short_n": 250, "short_p99_s": 1.0, "short_p95_s": 0.9,
            "long_n": 40, "long_p95_s": 5.0, "long_p99_s": 6.0, "errors": 0}  # fmt: skip
    return {"leg": leg, "run": run, "server": server, "workload": workload, **base, **figures}


ROWS = [
    row("unbounded", 1, "transformers", "batch", makespan_s=10.0),
    row("semaphore 8", 1, "transformers", "batch", makespan_s=20.0),
    row(
        "dsclient",
        1,
        "transformers",
        "batch",
        makespan_s=10.5,
        mode="throughput",
        signal="throughput",
        limit_end=48,
    ),
    row("unbounded", 1, "transformers", "online", short_p99_s=4.0, makespan_s=20.0),
    row("dsclient", 1, "transformers", "online", short_p99_s=1.0, makespan_s=22.0),
    row("unbounded + priority", 1, "vllm-priority", "online", short_p99_s=0.5, makespan_s=20.0),
    row("dsclient", 1, "vllm-priority", "online", short_p99_s=0.4, makespan_s=19.0),
    row("unbounded", 2, "transformers", "batch", makespan_s=9.0),
    row("dsclient", 2, "transformers", "batch", makespan_s=12.0),
]


def test_goals_per_run_batch_makespan_online_tail_and_priority():
    found = {(c["server"], c["workload"], c["run"], c["goal"].split()[0]): c for c in goals(ROWS)}
    batch1 = found["transformers", "batch", 1, "makespan"]
    assert batch1["makespan_x"] == 1.05 and batch1["met"]
    batch2 = found["transformers", "batch", 2, "makespan"]
    assert batch2["makespan_x"] == round(12 / 9, 3) and not batch2["met"]
    online = found["transformers", "online", 1, "short"]
    # Short p99 0.25x of unbounded's, but the makespan 1.1x: within 1.15x, so met.
    assert online["short_tail_x"] == 0.25 and online["makespan_x"] == 1.1 and online["met"]
    assert "p99" in online["goal"]
    priority = found["vllm-priority", "online", 1, "short"]
    assert priority["short_tail_x"] == 0.8 and priority["makespan_x"] == 0.95 and priority["met"]
    assert "unbounded + priority" in priority["goal"]


def test_goals_use_p95_where_a_leg_had_fewer_than_200_shorts():
    rows = [
        row("unbounded", 1, "s", "online", short_n=150, short_p95_s=2.0),
        row("dsclient", 1, "s", "online", short_n=150, short_p95_s=0.5),
    ]
    (check,) = goals(rows)
    assert "p95" in check["goal"] and check["short_tail_x"] == 0.25


def record() -> dict:
    return {
        "benchmark": "blackbox",
        "_file": "20261204T190000Z.json",
        "started_utc": "2026-12-04T19:00:00Z",
        "code": {"commit": "abc", "dirty": False, "changed": []},
        "host": {"cores": 2, "python": "3.11"},
        "versions": {"dsclient": "0.1"},
        "load_before": [1.0],
        "load_after": [1.5],
        "facts": {},
        "notes": [],
        "rows": ROWS,
    }


def test_render_has_a_table_per_server_and_workload_and_the_goals():
    text = render([record()])
    assert "**transformers, batch** (dsclient: mode throughput, signal throughput)" in text
    assert "**vllm-priority, online**" in text
    assert "| dsclient: AsyncClient(url), defaults | 2 |" in text
    assert "Goals, per run:" in text and "| **no** |" in text
    assert "commit `abc`" in text


def test_headline_compares_dsclient_with_each_leg_per_server_and_workload():
    lines = headline([record()])
    batch = [v for v in lines if v.workload == "transformers, batch" and v.peer == "unbounded"]
    makespan = [v for v in batch if v.column == "makespan"]
    assert makespan and makespan[0].ratios == (1.05, round(12 / 9, 3))
    priority = [v for v in lines if v.peer == "unbounded + priority"]
    assert {v.column for v in priority} >= {"makespan", "short-request tail"}
    assert report.headline_table(lines).count("\n") >= 3


def test_each_server_shows_the_newest_invocation_that_ran_it():
    """A later invocation of one server (``--servers``) replaces that server's figures only."""
    older = record()
    newer = {
        **record(),
        "_file": "20261205T130000Z.json",
        "started_utc": "2026-12-05T13:00:00Z",
        "code": {"commit": "def", "dirty": False, "changed": []},
        "rows": [
            row("unbounded", 1, "transformers", "batch", makespan_s=10.0),
            row("dsclient", 1, "transformers", "batch", makespan_s=7.0),
        ],
    }
    lines = headline([older, newer])
    batch = [v for v in lines if v.workload == "transformers, batch" and v.column == "makespan"]
    assert [v.ratios for v in batch if v.peer == "unbounded"] == [(0.7,)]
    assert any(v.peer == "unbounded + priority" for v in lines)  # from the older one
    text = render([older, newer])
    assert "transformers: From" in text and "commit `def`" in text
    assert "vllm-priority: From" in text and "commit `abc`" in text


def test_the_server_queue_comes_from_the_engine_side_and_is_none_where_there_is_none():
    from benchmarks._common import engine_summary
    from benchmarks.bench_blackbox import server_queue

    sampled = engine_summary([(8.0, 0.0), (8.0, 3.0), (8.0, 12.0), (6.0, 1.0)])
    assert server_queue(sampled) == {"queue_p90": 12.0, "queue_max": 12.0, "running_mean": 7.5}
    assert server_queue({}) == {"queue_p90": None, "queue_max": None, "running_mean": None}


def test_the_table_has_the_server_queue_and_both_sides_cpu_and_three_runs_by_default():
    import inspect

    from benchmarks import bench_blackbox

    rows = [
        {**r, "queue_p90": 4.0, "queue_max": 9.0, "own_cores": 0.3, "server_cores": 0.9}
        for r in ROWS
    ]
    text = render([{**record(), "rows": rows}])
    assert "server queue p90 | queue peak |" in text and "client cores | server cores |" in text
    assert "| 4 | 9 |" in text
    assert '"--runs", type=int, default=3' in inspect.getsource(bench_blackbox.main)


def test_server_group_finds_a_local_server_by_the_port_in_its_command_line():
    import os
    import subprocess
    import sys
    import time

    from benchmarks._common import server_group

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "--port", "65531"],
        start_new_session=True,
    )
    try:
        time.sleep(0.2)
        assert server_group("http://127.0.0.1:65531") == os.getpgid(child.pid)
        assert server_group("http://127.0.0.1:65532") is None
    finally:
        child.kill()
        child.wait()


def test_server_group_prefers_the_process_that_holds_the_listening_socket():
    import os
    import socket
    import subprocess
    import sys
    import time

    from benchmarks._common import listening_pid, server_group

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listen = (
        "import socket, time\ns = socket.socket()\n"
        f"s.bind(('127.0.0.1', {port}))\ns.listen()\ntime.sleep(30)"
    )
    server = subprocess.Popen([sys.executable, "-c", listen], start_new_session=True)
    # A decoy naming the same port in its command line, as a failed second server would.
    decoy = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "--port", str(port)],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while listening_pid(port) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listening_pid(port) == server.pid
        assert server_group(f"http://127.0.0.1:{port}") == os.getpgid(server.pid)
    finally:
        for child in (server, decoy):
            child.kill()
            child.wait()

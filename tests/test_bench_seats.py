"""The seats benchmark's pure parts: goals and the report (the benchmark itself starts seat
servers and is run on demand: ``python -m benchmarks seats``)."""

from __future__ import annotations

from typing import Any

from benchmarks.bench_seats import goals, render


def _row(leg: str, *, steady: float, p90: int, peak: int, urgent: float) -> dict[str, Any]:
    return {
        "leg": leg,
        "run": 1,
        "seats": 8,
        "states": "none",
        "service_s": 0.1,
        "calls": 800,
        "makespan_s": 10.0,
        "steady_rps": steady,
        "queue_p90": p90,
        "queue_peak": peak,
        "urgent_p99_s": urgent,
        "errors": 0,
        "reason": None,
    }


def test_goals_judge_the_servers_queue_throughput_and_the_urgent_call() -> None:
    fixed = _row("fixed = seats", steady=80.0, p90=0, peak=1, urgent=0.2)
    met = _row("dsclient", steady=78.0, p90=4, peak=16, urgent=0.3)
    [check] = goals([fixed, met])
    assert check == {
        "seats": 8,
        "states": "none",
        "run": 1,
        "queue p90 (steady)": True,
        "queue peak": True,
        "urgent p99 (steady)": True,
        "steady >= 0.9x fixed": True,
    }
    missed = _row("dsclient", steady=70.0, p90=5, peak=17, urgent=0.36)
    [check] = goals([fixed, missed])
    assert not any(v for k, v in check.items() if k not in ("seats", "states", "run"))


def test_render_shows_each_server_and_the_goals() -> None:
    record = {
        "benchmark": "seats",
        "started_utc": "20261207T060000Z",
        "params": {},
        "code": {"commit": "abc", "dirty": False},
        "versions": {},
        "host": {},
        "load_before": [1.0, 1.0, 1.0],
        "rows": [
            _row("fixed = seats", steady=80.0, p90=0, peak=1, urgent=0.2),
            _row("dsclient", steady=78.0, p90=4, peak=16, urgent=0.3),
            _row("unbounded", steady=80.0, p90=790, peak=792, urgent=8.0),
        ],
        "notes": [],
        "facts": {},
    }
    page = render([record])
    assert "**8 seats, 0.1 s a call, states nothing**" in page
    assert "Goals of issue 41, per run:" in page
    assert "| 8 | none | 1 | yes | yes | yes | yes |" in page


def test_an_invocation_of_some_sizes_replaces_those_servers_only() -> None:
    """``--sizes 64,256`` after a run of every size: the page keeps the other sizes from the
    older file and names the file of each table."""

    def record(name: str, seats: int, p90: int) -> dict[str, Any]:
        rows = [
            {**_row("fixed = seats", steady=80.0, p90=0, peak=1, urgent=0.2), "seats": seats},
            {**_row("dsclient", steady=78.0, p90=p90, peak=16, urgent=0.3), "seats": seats},
        ]
        return {"benchmark": "seats", "_file": name, "code": {}, "host": {}, "rows": rows}

    old = record("1.json", 8, 3)
    old["rows"] += record("1.json", 256, 290)["rows"]
    page = render([old, record("2.json", 256, 99)])
    assert "**8 seats, 0.1 s a call, states nothing** (`1.json`)" in page
    assert "**256 seats, 0.1 s a call, states nothing** (`2.json`)" in page
    assert "| 8 | none | 1 | yes |" in page and "| 256 | none | 1 | yes |" in page
    assert page.count("From `benchmarks/results/seats/") == 2
    assert "| 290 |" not in page  # the older 256 run is replaced, not shown

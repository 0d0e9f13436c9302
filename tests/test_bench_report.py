"""benchmarks._report: the page's generated blocks, and that docs/benchmarks.md is up to date."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import _report as report
from benchmarks._report import (
    Column,
    Versus,
    headline_table,
    leg_table,
    render_page,
    spread_cell,
    tail_name,
)


def test_the_page_is_what_the_committed_results_give() -> None:
    """Fails when results were added (or the renderers changed) without rerunning the report:
    ``python -m benchmarks report`` rewrites the page's generated blocks."""
    text = report.PAGE.read_text()
    assert "<!-- BEGIN generated: headline-table -->" in text
    assert render_page(text) == text, "run: python -m benchmarks report"


@pytest.mark.parametrize("page", ["HOME_PAGE", "README"])
def test_the_home_page_and_readme_are_what_the_committed_results_give(page: str) -> None:
    text = getattr(report, page).read_text()
    assert "<!-- BEGIN generated: home" in text
    assert render_page(text) == text, "run: python -m benchmarks report"


def test_the_home_block_lists_each_pick_with_results_and_links_its_section() -> None:
    pick, two = report.HOME_PICKS[0], report.HOME_PICKS[3]
    lines = [
        report.Versus(pick.benchmark, pick.peer, pick.column, (0.2, 0.1, 0.3),
                      label="p95", workload=pick.workload),
        report.Versus("routing", "nobody", "makespan", (1.0, 1.0, 1.0)),
        report.Versus(two.benchmark, two.peer, two.column, (0.5, 0.6),  # 2 runs: left out
                      workload=two.workload),
    ]  # fmt: skip
    block = report.home_block(lines)
    assert block.count("\n") == 2  # the head, its rule and the one pick with results
    assert f"| [{pick.what}](benchmarks.md#{pick.anchor}) | 0.20" in block
    assert block.endswith(" | 3 |") and two.what not in block
    assert report.home_block([]) == "No results committed yet."
    assert f"(docs/benchmarks.md#{pick.anchor})" in report.home_block(lines, "docs/")
    page = report.PAGE.read_text()
    headings = {
        re.sub(r"[^\w\s-]", "", line[3:].strip().lower()).replace(" ", "-")
        for line in page.splitlines()
        if line.startswith("## ")
    }
    missing = {p.anchor for p in report.HOME_PICKS} - headings
    assert not missing, f"no such section on the benchmarks page: {missing}"


def test_spread_cell_is_the_median_with_its_range() -> None:
    assert spread_cell([3.0, 1.0, 2.0]) == "2.00 (1.00-3.00)"
    assert spread_cell([1.0, 4.0], 1, "x") == "2.5x (1.0-4.0)"
    assert spread_cell([2.0]) == "2.00"
    assert spread_cell([2.0, 2.0]) == "2.00"
    assert spread_cell([None, None]) == "-"
    assert spread_cell([None, 1.0]) == "1.00"


@pytest.mark.parametrize(
    ("counts", "tail"),
    [([200, 250], "p99"), ([199, 400], "p95"), ([20], "p95"), ([19, 300], "max"), ([], "max")],
)
def test_a_tail_is_the_p99_only_when_every_run_had_200_samples(counts: list, tail: str) -> None:
    assert tail_name(counts) == tail


ROWS = [
    {"leg": "a", "run": 1, "x": 1.0, "lat_n": 250, "lat_p99_s": 0.5, "lat_p95_s": 0.4},
    {"leg": "b", "run": 1, "x": 2.0, "lat_n": 250, "lat_p99_s": 0.9, "lat_p95_s": 0.8},
    {"leg": "a", "run": 2, "x": 3.0, "lat_n": 150, "lat_p99_s": 0.6, "lat_p95_s": 0.5},
]


def test_leg_table_one_line_per_leg_in_first_seen_order() -> None:
    table = leg_table(ROWS, [Column("x", "x", 1), Column("lat {tail} s", "lat_{tail}_s",
                                                          count="lat_n")])  # fmt: skip
    lines = table.splitlines()
    assert lines[0] == "| leg | runs | x | lat p95 s |"  # a run of a had 150 samples
    assert lines[2] == "| a | 2 | 2.0 (1.0-3.0) | 0.45 (0.40-0.50) |"
    assert lines[3] == "| b | 1 | 2.0 | p99: 0.90 |"  # b's every run had 250: its own tail
    assert leg_table([], []) == "No rows."


def test_ratios_pair_runs_and_skip_a_missing_or_zero_peer() -> None:
    rows = [
        {"leg": "dsclient", "run": 1, "m": 2.0},
        {"leg": "p", "run": 1, "m": 4.0},
        {"leg": "dsclient", "run": 2, "m": 3.0},
        {"leg": "p", "run": 2, "m": 0.0},
        {"leg": "p", "run": 3, "m": 1.0},
    ]
    assert report.ratios(rows, "m", "p") == (0.5,)


def test_headline_table_one_line_per_benchmark_and_peer() -> None:
    x = "\N{MULTIPLICATION SIGN}"
    table = headline_table([
        Versus("routing", "router", "makespan", (0.5, 1.5, 1.0)),
        Versus("routing", "router", "short-request tail", (0.2, 0.3), "p95"),
        Versus("headline", "openai", "makespan", (2.0,), workload="batch"),
    ])  # fmt: skip
    lines = table.splitlines()
    assert lines[0].startswith("| benchmark | peer | makespan (dsclient / peer) |")
    assert lines[2] == f"| routing | router | 1.00{x} (0.50-1.50) | p95: 0.25{x} (0.20-0.30) | - | - | 2 |"
    assert lines[3] == f"| headline (batch) | openai | 2.00{x} | - | - | - | 1 |"
    assert headline_table([]) == "No results committed yet."
    with pytest.raises(ValueError, match="column"):
        Versus("x", "y", "nonsense", (1.0,))


def write(root: Path, benchmark: str, name: str, rows: list[dict], load: float = 0.5) -> None:
    folder = root / benchmark
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "schema": 1, "benchmark": benchmark, "started_utc": "2026-12-04T18:00:00Z",
        "code": {"commit": "0123456789abcdef", "dirty": True, "changed": ["dsclient/x.py"]},
        "host": {"cores": 2, "python": "3.11.7", "cpu": "some cpu"},
        "versions": {"dsclient": "0.1", "peer": None}, "load_before": [load],
        "load_after": [load], "params": {}, "facts": {}, "notes": ["a note"], "rows": rows,
    }  # fmt: skip
    (folder / name).write_text(json.dumps(payload))


def test_render_page_rewrites_only_the_blocks(tmp_path: Path) -> None:
    rows = [
        {"leg": leg, "run": run, "workload": "batch", "makespan_s": m, "load_1min": 3.0}
        for run, (leg, m) in enumerate([("dsclient", 1.0), ("httpx", 2.0)], start=1)
    ]
    rows = [dict(r, run=run) for run in (1, 2, 3) for r in rows]  # the table needs 3 runs
    write(tmp_path, "headline", "20261204T180000Z.json", rows, load=3.0)
    page = (
        "# Title\n\nhand text\n\n<!-- BEGIN generated: headline-table -->\nold\n"
        "<!-- END generated: headline-table -->\n\nmore\n\n"
        "<!-- BEGIN generated: headline -->\n<!-- END generated: headline -->\n"
        "<!-- BEGIN generated: routing -->\nstale\n<!-- END generated: routing -->\n"
    )
    fresh = render_page(page, tmp_path)
    assert fresh.startswith("# Title\n\nhand text\n\n<!-- BEGIN generated: headline-table -->\n")
    line = next(x for x in fresh.splitlines() if x.startswith("| headline (batch) | httpx |"))
    assert "| 0.50\N{MULTIPLICATION SIGN}" in line and line.endswith("| - | - | - | 3 |")
    assert "old" not in fresh and "stale" not in fresh
    assert "No results committed yet: run `python -m benchmarks routing`." in fresh
    assert "tree differed from the commit (`dsclient/x.py`)" in fresh
    assert "**Busy machine:**" in fresh  # load 3 on 2 cores
    assert "Note: a note" in fresh
    assert render_page(fresh, tmp_path) == fresh  # idempotent


def test_a_block_naming_no_benchmark_fails_loudly(tmp_path: Path) -> None:
    write(tmp_path, "nonesuch", "a.json", [])
    page = "<!-- BEGIN generated: nonesuch -->\n<!-- END generated: nonesuch -->\n"
    with pytest.raises(KeyError, match="nonesuch"):
        render_page(page, tmp_path)


def test_check_mode_exits_1_on_a_stale_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- BEGIN generated: headline-table -->\nstale\n"
                    "<!-- END generated: headline-table -->\n")  # fmt: skip
    argv = ["--page", str(page), "--results", str(tmp_path / "none")]
    assert report.main(["--check", *argv]) == 1
    assert report.main(argv) == 0
    assert "No results committed yet." in page.read_text()
    assert report.main(["--check", *argv]) == 0


def test_failures_show_as_counts_beside_the_ratios() -> None:
    rows = [
        {"leg": "dsclient", "run": 1, "failed": 0, "m": 1.0},
        {"leg": "p", "run": 1, "failed": 7, "m": 0.5},
        {"leg": "q", "run": 1, "failed": 0, "m": 2.0},
    ]
    cells = report.failures(rows, "failed", "p", "b")
    assert [c.text for c in cells] == ["failed, median 0 vs 7 (max 0 vs 7)"]
    assert report.failures(rows, "failed", "q", "b") == []
    lines = [Versus("b", "p", "other", (2.0,), "hit rate"), *cells,
             Versus("b", "p", "makespan", report.ratios(rows, "m", "p"))]  # fmt: skip
    row = headline_table(lines).splitlines()[2]
    x = "\N{MULTIPLICATION SIGN}"
    assert row == (
        f"| b | p | 2.00{x} | - | - | hit rate: 2.00{x}; failed, median 0 vs 7 (max 0 vs 7) | 1 |"
    )


def kept_record(benchmark: str, rows: list[dict]) -> dict:
    return {
        "benchmark": benchmark, "_file": "f.json", "started_utc": "2026-12-04T18:00:00Z",
        "code": {"commit": "c0ffee", "dirty": False, "changed": []}, "host": {"cores": 2},
        "versions": {}, "load_before": [1.0], "load_after": [1.0], "rows": rows, "notes": [],
        "facts": {},
    }  # fmt: skip


def test_the_routing_shared_and_ray_sections_render_their_rows() -> None:
    from benchmarks import bench_ray, bench_routing, bench_shared

    routing = [
        {"leg": leg, "run": run, "makespan_s": m, "short_n": 90, "short_p95_s": m / 10,
         "long_n": 360, "long_p99_s": m, "hit_rate_own": 0.6, "served_a": 1, "served_b": 2,
         "failed": 0}
        for run in (1, 2) for leg, m in (("dsclient", 10.0), ("router-p2", 20.0))
    ]  # fmt: skip
    text = bench_routing.render([kept_record("routing", routing)])
    assert "short p95 s" in text and "long p99 s" in text
    cells = {(v.peer, v.column): v for v in bench_routing.headline([kept_record("routing", routing)])}
    assert cells["router-p2", "makespan"].ratios == (0.5, 0.5)
    assert cells["router-p2", "long-request tail"].label == "p99"

    shared = [
        {"leg": leg, "run": 1, "makespan_s": m, "queue_p90": q, "queue_max": q, "running_mean": 20,
         "failed": 0}
        for leg, m, q in (("four-shared", 8.0, 12), ("four-own", 8.0, 40), ("four-static", 16.0, 0))
    ]  # fmt: skip
    assert "four-static" in bench_shared.render([kept_record("shared", shared)])
    versus = bench_shared.headline([kept_record("shared", shared)])
    assert {(v.peer, v.column) for v in versus} >= {("four-static", "makespan"),
                                                    ("four-own", "other")}  # fmt: skip

    ray = [
        {"leg": leg, "run": 1, "makespan_s": m, "failures": 4, "running_mean": 1.0,
         "waiting_p90": 0}
        for leg, m in (("dsclient", 10.0), ("ray-http-actors8", 20.0))
    ]  # fmt: skip
    assert "ray-http-actors8" in bench_ray.render([kept_record("ray", ray)])
    (line,) = bench_ray.headline([kept_record("ray", ray)])
    assert line.ratios == (0.5,) and line.label == "job"


def test_the_verdict_names_where_dsclient_was_worse() -> None:
    lines = [
        Versus("h", "p", "makespan", (1.5, 1.2, 2.0)),
        Versus("h", "p", "short-request tail", (0.1,), "p95"),
        Versus("r", "q", "other", (0.8,), "hit rate", higher_better=True),
        Versus("r", "q", "other", (), text="failed, median 0 vs 3 (max 0 vs 3)"),
    ]
    x = "\N{MULTIPLICATION SIGN}"
    assert report.verdict(lines).splitlines() == [
        f"- h, makespan: dsclient worse against p (1 of 1; medians 1.50{x}).",
        f"- h, p95 short-request tail: dsclient better against 1 of 1 (medians 0.10{x}).",
        f"- r, hit rate: dsclient worse against q (1 of 1; medians 0.80{x}).",
    ]
    assert report.verdict([]) == ""


def test_the_opening_table_holds_only_figures_of_three_runs_or_more(tmp_path: Path) -> None:
    """Issue 25's rule: every headline figure stands on at least 3 runs. A benchmark with
    two runs of each leg (blackbox here) is named under the table, not put in it."""
    from tests.test_bench_blackbox import record

    folder = tmp_path / "blackbox"
    folder.mkdir()
    (folder / "20261204T190000Z.json").write_text(json.dumps(record()))
    block = report.render_block(report.HEADLINE, tmp_path)
    assert "| blackbox" not in block
    assert "fewer than 3 runs" in block and "`blackbox`" in block


def test_busy_is_judged_on_other_works_cpu_where_the_rows_measured_it() -> None:
    from benchmarks._report import busy

    host = {"cores": 2}
    # The benchmark's own client and server make a load of 2.5 on 2 cores: not busy, when the
    # rows say what other work took.
    quiet = {"host": host, "rows": [{"load_1min": 2.5, "others_cores": 0.01}] * 3}
    assert busy(quiet) is None
    shared = {
        "host": host,
        "rows": [{"load_1min": 2.5, "others_cores": c} for c in (1.1, 1.3, 0.2)],
    }
    assert busy(shared) == (
        "other work (not the clients or the server) took a median of 1.10 of the 2 cores "
        "during the legs"
    )
    # Rows without it: the load rule.
    assert busy({"host": host, "rows": [{"load_1min": 2.5}]}) is not None
    assert busy({"host": host, "rows": [{"load_1min": 1.5}]}) is None

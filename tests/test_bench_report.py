"""benchmarks._report: the page's generated blocks, and that docs/benchmarks.md is up to date."""

from __future__ import annotations

import json
import re
import subprocess
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
    pick, two = report.HOME_PICKS[0], report.HOME_PICKS[1]
    files = ("benchmarks/results/headline/a.json", "benchmarks/results/headline/b.json")
    lines = [
        report.Versus(pick.benchmark, pick.peer, pick.column, (0.2, 0.1, 0.3),
                      label="p95", workload=pick.workload, files=files),
        report.Versus("routing", "nobody", "makespan", (1.0, 1.0, 1.0)),
        report.Versus(two.benchmark, two.peer, two.column, (0.5, 0.6),  # 2 runs: left out
                      workload=two.workload),
    ]  # fmt: skip
    block = report.home_block(lines)
    caveat, table = block.split("\n\n")
    assert "2-core" in caveat and "(benchmarks.md#what-these-figures-can-and-cannot-show)" in caveat
    assert table.count("\n") == 2  # the head, its rule and the one pick with results
    assert f"| [{pick.what}](benchmarks.md#{pick.anchor}) | 0.20" in table
    # On a docs page the files are named, not linked: the site has no address for them.
    assert table.endswith(" | 3 | 1: `benchmarks/results/headline/a.json` "
                          "2: `benchmarks/results/headline/b.json` |")  # fmt: skip
    assert two.what not in block
    assert report.home_block([]).startswith("No results on today's request path yet")
    readme = report.home_block(lines, "docs/", "")
    assert f"(docs/benchmarks.md#{pick.anchor})" in readme
    assert "[1](benchmarks/results/headline/a.json)" in readme
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
    assert headline_table([]) == "No results on today's request path yet."
    with pytest.raises(ValueError, match="column"):
        Versus("x", "y", "nonsense", (1.0,))


def git(root: Path, *argv: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv],
        cwd=root, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A real checkout as :data:`report.REPO`: commits ``old``; ``request`` (changes the request
    path); ``head`` (changes only the command line and the README). Returns the three SHAs."""
    where = tmp_path / "repo"
    (where / "dsclient" / "cli").mkdir(parents=True)
    git(where, "init", "-q")
    shas = {}
    for name, path, text in (
        ("old", "dsclient/a.py", "x = 1\n"),
        ("request", "dsclient/a.py", "x = 2\n"),
        ("head", "dsclient/cli/b.py", "y = 1\n"),
    ):
        (where / path).write_text(text)
        (where / "README.md").write_text(name)
        git(where, "add", ".")
        git(where, "commit", "-qm", name)
        shas[name] = git(where, "rev-parse", "HEAD")
    monkeypatch.setattr(report, "REPO", where)
    report._changed_since.cache_clear()
    yield shas
    report._changed_since.cache_clear()


def write(
    root: Path, benchmark: str, name: str, rows: list[dict], load: float = 0.5,
    code: dict | None = None, params: dict | None = None,
) -> None:  # fmt: skip
    folder = root / benchmark
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "schema": 1, "benchmark": benchmark, "started_utc": "2026-12-04T18:00:00Z",
        "code": code or {"commit": "0123456789abcdef", "dirty": True, "changed": ["dsclient/x.py"]},
        "host": {"cores": 2, "python": "3.11.7", "cpu": "some cpu"},
        "versions": {"dsclient": "0.1", "peer": None}, "load_before": [load],
        "load_after": [load], "params": params or {}, "facts": {}, "notes": ["a note"],
        "rows": rows,
    }  # fmt: skip
    (folder / name).write_text(json.dumps(payload))


def test_render_page_rewrites_only_the_blocks(tmp_path: Path, repo: dict[str, str]) -> None:
    rows = [
        {"leg": leg, "run": run, "workload": "batch", "makespan_s": m, "load_1min": 3.0}
        for run, (leg, m) in enumerate([("dsclient", 1.0), ("httpx", 2.0)], start=1)
    ]
    rows = [dict(r, run=run) for run in (1, 2, 3) for r in rows]  # the table needs 3 runs
    code = {"commit": repo["request"], "dirty": True, "changed": ["dsclient/cli/x.py"]}
    write(tmp_path, "headline", "20261204T180000Z.json", rows, load=3.0, code=code)
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
    assert "tree differed from the commit (`dsclient/cli/x.py`)" in fresh
    assert "**Stale:**" not in fresh
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
    assert "No results on today's request path yet." in page.read_text()
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


def test_the_opening_table_holds_only_figures_of_three_runs_or_more(
    tmp_path: Path, repo: dict[str, str]
) -> None:
    """Issue 25's rule: every headline figure stands on at least 3 runs. A benchmark with
    two runs of each leg (blackbox here) is named under the table, not put in it."""
    from tests.test_bench_blackbox import record

    folder = tmp_path / "blackbox"
    folder.mkdir()
    fresh = {**record(), "code": {"commit": repo["head"], "dirty": False, "changed": []}}
    (folder / "20261204T190000Z.json").write_text(json.dumps(fresh))
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


def test_the_home_table_takes_the_hardest_peer_and_its_gain_and_cost_against_the_same_one() -> (
    None
):
    """The batch pick is against the best fixed semaphore of the sweep: the one dsclient's
    makespan is worst against (highest median ratio), however the others fare."""
    batch = next(p for p in report.HOME_PICKS if p.what.startswith("A batch of short"))
    assert batch.peer == report.SEMAPHORES
    lines = [
        report.Versus("headline", "openai+priority+sem5", "makespan", (0.6, 0.7, 0.65),
                      workload="batch"),
        report.Versus("headline", "openai+priority+sem16", "makespan", (1.01, 0.99, 1.0),
                      workload="batch"),
        report.Versus("headline", "openai+priority+sem8", "makespan", (0.8, 0.9, 0.85),
                      workload="batch"),
        report.Versus("headline", "openai", "makespan", (0.5, 0.5, 0.5), workload="batch"),
    ]  # fmt: skip
    assert report.hardest(lines, batch) == "openai+priority+sem16"
    row = next(x for x in report.home_block(lines).splitlines() if batch.what in x)
    assert "1.00\N{MULTIPLICATION SIGN} (0.99-1.01) (equal)" in row
    assert "`openai+priority+sem16`" in row
    # Both routing lines name the same peer: the one with the best makespan.
    routing = [p for p in report.HOME_PICKS if p.benchmark == "routing"]
    assert {p.peer for p in routing} == {report.ROUTERS} and "router-cache+priority" in report.ROUTERS
    assert {p.hardest_on for p in routing} == {"makespan"}
    online = [p for p in report.HOME_PICKS if p.workload == "online"]
    assert {p.peer for p in online} == {"openai+priority"}


def test_within_two_percent_is_equal_not_better() -> None:
    lines = [
        Versus("headline", "a", "makespan", (0.999, 0.99, 1.0), workload="online"),
        Versus("headline", "b", "makespan", (0.97, 0.97, 0.97), workload="online"),
        Versus("headline", "c", "makespan", (1.019, 1.02, 1.01), workload="online"),
    ]
    said = report.verdict(lines)
    assert "better against 1 of 3 (medians 0.97\N{MULTIPLICATION SIGN})" in said
    assert "equal (within 2%) against a, c (2 of 3)" in said
    assert "worse" not in said


def test_a_result_is_current_only_on_heads_request_path(repo: dict[str, str]) -> None:
    def code(commit: str, dirty: bool = False, changed: tuple[str, ...] = ()) -> dict:
        return {"code": {"commit": commit, "dirty": dirty, "changed": list(changed)}}

    assert report.staleness(code(repo["head"])) is None
    # Only the command line and the README changed since: the request path is HEAD's.
    assert report.staleness(code(repo["request"])) is None
    assert "changed between its commit" in report.staleness(code(repo["old"]))
    assert "not in this checkout" in report.staleness(code("f" * 40))
    assert report.staleness({"code": {"commit": None}}) == "no commit recorded"
    dirty = code(repo["head"], True, ("dsclient/governor/_knee.py",))
    assert "uncommitted changes to the request path" in report.staleness(dirty)
    # A dirty tree off the request path (the CLI, the benchmarks) is still current.
    assert report.staleness(code(repo["head"], True, ("dsclient/cli/x.py", "benchmarks/y"))) is None
    assert report.on_request_path("dsclient/a.py -> dsclient/b.py")
    assert not report.on_request_path("dsclient/launcher/_plan.py")


def test_the_opening_table_pools_every_current_invocation_set_up_alike_and_drops_no_file(
    tmp_path: Path, repo: dict[str, str]
) -> None:
    def rows(ratio: float) -> list[dict]:
        return [
            {"leg": leg, "run": run, "workload": "batch", "makespan_s": m}
            for run in (1, 2)
            for leg, m in (("dsclient", ratio), ("httpx", 1.0))
        ]

    now = {"commit": repo["head"], "dirty": False, "changed": []}
    old = {"commit": repo["old"], "dirty": False, "changed": []}
    write(tmp_path, "headline", "20261201T000000Z.json", rows(0.1), code=old)  # stale
    write(tmp_path, "headline", "20261202T000000Z.json", rows(0.5), code=now, params={"runs": 2})
    write(tmp_path, "headline", "20261203T000000Z.json", rows(0.9), code=now,
          params={"runs": 2, "quick": True})  # set up otherwise: not pooled  # fmt: skip
    write(tmp_path, "headline", "20261204T000000Z.json", rows(0.7), code=now, params={"runs": 3})
    lines = report.headline_lines(tmp_path)
    [httpx] = [v for v in lines if v.peer == "httpx" and v.column == "makespan"]
    assert sorted(httpx.ratios) == [0.5, 0.5, 0.7, 0.7]  # two invocations, two runs each
    assert httpx.files == (
        "benchmarks/results/headline/20261202T000000Z.json",
        "benchmarks/results/headline/20261204T000000Z.json",
    )
    block = report.render_block(report.HEADLINE, tmp_path)
    assert "| headline (batch) | httpx | 0.60\N{MULTIPLICATION SIGN} (0.50-0.70)" in block
    assert "20261202T000000Z.json" in block and "20261201T000000Z.json" not in block
    section = report.render_block("headline", tmp_path)  # the newest, all files still listed
    assert "`20261201T000000Z.json`" in section
    pooled = report.pool(report.current(report.load_records("headline", tmp_path)))
    assert pooled is not None and {r["run"] for r in pooled["rows"]} == {
        "20261202T000000Z.json#1", "20261202T000000Z.json#2",
        "20261204T000000Z.json#1", "20261204T000000Z.json#2",
    }  # fmt: skip
    stale_only = tmp_path / "only-stale"
    write(stale_only, "headline", "20261201T000000Z.json", rows(0.1), code=old)
    said = report.render_block(report.HEADLINE, stale_only)
    assert said.startswith("No results on today's request path yet.")
    assert "`headline`" in said
    assert "**Stale:**" in report.render_block("headline", stale_only)


def test_the_static_split_runs_at_the_even_share_and_at_its_best_twice_that() -> None:
    from benchmarks import bench_shared

    assert bench_shared.STATIC_SPLITS == {
        "four-static": bench_shared.MAX_NUM_SEQS // 4,
        "four-static-2x": bench_shared.MAX_NUM_SEQS // 2,
    }
    assert set(bench_shared.STATIC_SPLITS) <= set(bench_shared.LEGS)
    assert set(bench_shared.STATIC_SPLITS) <= set(bench_shared.ABOUT)
    rows = [
        {"leg": leg, "run": run, "makespan_s": m, "queue_p90": 1}
        for run in (1, 2, 3)
        for leg, m in (("four-shared", 8.0), ("four-static", 16.0), ("four-static-2x", 7.0))
    ]
    lines = bench_shared.headline([{"rows": rows}])
    pick = next(p for p in report.HOME_PICKS if p.benchmark == "shared (four-shared)")
    assert report.hardest(lines, pick) == "four-static-2x"  # the faster split is the peer


def test_ray_has_a_map_batches_gather_leg_and_the_home_line_takes_the_fastest_peer() -> None:
    from benchmarks import bench_ray

    assert bench_ray.gather_split(16, 2) == 8 and bench_ray.gather_split(3, 8) == 1
    rows = [
        {"leg": leg, "run": run, "makespan_s": m}
        for run in (1, 2, 3)
        for leg, m in (("dsclient", 10.0), ("ray-http-actors8", 20.0), ("ray-gather16", 9.0))
    ]
    lines = bench_ray.headline([{"rows": rows}])
    assert {v.peer for v in lines} == {"ray-http-actors8", "ray-gather16"}
    pick = next(p for p in report.HOME_PICKS if p.benchmark == "ray")
    assert report.hardest(lines, pick) == "ray-gather16"
